//! Carrying out a routing decision: prefill on P (failing over to the next candidate, then to local prefill on
//! D), stream the first token at once, decode on D with P's KV handle, and if D is lost mid-stream re-prefill the
//! prompt plus every token already sent on another decode worker and continue the same stream.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use proto::worker as pb;
use tokio::sync::mpsc;
use tonic::Status;

use crate::cluster::{Needs, Transport};
use crate::external::TokenStream;
use crate::http::error::ApiError;
use crate::scheduler::Decision;
use crate::scheduler::view::WorkerId;
use crate::state::RouterState;

/// A request ready to run.
#[derive(Debug)]
pub struct Job {
    /// The router's request number (load accounting).
    pub seq: u64,
    /// Sent to workers for cancellation and logs.
    pub request_id: String,
    pub tokens: Vec<u32>,
    /// With the whole output budget in `max_tokens`.
    pub sampling: pb::Sampling,
    pub namespace: Option<String>,
    pub request_blocks: u64,
    /// The chained hashes of the prompt's full blocks.
    pub hashes: Vec<kv_cache::SeqHash>,
    /// Their local hashes (what a predicted cache records, `crate::external`).
    pub locals: Vec<kv_cache::LocalHash>,
    /// Tokens per KV block.
    pub block_size: u64,
    pub traceparent: Option<String>,
    /// The request's deadline as Unix milliseconds, sent to workers so they drop work nobody waits for.
    pub deadline_unix_ms: u64,
    /// The routing decision's counts: the prompt on the worker that computes it and, with `reserve_decode`, the
    /// request on its decode worker; held until the job ends.
    pub reserved: Vec<crate::cluster::Reservation>,
}

impl Job {
    /// Tokens of a `len`-token prompt a worker still computes when it holds `blocks` of its leading blocks on some
    /// tier (onboarding from host or disk is cheap next to computing).
    fn uncached(&self, len: usize, blocks: usize) -> u64 {
        uncached(len, blocks, self.block_size)
    }
}

/// Tokens of a `len`-token prompt still to compute with `blocks` leading blocks of `block_size` tokens held.
pub fn uncached(len: usize, blocks: usize, block_size: u64) -> u64 {
    (len as u64).saturating_sub(blocks as u64 * block_size)
}

/// What the client's side of a job receives.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// The prompt's log-probabilities (its tokens from the second on), before the first token, when the request
    /// asked for them.
    Prompt(Vec<pb::TokenLogprobs>),
    /// A token, with its log-probabilities when the request asked for them.
    Token(u32, Option<pb::TokenLogprobs>),
    Finished {
        reason: pb::FinishReason,
        cached_tokens: u32,
    },
}

pub type Pieces = mpsc::Receiver<Result<Piece, ApiError>>;

/// `msg` with the trace context of `span` (or, when spans are not recorded, the client's) in its metadata.
pub(crate) fn with_trace<T>(msg: T, span: &tracing::Span, client: &Option<String>) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Some(tp) = telemetry::trace::traceparent(span).or_else(|| client.clone())
        && let Ok(v) = tp.parse()
    {
        req.metadata_mut().insert("traceparent", v);
    }
    req
}

/// Starts `job` as `decision` says; pieces arrive on the returned channel until `Finished` or an error.
/// Dropping the receiver cancels the work on the workers.
pub fn start(state: Arc<RouterState>, job: Job, decision: Decision) -> Pieces {
    let (tx, rx) = mpsc::channel(64);
    // The workers' spans hang under the request's own.
    let span = tracing::Span::current();
    tokio::spawn(tracing::Instrument::instrument(run(state, job, decision, tx), span));
    rx
}

/// The prefill step's result.
struct Prefilled {
    first: u32,
    first_logprobs: Option<pb::TokenLogprobs>,
    prompt_logprobs: Vec<pb::TokenLogprobs>,
    handle: Option<pb::KvHandle>,
    cached_tokens: u32,
    /// The decode worker's pulls of the prompt's leading pieces, when its KV was streamed.
    prefetches: crate::stream_kv::Prefetches,
}

