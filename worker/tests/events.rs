//! The KV event stream of a real worker: a fresh subscriber gets a snapshot and then events that, replayed,
//! give the worker's pool; a resubscriber after a buffered id gets exactly the events it missed; one after an id
//! the worker no longer holds gets a snapshot first. And an expired lease is gone.

use std::net::SocketAddr;
use std::time::Duration;

use engine::generate::EngineConfig;
use kv_cache::events::{EventId, KvEvent, Snapshot, Tier, TierView};
use kv_transfer::tls::DevCa;
use proto::worker as pb;
use proto::worker::worker_client::WorkerClient;
use tonic::transport::Channel;
use worker::{Role, RunningWorker, WorkerConfig};

async fn start(ca: &DevCa, replay: usize, lease_ttl: Duration) -> RunningWorker {
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let model = engine::fetch::ensure_default_model(&engine::fetch::Quiet).expect("model");
    RunningWorker::start(WorkerConfig {
        engine: EngineConfig { replay_events: replay, ..EngineConfig::default() },
        metrics: Some(loopback),
        lease_ttl,
        pull_timeout: Duration::from_secs(5),
        ..WorkerConfig::local(Role::Both, model, ca.issue("worker-0", &[]).expect("cert"))
    })
    .await
    .expect("starts")
}

/// The protobuf event back in domain terms, as the router's indexer reads it.
fn event(e: &pb::KvEvent) -> KvEvent {
    worker::convert::event_from_pb(e).expect("a valid event").1
}

fn snapshot(s: &pb::Snapshot) -> Snapshot {
    worker::convert::snapshot_from_pb(s).expect("a valid snapshot")
}

async fn run(c: &mut WorkerClient<Channel>, seed: u32, len: usize) {
    let tokens: Vec<u32> = (0..len as u32).map(|i| 100 + (i * 37 + seed * 101) % 4000).collect();
    let sampling =
        pb::Sampling { temperature: 0.0, top_p: 1.0, max_tokens: 20, ignore_eos: true, ..pb::Sampling::default() };
    let req = pb::GenerateRequest {
        request_id: format!("r{seed}"),
        tokens,
        sampling: Some(sampling),
        handle: None,
        cache_namespace: None,
        deadline_unix_ms: None,
    };
    let mut s = c.generate(req).await.expect("generate").into_inner();
    while s.message().await.expect("stream").is_some() {}
}

