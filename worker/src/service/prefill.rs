//! The prefill role: compute a prompt's KV, sample the first token, and hold the KV under a lease for the decode
//! worker to pull.

use std::time::Instant;

use bytes::Bytes;
use engine::generate::{ExportedKv, Request, SeqEvent};
use kv_cache::CacheNamespace;
use kv_transfer::checksum;
use kv_transfer::descriptor::{BlockDescriptor, KvHandle, RegionKey};
use kv_transfer::lease::LeaseId;
use proto::worker as pb;
use tonic::{Response, Status};

use super::{WorkerService, submit_status};
use crate::convert;

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

/// The prompt's blocks ready to lease: their descriptors, and (checksum, bytes) to serve.
struct Prepared {
    descriptors: Vec<BlockDescriptor>,
    held: Vec<(u64, Bytes)>,
}

/// Checksums every block (CPU work, run off the async runtime). The blocks served are the engine's own, pinned
/// where they lie (the lease keeps them); each descriptor gives the block's offset in the engine's store, which a
/// same-host reader maps when the store is a shared-memory file.
fn prepare(kv: &ExportedKv) -> Prepared {
    let mut held = Vec::with_capacity(kv.len());
    let mut descriptors = Vec::with_capacity(kv.len());
    for (i, meta) in kv.metas.iter().enumerate() {
        let bytes = kv.shared_block(i);
        let sum = checksum(&bytes);
        descriptors.push(BlockDescriptor {
            seq_hash: meta.map(|m| m.seq),
            region: RegionKey(0),
            offset: kv.offset(i),
            len: bytes.len() as u64,
            checksum: sum,
        });
        held.push((sum, bytes));
    }
    Prepared { descriptors, held }
}

impl WorkerService {
    pub(super) async fn prefill_inner(
        &self,
        r: pb::PrefillRequest,
        endpoint: String,
        arrived: Instant,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        let priority = r.sampling.as_ref().map_or(0, |s| s.priority);
        let sampling = convert::sampling(r.sampling, Some(1))?;
        let deadline = convert::deadline(r.deadline_unix_ms, std::time::SystemTime::now(), Instant::now())?;
        // Room for the prompt's KV under the lease cap, before any compute: past it, another worker should do this.
        let blocks = r.tokens.len().div_ceil(self.layout.block_tokens.max(1) as usize) as u64;
        let reserved = self
            .leases
            .reserve(blocks * self.layout.block_bytes(), &r.request_id)
            .map_err(|e| Status::resource_exhausted(e.to_string()))?;
        let (ticket, mut cancelled) = self.in_flight.enter(&r.request_id);
        let (request_id, piece) = (r.request_id.clone(), r.piece);
        let mut stream = self
            .engine
            .submit_exporting(
                Request {
                    namespace: r.cache_namespace.map(CacheNamespace::new),
                    prompt: r.tokens,
                    sampling,
                    deadline,
                    priority,
                },
                Some(ticket.tag()),
            )
            .await
            .map_err(submit_status)?;
        let (mut first, mut first_logprobs, mut kv, mut done) = (None, None, None, None);
        let mut abort = self.aborting.clone();
        loop {
            // Dropping the stream (on cancel, or when the caller goes away and this future with it) cancels the
            // sequence at the engine's next step.
            let ev = tokio::select! {
                ev = stream.next() => ev,
                _ = &mut cancelled => return Err(Status::cancelled("cancelled")),
                _ = abort.wait_for(|&a| a) => return Err(Status::unavailable("the worker stopped")),
            };
            let Some(ev) = ev else { break };
            match ev {
                SeqEvent::Token { token, logprobs, .. } => {
                    if !piece {
                        self.metrics.time_to_first_token.observe(arrived.elapsed());
                    }
                    first = Some(token);
                    first_logprobs = logprobs.as_ref().map(convert::logprobs_to_pb);
                }
                SeqEvent::Exported(e) => kv = Some(e),
                SeqEvent::Finished(c) => {
                    done = Some(c);
                    break;
                }
                SeqEvent::Failed(e) => return Err(Status::internal(e)),
                SeqEvent::Refused(e) => return Err(Status::invalid_argument(e)),
                SeqEvent::Expired => return Err(Status::deadline_exceeded("the request's deadline passed")),
            }
        }
        drop(ticket);
        let (Some(first), Some(kv), Some(done)) = (first, kv, done) else {
            return Err(Status::internal("prefill ended without a token and its KV"));
        };
        let span = tracing::Span::current();
        span.record("cached_tokens", done.cached_tokens);
        span.record("computed_tokens", kv.tokens - done.cached_tokens);
        let tokens = kv.tokens;
        let lease = lease_id();
        let prepared = tokio::task::spawn_blocking(move || prepare(&kv))
            .await
            .map_err(|e| Status::internal(format!("preparing the lease failed: {e}")))?;
        let shm_region = self.store.as_ref().map(|p| p.display().to_string());
        self.leases
            .grant(lease, &request_id, prepared.held, reserved, Instant::now(), self.lease_ttl)
            .map_err(|e| Status::internal(e.to_string()))?;
        let handle = KvHandle {
            endpoint,
            lease,
            model_fingerprint: self.info.model_fingerprint.clone(),
            layout: self.layout,
            tokens: tokens as u32,
            blocks: prepared.descriptors,
            shm_region,
            host_id: self.info.host_id.clone(),
            server_name: self.tls_name.clone(),
        };
        Ok(Response::new(pb::PrefillResponse {
            first_token: first,
            handle: Some(convert::handle_to_pb(&handle)),
            cached_tokens: done.cached_tokens as u32,
            computed_tokens: (tokens - done.cached_tokens) as u32,
            first_logprobs,
            prompt_logprobs: done.prompt_logprobs.iter().map(convert::logprobs_to_pb).collect(),
        }))
    }
}