/// How the prefill step ended.
enum PrefillOutcome {
    /// Boxed: a handle is large beside the other outcomes.
    Done(Box<Prefilled>),
    /// Every attempt failed (or the retry budget allowed no more).
    Failed,
    /// A worker refused what the request asks (another would too): the client's error.
    Refused(Status),
    ClientGone,
}

/// Records how a request to `worker` went; a worker failing again and again is ejected for a while.
fn outcome(state: &RouterState, worker: WorkerId, name: &str, result: Result<(), tonic::Code>) {
    if let Some(ejection) = state.cluster.outcome(worker, result) {
        state.metrics.ejections.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(worker = %name, ejection_secs = ejection.as_secs_f64(), "worker ejected after repeated failures");
    }
}

async fn prefill(
    state: &Arc<RouterState>,
    job: &Job,
    decision: &Decision,
    tx: &mpsc::Sender<Result<Piece, ApiError>>,
) -> PrefillOutcome {
    let Some(choice) = decision.prefill.as_ref() else { return PrefillOutcome::Failed };
    // The chosen worker first, then the others by cost.
    let order = choice.by_preference();
    let prefill_sampling = pb::Sampling { max_tokens: 1, ..job.sampling.clone() };
    let mut attempts = 0;
    for cand in order.into_iter().take(state.limits.max_prefill_attempts) {
        let Some(member) = state.cluster.member(cand.id).filter(|m| m.up) else { continue };
        // An external engine serves whole requests only: it cannot hand its KV to another worker.
        let Transport::Tandem(mut client) = member.transport.clone() else { continue };
        // A second worker for the same prompt is a retry: only within the budget.
        if attempts > 0 {
            if !state.try_retry() {
                return PrefillOutcome::Failed;
            }
            state.metrics.prefill_retries.fetch_add(1, Ordering::Relaxed);
        }
        attempts += 1;
        let msg = pb::PrefillRequest {
            request_id: job.request_id.clone(),
            tokens: job.tokens.clone(),
            sampling: Some(prefill_sampling.clone()),
            cache_namespace: job.namespace.clone(),
            deadline_unix_ms: Some(job.deadline_unix_ms),
            piece: false,
        };
        let uncached = job.uncached(job.tokens.len(), cand.device_blocks + cand.host_blocks + cand.disk_blocks);
        state.cluster.sent(cand.id, job.seq, &job.request_id, uncached, job.request_blocks, &job.hashes);
        let span = tracing::info_span!(
            "prefill",
            otel.kind = "client",
            worker = %member.name,
            cached_tokens = tracing::field::Empty
        );
        // The first attempt streams a long prompt's KV to the decided decode worker while it computes.
        let streamed = if attempts == 1 { stream_kv_to(state, job, decision, &member, cand) } else { None };
        let pieces = async {
            match streamed {
                Some((ends, decode)) => {
                    let route = crate::stream_kv::Route { prefill: &mut client, decode, whole: &msg, span: &span };
                    crate::stream_kv::prefill_pieces(state, job, &ends, route).await
                }
                None => crate::stream_kv::Prefetches::default(),
            }
        };
        let prefetches = tokio::select! {
            p = tracing::Instrument::instrument(pieces, span.clone()) => p,
            _ = tx.closed() => {
                state.cluster.done(cand.id, job.seq);
                return PrefillOutcome::ClientGone;
            }
        };
        let call = tracing::Instrument::instrument(
            tokio::time::timeout(
                state.limits.prefill_timeout,
                client.prefill(with_trace(msg, &span, &job.traceparent)),
            ),
            span.clone(),
        );
        let result = tokio::select! {
            r = call => r,
            // Its engine computes nothing: the next candidate (or the decode worker) takes the prompt now rather
            // than after the prefill timeout.
            () = state.cluster.stalls(cand.id) => Ok(Err(Status::unavailable("the prefill worker's engine stalled"))),
            _ = tx.closed() => {
                state.cluster.done(cand.id, job.seq);
                return PrefillOutcome::ClientGone;
            }
        };
        state.cluster.done(cand.id, job.seq);
        match result {
            Ok(Ok(resp)) => {
                let mut r = resp.into_inner();
                // A streamed prompt's last piece finds the earlier ones cached: they were computed for it.
                r.cached_tokens = prefetches.cached_tokens.unwrap_or(r.cached_tokens);
                span.record("cached_tokens", r.cached_tokens);
                outcome(state, cand.id, &member.name, Ok(()));
                state.metrics.prefilled_with_overlap([cand.device_blocks, cand.host_blocks, cand.disk_blocks]);
                return PrefillOutcome::Done(Box::new(Prefilled {
                    first: r.first_token,
                    first_logprobs: r.first_logprobs,
                    prompt_logprobs: r.prompt_logprobs,
                    handle: r.handle,
                    cached_tokens: r.cached_tokens,
                    prefetches,
                }));
            }
            Ok(Err(status)) if status.code() == tonic::Code::InvalidArgument => {
                outcome(state, cand.id, &member.name, Err(status.code()));
                return PrefillOutcome::Refused(status);
            }
            Ok(Err(status)) => {
                tracing::warn!(worker = %member.name, code = ?status.code(), "prefill failed");
                outcome(state, cand.id, &member.name, Err(status.code()));
            }
            Err(_) => {
                tracing::warn!(worker = %member.name, "prefill timed out");
                outcome(state, cand.id, &member.name, Err(tonic::Code::DeadlineExceeded));
            }
        }
    }
    PrefillOutcome::Failed
}