/// Reads batches until `pred` holds for the view or the deadline passes.
async fn follow(
    stream: &mut tonic::Streaming<pb::KvEventBatch>,
    view: &mut TierView,
    seen: &mut Vec<(u64, KvEvent)>,
    until: Option<u64>,
) {
    loop {
        if until.is_some() && view.as_of.map(|e| e.0) >= until {
            return;
        }
        let next = tokio::time::timeout(Duration::from_millis(500), stream.message()).await;
        let Ok(Ok(Some(batch))) = next else { return };
        match batch.body.expect("a body") {
            pb::kv_event_batch::Body::Snapshot(s) => *view = TierView::from_snapshot(&snapshot(&s)),
            pb::kv_event_batch::Body::Events(es) => {
                for e in es.events {
                    let ev = event(&e);
                    view.apply(EventId(e.id), &ev);
                    seen.push((e.id, ev));
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_see_the_pool_and_resume_exactly() {
    let ca = DevCa::generate().expect("ca");
    // A replay buffer of 4 events: the pool publishes one event per run of blocks read at once, so a few requests
    // make more events than it holds.
    let w = start(&ca, 4, Duration::from_secs(30)).await;
    let mut c = worker::grpc_tls::connect(w.grpc, &ca.issue("router", &[]).expect("cert")).await.expect("connects");
    let mut live = c
        .subscribe_kv_events(pb::SubscribeKvEventsRequest { after_event_id: None })
        .await
        .expect("subscribe")
        .into_inner();
    let mut view = TierView::default();
    let mut seen = Vec::new();
    follow(&mut live, &mut view, &mut seen, None).await;
    for seed in 0..5 {
        run(&mut c, seed, 40 + seed as usize * 17).await;
    }
    // The engine's own snapshot is the truth; the live subscriber must reach it.
    let truth = c
        .subscribe_kv_events(pb::SubscribeKvEventsRequest { after_event_id: None })
        .await
        .expect("subscribe")
        .into_inner()
        .message()
        .await
        .expect("ok")
        .expect("snapshot");
    let Some(pb::kv_event_batch::Body::Snapshot(truth)) = truth.body else { panic!("snapshot expected") };
    let truth = TierView::from_snapshot(&snapshot(&truth));
    follow(&mut live, &mut view, &mut seen, truth.as_of.map(|e| e.0)).await;
    assert!(seen.len() > 4, "the workload made more events than the replay buffer holds ({})", seen.len());
    for t in Tier::ALL {
        assert_eq!(view.blocks(t), truth.blocks(t), "{t:?} after live events");
    }
    // Resuming after a buffered id: exactly the events after it, in order.
    let last = seen.last().map(|(id, _)| *id).expect("events");
    let from = last - 3;
    let mut resumed = c
        .subscribe_kv_events(pb::SubscribeKvEventsRequest { after_event_id: Some(from) })
        .await
        .expect("resume")
        .into_inner();
    let batch = resumed.message().await.expect("ok").expect("events");
    let Some(pb::kv_event_batch::Body::Events(es)) = batch.body else { panic!("a replay, not a snapshot") };
    let replayed: Vec<(u64, KvEvent)> = es.events.iter().map(|e| (e.id, event(e))).collect();
    let expected: Vec<(u64, KvEvent)> = seen.iter().filter(|(id, _)| *id > from).cloned().collect();
    assert_eq!(replayed, expected);
    // Resuming after an id the worker no longer holds: a snapshot first.
    let mut stale = c
        .subscribe_kv_events(pb::SubscribeKvEventsRequest { after_event_id: Some(0) })
        .await
        .expect("resume")
        .into_inner();
    let batch = stale.message().await.expect("ok").expect("a batch");
    assert!(matches!(batch.body, Some(pb::kv_event_batch::Body::Snapshot(_))), "too old: snapshot");
    drop((live, resumed, stale));
    w.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_gone() {
    let ca = DevCa::generate().expect("ca");
    let w = start(&ca, 1024, Duration::from_millis(300)).await;
    let mut c = worker::grpc_tls::connect(w.grpc, &ca.issue("router", &[]).expect("cert")).await.expect("connects");
    let tokens: Vec<u32> = (0..40).map(|i| 200 + i).collect();
    let sampling = pb::Sampling { temperature: 0.0, top_p: 1.0, max_tokens: 1, ..pb::Sampling::default() };
    let pre = c
        .prefill(pb::PrefillRequest { request_id: "p".into(), tokens, sampling: Some(sampling), ..Default::default() })
        .await
        .expect("prefill");
    assert!(pre.into_inner().handle.is_some());
    assert_eq!(w.live_leases(), 1);
    let mut gone = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if w.live_leases() == 0 {
            gone = true;
            break;
        }
    }
    assert!(gone, "the lease expired and its blocks were let go");
    w.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_from_another_ca_cannot_subscribe_or_call() {
    let ca = DevCa::generate().expect("ca");
    let w = start(&ca, 1024, Duration::from_secs(30)).await;
    let intruder = DevCa::generate().expect("another ca").issue("router", &[]).expect("cert");
    // TLS 1.3 finishes the client's side of the handshake before the server checks the client certificate,
    // so the refusal shows either at connect or at the first call.
    if let Ok(mut c) = worker::grpc_tls::connect(w.grpc, &intruder).await {
        let sub = c.subscribe_kv_events(pb::SubscribeKvEventsRequest { after_event_id: None }).await;
        assert!(sub.is_err(), "subscribed without a certificate from the cluster CA");
        assert!(c.info(pb::InfoRequest {}).await.is_err());
    }
    // Plain text is refused too.
    if let Ok(mut c) = WorkerClient::connect(format!("http://{}", w.grpc)).await {
        assert!(c.info(pb::InfoRequest {}).await.is_err());
    }
    w.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reports_come_at_once_on_a_large_change() {
    let ca = DevCa::generate().expect("ca");
    let w = start(&ca, 1024, Duration::from_secs(30)).await;
    let mut c = worker::grpc_tls::connect(w.grpc, &ca.issue("router", &[]).expect("cert")).await.expect("connects");
    let mut load = c.watch_load(pb::WatchLoadRequest { interval_ms: 5_000 }).await.expect("watch").into_inner();
    let first = load.message().await.expect("ok").expect("a first report at once");
    assert_eq!((first.running, first.waiting), (0, 0));
    assert_eq!(first.usage.len(), 3);
    let mut g = c.clone();
    let busy = tokio::spawn(async move { run(&mut g, 9, 60).await });
    let started = std::time::Instant::now();
    let next = tokio::time::timeout(Duration::from_secs(3), load.message())
        .await
        .expect("a report long before the 5 s period");
    let next = next.expect("ok").expect("a report");
    assert!(next.running + next.waiting >= 1 || next.usage[0].used > 0, "{next:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
    busy.await.expect("the request finishes");
    drop(load);
    w.shutdown(Duration::from_secs(5)).await;
}
