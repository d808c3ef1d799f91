//! The per-query latency figures criterion does not give: p50 and p99 of one overlap query, and stored blocks per
//! second over a whole pass of the events (best of five), for both indexers, with the answers checked equal.
//! `cargo run --release [-- TRACE [WORKERS...]]`.

use std::time::Instant;

use dynamo_kv_router::radix_tree::RadixTree;
use indexer_vs_dynamo::{Workload, build, disagreements, read_trace};

fn percentile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.first().cloned().unwrap_or_else(|| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces/mooncake_conversation_1k.jsonl").into()
    });
    let workers: Vec<u32> = match args.get(1..) {
        Some(rest) if !rest.is_empty() => rest.iter().filter_map(|s| s.parse().ok()).collect(),
        _ => vec![64, 1024],
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let prompts = read_trace(&text, usize::MAX);
    println!("{path}: {} prompts", prompts.len());
    println!(
        "{:>8} {:>10} {:>14} {:>14} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "workers",
        "blocks",
        "tandem Mblk/s",
        "dynamo Mblk/s",
        "tandem p50",
        "dynamo p50",
        "tandem p99",
        "dynamo p99",
        "disagree"
    );
    for n in workers {
        let w = Workload::new(prompts.clone(), n);
        let ours_events = w.tandem_events();
        let mut best = (f64::INFINITY, f64::INFINITY);
        for _ in 0..5 {
            let mut index = w.empty_tandem();
            let t = Instant::now();
            for (worker, id, e) in &ours_events {
                let _ = index.apply(*worker, *id, e);
            }
            best.0 = best.0.min(t.elapsed().as_secs_f64());
            let events = w.dynamo_events();
            let mut tree = RadixTree::new();
            let t = Instant::now();
            for e in events {
                let _ = tree.apply_event(e);
            }
            best.1 = best.1.min(t.elapsed().as_secs_f64());
        }
        let (ours, theirs) = build(&w);
        let queries = w.dynamo_queries();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            for (p, q) in w.prompts.iter().zip(&queries) {
                let t = Instant::now();
                std::hint::black_box(ours.overlap(&p.seq));
                a.push(t.elapsed().as_secs_f64() * 1e6);
                let q = q.clone();
                let t = Instant::now();
                std::hint::black_box(theirs.find_matches(q, false));
                b.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        let blocks = w.stored_blocks as f64;
        println!(
            "{n:>8} {:>10} {:>14.2} {:>14.2} {:>8.2}us {:>8.2}us {:>8.2}us {:>8.2}us {:>9}",
            w.stored_blocks,
            blocks / best.0 / 1e6,
            blocks / best.1 / 1e6,
            percentile(&mut a, 0.5),
            percentile(&mut b, 0.5),
            percentile(&mut a, 0.99),
            percentile(&mut b, 0.99),
            disagreements(&w, &ours, &theirs)
        );
    }
}
