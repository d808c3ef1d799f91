//! The gRPC worker service: each call becomes engine work (`prefill`, `generate`), a subscription (`subscribe`:
//! KV events and load reports) or an answer from the worker's own state (info, health, cancel). The transfer
//! client side (pulling a prefill worker's blocks) is `crate::pull`; leased KV is `crate::leases`.

mod generate;
mod prefetch;
mod prefill;
mod subscribe;

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::generate::{EngineHandle, SubmitError};
use kv_transfer::descriptor::KvLayoutDesc;
use proto::worker as pb;
use proto::worker::worker_server::Worker;
pub use subscribe::{DEFAULT_LOAD_INTERVAL, EVENT_HEARTBEAT};
use tokio_stream::Stream;
use tonic::{Request as GrpcRequest, Response, Status};
use tracing::Instrument;

use crate::leases::Leases;
use crate::metrics::WorkerMetrics;
use crate::pull::Puller;
use crate::requests::InFlight;

type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The worker's fixed facts and shared machinery.
#[derive(Debug)]
pub struct WorkerService {
    pub(crate) engine: Arc<EngineHandle>,
    pub(crate) info: pb::InfoResponse,
    pub(crate) layout: KvLayoutDesc,
    pub(crate) leases: Arc<Leases>,
    pub(crate) puller: Puller,
    pub(crate) lease_ttl: Duration,
    /// Calls in flight by request id (cancellation, and what load reports cover).
    pub(crate) in_flight: Arc<InFlight>,
    pub(crate) metrics: Arc<WorkerMetrics>,
    /// This worker's place in the shared-memory directory (held while it runs); `None`: no shared-memory path.
    pub(crate) _shm: Option<Arc<kv_transfer::shm::ShmDir>>,
    /// The engine's device KV store, when it lives in a shared-memory file: handles name it, and same-host readers
    /// map leased blocks out of it.
    pub(crate) store: Option<std::path::PathBuf>,
    /// The name this worker's certificate carries, which pullers verify (`KvHandle.server_name`).
    pub(crate) tls_name: String,
    /// Becomes `true` when the worker stops: every stream this service feeds ends.
    pub(crate) stopping: tokio::sync::watch::Receiver<bool>,
    /// Becomes `true` when the shutdown grace period is over: running generations end with an error.
    pub(crate) aborting: tokio::sync::watch::Receiver<bool>,
}

/// The transfer endpoint a handle names. A worker listening on every interface (`0.0.0.0:9100`, as in a
/// container) is reached at the address its caller reached it at: the router dialled this connection's local
/// address, so a decode worker on the router's network can dial it too.
pub(crate) fn transfer_endpoint(listening: &str, local: Option<std::net::SocketAddr>) -> String {
    match (listening.parse::<std::net::SocketAddr>(), local) {
        (Ok(l), Some(local)) if l.ip().is_unspecified() => std::net::SocketAddr::new(local.ip(), l.port()).to_string(),
        _ => listening.to_string(),
    }
}

/// Resolves when the worker begins to stop.
async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|&s| s).await;
}

/// The one mapping of engine refusals to gRPC statuses.
fn submit_status(e: SubmitError) -> Status {
    match e {
        SubmitError::Invalid(e) => Status::invalid_argument(e.to_string()),
        SubmitError::Exhausted(e) => Status::resource_exhausted(e.to_string()),
        // As a pull whose block fails its check on receipt: another decode worker may succeed.
        SubmitError::Transfer(e) => Status::unavailable(format!("KV transfer failed: {e}")),
        SubmitError::Closed => Status::unavailable("the worker is shutting down"),
    }
}

