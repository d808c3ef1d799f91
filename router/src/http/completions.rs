//! `POST /v1/chat/completions` and `POST /v1/completions`: check, tokenize, route, run, and answer in OpenAI's
//! shapes, streamed (SSE) or whole.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use engine::generate::text::TextStream;
use kv_cache::{BlockSize, CacheNamespace, block_hashes};
use proto::worker as pb;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use super::error::ApiError;
use super::logprobs::Logprobs;
use super::openai::{Checked, Endpoint, Input};
use crate::record::{Arrival, Outcome};
use crate::scheduler::view::RouteRequest;
use crate::scheduler::{Decision, RouteError, route};
use crate::serve::{Job, Piece, Pieces};
use crate::state::RouterState;

/// A request that passed every check and was routed.
pub struct Routed {
    pub checked: Checked,
    pub job: Job,
    pub decision: Decision,
}

/// Prompt tokens for a checked request: the chat template and the tokenizer, CPU work on bodies of up to 2 MB, run
/// on the blocking pool (at most as many at once as the machine has cores) so the runtime keeps answering.
async fn tokenize(state: &Arc<RouterState>, checked: Checked) -> Result<(Checked, Vec<u32>), ApiError> {
    let _slot = state.tokenize_slots.acquire().await.map_err(|_| ApiError::Unavailable("shutting down".into()))?;
    let shared = Arc::clone(state);
    let span = tracing::info_span!("tokenize");
    tokio::task::spawn_blocking(move || {
        let _entered = span.entered();
        let tokens = tokenize_now(&shared, &checked)?;
        Ok((checked, tokens))
    })
    .await
    .map_err(|e| ApiError::Upstream(format!("tokenizing failed: {e}")))?
}

fn tokenize_now(state: &RouterState, checked: &Checked) -> Result<Vec<u32>, ApiError> {
    let text = match &checked.input {
        Input::Chat(messages) => state
            .text
            .render_chat(messages)
            .map_err(|e| ApiError::bad(format!("cannot apply the chat template: {e}"), "messages"))?,
        Input::Text(t) => t.clone(),
        Input::Tokens(ids) => {
            in_vocabulary(state, ids, "prompt")?;
            return Ok(ids.clone());
        }
    };
    let tokens = state.text.tokenizer().encode(&text);
    if tokens.is_empty() {
        return Err(ApiError::bad("the prompt is empty after tokenization", "messages"));
    }
    Ok(tokens)
}

/// Refuses token ids the served model's vocabulary does not have (`param` names the field they came in).
pub fn in_vocabulary(state: &RouterState, ids: &[u32], param: &'static str) -> Result<(), ApiError> {
    let vocab = state.text.tokenizer().vocab_size();
    match ids.iter().find(|&&t| t as usize >= vocab) {
        Some(bad) => Err(ApiError::bad(format!("token id {bad} is outside the vocabulary of {vocab}"), param)),
        None => Ok(()),
    }
}

/// A request's number (load accounting) and id (workers, logs, the response's `id`), given when it arrives.
#[derive(Clone, Debug)]
pub struct Ident {
    pub seq: u64,
    pub id: String,
}

impl Ident {
    pub fn new(state: &RouterState, endpoint: Endpoint) -> Ident {
        let seq = state.next_request();
        Ident { seq, id: crate::ids::request_id(endpoint == Endpoint::Chat, state.instance, seq) }
    }
}

