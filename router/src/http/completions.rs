//! `POST /v1/chat/completions` and `POST /v1/completions`, one prompt: tokenize, check against the context, and
//! route (`choices` runs and answers them).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use engine::chat::{ChatExtras, ChatMessage, Ending};
use engine::text::TextError;
use kv_cache::{BlockSize, CacheNamespace, block_hashes};
use proto::worker as pb;

use super::error::ApiError;
use super::openai::{Checked, EFFORT, Endpoint, Input, THINKING_SWITCH};
use crate::cluster::Needs;
use crate::record::{Arrival, Outcome};
use crate::scheduler::view::RouteRequest;
use crate::scheduler::{Decision, RouteError, route};
use crate::serve::Job;
use crate::state::RouterState;

/// A request that passed every check and was routed.
pub struct Routed {
    pub checked: Checked,
    pub job: Job,
    pub decision: Decision,
    /// Where the traffic recording put this request, for the line with its actual output.
    pub recorded: Option<crate::record::Entry>,
}

/// Prompts of at most this many bytes of text (and no grammar to compile) are tokenized on the runtime thread that
/// took the request: tens of microseconds, less than handing the work to the blocking pool and back, whose two
/// thread wake-ups were the largest cost of a short request at 64 streams (`tandem bench router`).
const INLINE_TOKENIZE_BYTES: usize = 2048;

/// Prompt tokens for a checked request: the chat template and the tokenizer, CPU work on bodies of up to 2 MB. A
/// short prompt is tokenized at once; a longer one on the blocking pool (at most as many at once as the machine
/// has cores), so the runtime keeps answering.
async fn tokenize(state: &Arc<RouterState>, mut checked: Checked) -> Result<(Checked, Vec<u32>), ApiError> {
    if checked.grammar.is_none() && checked.input.text_bytes() <= INLINE_TOKENIZE_BYTES {
        let tokens = tracing::info_span!("tokenize").in_scope(|| tokenize_now(state, &mut checked))?;
        return Ok((checked, tokens));
    }
    let _slot = state.tokenize_slots.acquire().await.map_err(|_| ApiError::Unavailable("shutting down".into()))?;
    let shared = Arc::clone(state);
    let span = tracing::info_span!("tokenize");
    tokio::task::spawn_blocking(move || {
        let _entered = span.entered();
        let tokens = tokenize_now(&shared, &mut checked)?;
        Ok((checked, tokens))
    })
    .await
    .map_err(|e| ApiError::Upstream(format!("tokenizing failed: {e}")))?
}

/// A conversation's prompt text: a template argument it does not read is a 400 naming `chat_template_kwargs`, any
/// other failure of the template one naming `messages`.
pub fn render_chat(
    state: &RouterState,
    messages: &[ChatMessage],
    extras: ChatExtras<'_>,
    ending: Ending,
) -> Result<String, ApiError> {
    state.text.render_chat_ending(messages, extras, ending).map_err(|e| match e {
        TextError::TemplateArgument(e) => ApiError::bad(e.to_string(), "chat_template_kwargs"),
        e => ApiError::bad(format!("cannot apply the chat template: {e}"), "messages"),
    })
}

/// A chat request's `chat_template_kwargs` as its template gets them. Under the `qwen3` reasoning parser the router
/// reads `enable_thinking` itself (`Checked::grammar_thinking`), so a template that does not read it gets it left
/// out rather than refused. `reasoning_effort` or `documents` asked of a template that does not read it is refused
/// by that name.
fn template_arguments<'a>(
    state: &RouterState,
    checked: &'a Checked,
) -> Result<Option<std::borrow::Cow<'a, serde_json::Map<String, serde_json::Value>>>, ApiError> {
    let Some(arguments) = checked.template_arguments.as_ref() else { return Ok(None) };
    if let Some(&unread) = checked.template_fields.iter().find(|&&name| !state.text.template_reads(name)) {
        let why = match unread {
            EFFORT => {
                "the served model's chat template does not read reasoning_effort (a reasoning model's thinking \
                       is split from its answer with the router's reasoning_parser)"
            }
            _ => "the served model's chat template does not read documents: put them in a message",
        };
        return Err(ApiError::bad(why, unread));
    }
    let read_here = checked.thinking.is_some_and(|t| t.parser.reads_thinking_switch());
    if read_here && arguments.contains_key(THINKING_SWITCH) && !state.text.template_reads(THINKING_SWITCH) {
        let mut rest = arguments.clone();
        rest.remove(THINKING_SWITCH);
        return Ok((!rest.is_empty()).then_some(std::borrow::Cow::Owned(rest)));
    }
    Ok(Some(std::borrow::Cow::Borrowed(arguments)))
}

/// The prompt's tokens; a chat request's thinking split as its rendered prompt leaves the answer (`Checked::rendered`).
fn tokenize_now(state: &RouterState, checked: &mut Checked) -> Result<Vec<u32>, ApiError> {
    let started = std::time::Instant::now();
    let text = match &checked.input {
        Input::Chat(messages, ending, tools) => {
            let arguments = template_arguments(state, checked)?;
            render_chat(state, messages, ChatExtras { tools, arguments: arguments.as_deref() }, *ending)?
        }
        Input::Text(t) => t.clone(),
        Input::Tokens(ids) => {
            in_vocabulary(state, ids, "prompt")?;
            grammar_compiles(state, checked)?;
            return Ok(ids.clone());
        }
    };
    let chat = matches!(checked.input, Input::Chat(..));
    if chat {
        checked.rendered(&text);
    }
    grammar_compiles(state, checked)?;
    let tokens = state.text.tokenizer().encode_prompt(&text, chat, checked.add_special_tokens);
    state.metrics.tokenized(tokens.len(), started.elapsed());
    if tokens.is_empty() {
        return Err(ApiError::bad("the prompt is empty after tokenization", "messages"));
    }
    Ok(tokens)
}