/// Where to cut the prompt and which decode worker pulls the pieces, when the router streams this prompt's KV
/// (`Limits::stream_kv`) from worker `prefill` (candidate `cand`) to the decided decode worker: both Tandem workers
/// that know streaming, an answer longer than one token, and a prompt of more than one of the prefill worker's
/// chunks past what it holds.
fn stream_kv_to(
    state: &RouterState,
    job: &Job,
    decision: &Decision,
    prefill: &crate::cluster::Member,
    cand: &crate::scheduler::Scored,
) -> Option<(Vec<usize>, proto::worker::worker_client::WorkerClient<tonic::transport::Channel>)> {
    // An answer of one token ends at the prefill worker: nothing is pulled. A prompt whose log-probabilities are
    // asked for is computed whole by its last piece's prefill whatever the pieces cached: no pieces either.
    if !state.limits.stream_kv
        || job.sampling.max_tokens <= 1
        || job.sampling.prompt_logprobs.is_some()
        || prefill.protocol < worker::STREAM_KV_PROTOCOL
    {
        return None;
    }
    let decode = state.cluster.member(decision.decode.id).filter(|m| m.up && m.protocol >= worker::STREAM_KV_PROTOCOL);
    let Transport::Tandem(decode) = decode?.transport else {
        return None;
    };
    let chunk = prefill.max_num_batched_tokens;
    let block = job.block_size as usize;
    let cached = (cand.device_blocks + cand.host_blocks + cand.disk_blocks) * block;
    let ends = crate::stream_kv::piece_ends(job.tokens.len(), cached, block, chunk as usize);
    (!ends.is_empty()).then_some((ends, decode))
}

