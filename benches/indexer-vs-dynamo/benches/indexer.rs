//! Criterion: stored-block events applied per second, and overlap queries answered per second, by Tandem's
//! `kv-index` and Dynamo's `RadixTree`, on the same trace-derived events and queries, at 64 and 1,024 workers.
//! `TRACE=path` uses another Mooncake-format trace (default: the repository's 1,000-request sample).

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use dynamo_kv_router::radix_tree::RadixTree;
use indexer_vs_dynamo::{Workload, build, disagreements, read_trace};

fn trace() -> String {
    let path = std::env::var("TRACE").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces/mooncake_conversation_1k.jsonl").into()
    });
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn indexers(c: &mut Criterion) {
    let prompts = read_trace(&trace(), usize::MAX);
    for workers in [64u32, 1024] {
        let w = Workload::new(prompts.clone(), workers);
        let (ours, theirs) = build(&w);
        assert_eq!(disagreements(&w, &ours, &theirs), 0, "both indexers give the same answers");

        let mut g = c.benchmark_group(format!("events/{workers}"));
        g.throughput(Throughput::Elements(w.stored_blocks as u64));
        g.sample_size(10);
        g.measurement_time(std::time::Duration::from_secs(4));
        let ours_events = w.tandem_events();
        g.bench_function("tandem", |b| {
            b.iter_batched(
                || w.empty_tandem(),
                |mut index| {
                    for (worker, id, e) in &ours_events {
                        let _ = index.apply(*worker, *id, e);
                    }
                    index
                },
                BatchSize::LargeInput,
            )
        });
        g.bench_function("dynamo", |b| {
            b.iter_batched(
                || (RadixTree::new(), w.dynamo_events()),
                |(mut tree, events)| {
                    for e in events {
                        let _ = tree.apply_event(e);
                    }
                    tree
                },
                BatchSize::LargeInput,
            )
        });
        g.finish();

        let mut g = c.benchmark_group(format!("queries/{workers}"));
        g.throughput(Throughput::Elements(w.prompts.len() as u64));
        g.measurement_time(std::time::Duration::from_secs(4));
        g.bench_function("tandem", |b| b.iter(|| w.prompts.iter().map(|p| ours.overlap(&p.seq).len()).sum::<usize>()));
        g.bench_function("dynamo", |b| {
            b.iter_batched(
                || w.dynamo_queries(),
                |queries| queries.into_iter().map(|q| theirs.find_matches(q, false).scores.len()).sum::<usize>(),
                BatchSize::LargeInput,
            )
        });
        g.finish();
    }
}

criterion_group!(benches, indexers);
criterion_main!(benches);
