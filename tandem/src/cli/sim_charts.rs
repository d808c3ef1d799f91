//! `tandem sim --out`'s charts: TTFT distribution per policy, requests held per worker over time, and where the
//! prompt tokens came from (computed, or cached on each tier).

use std::path::Path;

use sim::Outcome;

use super::chart::{Chart, Mark, Series, bars, cdf};
use super::serve::write;

/// Time buckets the per-worker queue chart is cut into (each shows the bucket's largest queue).
const QUEUE_BUCKETS: usize = 400;

/// Writes `ttft_cdf.svg`, `cache_by_tier.svg` and `POLICY/queues.svg` under `dir`.
pub fn write_charts(dir: &Path, rows: &[(&str, &Outcome)], prefill: usize) -> Result<(), String> {
    let ttft = Chart {
        title: "time to first token".into(),
        x_label: "TTFT (ms of virtual time)".into(),
        y_label: "share of requests".into(),
        series: rows
            .iter()
            .map(|(p, o)| Series {
                name: (*p).into(),
                points: cdf(&o.records.iter().filter_map(|r| r.time_to_first_token_ms).collect::<Vec<_>>()),
                mark: Mark::Steps,
            })
            .collect(),
    };
    write(dir.join("ttft_cdf.svg"), &ttft.svg())?;
    let groups: Vec<String> = rows.iter().map(|(p, _)| p.to_string()).collect();
    let tier = |t: usize| rows.iter().map(|(_, o)| o.cached_tokens_by_tier[t] as f64).collect::<Vec<_>>();
    let tiers = [
        ("computed".to_string(), rows.iter().map(|(_, o)| o.prefill_tokens_computed as f64).collect()),
        ("device hits".to_string(), tier(0)),
        ("host hits".to_string(), tier(1)),
    ];
    write(
        dir.join("cache_by_tier.svg"),
        &bars("prompt tokens: computed or cached, by tier", "tokens", &groups, &tiers),
    )?;
    for (p, o) in rows {
        write(dir.join(p).join("queues.svg"), &queue_chart(p, o, prefill).svg())?;
    }
    Ok(())
}

/// Requests each worker held over the run, bucketed in time (the bucket's largest).
fn queue_chart(policy: &str, o: &Outcome, prefill: usize) -> Chart {
    let workers = o.queues.first().map_or(0, |(_, q)| q.len());
    let (t0, t1) = (o.queues.first().map_or(0.0, |q| q.0), o.queues.last().map_or(0.0, |q| q.0));
    let width = ((t1 - t0) / QUEUE_BUCKETS as f64).max(1e-9);
    let mut series: Vec<Series> = (0..workers)
        .map(|w| Series {
            name: if w < prefill { format!("prefill-{w}") } else { format!("decode-{}", w - prefill) },
            points: Vec::new(),
            mark: Mark::Steps,
        })
        .collect();
    let mut bucket: Option<usize> = None;
    for (t, held) in &o.queues {
        let b = ((t - t0) / width) as usize;
        for (s, &n) in series.iter_mut().zip(held) {
            match s.points.last_mut() {
                Some(last) if bucket == Some(b) => last.1 = last.1.max(f64::from(n)),
                _ => s.points.push((t0 + b as f64 * width, f64::from(n))),
            }
        }
        bucket = Some(b);
    }
    Chart {
        title: format!("{policy}: requests held per worker"),
        x_label: "virtual seconds".into(),
        y_label: "running + waiting".into(),
        series,
    }
}