/// How long a lease release may take before it is left to expire.
const RELEASE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Frees a prefill worker's lease that no decode worker will pull (the answer ended at the first token, or the
/// client left), so its KV copy goes now rather than at expiry.
pub(crate) fn release_unused(state: &RouterState, handle: Option<pb::KvHandle>) {
    let (Some(client), Some(h)) = (state.leases.clone(), handle) else { return };
    let Ok(h) = worker::convert::handle_from_pb(h) else { return };
    let Ok(addr) = h.endpoint.parse::<std::net::SocketAddr>() else { return };
    // Called from drops too: outside a runtime (one shutting down), the lease is left to expire.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    runtime.spawn(async move {
        let _ = client.release(addr, &addr.ip().to_string(), h.lease, RELEASE_TIMEOUT).await;
    });
}

/// What a request has produced so far, across decode attempts (a resumption continues from it).
#[derive(Debug, Default)]
struct Progress {
    /// Tokens sent to the client.
    generated: Vec<u32>,
    /// Prompt tokens served from cache, as the first worker to report it said.
    cached: Option<u32>,
    /// Tokens the current attempt produced.
    produced: u32,
}

/// How one decode attempt ended.
enum Attempt {
    Finished,
    ClientGone,
    /// The worker failed; `Status` says how.
    Failed(Status),
}

/// Where one decode attempt goes.
struct Target {
    worker: WorkerId,
    /// The prefill worker's KV, when there is one to pull.
    handle: Option<pb::KvHandle>,
    /// The worker's leading blocks per tier (device, host, disk), when the router knows them: it prefills locally.
    overlap: Option<[usize; 3]>,
}

async fn decode_once(
    state: &RouterState,
    job: &Job,
    target: Target,
    progress: &mut Progress,
    tx: &mpsc::Sender<Result<Piece, ApiError>>,
) -> Attempt {
    let Target { worker, mut handle, overlap } = target;
    let Some(member) = state.cluster.member(worker) else {
        release_unused(state, handle);
        return Attempt::Failed(Status::unavailable("the decode worker left"));
    };
    if member.predicted() {
        // An external engine cannot pull another worker's KV: it computes the whole prompt.
        release_unused(state, handle.take());
    }
    let remaining = job.sampling.max_tokens.saturating_sub(progress.generated.len() as u32).max(1);
    let tokens = [job.tokens.as_slice(), progress.generated.as_slice()].concat();
    // What it computes itself: nothing much after a pull; the prompt less what it holds otherwise.
    let local_prefill = match (&handle, overlap) {
        (Some(_), _) => 0,
        (None, overlap) => {
            if let Some(o) = overlap {
                state.metrics.prefilled_with_overlap(o);
            }
            job.uncached(tokens.len(), overlap.map_or(0, |[d, h, k]| d + h + k))
        }
    };
    let lease = handle.clone();
    let msg = pb::GenerateRequest {
        request_id: job.request_id.clone(),
        tokens,
        sampling: Some(pb::Sampling {
            max_tokens: remaining,
            // What it is sent after the prompt was generated: the penalties and min_tokens count it.
            prior_generated: progress.generated.len() as u32,
            // The prompt's log-probabilities came with the first token: after it, nobody asks again.
            prompt_logprobs: job.sampling.prompt_logprobs.filter(|_| progress.generated.is_empty()),
            ..job.sampling.clone()
        }),
        handle,
        cache_namespace: job.namespace.clone(),
        deadline_unix_ms: Some(job.deadline_unix_ms),
    };
    state.cluster.sent(worker, job.seq, &job.request_id, local_prefill, job.request_blocks, &job.hashes);
    let span = tracing::info_span!(
        "generate",
        otel.kind = "client",
        worker = %member.name,
        output_tokens = tracing::field::Empty
    );
    // The client span covers the whole stream, not only the call that opens it.
    progress.produced = 0;
    let call = async {
        match member.transport {
            Transport::Tandem(mut client) => {
                let r = client.generate(with_trace(msg, &span, &job.traceparent)).await?;
                Ok(Box::pin(r.into_inner()) as TokenStream)
            }
            Transport::External(engine) => {
                if engine.caches(job.namespace.as_deref()) {
                    let blocks: Vec<_> = job.hashes.iter().copied().zip(job.locals.iter().copied()).collect();
                    state.cluster.predict(worker, &blocks, std::time::Instant::now());
                }
                let sampling = msg.sampling.unwrap_or_default();
                // vLLM and SGLang continue the trace from this header (their spans hang under this one).
                let traceparent = telemetry::trace::traceparent(&span).or_else(|| job.traceparent.clone());
                engine.generate(&msg.tokens, &sampling, msg.cache_namespace.as_deref(), traceparent.as_deref()).await
            }
        }
    };
    let outcome =
        tracing::Instrument::instrument(stream_tokens(state, job, worker, call, progress, tx), span.clone()).await;
    span.record("output_tokens", progress.produced);
    state.cluster.done(worker, job.seq);
    if !matches!(outcome, Attempt::Finished) {
        // The attempt given up may not have pulled the prompt's KV (a worker failing at once, or stalled): its lease
        // goes now rather than holding the prefill worker's lease room until it expires. One already pulled has
        // ended, and releasing it again does nothing.
        release_unused(state, lease);
    }
    outcome
}

