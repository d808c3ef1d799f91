//! The worker service: gRPC requests turned into engine work, KV leases and transfers.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use engine::generate::{EngineHandle, EngineStats, Request, SeqEvent, SubmitError};
use kv_cache::events::EventId;
use kv_cache::{BlockSize, CacheNamespace, block_hashes};
use kv_transfer::checksum;
use kv_transfer::descriptor::{BlockDescriptor, KvHandle, KvLayoutDesc, RegionKey};
use kv_transfer::frame::ErrorCode;
use kv_transfer::lease::LeaseId;
use kv_transfer::quic::{PullRequest, QuicClient, TransferError};
use proto::worker as pb;
use proto::worker::worker_server::Worker;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request as GrpcRequest, Response, Status};
use tracing::Instrument;

use crate::convert;
use crate::leases::Leases;
use crate::metrics::{Transport, WorkerMetrics};

type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// How often a KV event subscription looks for new events.
const EVENT_POLL: Duration = Duration::from_millis(20);
/// Load reports when the subscriber names no period.
pub const DEFAULT_LOAD_INTERVAL: Duration = Duration::from_millis(100);
/// How often a load subscription looks at the engine between periodic reports, to catch large changes.
const LOAD_CHECK: Duration = Duration::from_millis(20);
/// A change of this fraction of the device tier's blocks is reported at once.
const LARGE_BLOCK_CHANGE: f64 = 0.10;

/// Whether the load moved enough since the last report to tell the router now rather than at the next period:
/// a sequence started, finished or queued, or device block use moved by a tenth of capacity.
fn large_change(prev: &EngineStats, now: &EngineStats) -> bool {
    let device = |s: &EngineStats| s.usage[0].used as f64;
    let capacity = (now.usage[0].used + now.usage[0].cached + now.usage[0].free).max(1) as f64;
    prev.running != now.running
        || prev.waiting != now.waiting
        || (device(prev) - device(now)).abs() / capacity >= LARGE_BLOCK_CHANGE
}

fn load_report(stats: &EngineStats) -> pb::LoadReport {
    let usage = kv_cache::events::Tier::ALL
        .iter()
        .map(|&t| {
            let u = stats.usage[t.index()];
            pb::TierUsage {
                tier: convert::tier_to_pb(t) as i32,
                used: u.used as u64,
                cached: u.cached as u64,
                total: (u.used + u.cached + u.free) as u64,
            }
        })
        .collect();
    pb::LoadReport {
        running: stats.running as u32,
        waiting: stats.waiting as u32,
        active_prefill_tokens: stats.prefill_tokens_pending as u64,
        usage,
    }
}

/// Sends a load report every `period`, and at once when the load changes a lot, until the reader goes away.
async fn report_load(engine: Arc<EngineHandle>, period: Duration, tx: mpsc::Sender<Result<pb::LoadReport, Status>>) {
    let mut tick = tokio::time::interval(period.min(LOAD_CHECK));
    let mut last: Option<(EngineStats, Instant)> = None;
    loop {
        tick.tick().await;
        let Some(stats) = engine.stats().await else { return };
        let due = last.as_ref().is_none_or(|(prev, at)| at.elapsed() >= period || large_change(prev, &stats));
        if !due {
            continue;
        }
        if tx.send(Ok(load_report(&stats))).await.is_err() {
            return;
        }
        last = Some((stats, Instant::now()));
    }
}

/// Parallel QUIC streams per pull.
const PULL_STREAMS: usize = 4;

