//! A worker that answers `Info` like a real one (the real model's fingerprint, over mutual TLS) and then
//! misbehaves, as [`Behaviour`] says: it hangs (its event and load streams send their first message and go silent
//! without closing, `Generate` streams one token and stalls, `Prefill` and `Health` never answer: a hung process or
//! a wedged engine), or it fails every `Prefill` and `Generate` at once (a sick worker), or it decodes without ever
//! pulling KV (`Prefetch` fails). It counts those calls.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kv_transfer::tls::DevCa;
use proto::worker as pb;
use proto::worker::worker_server::{Worker, WorkerServer};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// How the fake worker misbehaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    /// Answers `Info`, then nothing more.
    Hang,
    /// Its process answers but its engine is stuck: it streams like a live worker (its reports never showing any
    /// tokens computed) and never answers `Prefill`, `Generate` or `Prefetch`.
    Stalled,
    /// Streams like a live worker but fails every `Prefill` and `Generate` with INTERNAL.
    Fail,
    /// Streams like a live worker but refuses every `Prefill` and `Generate` as invalid (INVALID_ARGUMENT), as an
    /// engine refuses a request it cannot take.
    Refuse,
    /// A decode worker that pulls nothing: `Prefetch` fails (UNAVAILABLE), `Generate` answers one token and
    /// finishes without reading the handle, `Prefill` fails.
    NoPulls,
    /// A decode worker whose pulls never end: `Prefetch` waits until its caller gives up (counted by
    /// [`FakeWorker::abandoned`]), `Generate` answers as [`Behaviour::NoPulls`].
    StalledPulls,
}

/// Counts a call whose caller gave up before it ended (its future dropped).
struct CountOnDrop(Arc<AtomicUsize>);

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Clone)]
struct Fake {
    info: pb::InfoResponse,
    behaviour: Behaviour,
    /// The blocks its first snapshot claims.
    blocks: Vec<u64>,
    calls: Arc<AtomicUsize>,
    abandoned: Arc<AtomicUsize>,
}