/// Everything before running: model, tokens, length, route.
/// `count` says whether the decision is counted in metrics (not for explanations).
pub async fn plan(
    state: &Arc<RouterState>,
    checked: Checked,
    ident: Ident,
    traceparent: Option<String>,
    count: bool,
) -> Result<Routed, ApiError> {
    if checked.model != state.served_model {
        return Err(ApiError::UnknownModel(checked.model));
    }
    let (checked, tokens) = tokenize(state, checked).await?;
    in_vocabulary(state, &checked.logits.logit_bias.iter().map(|(t, _)| *t).collect::<Vec<_>>(), "logit_bias")?;
    in_vocabulary(state, &checked.logits.stop_token_ids, "stop_token_ids")?;
    let room = state.max_model_len.saturating_sub(tokens.len());
    let max_tokens = checked.max_tokens.unwrap_or(state.limits.default_max_tokens.min(room as u32));
    if room == 0 || max_tokens as usize > room {
        return Err(ApiError::TooLong { prompt: tokens.len(), max_tokens, context: state.max_model_len });
    }
    let block_size = state.cluster.model().block_size;
    let bs = BlockSize::new(block_size)
        .ok_or_else(|| ApiError::Unavailable("the workers report a block size of 0".into()))?;
    let namespace = checked.namespace.as_deref().map(CacheNamespace::new);
    let kv_cache::BlockHashes { seq: hashes, local: locals } = block_hashes(&tokens, bs, namespace.as_ref());
    let sampling = pb::Sampling {
        temperature: checked.temperature,
        top_p: checked.top_p,
        top_k: checked.top_k,
        seed: checked.seed,
        max_tokens,
        stop: checked.stop.clone(),
        ignore_eos: checked.ignore_eos,
        logit_bias: checked.logits.logit_bias.iter().copied().collect(),
        frequency_penalty: checked.logits.frequency_penalty,
        presence_penalty: checked.logits.presence_penalty,
        repetition_penalty: checked.logits.repetition_penalty,
        min_tokens: checked.logits.min_tokens,
        stop_token_ids: checked.logits.stop_token_ids.clone(),
        prior_generated: 0,
        logprobs: checked.logprobs,
    };
    let config = state.scheduler_config();
    let mut req = RouteRequest::new(tokens.len() as u64, u64::from(block_size), &hashes, config.prefix_hash_blocks);
    let cache_key = checked.prompt_cache_key.as_deref().map(|k| cache_key(checked.namespace.as_deref(), k));
    let span = tracing::info_span!(
        "route",
        policy = config.policy.as_str(),
        candidates = tracing::field::Empty,
        prefill_worker = tracing::field::Empty,
        decode_worker = tracing::field::Empty,
        overlap_device = tracing::field::Empty,
        overlap_host = tracing::field::Empty,
        overlap_disk = tracing::field::Empty,
        cost = tracing::field::Empty,
        runner_up_cost = tracing::field::Empty,
        disaggregate = tracing::field::Empty,
        reason = tracing::field::Empty,
    );
    let arrived = Instant::now();
    // The view, the decision and the count of the prompt on the worker chosen to compute it are one step: a
    // request routed at the same moment sees this one's work.
    let (views, decision, reserved) = {
        let mut route_state = state.route_state.lock().unwrap_or_else(|p| p.into_inner());
        let protocol = crate::serve::protocol_needed(&sampling);
        let views = state.cluster.view(&hashes, protocol, Duration::from_secs_f64(config.slow_start_secs), arrived);
        req.affinity = cache_key.and_then(|k| route_state.affinity.get(k));
        let decision = route(&req, &views, &config, &mut route_state);
        // This request on `worker`, with `prefill_tokens` of its prompt to compute there.
        let reserve = |worker, prefill_tokens| {
            state.cluster.reserve(worker, ident.seq, &ident.id, prefill_tokens, req.request_blocks(), &hashes)
        };
        let mut reserved = Vec::new();
        if let (Ok(d), true) = (&decision, count) {
            let computes = d.prefill.as_ref().filter(|_| d.disaggregate).unwrap_or(&d.decode);
            if let Some(c) = computes.chosen() {
                if let Some(k) = cache_key {
                    route_state.affinity.remember(k, c.id);
                }
                let held = c.device_blocks + c.host_blocks + c.disk_blocks;
                reserved.push(reserve(c.id, crate::serve::uncached(tokens.len(), held, u64::from(block_size))));
            }
            if d.disaggregate && config.reserve_decode {
                reserved.push(reserve(d.decode.id, 0));
            }
        }
        (views, decision, reserved)
    };
    if count {
        let a = Arrival {
            input_length: tokens.len(),
            max_tokens,
            namespace: checked.namespace.as_deref(),
            hashes: &hashes,
        };
        let outcome = match &decision {
            Ok(d) => Outcome::Routed(d),
            Err(e) => Outcome::Refused(e.kind()),
        };
        state.record(arrived, &a, outcome);
    }
    let decision = decision.map_err(|e| {
        // Refusals for load are decisions too: operators see how much was shed and why.
        if count && matches!(e, RouteError::AllBusy | RouteError::Shed { .. }) {
            state.metrics.decision(config.policy.as_str(), e.kind());
        }
        match e {
            RouteError::NoDecodeWorkers => ApiError::Unavailable(e.to_string()),
            RouteError::AllBusy => ApiError::Overloaded(Duration::from_secs(1)),
            // Come back when the excess queue should have drained.
            RouteError::Shed { wait_ms, limit_ms } => {
                ApiError::Overloaded(Duration::from_secs(wait_ms.saturating_sub(limit_ms).div_ceil(1000).clamp(1, 60)))
            }
        }
    })?;
    record_route(&span, &decision, views.len());
    if count {
        state.metrics.decision(decision.policy.as_str(), decision.reason.as_str());
    }
    let job = Job {
        seq: ident.seq,
        request_id: ident.id,
        request_blocks: req.request_blocks(),
        hashes,
        locals,
        block_size: u64::from(block_size),
        tokens,
        sampling,
        namespace: checked.namespace.clone(),
        traceparent,
        deadline_unix_ms: unix_ms(SystemTime::now() + state.limits.request_timeout),
        reserved,
    };
    Ok(Routed { checked, job, decision })
}