/// The worker's fixed facts and shared machinery.
#[derive(Debug)]
pub struct WorkerService {
    pub(crate) engine: Arc<EngineHandle>,
    pub(crate) info: pb::InfoResponse,
    pub(crate) layout: KvLayoutDesc,
    pub(crate) leases: Arc<Leases>,
    pub(crate) client: Arc<QuicClient>,
    pub(crate) lease_ttl: Duration,
    pub(crate) pull_timeout: Duration,
    pub(crate) cancels: Mutex<HashMap<String, oneshot::Sender<()>>>,
    pub(crate) metrics: Arc<WorkerMetrics>,
    /// Where to put shared-memory copies of leased blocks; `None`: no shared-memory path.
    pub(crate) shm_dir: Option<std::path::PathBuf>,
    /// Becomes `true` when the worker stops: every stream this service feeds ends.
    pub(crate) stopping: tokio::sync::watch::Receiver<bool>,
    /// Becomes `true` when the shutdown grace period is over: running generations end with an error.
    pub(crate) aborting: tokio::sync::watch::Receiver<bool>,
}

/// Resolves when the worker begins to stop.
async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|&s| s).await;
}

fn submit_status(e: SubmitError) -> Status {
    match e {
        SubmitError::Invalid(e) => Status::invalid_argument(e.to_string()),
        SubmitError::Closed => Status::unavailable("the worker is shutting down"),
    }
}

fn transfer_status(e: TransferError) -> Status {
    match e {
        TransferError::Remote { code: ErrorCode::LeaseNotFound | ErrorCode::LeaseExpired, message } => {
            Status::not_found(format!("KV lease: {message}"))
        }
        TransferError::Timeout(d) => Status::deadline_exceeded(format!("KV transfer: no answer within {d:?}")),
        other => Status::unavailable(format!("KV transfer failed: {other}")),
    }
}

/// 128 bits nobody can predict from outside the process (keyed SipHash over a counter and the clock).
fn lease_id() -> LeaseId {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let half = |salt: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(n);
        h.write_u64(salt);
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        h.finish()
    };
    LeaseId(u128::from(half(1)) << 64 | u128::from(half(2)))
}

/// The caller's W3C trace context from gRPC metadata.
fn traceparent<T>(req: &GrpcRequest<T>) -> Option<String> {
    req.metadata().get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_string)
}

impl WorkerService {
    fn block_size(&self) -> BlockSize {
        BlockSize::new(self.layout.block_tokens).unwrap_or_default()
    }

