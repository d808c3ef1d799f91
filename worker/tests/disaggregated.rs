//! Two real workers on 127.0.0.1: prefill on P, decode on D, KV over QUIC with mutual TLS, all through gRPC.

mod common;

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use common::{http_get, model};
use engine::generate::{Engine, EngineConfig, Request};
use kv_cache::events::{EventId, Tier, TierView};
use kv_transfer::tls::DevCa;
use proto::worker as pb;
use proto::worker::worker_client::WorkerClient;
use worker::{Role, RunningWorker, WorkerConfig};

/// Long enough for a loopback pull on a loaded 2-core machine; short enough for the vanished-owner test.
const PULL_TIMEOUT: Duration = Duration::from_secs(5);

async fn start(ca: &DevCa, role: Role, name: &str, shm_dir: Option<std::path::PathBuf>) -> RunningWorker {
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    RunningWorker::start(WorkerConfig {
        metrics: Some(loopback),
        pull_timeout: PULL_TIMEOUT,
        shm_dir,
        ..WorkerConfig::local(role, model(), ca.issue(name, &[]).expect("cert"))
    })
    .await
    .expect("worker starts")
}

/// A prefill and a decode worker from one CA, and gRPC clients of both as the router would hold them.
struct Pair {
    p: RunningWorker,
    d: RunningWorker,
    pc: WorkerClient<tonic::transport::Channel>,
    dc: WorkerClient<tonic::transport::Channel>,
}

async fn pair(shm_dir: Option<std::path::PathBuf>) -> Pair {
    let ca = DevCa::generate().expect("ca");
    let p = start(&ca, Role::Prefill, "prefill-0", shm_dir.clone()).await;
    let d = start(&ca, Role::Decode, "decode-0", shm_dir).await;
    let router = ca.issue("router", &[]).expect("cert");
    let pc = worker::grpc_tls::connect(p.grpc, &router).await.expect("connects to P");
    let dc = worker::grpc_tls::connect(d.grpc, &router).await.expect("connects to D");
    Pair { p, d, pc, dc }
}

async fn stop(p: RunningWorker, d: RunningWorker) {
    p.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}

fn sampling(max_tokens: u32) -> pb::Sampling {
    pb::Sampling { temperature: 0.0, top_p: 1.0, max_tokens, ..pb::Sampling::default() }
}

/// Prefills `tokens` on P (up to `max` tokens in the sampling the decode side will continue).
async fn prefill(
    p: &mut WorkerClient<tonic::transport::Channel>,
    id: &str,
    tokens: &[u32],
    max: u32,
) -> pb::PrefillResponse {
    p.prefill(pb::PrefillRequest {
        request_id: id.into(),
        tokens: tokens.to_vec(),
        sampling: Some(sampling(max)),
        cache_namespace: None,
        deadline_unix_ms: None,
        piece: false,
    })
    .await
    .expect("prefill")
    .into_inner()
}

