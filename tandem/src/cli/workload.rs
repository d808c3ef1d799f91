//! The workload flags `tandem bench serve`, `tandem sim` and `tandem tune` share: a trace or a synthetic
//! shared-prefix workload, the window taken of it, and how its requests arrive.

use std::path::PathBuf;

use loadgen::schedule::Arrivals;
use loadgen::synthetic::SyntheticSpec;
use loadgen::trace::TraceRequest;

/// Requests a synthetic workload has when `--max-requests` does not say.
const DEFAULT_SYNTHETIC_REQUESTS: usize = 100;

/// Which requests, and when they arrive.
#[derive(Debug, clap::Args)]
pub struct WorkloadArgs {
    /// A Mooncake/aiperf `mooncake_trace` JSONL file, a Qwen Bailian JSONL trace, an Azure LLM trace CSV (2023
    /// or 2024) or a BurstGPT CSV; without it, the synthetic shared-prefix workload of the `--prefixes` … flags, which needs a pace:
    /// `--rate` (or, for `bench serve`, `--concurrency` or `--sweep-rate`).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Divide the trace's timestamps by this.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Open-loop arrivals at this many requests per second instead of the trace's timestamps.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Gamma shape of the open-loop gaps: 1 is Poisson, lower is burstier (CV = 1/sqrt(B)).
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    #[command(flatten)]
    synthetic: SyntheticArgs,
    /// Take at most this many requests: the trace's first ones after --skip-requests, or the synthetic workload's
    /// count (default 100).
    #[arg(long)]
    max_requests: Option<usize>,
    /// Leave out the trace's first N requests: a window further into it (its arrivals count from the first taken).
    #[arg(long, default_value_t = 0)]
    skip_requests: usize,
    /// Tokens per trace block id (default: Mooncake's 512; a router recording and a Bailian trace state their own).
    #[arg(long)]
    trace_block_size: Option<usize>,
}

/// A synthetic shared-prefix workload (used when no `--trace` is given).
#[derive(Debug, clap::Args)]
struct SyntheticArgs {
    /// Distinct shared prefixes (system prompts).
    #[arg(long, default_value_t = 8)]
    prefixes: usize,
    /// Tokens of each shared prefix (a multiple of --trace-block-size).
    #[arg(long, default_value_t = 2048)]
    prefix_len: usize,
    /// Tokens each request adds of its own (per turn; a multiple of --trace-block-size).
    #[arg(long, default_value_t = 512)]
    suffix_len: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Zipf exponent of prefix popularity (0: uniform).
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Turns per session; each re-sends the conversation so far.
    #[arg(long, default_value_t = 1)]
    turns: usize,
    /// Milliseconds between a turn's answer and the next turn.
    #[arg(long, default_value_t = 0.0)]
    turn_delay_ms: f64,
}

impl WorkloadArgs {
    /// Tokens per trace block id ([`loadgen::trace::block_size`]).
    pub fn trace_block(&self) -> Result<usize, String> {
        loadgen::trace::block_size(self.trace.as_deref(), self.trace_block_size)
    }