/// A stream that sends `first`, then `then` every period (a live worker) or nothing at all (a hung one), never
/// closing while its reader waits.
fn stream<T: Clone + Send + 'static>(first: T, then: Option<(T, Duration)>) -> Streamed<T> {
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        if tx.send(Ok(first)).await.is_err() {
            return;
        }
        match then {
            None => tx.closed().await,
            Some((item, period)) => {
                while tx.send(Ok(item.clone())).await.is_ok() {
                    tokio::time::sleep(period).await;
                }
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

#[tonic::async_trait]
impl Worker for Fake {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn prefill(&self, _: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        match self.behaviour {
            Behaviour::Hang | Behaviour::Stalled => std::future::pending().await,
            Behaviour::Fail | Behaviour::NoPulls | Behaviour::StalledPulls => {
                Err(Status::internal("this worker is unwell"))
            }
            Behaviour::Refuse => Err(Status::invalid_argument("the prompt is longer than this worker's context")),
        }
    }

    type GenerateStream = Streamed<pb::GenerateResponse>;

    async fn generate(&self, _: Request<pb::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        match self.behaviour {
            Behaviour::Fail => return Err(Status::internal("this worker is unwell")),
            Behaviour::Refuse => {
                return Err(Status::invalid_argument("the prompt is longer than this worker's context"));
            }
            Behaviour::Hang => {}
            Behaviour::Stalled => std::future::pending().await,
            Behaviour::NoPulls | Behaviour::StalledPulls => {
                let token = pb::GenerateResponse {
                    event: Some(pb::generate_response::Event::Token(pb::Token {
                        id: 504,
                        text: "The".into(),
                        ..Default::default()
                    })),
                };
                let finished = pb::GenerateResponse {
                    event: Some(pb::generate_response::Event::Finished(pb::Finished {
                        reason: pb::FinishReason::Length as i32,
                        ..Default::default()
                    })),
                };
                return Ok(Response::new(Box::pin(tokio_stream::iter([Ok(token), Ok(finished)]))));
            }
        }
        let token = pb::Token { id: 504, text: "The".into(), ..Default::default() };
        Ok(Response::new(stream(
            pb::GenerateResponse { event: Some(pb::generate_response::Event::Token(token)) },
            None,
        )))
    }

    async fn prefetch(&self, _: Request<pb::PrefetchRequest>) -> Result<Response<pb::PrefetchResponse>, Status> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        match self.behaviour {
            Behaviour::Hang | Behaviour::Stalled => std::future::pending().await,
            Behaviour::Fail => Err(Status::internal("this worker is unwell")),
            Behaviour::NoPulls => Err(Status::unavailable("this worker pulls nothing")),
            Behaviour::StalledPulls => {
                let _abandoned = CountOnDrop(Arc::clone(&self.abandoned));
                std::future::pending().await
            }
            Behaviour::Refuse => Err(Status::invalid_argument("not this worker's prompt")),
        }
    }

    async fn cancel(&self, _: Request<pb::CancelRequest>) -> Result<Response<pb::CancelResponse>, Status> {
        Ok(Response::new(pb::CancelResponse { found: false }))
    }

    type SubscribeKvEventsStream = Streamed<pb::KvEventBatch>;

    async fn subscribe_kv_events(
        &self,
        _: Request<pb::SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        let blocks = self.blocks.iter().map(|&h| pb::SnapshotBlock { seq_hash: h, local_hash: h, parent: None });
        let tiers = vec![pb::TierBlocks { tier: pb::Tier::Device as i32, blocks: blocks.collect() }];
        let snapshot = pb::Snapshot { as_of: Some(0), tiers };
        let batch = pb::KvEventBatch {
            instance_id: self.info.instance_id.clone(),
            body: Some(pb::kv_event_batch::Body::Snapshot(snapshot)),
        };
        // A live worker follows its snapshot with a heartbeat now and then.
        let heartbeat = pb::KvEventBatch {
            instance_id: self.info.instance_id.clone(),
            body: Some(pb::kv_event_batch::Body::Events(pb::KvEvents { events: Vec::new() })),
        };
        let then = (self.behaviour != Behaviour::Hang).then_some((heartbeat, Duration::from_millis(500)));
        Ok(Response::new(stream(batch, then)))
    }

    type WatchLoadStream = Streamed<pb::LoadReport>;

    async fn watch_load(&self, _: Request<pb::WatchLoadRequest>) -> Result<Response<Self::WatchLoadStream>, Status> {
        let usage = vec![pb::TierUsage { tier: pb::Tier::Device as i32, used: 0, cached: 0, total: 1024 }];
        let report = pb::LoadReport { usage, ..Default::default() };
        let then = (self.behaviour != Behaviour::Hang).then_some((report.clone(), Duration::from_millis(100)));
        Ok(Response::new(stream(report, then)))
    }

    async fn health(&self, _: Request<pb::HealthRequest>) -> Result<Response<pb::HealthResponse>, Status> {
        std::future::pending().await
    }
}

/// A fake worker serving on loopback.
pub struct FakeWorker {
    pub grpc: SocketAddr,
    calls: Arc<AtomicUsize>,
    abandoned: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeWorker {
    /// Starts one in `role` whose snapshot claims the blocks `blocks` (chained hashes), answering `Info` as a
    /// worker of this build's protocol does (with no name).
    pub async fn start(ca: &DevCa, role: pb::Role, behaviour: Behaviour, blocks: Vec<u64>) -> FakeWorker {
        FakeWorker::speaking(ca, role, behaviour, blocks, worker::PROTOCOL_VERSION).await
    }

    /// [`FakeWorker::start`], naming protocol version `version` in `Info` (0: none).
    pub async fn speaking(
        ca: &DevCa,
        role: pb::Role,
        behaviour: Behaviour,
        blocks: Vec<u64>,
        version: u32,
    ) -> FakeWorker {
        FakeWorker::serving(ca, role, behaviour, blocks, version, 2048).await
    }

    /// [`FakeWorker::speaking`] with no blocks, computing prompts in chunks of `chunk` tokens (`Info`'s
    /// `max_num_batched_tokens`).
    pub async fn chunked(ca: &DevCa, role: pb::Role, behaviour: Behaviour, version: u32, chunk: u32) -> FakeWorker {
        FakeWorker::serving(ca, role, behaviour, Vec::new(), version, chunk).await
    }

    async fn serving(
        ca: &DevCa,
        role: pb::Role,
        behaviour: Behaviour,
        blocks: Vec<u64>,
        version: u32,
        chunk: u32,
    ) -> FakeWorker {
        let text = engine::text::TextModel::open(&crate::model()).expect("the model's text side");
        let layout = pb::KvLayout {
            dtype: pb::KvDtype::F16 as i32,
            order: pb::KvOrder::LayerKvHeadTokenDim as i32,
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            block_tokens: 16,
        };
        let info = pb::InfoResponse {
            role: role as i32,
            model_id: "smollm2-135m-instruct".into(),
            model_fingerprint: text.fingerprint().to_string(),
            block_size: 16,
            layout: Some(layout),
            tiers: vec![pb::TierCapacity { tier: pb::Tier::Device as i32, blocks: 1024 }],
            transfer_endpoint: "127.0.0.1:9".into(),
            instance_id: "fake".into(),
            max_model_len: 8192,
            max_num_batched_tokens: chunk,
            host_id: "elsewhere".into(),
            protocol_version: version,
            name: String::new(),
        };
        let identity = ca.issue("fake-worker", &[]).expect("cert");
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.expect("binds");
        let grpc = listener.local_addr().expect("address");
        // The real worker's TLS acceptor, with settings that never change (the sender is dropped).
        let tls = worker::grpc_tls::server_config(&identity).expect("tls");
        let incoming = worker::grpc_tls::incoming(listener, tokio::sync::watch::channel(tls).1);
        let mut server = tonic::transport::Server::builder();
        let (calls, abandoned) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let fake = Fake { info, behaviour, blocks, calls: Arc::clone(&calls), abandoned: Arc::clone(&abandoned) };
        let svc = WorkerServer::new(fake);
        let task = tokio::spawn(async move {
            let _ = server.add_service(svc).serve_with_incoming(incoming).await;
        });
        FakeWorker { grpc, calls, abandoned, task }
    }

    /// `Prefill` and `Generate` calls so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }

    /// Calls whose caller gave up before they ended ([`Behaviour::StalledPulls`]'s `Prefetch`).
    pub fn abandoned(&self) -> usize {
        self.abandoned.load(Ordering::Relaxed)
    }
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        self.task.abort();
    }
}
