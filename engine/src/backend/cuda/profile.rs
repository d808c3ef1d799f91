//! Where a CUDA step's device time goes (`TANDEM_CUDA_PROFILE=1`): an event is recorded on the stream before and
//! after every kernel launch and matmul, and when the step's results come back their times are added up by kind
//! of step and kernel. Printed to stderr when the device is dropped (the end of `tandem bench engine` or
//! `generate`). Recording steps as graphs is off while profiling (an event around every launch is what it
//! measures), so the figures are of the work as issued: the sum of the kernels' times against the span from the
//! first to the last shows what the gaps between launches cost.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, DriverError};

use crate::forward::ForwardError;

/// The variable that turns the profile on.
pub const PROFILE_VAR: &str = "TANDEM_CUDA_PROFILE";

/// Whether the environment asks for the profile.
pub fn wanted() -> bool {
    std::env::var(PROFILE_VAR).is_ok_and(|v| v == "1")
}

#[derive(Default)]
struct Totals {
    calls: u64,
    ms: f64,
}

#[derive(Default)]
struct Steps {
    steps: u64,
    /// From the first launch's start to the last's end, summed over the steps.
    span_ms: f64,
    /// The launches' own times, summed.
    kernels_ms: f64,
}

/// Events not yet read, and the totals so far.
#[derive(Default)]
pub struct Profile {
    /// The kind of step under way (`Gpu::begin_step`; `load` before the first: the weights' dequantization).
    label: &'static str,
    /// Per launch: the kind of step, the kernel, its events.
    pending: Vec<(&'static str, &'static str, CudaEvent, CudaEvent)>,
    totals: BTreeMap<(&'static str, &'static str), Totals>,
    steps: BTreeMap<&'static str, Steps>,
}

fn timed(stream: &Arc<CudaStream>) -> Result<CudaEvent, DriverError> {
    stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
}

impl Profile {
    pub fn begin_step(&mut self, label: &'static str) {
        self.label = label;
    }

    /// Runs `work` (one launch or matmul named `name`) between two events.
    pub fn around(
        &mut self,
        stream: &Arc<CudaStream>,
        name: &'static str,
        work: impl FnOnce() -> Result<(), ForwardError>,
    ) -> Result<(), ForwardError> {
        let event = |e: DriverError| ForwardError::Device(format!("CUDA: an event for the profile: {e}"));
        let start = timed(stream).map_err(event)?;
        work()?;
        let end = timed(stream).map_err(event)?;
        let label = if self.label.is_empty() { "load" } else { self.label };
        self.pending.push((label, name, start, end));
        Ok(())
    }

    /// Reads the events of the work issued so far (call after the stream has been synchronized): a step for each
    /// kind of step among them (the load's launches come back with the first step's).
    pub fn collect(&mut self) -> Result<(), DriverError> {
        let pending = std::mem::take(&mut self.pending);
        let mut at = 0;
        while at < pending.len() {
            let label = pending[at].0;
            let run = pending[at..].iter().take_while(|p| p.0 == label).count();
            let step = &pending[at..at + run];
            let span = f64::from(step[0].2.elapsed_ms(&step[run - 1].3)?);
            let mut kernels = 0.0;
            for (_, name, start, end) in step {
                let ms = f64::from(start.elapsed_ms(end)?);
                let t = self.totals.entry((label, name)).or_default();
                t.calls += 1;
                t.ms += ms;
                kernels += ms;
            }
            let s = self.steps.entry(label).or_default();
            s.steps += 1;
            s.span_ms += span;
            s.kernels_ms += kernels;
            at += run;
        }
        Ok(())
    }

    /// The table, one line per kind of step and one per kernel within it, the longest first.
    pub fn report(&self) -> String {
        let mut out = format!("CUDA profile ({PROFILE_VAR}=1; graphs off): device time by kind of step and kernel\n");
        for (label, s) in &self.steps {
            let per = |ms: f64| ms / s.steps.max(1) as f64;
            out += &format!(
                "{label}: {} steps, {:.3} ms a step from the first launch to the last, {:.3} ms of it in kernels\n",
                s.steps,
                per(s.span_ms),
                per(s.kernels_ms)
            );
            let mut kernels: Vec<_> = self.totals.iter().filter(|((l, _), _)| l == label).collect();
            kernels.sort_by(|a, b| b.1.ms.total_cmp(&a.1.ms));
            for ((_, name), t) in kernels {
                out += &format!(
                    "  {name:<16} {:>8} calls {:>10.3} ms {:>9.2} us each {:>5.1}%\n",
                    t.calls,
                    t.ms,
                    1000.0 * t.ms / t.calls.max(1) as f64,
                    100.0 * t.ms / s.kernels_ms.max(f64::MIN_POSITIVE)
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_gives_each_kind_of_step_and_its_kernels_longest_first() {
        let mut p = Profile::default();
        for (label, name, calls, ms) in
            [("decode-1", "gemm", 120, 3.0), ("decode-1", "attend", 30, 6.0), ("prompt", "attend_rows", 60, 12.0)]
        {
            p.totals.insert((label, name), Totals { calls, ms });
        }
        p.steps.insert("decode-1", Steps { steps: 2, span_ms: 20.0, kernels_ms: 9.0 });
        p.steps.insert("prompt", Steps { steps: 1, span_ms: 13.0, kernels_ms: 12.0 });
        let report = p.report();
        let lines: Vec<&str> = report.lines().collect();
        assert!(
            lines[1].starts_with("decode-1: 2 steps, 10.000 ms a step") && lines[1].contains("4.500 ms"),
            "{report}"
        );
        // Within decode-1, attend (6 ms) before gemm (3 ms): 200 us a call, two thirds of the kernels' time.
        assert!(
            lines[2].trim_start().starts_with("attend")
                && lines[2].contains("200.00 us")
                && lines[2].ends_with("66.7%")
        );
        assert!(lines[3].trim_start().starts_with("gemm"), "{report}");
        assert!(lines[4].starts_with("prompt: 1 steps") && lines[5].contains("attend_rows"), "{report}");
    }
}