/// A grammar that does not compile is the client's error, named here rather than by a worker.
fn grammar_compiles(state: &RouterState, checked: &Checked) -> Result<(), ApiError> {
    if let Some((g, param)) = &checked.grammar {
        state.grammars.matcher(g, checked.grammar_thinking(), &[]).map_err(|e| ApiError::bad(e.to_string(), param))?;
    }
    Ok(())
}

/// The token sequences a bad word stands for: the word (its leading whitespace trimmed) and the word after a space,
/// as vLLM tokenizes it, both wherever they differ. (vLLM keeps the second only when it has as many tokens, so a
/// word whose space merges into it, ` dawn` one token where `dawn` is two, stays possible after a space there.)
pub fn bad_word_tokens(tokenizer: &engine::tokenizer::Tokenizer, word: &str) -> Vec<Vec<u32>> {
    let bare = tokenizer.encode(word.trim_start());
    let spaced = tokenizer.encode(&format!(" {}", word.trim_start()));
    let mut out = vec![bare];
    if spaced != out[0] {
        out.push(spaced);
    }
    out.retain(|w| !w.is_empty());
    out
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
    let tokens = match checked.keep_last {
        Some(keep) => keep.apply(tokens, state.max_model_len)?,
        None => tokens,
    };
    in_vocabulary(state, &checked.logits.logit_bias.iter().map(|(t, _)| *t).collect::<Vec<_>>(), "logit_bias")?;
    in_vocabulary(state, &checked.logits.stop_token_ids, "stop_token_ids")?;
    in_vocabulary(state, &checked.logits.allowed_token_ids, "allowed_token_ids")?;
    let bad_words = checked.logits.bad_words.iter().flat_map(|w| bad_word_tokens(state.text.tokenizer(), w));
    let bad_words: Vec<pb::TokenSequence> = bad_words.map(|ids| pb::TokenSequence { ids }).collect();
    let room = state.max_model_len.saturating_sub(tokens.len());
    let max_tokens = checked.max_tokens.unwrap_or(state.limits.default_max_tokens.min(room as u32));
    if room == 0 || max_tokens as usize > room {
        // The field that holds the prompt is the one named: `messages` or `prompt`.
        let param = match checked.endpoint {
            Endpoint::Chat => "messages",
            Endpoint::Completion => "prompt",
        };
        return Err(ApiError::TooLong { prompt: tokens.len(), max_tokens, context: state.max_model_len, param });
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
        allowed_token_ids: checked.logits.allowed_token_ids.clone(),
        bad_words,
        prior_generated: 0,
        logprobs: checked.logprobs,
        prompt_logprobs: checked.scored_prompt(),
        grammar: checked.grammar.as_ref().map(|(g, _)| pb::Grammar {
            kind: g.kind().into(),
            data: g.data().into(),
            thinking: worker::convert::thinking_to_pb(checked.grammar_thinking()) as i32,
        }),
        min_p: checked.min_p,
        priority: checked.priority,
    };
    let config = state.scheduler_config();
    let mut req = RouteRequest::new(tokens.len() as u64, u64::from(block_size), &hashes, config.prefix_hash_blocks);
    req.priority = checked.priority;
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
    let (views, decision, reserved, others_only) = {
        let mut route_state = state.route_state.lock().unwrap_or_else(|p| p.into_inner());
        let slow_start = Duration::from_secs_f64(config.slow_start_secs);
        let needs = crate::serve::needs(&sampling);
        // A prompt scored for its log-probabilities is computed whole wherever it goes (a cached token has no
        // logits): no worker's cache counts for it.
        let cached_counts = sampling.prompt_logprobs.is_none();
        let views = state.cluster.view(if cached_counts { &hashes } else { &[] }, needs, slow_start, arrived);
        // Workers that would serve the request were it not for what it asks (external engines, older workers).
        let others_only = views.is_empty()
            && needs != Needs::ANY
            && !state.cluster.view(&hashes, Needs::ANY, slow_start, arrived).is_empty();
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
        (views, decision, reserved, others_only)
    };
    let mut recorded = None;
    if count {
        let a = Arrival {
            input_length: tokens.len(),
            max_tokens,
            namespace: checked.namespace.as_deref(),
            hashes: &hashes,
            priority: checked.priority,
        };
        let outcome = match &decision {
            Ok(d) => Outcome::Routed(d),
            Err(e) => Outcome::Refused(e.kind()),
        };
        recorded = state.record(arrived, &a, outcome);
    }
    let decision = decision.map_err(|e| {
        // Refusals for load are decisions too: operators see how much was shed and why.
        if count && matches!(e, RouteError::AllBusy | RouteError::Shed { .. }) {
            state.metrics.decision(config.policy.as_str(), e.kind());
        }
        match e {
            RouteError::NoDecodeWorkers if others_only => ApiError::BadRequest {
                message: format!("no worker up can serve this request: {}", crate::serve::unserved(&sampling)),
                param: None,
            },
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
    Ok(Routed { checked, job, decision, recorded })
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

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub fn fail(state: &RouterState, route: &'static str, e: ApiError) -> Response {
    state.metrics.request(route, e.status().as_u16());
    tracing::info!(kind = e.kind(), "request failed");
    e.into_response()
}

/// The client's W3C trace context, if it sent one.
pub fn traceparent(headers: &HeaderMap) -> Option<String> {
    headers.get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_string)
}