/// Opens the decode stream (`call`) and moves its tokens to the client until it finishes, fails, stalls or the
/// client leaves.
async fn stream_tokens(
    state: &RouterState,
    job: &Job,
    worker: WorkerId,
    call: impl std::future::Future<Output = Result<TokenStream, Status>>,
    progress: &mut Progress,
    tx: &mpsc::Sender<Result<Piece, ApiError>>,
) -> Attempt {
    let limits = &state.limits;
    // A worker found stalled is given up at once, whatever the timeouts say.
    let stalled = state.cluster.stalls(worker);
    tokio::pin!(stalled);
    let gave_up = || Attempt::Failed(Status::unavailable("the decode worker's engine stalled"));
    let opened = tokio::select! {
        r = tokio::time::timeout(limits.prefill_timeout, call) => r,
        () = &mut stalled => return gave_up(),
        _ = tx.closed() => return Attempt::ClientGone,
    };
    let mut stream = match opened {
        Ok(Ok(s)) => s,
        Ok(Err(status)) => return Attempt::Failed(status),
        Err(_) => return Attempt::Failed(Status::deadline_exceeded("the decode worker did not answer")),
    };
    loop {
        // Before the first token the worker may be prefilling; after it, a silent stream is a stuck worker.
        let wait = if progress.produced == 0 { limits.prefill_timeout } else { limits.decode_idle_timeout };
        let msg = tokio::select! {
            m = tokio::time::timeout(wait, futures_util::StreamExt::next(&mut stream)) => match m {
                Ok(m) => m,
                Err(_) => return Attempt::Failed(Status::deadline_exceeded(format!("no token for {wait:?}"))),
            },
            () = &mut stalled => return gave_up(),
            _ = tx.closed() => return Attempt::ClientGone,
        };
        match msg {
            Some(Ok(pb::GenerateResponse { event: Some(pb::generate_response::Event::Token(t)) })) => {
                if progress.produced == 0 {
                    state.cluster.first_token(worker, job.seq);
                }
                progress.produced += 1;
                let first = progress.generated.is_empty();
                progress.generated.push(t.id);
                if first
                    && job.sampling.prompt_logprobs.is_some()
                    && tx.send(Ok(Piece::Prompt(t.prompt_logprobs))).await.is_err()
                {
                    return Attempt::ClientGone;
                }
                if tx.send(Ok(Piece::Token(t.id, t.logprobs))).await.is_err() {
                    return Attempt::ClientGone;
                }
            }
            Some(Ok(pb::GenerateResponse { event: Some(pb::generate_response::Event::Finished(f)) })) => {
                let cached_tokens = *progress.cached.get_or_insert(f.cached_tokens);
                let reason = pb::FinishReason::try_from(f.reason).unwrap_or(pb::FinishReason::Stop);
                let _ = tx.send(Ok(Piece::Finished { reason, cached_tokens })).await;
                return Attempt::Finished;
            }
            Some(Ok(_)) => {}
            None => return Attempt::Failed(Status::unavailable("the decode stream ended without finishing")),
            Some(Err(status)) => return Attempt::Failed(status),
        }
    }
}