    /// Decode side of a handle: checks it, then pulls and stores the full blocks this worker lacks.
    #[tracing::instrument(
        name = "kv_transfer.pull",
        skip_all,
        fields(
            transport = tracing::field::Empty,
            blocks = tracing::field::Empty,
            bytes = tracing::field::Empty,
            throughput_bytes_per_s = tracing::field::Empty
        )
    )]
    async fn pull_missing(
        &self,
        tokens: &[u32],
        namespace: Option<&CacheNamespace>,
        handle: KvHandle,
        traceparent: Option<String>,
    ) -> Result<(), Status> {
        handle
            .check_compatible(&self.info.model_fingerprint, &self.layout)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let covered = handle.tokens as usize;
        if covered > tokens.len() {
            return Err(Status::invalid_argument(format!(
                "the handle covers {covered} tokens, the request has {}",
                tokens.len()
            )));
        }
        let bt = self.layout.block_tokens as usize;
        let full = covered / bt;
        let prompt = &tokens[..full * bt];
        let hashes = block_hashes(prompt, self.block_size(), namespace).seq;
        if hashes.iter().zip(&handle.blocks).any(|(h, d)| d.seq_hash != Some(*h)) {
            return Err(Status::invalid_argument("the handle's blocks are not this prompt's"));
        }
        let held = self.engine.lookup(hashes.clone()).await.ok_or_else(|| Status::unavailable("engine stopped"))?;
        let start = held.device + held.host + held.disk;
        let wanted: Vec<(u32, BlockDescriptor)> = (start..full).map(|i| (i as u32, handle.blocks[i])).collect();
        let addr = handle
            .endpoint
            .parse::<std::net::SocketAddr>()
            .map_err(|e| Status::invalid_argument(format!("handle endpoint {:?}: {e}", handle.endpoint)))?;
        let server_name = addr.ip().to_string();
        if wanted.is_empty() {
            tracing::Span::current().record("blocks", 0);
            self.release_lease(addr, &server_name, handle.lease).await;
            return Ok(());
        }
        let req = PullRequest {
            addr,
            server_name: &server_name,
            lease: handle.lease,
            blocks: &wanted,
            streams: PULL_STREAMS,
            timeout: self.pull_timeout,
            // The owner's serve span becomes a child of this pull.
            traceparent: telemetry::trace::traceparent(&tracing::Span::current()).or(traceparent),
        };
        // On the same host the owner's shared-memory region is readable: copy from it (one-sided); else QUIC.
        let local = handle
            .shm_region
            .as_deref()
            .filter(|_| self.shm_dir.is_some())
            .map(std::path::Path::new)
            .filter(|p| p.exists());
        let started = Instant::now();
        let (transport, pulled) = match local {
            Some(path) => (Transport::Shm, kv_transfer::shm::pull(path, &wanted).map_err(transfer_status)?),
            None => (Transport::Quic, self.client.pull(req).await.map_err(transfer_status)?),
        };
        let took = started.elapsed();
        let bytes: u64 = pulled.iter().map(|(_, b)| b.len() as u64).sum();
        self.metrics.pulled(transport, pulled.len(), bytes, took);
        let span = tracing::Span::current();
        span.record("transport", transport.as_str());
        span.record("blocks", pulled.len());
        span.record("bytes", bytes);
        span.record("throughput_bytes_per_s", (bytes as f64 / took.as_secs_f64().max(1e-9)) as u64);
        let blocks: Vec<(usize, Bytes)> = pulled.into_iter().map(|(i, b)| (i as usize, b)).collect();
        self.engine.import(prompt.to_vec(), namespace.cloned(), blocks).await.map_err(submit_status)?;
        self.release_lease(addr, &server_name, handle.lease).await;
        Ok(())
    }

    async fn prefill_inner(
        &self,
        r: pb::PrefillRequest,
        arrived: Instant,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        let sampling = convert::sampling(r.sampling, Some(1))?;
        let mut stream = self
            .engine
            .submit_exporting(Request {
                namespace: r.cache_namespace.map(CacheNamespace::new),
                prompt: r.tokens,
                sampling,
            })
            .await
            .map_err(submit_status)?;
        let (mut first, mut kv, mut done) = (None, None, None);
        let mut abort = self.aborting.clone();
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                _ = abort.wait_for(|&a| a) => return Err(Status::unavailable("the worker stopped")),
            };
            let Some(ev) = ev else { break };
            match ev {
                SeqEvent::Token { token, .. } => {
                    self.metrics.time_to_first_token.observe(arrived.elapsed());
                    first = Some(token);
                }
                SeqEvent::Exported(e) => kv = Some(e),
                SeqEvent::Finished(c) => {
                    done = Some(c);
                    break;
                }
                SeqEvent::Failed(e) => return Err(Status::internal(e)),
            }
        }
        let (Some(first), Some(kv), Some(done)) = (first, kv, done) else {
            return Err(Status::internal("prefill ended without a token and its KV"));
        };
        let span = tracing::Span::current();
        span.record("cached_tokens", done.cached_tokens);
        span.record("computed_tokens", kv.tokens - done.cached_tokens);
        let len = self.layout.block_bytes();
        let mut held = Vec::with_capacity(kv.blocks.len());
        let mut blocks = Vec::with_capacity(kv.blocks.len());
        for (i, b) in kv.blocks.into_iter().enumerate() {
            let bytes = Bytes::from(b.bytes);
            let sum = checksum(&bytes);
            blocks.push(BlockDescriptor {
                seq_hash: b.meta.map(|m| m.seq),
                region: RegionKey(0),
                offset: i as u64 * len,
                len,
                checksum: sum,
            });
            held.push((sum, bytes));
        }
        let lease = lease_id();
        // Same-host readers can copy the blocks straight out of shared memory; failing to make it only costs that.
        let region = self.shm_dir.as_deref().and_then(|dir| {
            let bytes: Vec<Bytes> = held.iter().map(|(_, b)| b.clone()).collect();
            kv_transfer::shm::ShmRegion::create(dir, lease, &bytes).ok().map(|(r, _)| r)
        });
        let shm_region = region.as_ref().map(|r| r.path().display().to_string());
        self.leases
            .grant(lease, held, region, Instant::now(), self.lease_ttl)
            .map_err(|e| Status::internal(e.to_string()))?;
        let handle = KvHandle {
            endpoint: self.info.transfer_endpoint.clone(),
            lease,
            model_fingerprint: self.info.model_fingerprint.clone(),
            layout: self.layout,
            tokens: kv.tokens as u32,
            blocks,
            shm_region,
        };
        Ok(Response::new(pb::PrefillResponse {
            first_token: first,
            handle: Some(convert::handle_to_pb(&handle)),
            cached_tokens: done.cached_tokens as u32,
            computed_tokens: (kv.tokens - done.cached_tokens) as u32,
        }))
    }

    async fn generate_inner(
        &self,
        r: pb::GenerateRequest,
        traceparent: Option<String>,
        arrived: Instant,
    ) -> Result<Response<Streamed<pb::GenerateResponse>>, Status> {
        let sampling = convert::sampling(r.sampling, None)?;
        let namespace = r.cache_namespace.map(CacheNamespace::new);
        if let Some(h) = r.handle {
            self.pull_missing(&r.tokens, namespace.as_ref(), convert::handle_from_pb(h)?, traceparent).await?;
        }
        let capacity = sampling.max_tokens() as usize + 2;
        let mut stream =
            self.engine.submit(Request { namespace, prompt: r.tokens, sampling }).await.map_err(submit_status)?;
        let (cancel_tx, mut cancel_rx) = oneshot::channel();
        if !r.request_id.is_empty()
            && let Ok(mut c) = self.cancels.lock()
        {
            c.insert(r.request_id.clone(), cancel_tx);
        }
        let (tx, rx) = mpsc::channel(capacity);
        let metrics = Arc::clone(&self.metrics);
        let abort = self.aborting.clone();
        let decode =
            tracing::info_span!("decode", output_tokens = tracing::field::Empty, cached_tokens = tracing::field::Empty);
        tokio::spawn(
            async move {
                let mut first_at = None;
                loop {
                    let ev = tokio::select! {
                        _ = &mut cancel_rx => break,
                        _ = stopped(abort.clone()) => {
                            let _ = tx.send(Err(Status::unavailable("the worker stopped"))).await;
                            break;
                        }
                        ev = stream.next() => ev,
                    };
                    let Some(ev) = ev else { break };
                    let (msg, last) = match ev {
                        SeqEvent::Token { token, text } => (
                            {
                                if first_at.is_none() {
                                    metrics.time_to_first_token.observe(arrived.elapsed());
                                    first_at = Some(Instant::now());
                                }
                                Ok(pb::GenerateResponse {
                                    event: Some(pb::generate_response::Event::Token(pb::Token { id: token, text })),
                                })
                            },
                            false,
                        ),
                        SeqEvent::Finished(c) => {
                            let n = c.token_ids.len();
                            if let (Some(at), true) = (first_at, n > 1) {
                                metrics.time_per_output_token.observe(at.elapsed() / (n as u32 - 1));
                            }
                            tracing::Span::current()
                                .record("output_tokens", n)
                                .record("cached_tokens", c.cached_tokens);
                            let finished = pb::Finished {
                                reason: convert::finish_to_pb(c.finish_reason) as i32,
                                prompt_tokens: c.prompt_ids.len() as u32,
                                completion_tokens: c.token_ids.len() as u32,
                                cached_tokens: c.cached_tokens as u32,
                            };
                            (
                                Ok(pb::GenerateResponse {
                                    event: Some(pb::generate_response::Event::Finished(finished)),
                                }),
                                true,
                            )
                        }
                        SeqEvent::Failed(e) => (Err(Status::internal(e)), true),
                        SeqEvent::Exported(_) => continue,
                    };
                    // A client that went away drops the engine stream here, which cancels the sequence.
                    if tx.send(msg).await.is_err() || last {
                        break;
                    }
                }
            }
            .instrument(decode),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    /// Tells the owner its lease is no longer needed; if that fails the lease simply expires.
    async fn release_lease(&self, addr: std::net::SocketAddr, server_name: &str, lease: LeaseId) {
        let _ = self.client.release(addr, server_name, lease, self.pull_timeout).await;
    }
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
        self.prefill_inner(req.into_inner(), arrived).instrument(span).await
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

    async fn cancel(&self, req: GrpcRequest<pb::CancelRequest>) -> Result<Response<pb::CancelResponse>, Status> {
        let id = req.into_inner().request_id;
        let found = self.cancels.lock().ok().and_then(|mut c| c.remove(&id)).is_some_and(|tx| tx.send(()).is_ok());
        Ok(Response::new(pb::CancelResponse { found }))
    }

    type SubscribeKvEventsStream = Streamed<pb::KvEventBatch>;

    async fn subscribe_kv_events(
        &self,
        req: GrpcRequest<pb::SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        let after = req.into_inner().after_event_id.map(EventId);
        let engine = Arc::clone(&self.engine);
        let instance = self.info.instance_id.clone();
        let (tx, rx) = mpsc::channel(64);
        let stop = self.stopping.clone();
        tokio::spawn(async move {
            tokio::select! {
              _ = stopped(stop) => {}
              _ = async move {
              let batch = |body| pb::KvEventBatch { instance_id: instance.clone(), body: Some(body) };
              let mut last = after;
              let mut need_snapshot = after.is_none();
              loop {
                  if need_snapshot {
                      let Some(snap) = engine.snapshot().await else { return };
                      last = snap.as_of;
                      if tx.send(Ok(batch(pb::kv_event_batch::Body::Snapshot(convert::snapshot_to_pb(&snap))))).await.is_err() {
                          return;
                      }
                      need_snapshot = false;
                  }
                  match engine.events_after(last).await {
                      None => return,
                      Some(Err(_too_old)) => need_snapshot = true,
                      Some(Ok(events)) if events.is_empty() => tokio::time::sleep(EVENT_POLL).await,
                      Some(Ok(events)) => {
                          last = events.last().map(|(id, _)| *id);
                          let events = events.iter().map(|(id, e)| convert::event_to_pb(id.0, e)).collect();
                          if tx.send(Ok(batch(pb::kv_event_batch::Body::Events(pb::KvEvents { events })))).await.is_err() {
                              return;
                          }
                      }
                  }
              }
              } => {}
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type WatchLoadStream = Streamed<pb::LoadReport>;

    async fn watch_load(
        &self,
        req: GrpcRequest<pb::WatchLoadRequest>,
    ) -> Result<Response<Self::WatchLoadStream>, Status> {
        let ms = req.into_inner().interval_ms;
        let period = if ms == 0 { DEFAULT_LOAD_INTERVAL } else { Duration::from_millis(u64::from(ms)) };
        let engine = Arc::clone(&self.engine);
        let (tx, rx) = mpsc::channel(4);
        let stop = self.stopping.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = stopped(stop) => {}
                _ = report_load(engine, period, tx) => {}
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn health(&self, _: GrpcRequest<pb::HealthRequest>) -> Result<Response<pb::HealthResponse>, Status> {
        Ok(Response::new(pb::HealthResponse { serving: self.engine.stats().await.is_some() }))
    }
}