async fn generate(
    d: &mut WorkerClient<tonic::transport::Channel>,
    tokens: Vec<u32>,
    handle: Option<pb::KvHandle>,
    max: u32,
) -> Result<Vec<u32>, tonic::Status> {
    let req = pb::GenerateRequest {
        request_id: "r".into(),
        tokens,
        sampling: Some(sampling(max)),
        handle,
        cache_namespace: None,
        deadline_unix_ms: None,
    };
    let mut stream = d.generate(req).await?.into_inner();
    let mut out = Vec::new();
    while let Some(msg) = stream.message().await? {
        match msg.event {
            Some(pb::generate_response::Event::Token(t)) => out.push(t.id),
            Some(pb::generate_response::Event::Finished(_)) => break,
            None => {}
        }
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_on_p_and_decode_on_d_match_a_single_engine() {
    let mut single = Engine::open(&model(), EngineConfig::default()).expect("engine");
    let text = "Disaggregated serving runs the prompt on one machine and the answer on another. In one sentence, why";
    let mut prompt = single.tokenizer().encode(&[text; 4].join(" "));
    prompt.truncate(70);
    let greedy = |p: Vec<u32>, n| Request::greedy(p, NonZeroU32::new(n).expect("n"));
    let want =
        single.run(&[greedy(prompt.clone(), 10)], &AtomicBool::new(false), |_| {}).expect("runs").remove(0).token_ids;

    let Pair { p, d, mut pc, mut dc } = pair(None).await;
    let info = dc.info(pb::InfoRequest {}).await.expect("info").into_inner();
    assert_eq!((info.role(), info.block_size), (pb::Role::Decode, 16));

    let pre = prefill(&mut pc, "r1", &prompt, 10).await;
    assert_eq!(pre.first_token, want[0]);
    assert_eq!(p.live_leases(), 1);
    let handle = pre.handle.expect("a handle");
    let rest = generate(&mut dc, [prompt.clone(), vec![pre.first_token]].concat(), Some(handle.clone()), 9)
        .await
        .expect("generate");
    assert_eq!([vec![pre.first_token], rest].concat(), want, "P + D give the single engine's tokens");
    assert_eq!(d.pulled_blocks(), 4, "the four full blocks came over QUIC");
    assert_eq!(p.live_leases(), 0, "the decode worker released the lease once it had the blocks");

    // A second prompt sharing the first 64 tokens: D pulls only the block it lacks.
    let mut second = prompt[..64].to_vec();
    second.extend(
        single
            .tokenizer()
            .encode(&[" Because prefill and decode want different hardware, and the cache can move."; 3].concat()),
    );
    second.truncate(84);
    assert_eq!(second.len(), 84, "five full blocks, the first four shared");
    let pre2 = prefill(&mut pc, "r2", &second, 4).await;
    assert_eq!(pre2.cached_tokens, 64, "P reused its own cached prefix");
    generate(&mut dc, [second.clone(), vec![pre2.first_token]].concat(), pre2.handle.clone(), 3)
        .await
        .expect("generate");
    assert_eq!(d.pulled_blocks(), 5, "only the one new full block was pulled");

    // A handle from another model, or with an unknown lease, is refused with the right status.
    let mut foreign = handle.clone();
    foreign.model_fingerprint = "xxh3:0000000000000000".into();
    let err =
        generate(&mut dc, [prompt.clone(), vec![1]].concat(), Some(foreign), 2).await.expect_err("foreign handle");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("fingerprint"), "{}", err.message());
    let mut fresh = single.tokenizer().encode(&["A different prompt entirely, about rivers and stones."; 3].join(" "));
    fresh.truncate(40);
    let pre3 = prefill(&mut pc, "r3", &fresh, 2).await;
    let mut unknown = pre3.handle.expect("handle");
    unknown.lease_id = vec![7; 16];
    let err =
        generate(&mut dc, [fresh, vec![pre3.first_token]].concat(), Some(unknown), 2).await.expect_err("unknown lease");
    assert_eq!(err.code(), tonic::Code::NotFound, "{}", err.message());

    // D's event stream, replayed, is D's pool.
    let mut events = dc
        .subscribe_kv_events(pb::SubscribeKvEventsRequest { after_event_id: None })
        .await
        .expect("subscribe")
        .into_inner();
    let first = events.message().await.expect("ok").expect("a snapshot first");
    let Some(pb::kv_event_batch::Body::Snapshot(snap)) = first.body else { panic!("snapshot expected") };
    let mut view = TierView::default();
    for tier in snap.tiers {
        for b in tier.blocks {
            if tier.tier == pb::Tier::Device as i32 {
                let stored = kv_cache::events::KvEvent::Stored {
                    tier: Tier::Device,
                    parent: b.parent.map(kv_cache::SeqHash),
                    blocks: vec![(kv_cache::SeqHash(b.seq_hash), kv_cache::LocalHash(b.local_hash))],
                };
                view.apply(EventId(0), &stored);
            }
        }
    }
    let stats = d.stats();
    assert_eq!(
        view.blocks(Tier::Device).len(),
        stats.usage[0].used + stats.usage[0].cached,
        "the snapshot holds every registered device block"
    );
    drop(events);
    // The metrics endpoint tells the same story.
    let text = http_get(d.metrics.expect("metrics served"), "/metrics").await;
    assert!(text.contains("tandem_kv_transfer_pulled_blocks_total{transport=\"quic\"} 5\n"), "{text}");
    assert!(text.contains("tandem_worker_time_to_first_token_seconds_count 2\n"), "{text}");
    assert!(text.contains("tandem_worker_time_per_output_token_seconds_count 2\n"), "{text}");
    assert!(text.contains("tandem_kv_imported_blocks_total 5\n"), "{text}");
    assert!(http_get(p.metrics.expect("metrics served"), "/metrics").await.contains("tandem_kv_leases "));
    drop((pc, dc));
    stop(p, d).await;
}

fn prefetch(tokens: &[u32], handle: Option<pb::KvHandle>) -> pb::PrefetchRequest {
    pb::PrefetchRequest { request_id: "r".into(), tokens: tokens.to_vec(), handle, cache_namespace: None }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetched_piece_is_cached_on_d_and_the_whole_prompt_pulls_only_the_rest() {
    let Pair { p, d, mut pc, mut dc } = pair(None).await;
    let prompt: Vec<u32> = (500..600).collect();
    // The leading piece: 64 tokens, four blocks.
    let piece = prefill(&mut pc, "r", &prompt[..64], 1).await;
    let handle = piece.handle.expect("a handle");
    // Bad requests are refused and store nothing: no handle, a handle for other tokens.
    let none = dc.prefetch(prefetch(&prompt[..64], None)).await.expect_err("no handle");
    assert_eq!(none.code(), tonic::Code::InvalidArgument);
    let other: Vec<u32> = (700..764).collect();
    let wrong = dc.prefetch(prefetch(&other, Some(handle.clone()))).await.expect_err("another prompt");
    assert_eq!(wrong.code(), tonic::Code::InvalidArgument, "{wrong}");
    assert_eq!(d.pulled_blocks(), 0);
    let stored = dc.prefetch(prefetch(&prompt[..64], Some(handle.clone()))).await.expect("prefetched");
    assert_eq!(stored.into_inner().stored_blocks, 4);
    assert_eq!(d.pulled_blocks(), 4);
    // The pull released the piece's lease: asking again finds it gone.
    let gone = dc.prefetch(prefetch(&prompt[..64], Some(handle))).await;
    assert!(gone.as_ref().is_ok_and(|r| r.get_ref().stored_blocks == 0), "held already: nothing pulled: {gone:?}");

    // The whole prompt: P finds the piece cached, D pulls only the two blocks past it.
    let whole = prefill(&mut pc, "r", &prompt, 3).await;
    assert_eq!(whole.cached_tokens, 64);
    let tokens = [prompt.clone(), vec![whole.first_token]].concat();
    generate(&mut dc, tokens, whole.handle, 2).await.expect("decodes");
    assert_eq!(d.pulled_blocks(), 6, "four ahead, then the two it lacked");
    assert_eq!(p.live_leases(), 0);
    stop(p, d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_transfer_is_an_error_and_nothing_of_it_is_used() {
    let Pair { p, d, mut pc, mut dc } = pair(None).await;
    let prompt: Vec<u32> = (0..50).map(|i| 300 + i * 3).collect();
    let pre = prefill(&mut pc, "x", &prompt, 3).await;
    let good = pre.handle.expect("handle");
    // The bytes P serves no longer match what the handle promises for block 1 (as if damaged in flight).
    let mut damaged = good.clone();
    damaged.blocks[1].checksum ^= 0xFFFF;
    let tokens = [prompt.clone(), vec![pre.first_token]].concat();
    let err = generate(&mut dc, tokens.clone(), Some(damaged), 2).await.expect_err("damaged");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{}", err.message());
    assert!(err.message().contains("checksum"), "{}", err.message());
    let stats = d.stats();
    assert_eq!(stats.counters.imported_blocks, 0, "no block of a failed pull was stored");
    assert_eq!(d.pulled_blocks(), 0);
    // The lease is still there, so the good handle works afterwards.
    assert_eq!(generate(&mut dc, tokens, Some(good), 2).await.expect("clean pull").len(), 2);
    assert_eq!(d.pulled_blocks(), 3);
    drop((pc, dc));
    stop(p, d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_host_the_blocks_come_through_shared_memory() {
    let shm = std::env::temp_dir().join(format!("tandem-shm-test-{}", std::process::id()));
    std::fs::create_dir_all(&shm).expect("dir");
    let Pair { p, d, mut pc, mut dc } = pair(Some(shm.clone())).await;
    let prompt: Vec<u32> = (0..70).map(|i| 500 + i * 11).collect();
    let mut single = Engine::open(&model(), EngineConfig::default()).expect("engine");
    let greedy = Request::greedy(prompt.clone(), NonZeroU32::new(6).expect("n"));
    let want = single.run(&[greedy], &AtomicBool::new(false), |_| {}).expect("runs").remove(0).token_ids;
    let pre = prefill(&mut pc, "s", &prompt, 6).await;
    let handle = pre.handle.expect("handle");
    // The handle names P's KV store itself: the lease wrote no file of its own.
    let store = handle.shm_region.clone().expect("P's KV store in the handle");
    assert!(store.ends_with("-store") && std::path::Path::new(&store).exists(), "{store}");
    let files: Vec<String> =
        std::fs::read_dir(&shm).expect("dir").filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    assert!(files.iter().all(|n| n.ends_with("-store") || n.ends_with(".lock")), "{files:?}");
    let rest = generate(&mut dc, [prompt, vec![pre.first_token]].concat(), Some(handle), 5).await.expect("generate");
    assert_eq!([vec![pre.first_token], rest].concat(), want);
    assert_eq!((d.pulled_blocks(), d.shm_blocks()), (4, 4), "all four blocks came through shared memory");
    // D releases the lease once its engine has copied the blocks, and P takes them back.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while (p.live_leases() > 0 || p.stats().usage[0].used > 0) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!((p.live_leases(), p.stats().usage[0].used), (0, 0));
    drop((pc, dc));
    stop(p, d).await;
    assert!(!std::path::Path::new(&store).exists(), "the store went with its worker");
    let _ = std::fs::remove_dir_all(&shm);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_makes_the_decode_worker_read_only_a_store_in_its_own_directory() {
    let shm = std::env::temp_dir().join(format!("tandem-shm-named-{}", std::process::id()));
    let elsewhere = std::env::temp_dir().join(format!("tandem-shm-elsewhere-{}", std::process::id()));
    std::fs::create_dir_all(&shm).expect("dir");
    std::fs::create_dir_all(&elsewhere).expect("dir");
    let Pair { p, d, mut pc, mut dc } = pair(Some(shm.clone())).await;
    // A file outside D's directory holding P's blocks at the handle's offsets (a link to P's store): reading it
    // would even work, but a handle must not choose which of D's files D opens.
    let prompt: Vec<u32> = (0..70).map(|i| 900 + i * 5).collect();
    let pre = prefill(&mut pc, "a", &prompt, 3).await;
    let mut handle = pre.handle.expect("handle");
    let decoy = elsewhere.join("kv");
    std::os::unix::fs::symlink(handle.shm_region.as_deref().expect("P's store"), &decoy).expect("link");
    handle.shm_region = Some(decoy.display().to_string());
    let rest = generate(&mut dc, [prompt, vec![pre.first_token]].concat(), Some(handle), 2).await.expect("generate");
    assert_eq!(rest.len(), 2);
    assert_eq!((d.pulled_blocks(), d.shm_blocks()), (4, 0), "pulled over QUIC, the named file left unread");
    // A store's name in another directory: the store of that name in D's own directory is the one read.
    let prompt: Vec<u32> = (0..70).map(|i| 1900 + i * 5).collect();
    let pre = prefill(&mut pc, "b", &prompt, 3).await;
    let mut handle = pre.handle.expect("handle");
    let store = handle.shm_region.clone().expect("P's store");
    let name = std::path::Path::new(&store).file_name().and_then(|n| n.to_str()).expect("name").to_string();
    handle.shm_region = Some(format!("/no/such/directory/{name}"));
    let rest = generate(&mut dc, [prompt, vec![pre.first_token]].concat(), Some(handle), 2).await.expect("generate");
    assert_eq!(rest.len(), 2);
    assert_eq!((d.pulled_blocks(), d.shm_blocks()), (8, 4), "the second pull came through shared memory");
    drop((pc, dc));
    stop(p, d).await;
    let _ = std::fs::remove_dir_all(&shm);
    let _ = std::fs::remove_dir_all(&elsewhere);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_damaged_in_shared_memory_is_caught_in_the_decode_engine_and_nothing_of_it_is_kept() {
    let shm = std::env::temp_dir().join(format!("tandem-shm-damage-{}", std::process::id()));
    std::fs::create_dir_all(&shm).expect("dir");
    let Pair { p, d, mut pc, mut dc } = pair(Some(shm.clone())).await;
    let prompt: Vec<u32> = (0..70).map(|i| 700 + i * 7).collect();
    let pre = prefill(&mut pc, "s", &prompt, 4).await;
    let mut damaged = pre.handle.expect("handle");
    assert!(damaged.shm_region.is_some(), "a shared-memory pull");
    // The region's block 2 is not what the handle promises: the engine's copy of it fails its check.
    damaged.blocks[2].checksum ^= 0xFFFF;
    let tokens = [prompt.clone(), vec![pre.first_token]].concat();
    let err = generate(&mut dc, tokens.clone(), Some(damaged), 3).await.expect_err("damaged");
    assert_eq!(err.code(), tonic::Code::Unavailable, "another decode worker may succeed: {}", err.message());
    assert!(err.message().contains("checksum"), "{}", err.message());
    let stats = d.stats();
    assert_eq!(stats.counters.imported_blocks, 0, "no block of the failed import was stored");
    assert_eq!(stats.usage[0].used + stats.usage[0].cached, 0, "nor left behind in the pool");
    assert_eq!(d.shm_blocks(), 0, "a failed pull is not counted");
    // The worker goes on: the same prompt from a fresh prefill decodes through shared memory.
    let again = prefill(&mut pc, "t", &prompt, 4).await;
    let handle = again.handle.expect("handle");
    assert_eq!(
        generate(&mut dc, [prompt, vec![again.first_token]].concat(), Some(handle), 3).await.expect("ok").len(),
        3
    );
    assert_eq!(d.shm_blocks(), 4);
    drop((pc, dc));
    stop(p, d).await;
    let _ = std::fs::remove_dir_all(&shm);
}

/// Spans seen in this process: (name, its `traceparent` field if any).
#[derive(Default)]
struct Spans(std::sync::Mutex<Vec<(String, Option<String>)>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for &'static Spans {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        struct Find(Option<String>);
        impl tracing::field::Visit for Find {
            fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                if f.name() == "traceparent" {
                    self.0 = Some(v.to_string());
                }
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut find = Find(None);
        attrs.record(&mut find);
        if let Ok(mut seen) = self.0.lock() {
            seen.push((attrs.metadata().name().to_string(), find.0));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_rides_from_grpc_metadata_into_the_transfer_request() {
    use tracing_subscriber::layer::SubscriberExt;
    static SPANS: std::sync::OnceLock<Spans> = std::sync::OnceLock::new();
    let spans = SPANS.get_or_init(Spans::default);
    let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(spans));

    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let Pair { p, d, mut pc, mut dc } = pair(None).await;
    let prompt: Vec<u32> = (0..40).map(|i| 700 + i * 5).collect();
    let mut req = tonic::Request::new(pb::PrefillRequest {
        request_id: "t".into(),
        tokens: prompt.clone(),
        sampling: Some(sampling(3)),
        cache_namespace: None,
        deadline_unix_ms: None,
        piece: false,
    });
    req.metadata_mut().insert("traceparent", tp.parse().expect("ascii"));
    let pre = pc.prefill(req).await.expect("prefill").into_inner();
    let mut req = tonic::Request::new(pb::GenerateRequest {
        request_id: "t".into(),
        tokens: [prompt, vec![pre.first_token]].concat(),
        sampling: Some(sampling(2)),
        handle: pre.handle,
        cache_namespace: None,
        deadline_unix_ms: None,
    });
    req.metadata_mut().insert("traceparent", tp.parse().expect("ascii"));
    let mut stream = dc.generate(req).await.expect("generate").into_inner();
    while stream.message().await.expect("streams").is_some() {}
    assert_eq!(d.pulled_blocks(), 2);

    let seen = spans.0.lock().expect("spans").clone();
    let with = |name: &str| seen.iter().filter(|(n, t)| n == name && t.as_deref() == Some(tp)).count();
    assert_eq!(with("prefill"), 1, "P's prefill span carries the caller's context: {seen:?}");
    assert_eq!(with("generate"), 1, "D's generate span carries it: {seen:?}");
    assert!(seen.iter().any(|(n, _)| n == "kv_transfer.pull"), "{seen:?}");
    // The owner's side of the transfer learned the context from the Read frame alone.
    assert!(with("kv_transfer.serve") >= 1, "the transfer request carried the context to P: {seen:?}");
    drop((pc, dc));
    stop(p, d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_from_a_vanished_prefill_worker_fails_and_stores_nothing() {
    let Pair { p, d, mut pc, mut dc } = pair(None).await;
    let prompt: Vec<u32> = (0..40).map(|i| 900 + i * 7).collect();
    let pre = prefill(&mut pc, "v", &prompt, 3).await;
    // P goes away with the lease before D pulls: the transfer is dropped whole.
    p.shutdown(Duration::from_secs(1)).await;
    let tokens = [prompt, vec![pre.first_token]].concat();
    let started = std::time::Instant::now();
    let err = generate(&mut dc, tokens.clone(), pre.handle, 2).await.expect_err("nobody serves the lease");
    assert!(
        matches!(err.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded),
        "{:?}: {}",
        err.code(),
        err.message()
    );
    assert!(started.elapsed() < PULL_TIMEOUT + Duration::from_secs(5), "a timeout, not a hang");
    assert_eq!(d.stats().counters.imported_blocks, 0, "nothing of it was stored");
    assert_eq!(d.pulled_blocks(), 0);
    // D still serves: the same request without a handle prefills locally.
    assert_eq!(generate(&mut dc, tokens, None, 2).await.expect("local prefill").len(), 2);
    drop((pc, dc));
    d.shutdown(Duration::from_secs(5)).await;
}

/// Reads a Generate stream to its end; the `Finished` message, if one came.
async fn finish(mut s: tonic::Streaming<pb::GenerateResponse>) -> Option<pb::Finished> {
    while let Ok(Some(msg)) = s.message().await {
        if let Some(pb::generate_response::Event::Finished(f)) = msg.event {
            return Some(f);
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulled_blocks_survive_while_their_request_waits_for_a_place() {
    let ca = DevCa::generate().expect("ca");
    let p = start(&ca, Role::Prefill, "prefill-0", None).await;
    // A small decode worker: 24 blocks, two sequences at a time.
    let engine = EngineConfig {
        kv_blocks: 24,
        max_model_len: Some(384),
        max_num_seqs: 2,
        threads: std::num::NonZeroUsize::new(1),
        ..EngineConfig::default()
    };
    let d = RunningWorker::start(WorkerConfig {
        engine,
        pull_timeout: PULL_TIMEOUT,
        ..WorkerConfig::local(Role::Decode, model(), ca.issue("decode-0", &[]).expect("cert"))
    })
    .await
    .expect("starts");
    let router = ca.issue("router", &[]).expect("cert");
    let mut pc = worker::grpc_tls::connect(p.grpc, &router).await.expect("connects to P");
    let mut dc = worker::grpc_tls::connect(d.grpc, &router).await.expect("connects to D");
    // Two long answers fill D's places and, as they grow, need more blocks than it has beside the pulled ones
    // (11 each, and 24 - 4 = 20 left).
    let long = |id: &str, first: u32| pb::GenerateRequest {
        request_id: id.into(),
        tokens: (first..first + 16).collect(),
        sampling: Some(pb::Sampling { ignore_eos: true, ..sampling(160) }),
        ..Default::default()
    };
    let mut busy = Vec::new();
    for (id, first) in [("long-1", 1000), ("long-2", 2000)] {
        let mut s = dc.generate(long(id, first)).await.expect("accepted").into_inner();
        s.message().await.expect("stream").expect("a first token");
        busy.push(s);
    }
    // A disaggregated request arrives meanwhile: its 4 full blocks come from P and it waits for a place.
    let prompt: Vec<u32> = (0..70).map(|i| 3000 + i * 7).collect();
    let pre = prefill(&mut pc, "x", &prompt, 3).await;
    let req = pb::GenerateRequest {
        request_id: "x".into(),
        tokens: [prompt.clone(), vec![pre.first_token]].concat(),
        sampling: Some(sampling(3)),
        handle: pre.handle,
        ..Default::default()
    };
    let waiting = dc.generate(req).await.expect("accepted").into_inner();
    let (x, a, b) = tokio::join!(finish(waiting), finish(busy.remove(0)), finish(busy.remove(0)));
    assert!(a.is_some() && b.is_some(), "the long answers finished");
    let x = x.expect("the disaggregated request finished");
    assert_eq!(x.cached_tokens, 64, "the pulled blocks were still there when it ran: {x:?}");
    assert_eq!(d.stats().usage[0].used, 0, "no block is held once everything ended");
    drop((pc, dc));
    stop(p, d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_shared_memory_domain_pulls_over_quic() {
    // Two workers with their own shared-memory directories, as two containers with their own /dev/shm: the
    // prefill worker's region file exists, but the decode worker is not in its domain and must not use it.
    let base = std::env::temp_dir().join(format!("tandem-shm-domains-{}", std::process::id()));
    let (dir_p, dir_d) = (base.join("p"), base.join("d"));
    std::fs::create_dir_all(&dir_p).expect("dir");
    std::fs::create_dir_all(&dir_d).expect("dir");
    let ca = DevCa::generate().expect("ca");
    let p = start(&ca, Role::Prefill, "prefill-0", Some(dir_p.clone())).await;
    let d = start(&ca, Role::Decode, "decode-0", Some(dir_d.clone())).await;
    let router = ca.issue("router", &[]).expect("cert");
    let mut pc = worker::grpc_tls::connect(p.grpc, &router).await.expect("connects to P");
    let mut dc = worker::grpc_tls::connect(d.grpc, &router).await.expect("connects to D");
    let prompt: Vec<u32> = (0..70).map(|i| 700 + i * 13).collect();
    let pre = prefill(&mut pc, "x", &prompt, 3).await;
    let handle = pre.handle.expect("handle");
    let region = handle.shm_region.clone().expect("P keeps its KV store in its own directory");
    assert!(std::path::Path::new(&region).exists(), "readable from here, all the same");
    generate(&mut dc, [prompt, vec![pre.first_token]].concat(), Some(handle), 2).await.expect("generate");
    assert_eq!((d.pulled_blocks(), d.shm_blocks()), (4, 0), "every block came over QUIC");
    drop((pc, dc));
    stop(p, d).await;
    let _ = std::fs::remove_dir_all(&base);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_names_the_certificate_name_to_verify_and_a_version_1_handle_is_verified_by_address() {
    let Pair { p, d, mut pc, mut dc } = pair(None).await;
    let info = pc.info(pb::InfoRequest {}).await.expect("info").into_inner();
    assert_eq!(info.protocol_version, worker::PROTOCOL_VERSION);
    let prompt: Vec<u32> = (100..150).collect();
    let continued = |first| [prompt.clone(), vec![first]].concat();

    // The owner's certificate name rides in the handle (`WorkerConfig::local`'s: every dev certificate has it).
    let pre = prefill(&mut pc, "named", &prompt, 4).await;
    let handle = pre.handle.expect("a handle");
    assert_eq!(handle.server_name, "localhost");
    // A name the owner's certificate does not carry is refused by the reader: the name is what is verified.
    let mut wrong = handle.clone();
    wrong.server_name = "someone-else".into();
    let before = d.pulled_blocks();
    let _ = generate(&mut dc, continued(pre.first_token), Some(wrong), 3).await;
    assert_eq!(d.pulled_blocks(), before, "nothing pulled from a peer that is not who the handle says");
    generate(&mut dc, continued(pre.first_token), Some(handle), 3).await.expect("the named owner");
    assert_eq!(d.pulled_blocks(), before + 3, "three full blocks over QUIC");

    // A version-1 owner names no certificate name: the reader verifies the endpoint's address instead.
    let other: Vec<u32> = (200..250).collect();
    let pre = prefill(&mut pc, "v1", &other, 4).await;
    let mut v1 = pre.handle.expect("a handle");
    v1.server_name = String::new();
    generate(&mut dc, [other.clone(), vec![pre.first_token]].concat(), Some(v1), 3).await.expect("a v1 handle");
    assert_eq!(d.pulled_blocks(), before + 6);
    stop(p, d).await;
}