/// What a worker must speak to apply everything `s` asks for (a version-3 worker would ignore the
/// log-probabilities, a version-5 one `min_p`, a version-6 one the prompt's log-probabilities, a version-7 one the
/// allowed tokens and bad words, a version-8 one the priority, a version-9 one a Lark grammar, a version-10 one a
/// grammar's thinking, a version-11 one a GBNF grammar, a version-12 one Gemma 4's thinking channel). External engines take the sampling fields (`min_p`
/// included) and grammars (as their own structured outputs, GBNF as it is, Lark not at all; regular expressions not
/// on llama-server; held after the thinking where the engine runs with a reasoning parser of its own, as vLLM and
/// SGLang do) in their own APIs, and vLLM the allowed tokens; priorities go to a server started with priority
/// scheduling; prompt log-probabilities and bad words are not relayed to them, log-probabilities from llama-server
/// and vLLM, and from SGLang at a temperature of 0 or 1.
pub fn needs(s: &pb::Sampling) -> Needs {
    let plain = s.logit_bias.is_empty()
        && s.frequency_penalty == 0.0
        && s.presence_penalty == 0.0
        && s.repetition_penalty.is_none_or(|p| p == 1.0)
        && s.min_tokens == 0
        && s.stop_token_ids.is_empty();
    let mut protocol = if plain { 0 } else { worker::LOGITS_RULES_PROTOCOL };
    // The prompt's log-probabilities and bad words are applied by Tandem's own workers only, allowed tokens by vLLM
    // too.
    let allowed = !s.allowed_token_ids.is_empty();
    let token_rules = allowed || !s.bad_words.is_empty();
    // A grammar goes to an external engine as the engine's own structured output, from its start: not one of a kind
    // the relay does not know, nor one to continue after tokens generated elsewhere.
    let grammar = s.grammar.as_ref().map(|g| engine::grammar::Grammar::from_parts(&g.kind, &g.data));
    let relayable = match &grammar {
        None => true,
        Some(g) => g.is_ok() && s.prior_generated == 0,
    };
    let regex = matches!(grammar, Some(Ok(engine::grammar::Grammar::Regex(_))));
    // Lark dialects differ between engines (llguidance's extensions; vLLM's xgrammar backend converts to its own):
    // Tandem's workers only.
    let lark = matches!(grammar, Some(Ok(engine::grammar::Grammar::Lark(_))));
    let external = relayable && !lark && s.prompt_logprobs.is_none() && s.bad_words.is_empty();
    if s.logprobs.is_some() || s.grammar.is_some() {
        protocol = worker::LOGPROBS_PROTOCOL;
    }
    if s.min_p > 0.0 {
        protocol = worker::MIN_P_PROTOCOL;
    }
    if s.prompt_logprobs.is_some() {
        protocol = worker::PROMPT_LOGPROBS_PROTOCOL;
    }
    if token_rules {
        protocol = worker::TOKEN_RULES_PROTOCOL;
    }
    if s.priority != 0 {
        protocol = worker::PRIORITY_PROTOCOL;
    }
    if lark {
        protocol = worker::LARK_PROTOCOL;
    }
    if s.grammar.as_ref().is_some_and(|g| g.thinking != pb::Thinking::Unspecified as i32) {
        protocol = worker::THINKING_PROTOCOL;
    }
    if matches!(grammar, Some(Ok(engine::grammar::Grammar::Gbnf(_)))) {
        protocol = worker::GBNF_PROTOCOL;
    }
    if s.grammar.as_ref().is_some_and(|g| g.thinking == pb::Thinking::Channel as i32) {
        protocol = worker::CHANNEL_PROTOCOL;
    }
    let logprobs = s.logprobs.is_some();
    let tempered = logprobs && s.temperature != 0.0 && s.temperature != 1.0;
    Needs { protocol, external, logprobs, tempered, regex, allowed, priority: s.priority != 0 }
}

