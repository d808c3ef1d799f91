//! Streaming a long prompt's KV to its decode worker while the prompt still computes. A disaggregated prompt of
//! several prefill chunks is prefilled in pieces, each a longer leading part of the prompt: the prefill worker finds
//! the pieces before cached and computes only the new part, and as each piece finishes the decode worker pulls its
//! blocks into its cache (`Prefetch`) while the next piece computes. The last piece is the whole prompt, prefilled
//! as without streaming; its handle leaves the decode worker only the blocks of the last part to pull.
//!
//! Where to cut is policy ([`piece_ends`], pure); the calls are [`prefill_pieces`]. A piece that fails ends the
//! streaming, not the request: the whole prompt is prefilled as usual and the decode worker pulls what it lacks.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use proto::worker as pb;
use proto::worker::worker_client::WorkerClient;
use tonic::transport::Channel;

use crate::serve::{Job, with_trace};
use crate::state::RouterState;

/// The longest wait for the decode worker's pulls of the pieces before it is asked for the rest: a pull still
/// going then only means its blocks are pulled again with the rest.
pub const SETTLE_LIMIT: Duration = Duration::from_secs(2);

/// At most this many pieces before the whole prompt (each costs the prefill worker a round trip and a lease, and
/// the decode worker a pull): a longer prompt's pieces span several chunks each.
pub const MAX_PIECES: usize = 8;

/// Where to cut a `len`-token prompt whose first `cached` tokens its prefill worker holds and which it computes
/// `chunk` tokens per step: the ends (in tokens, whole `block`-token blocks, ascending, each below `len`) of the
/// leading pieces, each a whole number of chunks of computed tokens past the one before. The whole prompt is the
/// last piece and is not listed. Empty when the prompt computes in one chunk: there is nothing to overlap.
pub fn piece_ends(len: usize, cached: usize, block: usize, chunk: usize) -> Vec<usize> {
    let cached = cached.min(len);
    let chunks = (len - cached).div_ceil(chunk.max(1));
    if block == 0 || chunk < block || chunks < 2 {
        return Vec::new();
    }
    // Chunks per piece: one, or more when the prompt would need more than MAX_PIECES pieces besides the last.
    let step = chunks.div_ceil(MAX_PIECES + 1) * chunk;
    let mut ends = Vec::new();
    let mut end = cached + step;
    while end < len {
        let cut = end / block * block;
        if cut > ends.last().copied().unwrap_or(cached) {
            ends.push(cut);
        }
        end += step;
    }
    ends
}

/// The decode worker's pulls of earlier pieces, running while the prompt's last piece computes: one after another
/// (each finds the pieces before it held and pulls only its own part), so one task ends them all. They belong to
/// the request: dropped (the client left, or [`settle`](Self::settle) stopped waiting), the pulls still going are
/// cancelled and the leases of the pieces not pulled are released, rather than pulling blocks nobody will read and
/// pinning the prefill worker's copies until the leases expire.
#[derive(Debug, Default)]
pub struct Prefetches {
    last: Option<tokio::task::JoinHandle<()>>,
    /// Every pull's task (each waits for the one before it), so that a drop cancels them all.
    tasks: Vec<tokio::task::AbortHandle>,
    /// The handles of the pieces whose pull has not ended, and the state to release them with.
    unpulled: Option<(Arc<RouterState>, Arc<Unpulled>)>,
    /// Prompt tokens the prefill worker held before the first piece: what the request was served from cache (the
    /// whole prompt's prefill finds the earlier pieces cached, which were computed for it).
    pub cached_tokens: Option<u32>,
}

impl Prefetches {
    /// Waits (at most `limit`) for the pulls to end, so that the decode worker's `Generate` finds their blocks held
    /// rather than pulling them a second time. A pull that fails or is late costs nothing but that.
    pub async fn settle(mut self, limit: Duration) {
        if let Some(last) = self.last.as_mut() {
            let _ = tokio::time::timeout(limit, last).await;
        }
    }
}

impl Drop for Prefetches {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        if let Some((state, unpulled)) = self.unpulled.take() {
            let handles = std::mem::take(&mut *unpulled.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
            for handle in handles {
                crate::serve::release_unused(&state, Some(handle));
            }
        }
    }
}

/// The handles of the pieces whose pull has not ended.
type Unpulled = std::sync::Mutex<Vec<pb::KvHandle>>;

/// Takes `handle` off the list of pieces not pulled; whether it was there (not released yet by a drop).
fn pulled(unpulled: &Unpulled, handle: &pb::KvHandle) -> bool {
    let mut list = unpulled.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let at = list.iter().position(|h| h == handle);
    at.map(|i| list.swap_remove(i)).is_some()
}

/// Where the pieces go: the prefill worker that computes them and the decode worker that pulls them; `whole` is the
/// whole prompt's prefill, which each piece's request is cut from.
pub struct Route<'a> {
    pub prefill: &'a mut WorkerClient<Channel>,
    pub decode: WorkerClient<Channel>,
    pub whole: &'a pb::PrefillRequest,
    pub span: &'a tracing::Span,
}

