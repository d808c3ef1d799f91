//! A worker that answers `Info` like a real one (the real model's fingerprint, over mutual TLS) and then stops:
//! its event and load streams send their first message and go silent without closing, `Generate` streams one
//! token and stalls, and `Prefill` and `Health` never answer. What a hung process or a wedged engine looks like
//! from the router.

use std::net::SocketAddr;
use std::pin::Pin;

use kv_transfer::tls::DevCa;
use proto::worker as pb;
use proto::worker::worker_server::{Worker, WorkerServer};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[derive(Clone)]
struct Hung {
    info: pb::InfoResponse,
    /// The blocks its first (and last) snapshot claims.
    blocks: Vec<u64>,
}

/// A stream that sends `first` and then nothing, never closing while its reader waits.
fn then_silence<T: Send + 'static>(first: T) -> Streamed<T> {
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        let _ = tx.send(Ok(first)).await;
        tx.closed().await;
    });
    Box::pin(ReceiverStream::new(rx))
}

#[tonic::async_trait]
impl Worker for Hung {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn prefill(&self, _: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        std::future::pending().await
    }

    type GenerateStream = Streamed<pb::GenerateResponse>;

    async fn generate(&self, _: Request<pb::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let token = pb::Token { id: 504, text: "The".into() };
        Ok(Response::new(then_silence(pb::GenerateResponse {
            event: Some(pb::generate_response::Event::Token(token)),
        })))
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
        Ok(Response::new(then_silence(batch)))
    }

    type WatchLoadStream = Streamed<pb::LoadReport>;

    async fn watch_load(&self, _: Request<pb::WatchLoadRequest>) -> Result<Response<Self::WatchLoadStream>, Status> {
        let usage = vec![pb::TierUsage { tier: pb::Tier::Device as i32, used: 0, cached: 0, total: 1024 }];
        Ok(Response::new(then_silence(pb::LoadReport { usage, ..Default::default() })))
    }

    async fn health(&self, _: Request<pb::HealthRequest>) -> Result<Response<pb::HealthResponse>, Status> {
        std::future::pending().await
    }
}

/// A hung worker serving on loopback.
pub struct HungWorker {
    pub grpc: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl HungWorker {
    /// Starts one in `role` whose snapshot claims the blocks `blocks` (chained hashes).
    pub async fn start(ca: &DevCa, role: pb::Role, blocks: Vec<u64>) -> HungWorker {
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
            instance_id: "hung".into(),
            max_model_len: 8192,
            max_num_batched_tokens: 2048,
            host_id: "elsewhere".into(),
        };
        let identity = ca.issue("hung-worker", &[]).expect("cert");
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.expect("binds");
        let grpc = listener.local_addr().expect("address");
        let mut server =
            tonic::transport::Server::builder().tls_config(worker::grpc_tls::server(&identity)).expect("tls");
        let svc = WorkerServer::new(Hung { info, blocks });
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let task = tokio::spawn(async move {
            let _ = server.add_service(svc).serve_with_incoming(incoming).await;
        });
        HungWorker { grpc, task }
    }
}

impl Drop for HungWorker {
    fn drop(&mut self) {
        self.task.abort();
    }
}