/// Why only some workers serve a request asking for `s` (to a client whose fleet has none of them up).
pub fn unserved(s: &pb::Sampling) -> String {
    let n = needs(s);
    let mut asked = Vec::new();
    if s.prompt_logprobs.is_some() {
        asked.push("the prompt's log-probabilities");
    }
    if n.allowed {
        asked.push("allowed_token_ids (taken by vLLM)");
    }
    if !s.bad_words.is_empty() {
        asked.push("bad_words");
    }
    if s.priority != 0 {
        asked.push("a priority (taken by vLLM and SGLang servers configured with priority scheduling)");
    }
    if s.grammar.as_ref().is_some_and(|g| g.kind == "lark") {
        asked.push("a Lark grammar");
    }
    if s.grammar.as_ref().is_some_and(|g| g.kind == "gbnf") {
        asked.push("a GBNF grammar (taken by llama-server, vLLM and SGLang)");
    }
    if n.logprobs {
        asked.push(if n.tempered {
            "log-probabilities at a temperature other than 0 or 1 (relayed from llama-server and vLLM; SGLang reports \
             those of the tempered distribution)"
        } else {
            "log-probabilities (relayed from llama-server, vLLM and SGLang)"
        });
    }
    if n.regex {
        asked.push("a regular expression (taken by vLLM and SGLang)");
    }
    if s.grammar.is_some() && !n.regex {
        asked.push("a structured output");
    }
    if asked.is_empty() {
        asked.push("its sampling rules");
    }
    let elsewhere = if n.external { ", or an external engine that takes them" } else { " (external engines do not)" };
    format!("{} need Tandem workers of protocol {} or newer{elsewhere}", asked.join(", "), n.protocol)
}

/// What the decode call for `job` asks of its worker once `generated` tokens came from elsewhere (they count as
/// generated: a grammar then cannot be relayed to an external engine, which would start it over).
fn continuing(job: &Job, generated: usize) -> Needs {
    needs(&pb::Sampling { prior_generated: u32::try_from(generated).unwrap_or(u32::MAX), ..job.sampling.clone() })
}

/// The least loaded routable decode worker not in `tried` that serves the job after `generated` tokens, or
/// `fallback` when there is none.
fn next_decoder(state: &RouterState, job: &Job, generated: usize, tried: &[WorkerId], fallback: WorkerId) -> WorkerId {
    let needs = continuing(job, generated);
    state
        .cluster
        .routable_members(std::time::Instant::now())
        .into_iter()
        .filter(|(id, m)| m.role.decodes() && !tried.contains(id) && needs.met_by(m))
        .min_by_key(|(id, _)| state.cluster.in_flight(*id))
        .map_or(fallback, |(id, _)| id)
}