    /// Refuses a speedup, burstiness or rate that is not a positive number.
    pub fn check_numbers(&self) -> Result<(), String> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if positive(self.speedup) && positive(self.burstiness) && self.rate.is_none_or(positive) {
            Ok(())
        } else {
            Err("--speedup, --burstiness and --rate must be positive numbers".into())
        }
    }

    /// The requests of the trace, or of the synthetic workload when there is none (seeded by `seed`, in blocks of
    /// `trace_block` tokens), in the window `--skip-requests` and `--max-requests` take.
    pub fn requests(&self, seed: u64, trace_block: usize) -> Result<Vec<TraceRequest>, String> {
        let (skip, max) = (self.skip_requests, self.max_requests);
        let mut requests = match &self.trace {
            Some(path) => {
                let mut all = loadgen::trace::read(path)?;
                if skip >= all.len() && skip > 0 {
                    return Err(format!("--skip-requests {skip} leaves none of the trace's {} requests", all.len()));
                }
                all.drain(..skip);
                all
            }
            None if skip > 0 => return Err("--skip-requests windows a trace: give --trace".into()),
            None => {
                let s = &self.synthetic;
                let spec = SyntheticSpec {
                    requests: max.unwrap_or(DEFAULT_SYNTHETIC_REQUESTS),
                    prefixes: s.prefixes,
                    prefix_len: s.prefix_len,
                    suffix_len: s.suffix_len,
                    output_len: s.output_len,
                    zipf: s.zipf,
                    turns: s.turns,
                    turn_delay_ms: s.turn_delay_ms,
                    seed,
                };
                spec.check(trace_block).map_err(|e| format!("{e} (--prefix-len, --suffix-len, --trace-block-size)"))?;
                spec.generate(trace_block)
            }
        };
        if let Some(n) = max {
            requests.truncate(n);
        }
        if requests.is_empty() {
            // A run of nothing would print a table of zeros, as if measured.
            return Err("the workload has no requests (an empty trace, or --max-requests 0)".into());
        }
        Ok(requests)
    }

    /// The requests and their arrivals for the simulator: open loop at `--rate`, else the trace's own schedule
    /// (`seed` draws the synthetic workload and the open-loop gaps). Literal prompts (aiperf's `text_input`) are
    /// tokenized with the tokenizer of `model`, the model the simulated workers serve.
    pub fn load(&self, seed: u64, model: &std::path::Path) -> Result<(Vec<TraceRequest>, Arrivals), String> {
        self.check_numbers()?;
        let arrivals = match (self.rate, &self.trace) {
            (Some(rate), _) => Arrivals::Rate { rate, burstiness: self.burstiness, seed },
            (None, Some(_)) => Arrivals::Trace { speedup: self.speedup },
            (None, None) => return Err("a synthetic workload needs --rate (or give --trace)".into()),
        };
        let mut requests = self.requests(seed, self.trace_block()?)?;
        if let Some(k) = loadgen::schedule::untimed(&requests, &arrivals) {
            return Err(untimed_error(k, "--rate"));
        }
        if requests.iter().any(|r| r.literal.is_some()) {
            let gguf = engine::gguf::GgufFile::open(model).map_err(|e| format!("{}: {e}", model.display()))?;
            let tokenizer = engine::tokenizer::Tokenizer::from_gguf(&gguf).map_err(|e| e.to_string())?;
            loadgen::trace::tokenize_literals(&mut requests, &tokenizer);
        }
        Ok((requests, arrivals))
    }
}

/// Why a workload cannot follow the trace's own schedule: its request `k` (from 0) has no moment to be sent at;
/// `flags` name the schedules that set one.
pub fn untimed_error(k: usize, flags: &str) -> String {
    format!(
        "request {} of the workload has no timestamp and follows no earlier turn of its session: give {flags} to \
         set the pace",
        k + 1
    )
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        workload: WorkloadArgs,
    }

    fn args(flags: &[&str]) -> WorkloadArgs {
        Cli::parse_from(std::iter::once("x").chain(flags.iter().copied())).workload
    }

    #[test]
    fn a_window_leaves_out_the_first_requests_then_takes_at_most_max() {
        let dir = std::env::temp_dir().join(format!("tandem-workload-window-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let trace = dir.join("t.jsonl");
        let lines: String = (1..=5)
            .map(|k| format!("{{\"timestamp\": {}, \"input_length\": {k}, \"output_length\": 1}}\n", 100 * k))
            .collect();
        std::fs::write(&trace, lines).expect("written");
        let path = trace.to_str().expect("a UTF-8 path");
        let read = |window: &[&str]| {
            let flags: Vec<&str> = ["--trace", path].iter().chain(window).copied().collect();
            args(&flags).requests(0, 512)
        };
        let lengths = |r: Vec<TraceRequest>| r.iter().map(|x| x.input_length).collect::<Vec<_>>();
        assert_eq!(read(&[]).map(lengths), Ok(vec![1, 2, 3, 4, 5]));
        assert_eq!(read(&["--skip-requests", "2", "--max-requests", "2"]).map(lengths), Ok(vec![3, 4]));
        assert_eq!(read(&["--skip-requests", "4", "--max-requests", "9"]).map(lengths), Ok(vec![5]));
        let e = read(&["--skip-requests", "5"]).expect_err("nothing left");
        assert!(e.contains("leaves none of the trace's 5 requests"), "{e}");
        let e = args(&["--skip-requests", "1", "--max-requests", "3"]).requests(0, 512).expect_err("no trace");
        assert!(e.contains("give --trace"), "{e}");
        for none in [read(&["--max-requests", "0"]), args(&["--max-requests", "0"]).requests(0, 512)] {
            assert!(none.expect_err("nothing to run").contains("no requests"));
        }
        std::fs::write(&trace, "").expect("emptied");
        assert!(read(&[]).expect_err("an empty trace").contains("no requests"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn speedup_burstiness_and_rate_must_be_positive_finite_numbers() {
        assert!(args(&["--rate", "2.5", "--speedup", "0.5"]).check_numbers().is_ok());
        for bad in [["--speedup", "0"], ["--speedup", "inf"], ["--burstiness=-1", "--rate=2"], ["--rate", "NaN"]] {
            assert!(args(&bad).check_numbers().is_err(), "{bad:?}");
        }
    }
}
