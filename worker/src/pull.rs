//! The decode side of a transfer: check a prefill worker's `KvHandle` against the prompt, find which blocks this
//! worker already holds, pull only the rest (shared memory on one host, QUIC otherwise), and release the lease.
//! The gRPC service calls it; it knows nothing of gRPC beyond the status it answers with.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use engine::generate::{EngineHandle, PulledBlocks};
use kv_cache::{BlockSize, CacheNamespace, block_hashes};
use kv_transfer::descriptor::{BlockDescriptor, KvHandle, KvLayoutDesc};
use kv_transfer::frame::ErrorCode;
use kv_transfer::lease::LeaseId;
use kv_transfer::quic::{PullRequest, QuicClient, TransferError};
use tonic::Status;

use crate::metrics::{Transport, WorkerMetrics};

/// Parallel QUIC streams per pull.
const PULL_STREAMS: usize = 4;

/// Pulls blocks from other workers.
#[derive(Debug)]
pub struct Puller {
    pub(crate) client: Arc<QuicClient>,
    pub(crate) timeout: Duration,
    pub(crate) fingerprint: String,
    pub(crate) layout: KvLayoutDesc,
    /// Where this worker may read other workers' KV stores: only with a shared-memory directory of its own.
    pub(crate) same_host: Option<SameHost>,
    pub(crate) metrics: Arc<WorkerMetrics>,
    /// A mock worker's transfers take (and report) the time and bytes of the modelled model's blocks.
    pub(crate) modelled: Option<ModelledTransfer>,
}

/// This worker's shared-memory domain: a handle from a worker with the same host id names a store that lies in
/// this worker's own directory (`kv_transfer::shm::store_in`), read through the stores' kept mappings.
#[derive(Clone, Debug)]
pub struct SameHost {
    pub host_id: String,
    pub dir: std::path::PathBuf,
    pub stores: Arc<kv_transfer::shm::StoreMaps>,
}

/// Transfer timing for a mock worker: the profile's link, sped up as its steps are.
#[derive(Clone, Debug)]
pub struct ModelledTransfer {
    pub profile: engine::backend::TimingProfile,
    pub speedup: f64,
}

impl ModelledTransfer {
    /// The wall time a pull of `blocks` blocks must take.
    fn duration(&self, blocks: u64) -> Duration {
        Duration::from_secs_f64((self.profile.transfer_ms(blocks) / 1000.0 / self.speedup).max(0.0))
    }
}

/// Blocks pulled for a prompt, ready to import: received into buffers of their own (checked on receipt), arrived
/// over QUIC and still in the packets they came in, or still in the owner's shared-memory region, mapped. The
/// engine copies each of the last two straight into its KV block and checks it there, timed by the
/// [`CopyClock`].
#[derive(Debug)]
pub enum Pulled {
    Received(Vec<(usize, Bytes)>),
    Arrived(Vec<kv_transfer::incoming::Arrived>, Arc<CopyClock>),
    Mapped(kv_transfer::shm::MappedBlocks, Arc<CopyClock>),
}

impl Pulled {
    /// Blocks gathered and checked by the transport (`QuicClient::pull`, `shm::pull`), by position.
    pub fn received(blocks: Vec<(u32, Bytes)>) -> Pulled {
        Pulled::Received(blocks.into_iter().map(|(i, b)| (i as usize, b)).collect())
    }

    /// Mapped blocks with a clock of their own.
    pub fn mapped(blocks: kv_transfer::shm::MappedBlocks) -> Pulled {
        Pulled::Mapped(blocks, Arc::default())
    }
}

/// How long the engine took over a mapped pull's blocks: from its first read of one to its latest check (the copy
/// is the pull's last leg, and the engine's queue before it is not part of the transfer).
#[derive(Debug, Default)]
pub struct CopyClock {
    first: std::sync::OnceLock<Instant>,
    nanos: std::sync::atomic::AtomicU64,
}

impl CopyClock {
    fn read(&self) {
        self.first.get_or_init(Instant::now);
    }