/// The affinity key of a `prompt_cache_key` within its cache namespace (tenants' keys never meet).
fn cache_key(namespace: Option<&str>, key: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (namespace, key).hash(&mut h);
    h.finish()
}

fn record_route(span: &tracing::Span, d: &Decision, candidates: usize) {
    span.record("candidates", candidates);
    span.record("decode_worker", d.decode.worker.as_str());
    span.record("disaggregate", d.disaggregate);
    span.record("reason", d.reason.as_str());
    if let Some(p) = &d.prefill {
        span.record("prefill_worker", p.worker.as_str());
        if let Some(c) = p.chosen() {
            span.record("overlap_device", c.device_blocks);
            span.record("overlap_host", c.host_blocks);
            span.record("overlap_disk", c.disk_blocks);
            span.record("cost", c.cost);
        }
        if let Some(r) = p.runner_up_cost() {
            span.record("runner_up_cost", r);
        }
    }
}

fn finish_reason(r: pb::FinishReason, stopped_by_text: bool) -> &'static str {
    if stopped_by_text {
        return "stop";
    }
    match r {
        pb::FinishReason::Length => "length",
        _ => "stop",
    }
}

fn usage(prompt: usize, completion: usize, cached: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn created() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Token pieces turned into text, with stop strings applied.
struct Text {
    stream: TextStream,
    tokens: usize,
    stopped: bool,
    /// The request's `stop_token_ids`: like end-of-generation, not part of the text.
    stop_ids: Vec<u32>,
}

impl Text {
    fn push(&mut self, state: &RouterState, id: u32) -> String {
        self.tokens += 1;
        // End-of-generation and stop tokens end the text; they are not part of it (as in the engine).
        if state.text.tokenizer().is_end_of_generation(id) || self.stop_ids.contains(&id) {
            return String::new();
        }
        let (text, hit) = self.stream.push(state.text.tokenizer(), id);
        self.stopped |= hit;
        text
    }
}

/// Times the tokens a client receives.
struct Clock {
    arrived: Instant,
    last: Option<Instant>,
}

impl Clock {
    fn token(&mut self, state: &RouterState) {
        let now = Instant::now();
        match self.last {
            None => state.metrics.time_to_first_token.observe(now - self.arrived),
            Some(prev) => state.metrics.inter_token_latency.observe(now - prev),
        }
        self.last = Some(now);
    }
}

/// Runs a routed request to the end and answers with one JSON body.
pub async fn whole(state: Arc<RouterState>, routed: Routed, arrived: Instant, route: &'static str) -> Response {
    let Routed { checked, job, decision } = routed;
    let prompt_len = job.tokens.len();
    let id = job.request_id.clone();
    let deadline = state.limits.request_timeout;
    let mut pieces = crate::serve::start(Arc::clone(&state), job, decision);
    let mut text = Text {
        stream: TextStream::new(checked.stop.clone()),
        tokens: 0,
        stopped: false,
        stop_ids: checked.logits.stop_token_ids.clone(),
    };
    let mut clock = Clock { arrived, last: None };
    let mut out = String::new();
    let mut logprobs = checked.logprobs.map(|_| Logprobs::new(checked.endpoint));
    let collected = tokio::time::timeout(deadline, async {
        while let Some(p) = pieces.recv().await {
            match p? {
                Piece::Token(t, lp) => {
                    clock.token(&state);
                    if let Some(l) = logprobs.as_mut() {
                        l.push(state.text.tokenizer(), t, lp.as_ref())?;
                    }
                    out.push_str(&text.push(&state, t));
                    if text.stopped {
                        return Ok((pb::FinishReason::Stop, None));
                    }
                }
                Piece::Finished { reason, cached_tokens } => return Ok((reason, Some(cached_tokens))),
            }
        }
        Err(ApiError::Upstream("the request ended without finishing".into()))
    })
    .await;
    let (reason, cached) = match collected {
        Err(_) => return fail(&state, route, ApiError::Deadline(deadline)),
        Ok(Err(e)) => return fail(&state, route, e),
        Ok(Ok(r)) => r,
    };
    drop(pieces);
    out.push_str(&text.stream.finish(text.stopped));
    let finish = finish_reason(reason, text.stopped);
    let model = &state.served_model;
    let logprobs = logprobs.as_mut().map_or(Value::Null, Logprobs::take);
    let body = match checked.endpoint {
        Endpoint::Chat => json!({
            "id": id, "object": "chat.completion", "created": created(), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage(prompt_len, text.tokens, cached.unwrap_or(0)),
        }),
        Endpoint::Completion => json!({
            "id": id, "object": "text_completion", "created": created(), "model": model,
            "choices": [{"index": 0, "text": out, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage(prompt_len, text.tokens, cached.unwrap_or(0)),
        }),
    };
    tracing::Span::current()
        .record("gen_ai.usage.output_tokens", text.tokens)
        .record("gen_ai.response.finish_reasons", finish);
    state.metrics.request(route, 200);
    state.metrics.request_duration.observe(arrived.elapsed());
    axum::Json(body).into_response()
}

pub fn fail(state: &RouterState, route: &'static str, e: ApiError) -> Response {
    state.metrics.request(route, e.status().as_u16());
    tracing::info!(kind = e.kind(), "request failed");
    e.into_response()
}

/// One SSE chunk in the endpoint's shape.
fn chunk(endpoint: Endpoint, id: &str, model: &str, text: Option<&str>, finish: Option<&str>, role: bool) -> Value {
    chunk_with(endpoint, id, model, text, finish, role, Value::Null)
}

/// One SSE chunk, with the log-probabilities of the tokens it carries.
fn chunk_with(
    endpoint: Endpoint,
    id: &str,
    model: &str,
    text: Option<&str>,
    finish: Option<&str>,
    role: bool,
    logprobs: Value,
) -> Value {
    match endpoint {
        Endpoint::Chat => {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({"id": id, "object": "chat.completion.chunk", "created": created(), "model": model,
                   "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
        }
        Endpoint::Completion => json!({"id": id, "object": "text_completion", "created": created(), "model": model,
                   "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}]}),
    }
}

/// Runs a routed request and streams it as server-sent events.
pub fn streamed(
    state: Arc<RouterState>,
    routed: Routed,
    arrived: Instant,
    route: &'static str,
    permit: OwnedSemaphorePermit,
) -> Response {
    let Routed { checked, job, decision } = routed;
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let prompt_len = job.tokens.len();
    let id = job.request_id.clone();
    let pieces = crate::serve::start(Arc::clone(&state), job, decision);
    let span = tracing::Span::current();
    tokio::spawn(tracing::Instrument::instrument(
        async move {
            let _permit = permit;
            let status = pump(&state, checked, pieces, &tx, &id, prompt_len, arrived).await;
            state.metrics.request(route, status);
            state.metrics.request_duration.observe(arrived.elapsed());
        },
        span,
    ));
    Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response()
}

/// Moves pieces to the client until the end; returns the status to count.
async fn pump(
    state: &RouterState,
    checked: Checked,
    mut pieces: Pieces,
    tx: &mpsc::Sender<Result<Event, Infallible>>,
    id: &str,
    prompt_len: usize,
    arrived: Instant,
) -> u16 {
    let model = state.served_model.as_str();
    let endpoint = checked.endpoint;
    let send = |v: Value| {
        let tx = tx.clone();
        async move { tx.send(Ok(Event::default().data(v.to_string()))).await.is_ok() }
    };
    let mut text = Text {
        stream: TextStream::new(checked.stop.clone()),
        tokens: 0,
        stopped: false,
        stop_ids: checked.logits.stop_token_ids.clone(),
    };
    let mut clock = Clock { arrived, last: None };
    let mut first = true;
    let mut logprobs = checked.logprobs.map(|_| Logprobs::new(endpoint));
    let deadline = tokio::time::sleep(state.limits.request_timeout);
    tokio::pin!(deadline);
    let (reason, cached) = loop {
        let piece = tokio::select! {
            p = pieces.recv() => p,
            _ = &mut deadline => Some(Err(ApiError::Deadline(state.limits.request_timeout))),
            // The client left (before the first token too): dropping `pieces` cancels the work on every worker.
            _ = tx.closed() => return 499,
        };
        match piece {
            Some(Ok(Piece::Token(t, lp))) => {
                clock.token(state);
                let mut lps = Value::Null;
                if let Some(l) = logprobs.as_mut() {
                    if let Err(e) = l.push(state.text.tokenizer(), t, lp.as_ref()) {
                        let _ = send(e.body()).await;
                        return e.status().as_u16();
                    }
                    lps = l.take();
                }
                let s = text.push(state, t);
                // With log-probabilities every token has its chunk, text or not (held back, or end-of-generation).
                let due = !s.is_empty() || first || !lps.is_null();
                if due && !send(chunk_with(endpoint, id, model, Some(&s), None, first, lps)).await {
                    return 499;
                }
                first = false;
                if text.stopped {
                    break (pb::FinishReason::Stop, None);
                }
            }
            Some(Ok(Piece::Finished { reason, cached_tokens })) => break (reason, Some(cached_tokens)),
            Some(Err(e)) => {
                // The headers are out: the error travels as an event, as OpenAI's API does.
                let status = e.status().as_u16();
                let _ = send(e.body()).await;
                return status;
            }
            None => {
                let e = ApiError::Upstream("the request ended without finishing".into());
                let _ = send(e.body()).await;
                return e.status().as_u16();
            }
        }
    };
    drop(pieces);
    let rest = text.stream.finish(text.stopped);
    if !rest.is_empty() && !send(chunk(endpoint, id, model, Some(&rest), None, false)).await {
        return 499;
    }
    let finish = finish_reason(reason, text.stopped);
    tracing::Span::current()
        .record("gen_ai.usage.output_tokens", text.tokens)
        .record("gen_ai.response.finish_reasons", finish);
    if !send(chunk(endpoint, id, model, None, Some(finish), false)).await {
        return 499;
    }
    if checked.include_usage {
        let u = json!({"id": id, "object": if endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" },
                       "created": created(), "model": model, "choices": [], "usage": usage(prompt_len, text.tokens, cached.unwrap_or(0))});
        let _ = send(u).await;
    }
    let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    200
}

/// The client's W3C trace context, if it sent one.
pub fn traceparent(headers: &HeaderMap) -> Option<String> {
    headers.get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_string)
}