/// Prefills the pieces of `job`'s prompt ending at `ends` in turn and, as each finishes, has the decode worker pull
/// its blocks in the background. Stops at the first piece that fails or times out (the caller then prefills the
/// whole prompt as usual).
pub async fn prefill_pieces(state: &Arc<RouterState>, job: &Job, ends: &[usize], route: Route<'_>) -> Prefetches {
    let Route { prefill, decode, whole, span } = route;
    // A piece's first token is thrown away: it needs no log-probabilities or grammar.
    let sampling =
        whole.sampling.clone().map(|s| pb::Sampling { logprobs: None, prompt_logprobs: None, grammar: None, ..s });
    let unpulled: Arc<Unpulled> = Arc::default();
    let mut prefetches = Prefetches {
        last: None,
        tasks: Vec::new(),
        unpulled: Some((Arc::clone(state), Arc::clone(&unpulled))),
        cached_tokens: None,
    };
    for &end in ends {
        let tokens = whole.tokens[..end].to_vec();
        let msg = pb::PrefillRequest {
            request_id: whole.request_id.clone(),
            tokens: tokens.clone(),
            sampling: sampling.clone(),
            cache_namespace: whole.cache_namespace.clone(),
            deadline_unix_ms: whole.deadline_unix_ms,
            piece: true,
        };
        let call = prefill.prefill(with_trace(msg, span, &job.traceparent));
        let handle = match tokio::time::timeout(state.limits.prefill_timeout, call).await {
            Ok(Ok(r)) => {
                let r = r.into_inner();
                prefetches.cached_tokens.get_or_insert(r.cached_tokens);
                r.handle
            }
            Ok(Err(status)) => {
                tracing::debug!(code = ?status.code(), "a streamed piece's prefill failed; prefilling the whole prompt");
                None
            }
            Err(_) => None,
        };
        let Some(handle) = handle else { break };
        state.metrics.streamed_pieces.fetch_add(1, Ordering::Relaxed);
        let request = pb::PrefetchRequest {
            request_id: whole.request_id.clone(),
            tokens,
            handle: Some(handle.clone()),
            cache_namespace: whole.cache_namespace.clone(),
        };
        unpulled.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(handle.clone());
        let (mut client, state, span) = (decode.clone(), Arc::clone(state), span.clone());
        let (traceparent, unpulled) = (job.traceparent.clone(), Arc::clone(&unpulled));
        let before = prefetches.last.take();
        let task = tokio::spawn(async move {
            if let Some(before) = before {
                let _ = before.await;
            }
            let call = client.prefetch(with_trace(request, &span, &traceparent));
            let done = matches!(tokio::time::timeout(state.limits.prefill_timeout, call).await, Ok(Ok(_)));
            // A pull that worked released the piece's lease itself.
            if pulled(&unpulled, &handle) && !done {
                // The decode worker pulls these blocks with the rest; the piece's lease goes now, not at expiry.
                state.metrics.streamed_piece_failures.fetch_add(1, Ordering::Relaxed);
                crate::serve::release_unused(&state, Some(handle));
            }
        });
        prefetches.tasks.push(task.abort_handle());
        prefetches.last = Some(task);
    }
    prefetches
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_end_a_chunk_apart_on_whole_blocks_after_what_is_cached() {
        // 8k prompt, nothing cached, 2,048-token chunks: three pieces, the whole prompt the fourth.
        assert_eq!(piece_ends(8192, 0, 16, 2048), vec![2048, 4096, 6144]);
        // Cached tokens are not computed: the pieces start after them and end on block boundaries.
        assert_eq!(piece_ends(8000, 1000, 16, 2048), vec![3040, 5088, 7136]);
        // One chunk or less to compute: nothing to overlap.
        assert!(piece_ends(2048, 0, 16, 2048).is_empty());
        assert!(piece_ends(8192, 7000, 16, 2048).is_empty());
        assert!(piece_ends(100, 0, 16, 0).is_empty(), "an unknown chunk size streams nothing");
        // A long prompt: at most MAX_PIECES pieces, each several chunks.
        let long = piece_ends(100_000, 0, 16, 2048);
        assert!(long.len() <= MAX_PIECES, "{long:?}");
        assert!(long.windows(2).all(|w| w[0] < w[1] && w[1] - w[0] == 12_288), "{long:?}");
        assert!(long.iter().all(|e| e % 16 == 0 && *e < 100_000));
    }

    #[test]
    fn a_piece_never_ends_at_or_past_the_prompt() {
        for len in [4097, 4096, 4111, 6000] {
            for cached in [0, 16, 2047] {
                let ends = piece_ends(len, cached, 16, 2048);
                assert!(ends.iter().all(|&e| e > cached && e < len && e % 16 == 0), "{len} {cached}: {ends:?}");
                assert!(ends.windows(2).all(|w| w[0] < w[1]));
            }
        }
    }
}
