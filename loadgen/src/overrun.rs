//! The target's mock-worker step overrun, read from its Prometheus text (`/metrics`) before and after a run.

use crate::client::Target;

/// The series the router exposes (cumulative counts by `le`, summed over its mock workers).
const SERIES: &str = "tandem_router_mock_step_overrun_steps{le=\"";

/// Cumulative counts by bucket bound, in exposition order; `None` when the target does not report them.
pub fn parse(text: &str) -> Option<Vec<(f64, f64)>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(SERIES) else { continue };
        let (le, value) = rest.split_once("\"} ")?;
        let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
        out.push((le, value.trim().parse().ok()?));
    }
    (!out.is_empty()).then_some(out)
}

/// The bound under which 99% of the steps taken between the two readings fall.
pub fn p99_between(before: &[(f64, f64)], after: &[(f64, f64)]) -> Option<f64> {
    let delta = |i: usize| {
        let b = before.iter().find(|(le, _)| *le == after[i].0).map_or(0.0, |(_, n)| *n);
        (after[i].1 - b).max(0.0)
    };
    let total = delta(after.len().checked_sub(1)?);
    if total == 0.0 {
        return None;
    }
    (0..after.len()).find(|&i| delta(i) >= 0.99 * total).map(|i| after[i].0)
}

/// Reads the target's `/metrics`; `None` when it has none or no mock workers.
pub async fn read(target: &Target) -> Option<Vec<(f64, f64)>> {
    let path = format!("{}/metrics", target.base_path);
    let text = crate::client::get(target, &path).await.ok()?;
    parse(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_p99_bound_comes_from_the_steps_between_readings() {
        let text = |a: u32, b: u32, c: u32| {
            format!("# HELP x\n{SERIES}1.01\"}} {a}\n{SERIES}1.05\"}} {b}\n{SERIES}+Inf\"}} {c}\nother 1\n")
        };
        let before = parse(&text(100, 100, 100)).expect("series");
        let after = parse(&text(1000, 1095, 1100)).expect("series");
        // 1000 steps since: 900 within 1.01, 995 within 1.05, all within +Inf: p99 is under 1.05.
        assert_eq!(p99_between(&before, &after), Some(1.05));
        assert_eq!(p99_between(&after, &after), None, "no steps in between");
        assert!(parse("tandem_other 1\n").is_none());
    }
}