/// The caller's W3C trace context from gRPC metadata.
fn traceparent<T>(req: &GrpcRequest<T>) -> Option<String> {
    req.metadata().get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_string)
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn info(&self, _: GrpcRequest<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn prefill(&self, req: GrpcRequest<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        let arrived = Instant::now();
        let span = tracing::info_span!(
            "prefill",
            otel.kind = "server",
            traceparent = traceparent(&req).as_deref(),
            request_id = %req.get_ref().request_id,
            prompt_tokens = req.get_ref().tokens.len(),
            cached_tokens = tracing::field::Empty,
            computed_tokens = tracing::field::Empty,
        );
        telemetry::trace::set_parent(&span, traceparent(&req).as_deref());
        let endpoint = transfer_endpoint(&self.info.transfer_endpoint, req.local_addr());
        self.prefill_inner(req.into_inner(), endpoint, arrived).instrument(span).await
    }

    type GenerateStream = Streamed<pb::GenerateResponse>;

    async fn generate(&self, req: GrpcRequest<pb::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let arrived = Instant::now();
        // W3C trace context from the caller rides on into the transfer request.
        let traceparent = traceparent(&req);
        let span = tracing::info_span!(
            "generate",
            otel.kind = "server",
            traceparent = traceparent.as_deref(),
            request_id = %req.get_ref().request_id,
            prompt_tokens = req.get_ref().tokens.len(),
        );
        telemetry::trace::set_parent(&span, traceparent.as_deref());
        self.generate_inner(req.into_inner(), traceparent, arrived).instrument(span).await
    }

    async fn prefetch(&self, req: GrpcRequest<pb::PrefetchRequest>) -> Result<Response<pb::PrefetchResponse>, Status> {
        let traceparent = traceparent(&req);
        let span = tracing::info_span!(
            "prefetch",
            otel.kind = "server",
            traceparent = traceparent.as_deref(),
            request_id = %req.get_ref().request_id,
            prompt_tokens = req.get_ref().tokens.len(),
        );
        telemetry::trace::set_parent(&span, traceparent.as_deref());
        self.prefetch_inner(req.into_inner(), traceparent).instrument(span).await
    }

    async fn cancel(&self, req: GrpcRequest<pb::CancelRequest>) -> Result<Response<pb::CancelResponse>, Status> {
        Ok(Response::new(pb::CancelResponse { found: self.in_flight.cancel(&req.into_inner().request_id) }))
    }

    type SubscribeKvEventsStream = Streamed<pb::KvEventBatch>;

    async fn subscribe_kv_events(
        &self,
        req: GrpcRequest<pb::SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        Ok(Response::new(self.kv_events(req.into_inner())))
    }

    type WatchLoadStream = Streamed<pb::LoadReport>;

    async fn watch_load(
        &self,
        req: GrpcRequest<pb::WatchLoadRequest>,
    ) -> Result<Response<Self::WatchLoadStream>, Status> {
        Ok(Response::new(self.load_reports(req.into_inner())))
    }

    /// Answered by the process itself, never through the engine's queue: a worker in a long step is alive.
    async fn health(&self, _: GrpcRequest<pb::HealthRequest>) -> Result<Response<pb::HealthResponse>, Status> {
        let serving = self.engine.is_running() && !*self.stopping.borrow();
        Ok(Response::new(pb::HealthResponse { serving }))
    }
}

#[cfg(test)]
mod tests {
    use super::transfer_endpoint;

    #[test]
    fn a_worker_listening_everywhere_is_named_by_the_address_it_was_reached_at() {
        let local = Some("172.18.0.5:9000".parse().expect("addr"));
        assert_eq!(transfer_endpoint("0.0.0.0:9100", local), "172.18.0.5:9100");
        assert_eq!(transfer_endpoint("[::]:9100", Some("[fd00::5]:9000".parse().expect("addr"))), "[fd00::5]:9100");
        assert_eq!(transfer_endpoint("10.0.0.7:9100", local), "10.0.0.7:9100", "a bound address is kept");
        assert_eq!(transfer_endpoint("0.0.0.0:9100", None), "0.0.0.0:9100", "nothing better known");
    }
}