    fn checked(&self) {
        if let Some(first) = self.first.get() {
            let nanos = u64::try_from(first.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.nanos.store(nanos, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn took(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// Received blocks answer as the engine's own buffer source does; arrived and mapped ones are copied from where
/// they lie and checked in the copy.
impl PulledBlocks for Pulled {
    fn count(&self) -> usize {
        match self {
            Pulled::Received(v) => v.count(),
            Pulled::Arrived(v, _) => v.len(),
            Pulled::Mapped(m, _) => m.len(),
        }
    }

    fn block(&self, k: usize) -> (usize, usize) {
        match self {
            Pulled::Received(v) => v.block(k),
            Pulled::Arrived(v, _) => (v[k].index as usize, v[k].len()),
            Pulled::Mapped(m, _) => {
                let (index, bytes) = m.block(k);
                (index as usize, bytes.len())
            }
        }
    }

    fn copy_into(&self, k: usize, dst: &mut [u8]) -> Result<(), String> {
        match self {
            Pulled::Received(v) => v.copy_into(k, dst),
            Pulled::Arrived(v, clock) => {
                clock.read();
                let checked = v[k].copy_into(dst).map_err(str::to_string);
                clock.checked();
                checked
            }
            Pulled::Mapped(m, clock) => {
                clock.read();
                let checked = m.copy_checked(k, dst).map_err(|e| e.to_string());
                clock.checked();
                checked
            }
        }
    }
}

/// A pull whose blocks are not imported yet: its figures are recorded once they are (the engine's copy is its last
/// leg), by [`Puller::imported`].
#[derive(Debug)]
pub struct PullTiming {
    transport: Transport,
    blocks: usize,
    bytes: u64,
    /// From the pull's start to the blocks handed over (arrived, or mapped).
    handed_over: Duration,
    copy: Arc<CopyClock>,
    span: tracing::Span,
    /// The owner's lease, when it must outlast the engine's copy: mapped blocks of the owner's KV store stay as
    /// they are only while the lease pins them.
    _release: Option<ReleaseLater>,
}

/// A lease to release once its blocks are copied: released when dropped, however the pull ends (a caller that
/// goes away mid-import included), in the background; if that fails the lease simply expires.
#[derive(Debug)]
struct ReleaseLater {
    client: Arc<QuicClient>,
    addr: std::net::SocketAddr,
    server_name: String,
    lease: LeaseId,
    timeout: Duration,
}

impl Drop for ReleaseLater {
    fn drop(&mut self) {
        let (client, addr, lease, timeout) = (Arc::clone(&self.client), self.addr, self.lease, self.timeout);
        let server_name = std::mem::take(&mut self.server_name);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = client.release(addr, &server_name, lease, timeout).await;
            });
        }
    }
}

pub(crate) fn transfer_status(e: TransferError) -> Status {
    match e {
        TransferError::Remote { code: ErrorCode::LeaseNotFound | ErrorCode::LeaseExpired, message } => {
            Status::not_found(format!("KV lease: {message}"))
        }
        TransferError::Timeout(d) => Status::deadline_exceeded(format!("KV transfer: no answer within {d:?}")),
        other => Status::unavailable(format!("KV transfer failed: {other}")),
    }
}

/// A pull's figures: the worker's transfer metrics and its span's throughput.
fn record(
    metrics: &WorkerMetrics,
    span: &tracing::Span,
    transport: Transport,
    blocks: usize,
    bytes: u64,
    took: Duration,
) {
    metrics.pulled(transport, blocks, bytes, took);
    span.record("throughput_bytes_per_s", (bytes as f64 / took.as_secs_f64().max(1e-9)) as u64);
}

impl Puller {
    fn block_size(&self) -> BlockSize {
        BlockSize::new(self.layout.block_tokens).unwrap_or_default()
    }

    /// Checks `handle`, then pulls the full blocks of `tokens` that `engine` lacks; the lease is released once they
    /// are here (or when none are needed).
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
    pub async fn pull_missing(
        &self,
        engine: &EngineHandle,
        tokens: &[u32],
        namespace: Option<&CacheNamespace>,
        handle: KvHandle,
        traceparent: Option<String>,
    ) -> Result<(Pulled, Option<PullTiming>), Status> {
        handle
            .check_compatible(&self.fingerprint, &self.layout)
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
        let hashes = block_hashes(&tokens[..full * bt], self.block_size(), namespace).seq;
        if handle.blocks.len() < full || hashes.iter().zip(&handle.blocks).any(|(h, d)| d.seq_hash != Some(*h)) {
            return Err(Status::invalid_argument("the handle's blocks are not this prompt's"));
        }
        let held = engine.lookup(hashes).await.ok_or_else(|| Status::unavailable("engine stopped"))?;
        let start = held.device + held.host + held.disk;
        let wanted: Vec<(u32, BlockDescriptor)> = (start..full).map(|i| (i as u32, handle.blocks[i])).collect();
        let addr = handle
            .endpoint
            .parse::<std::net::SocketAddr>()
            .map_err(|e| Status::invalid_argument(format!("handle endpoint {:?}: {e}", handle.endpoint)))?;
        // Protocol version 1 handles name no certificate name: the address, as then.
        let server_name =
            if handle.server_name.is_empty() { addr.ip().to_string() } else { handle.server_name.clone() };
        if wanted.is_empty() {
            tracing::Span::current().record("blocks", 0);
            self.release(addr, &server_name, handle.lease).await;
            return Ok((Pulled::Received(Vec::new()), None));
        }
        let req = PullRequest {
            addr,
            server_name: &server_name,
            lease: handle.lease,
            blocks: &wanted,
            streams: PULL_STREAMS,
            timeout: self.timeout,
            // The owner's serve span becomes a child of this pull.
            traceparent: telemetry::trace::traceparent(&tracing::Span::current()).or(traceparent),
        };
        // On the same host (equal host ids) the owner's KV store is readable in this worker's own shared-memory
        // directory: copy from it (one-sided, off the async runtime); else QUIC. Any other file the handle names
        // is not opened.
        let local = self.same_host.as_ref().filter(|own| own.host_id == handle.host_id).and_then(|own| {
            let path = kv_transfer::shm::store_in(&own.dir, handle.shm_region.as_deref()?)?;
            path.exists().then(|| (path, Arc::clone(&own.stores)))
        });
        let started = Instant::now();
        let (transport, pulled) = match local {
            Some((path, stores)) => {
                let blocks = wanted.clone();
                let mapped = tokio::task::spawn_blocking(move || stores.blocks(&path, &blocks))
                    .await
                    .map_err(|e| Status::internal(format!("shared-memory mapping: {e}")))?;
                (Transport::Shm, Pulled::mapped(mapped.map_err(transfer_status)?))
            }
            None => {
                let arrived = self.client.pull_in_place(req).await.map_err(transfer_status)?;
                (Transport::Quic, Pulled::Arrived(arrived, Arc::default()))
            }
        };
        let blocks = pulled.count();
        let bytes: u64 = match (&self.modelled, &pulled) {
            (None, Pulled::Received(v)) => v.iter().map(|(_, b)| b.len() as u64).sum(),
            (None, Pulled::Arrived(v, _)) => v.iter().map(|b| b.len() as u64).sum(),
            (None, Pulled::Mapped(m, _)) => m.bytes(),
            (Some(m), _) => {
                let target = m.duration(blocks as u64);
                tokio::time::sleep(target.saturating_sub(started.elapsed())).await;
                m.profile.transfer_bytes(blocks as u64)
            }
        };
        let span = tracing::Span::current();
        span.record("transport", transport.as_str());
        span.record("blocks", blocks);
        span.record("bytes", bytes);
        let timing = match &pulled {
            Pulled::Received(_) => {
                record(&self.metrics, &span, transport, blocks, bytes, started.elapsed());
                None
            }
            Pulled::Arrived(_, copy) | Pulled::Mapped(_, copy) => {
                let copy = Arc::clone(copy);
                let handed_over = started.elapsed();
                // Mapped blocks are read where the owner's engine keeps them: its lease goes after the copy.
                let release = matches!(pulled, Pulled::Mapped(..)).then(|| ReleaseLater {
                    client: Arc::clone(&self.client),
                    addr,
                    server_name: server_name.clone(),
                    lease: handle.lease,
                    timeout: self.timeout,
                });
                Some(PullTiming { transport, blocks, bytes, handed_over, copy, span: span.clone(), _release: release })
            }
        };
        if !matches!(pulled, Pulled::Mapped(..)) {
            // Arrived or received blocks are this worker's memory: the lease can go before the copy.
            self.release(addr, &server_name, handle.lease).await;
        }
        Ok((pulled, timing))
    }

    /// Ends a pull once the engine has taken its blocks (or refused them): its figures are recorded when the import
    /// succeeded (the time to hand them over plus the engine's copy), and a lease still held for the copy is
    /// released (in the background: the caller's stream need not wait for the owner's answer).
    pub fn finish(&self, t: PullTiming, imported: bool) {
        if imported {
            record(&self.metrics, &t.span, t.transport, t.blocks, t.bytes, t.handed_over + t.copy.took());
        }
    }

    /// Tells the owner its lease is no longer needed; if that fails the lease simply expires.
    async fn release(&self, addr: std::net::SocketAddr, server_name: &str, lease: LeaseId) {
        let _ = self.client.release(addr, server_name, lease, self.timeout).await;
    }
}

#[cfg(test)]
mod tests {
    use kv_transfer::descriptor::RegionKey;

    use super::*;

    /// A mapped pull's time is the engine's copy, from its first read of a block to its latest check: the queue
    /// before the engine takes it up is not counted. (An arrived QUIC pull's copy is timed the same way.)
    #[test]
    fn a_mapped_pull_times_the_engines_copy_alone() {
        let path = std::env::temp_dir().join(format!("tandem-copy-clock-{}", std::process::id()));
        let block = vec![5u8; 4096];
        std::fs::write(&path, &block).expect("region");
        let d = BlockDescriptor {
            seq_hash: None,
            region: RegionKey(0),
            offset: 0,
            len: 4096,
            checksum: kv_transfer::checksum(&block),
        };
        let pulled = Pulled::mapped(kv_transfer::shm::MappedBlocks::open(&path, &[(0, d)]).expect("maps"));
        let _ = std::fs::remove_file(&path);
        let Pulled::Mapped(_, clock) = &pulled else { unreachable!("mapped") };
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(clock.took(), Duration::ZERO, "nothing read yet: waiting for the engine is not the copy");
        // Two copies 5 ms apart: the clock runs from the first read to the latest check.
        let reading = Instant::now();
        let mut copy = vec![0u8; 4096];
        assert!(pulled.copy_into(0, &mut copy).is_ok());
        std::thread::sleep(Duration::from_millis(5));
        assert!(pulled.copy_into(0, &mut copy).is_ok());
        assert_eq!(copy, block);
        let (took, since_read) = (clock.took(), reading.elapsed());
        assert!(took >= Duration::from_millis(5) && took <= since_read, "{took:?} of {since_read:?}");
    }
}