async fn run(state: Arc<RouterState>, job: Job, decision: Decision, tx: mpsc::Sender<Result<Piece, ApiError>>) {
    let mut progress = Progress::default();
    let mut handle = None;
    let mut prefetches = crate::stream_kv::Prefetches::default();
    state.request_started();
    if decision.disaggregate {
        match prefill(&state, &job, &decision, &tx).await {
            PrefillOutcome::Done(p) => {
                let prompt = job.sampling.prompt_logprobs.is_some().then_some(Piece::Prompt(p.prompt_logprobs));
                if let Some(prompt) = prompt
                    && tx.send(Ok(prompt)).await.is_err()
                {
                    release_unused(&state, p.handle);
                    return;
                }
                if tx.send(Ok(Piece::Token(p.first, p.first_logprobs))).await.is_err() {
                    release_unused(&state, p.handle);
                    return;
                }
                progress.generated.push(p.first);
                progress.cached = Some(p.cached_tokens);
                handle = p.handle;
                prefetches = p.prefetches;
                let eos = job.sampling.stop_token_ids.contains(&p.first)
                    || (state.text.tokenizer().is_end_of_generation(p.first) && !job.sampling.ignore_eos);
                if eos || job.sampling.max_tokens <= 1 {
                    let reason = if eos { pb::FinishReason::Stop } else { pb::FinishReason::Length };
                    let _ = tx.send(Ok(Piece::Finished { reason, cached_tokens: p.cached_tokens })).await;
                    release_unused(&state, handle.take());
                    return;
                }
            }
            PrefillOutcome::ClientGone => return,
            PrefillOutcome::Refused(status) => {
                let e = ApiError::BadRequest { message: status.message().to_string(), param: None };
                let _ = tx.send(Err(e)).await;
                return;
            }
            PrefillOutcome::Failed => {
                // Prefilling on the decode worker instead is one more try: only within the budget.
                if !state.try_retry() {
                    let e = ApiError::Unavailable("the prefill failed and the retry budget is spent".into());
                    let _ = tx.send(Err(e)).await;
                    return;
                }
                state.metrics.local_prefill_fallbacks.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    let mut worker = decision.decode.id;
    // The decided decode worker's overlap, for its own prefill (aggregated, or after every prefill attempt failed).
    let mut overlap = decision.decode.chosen().map(|c| [c.device_blocks, c.host_blocks, c.disk_blocks]);
    let mut tried = Vec::new();
    // The decode worker's pulls of a streamed prompt's pieces end before it is asked for the rest.
    prefetches.settle(crate::stream_kv::SETTLE_LIMIT).await;
    let serves = |w| state.cluster.member(w).is_some_and(|m| continuing(&job, progress.generated.len()).met_by(&m));
    if !state.cluster.is_routable(worker, std::time::Instant::now()) || !serves(worker) {
        // The decided decode worker left while the prompt prefilled (a drain began, its streams ended), or its
        // breaker ejected it meanwhile (it answers with errors), or it cannot go on from the prefill's first token
        // (an external engine under a grammar): nothing ran there, so another takes the request as its first decode
        // attempt, pulling the prefilled KV, not as a resumption after a failure.
        worker = next_decoder(&state, &job, progress.generated.len(), &tried, worker);
        overlap = None;
    }
    for attempt in 0..state.limits.max_decode_attempts {
        if attempt > 0 {
            if !state.try_retry() {
                break;
            }
            state.metrics.decode_resumptions.fetch_add(1, Ordering::Relaxed);
            worker = next_decoder(&state, &job, progress.generated.len(), &tried, worker);
            overlap = None;
        }
        let target = Target { worker, handle: handle.take(), overlap };
        let name = state.cluster.member(worker).map_or_else(String::new, |m| m.name);
        match decode_once(&state, &job, target, &mut progress, &tx).await {
            Attempt::Finished => {
                outcome(&state, worker, &name, Ok(()));
                return;
            }
            Attempt::ClientGone => return,
            Attempt::Failed(status) if status.code() == tonic::Code::InvalidArgument => {
                // The worker refused the request itself (an external engine's 4xx): another would too.
                outcome(&state, worker, &name, Err(status.code()));
                let e = ApiError::BadRequest { message: status.message().to_string(), param: None };
                let _ = tx.send(Err(e)).await;
                return;
            }
            Attempt::Failed(status) => {
                tracing::warn!(code = ?status.code(), message = status.message(), "decode attempt failed");
                outcome(&state, worker, &name, Err(status.code()));
                tried.push(worker);
            }
        }
    }
    let _ = tx
        .send(Err(ApiError::Upstream(format!("no decode worker finished the request after {} attempts", tried.len()))))
        .await;
}
