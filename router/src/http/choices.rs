//! The choices of one request, run and answered in OpenAI's shapes, whole or streamed: one per prompt of a batch
//! times `n` samples each, numbered prompt-major as OpenAI does. A prompt's first sample is routed as any request;
//! its other samples are forks pinned to the worker that decodes the first, started once the prompt's KV is there
//! (after the first sample's first token, or its second when disaggregated: the one that follows the pull), so the
//! prompt is computed once and its blocks are shared in that worker's pool.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use engine::generate::text::TextStream;
use futures_util::StreamExt;
use futures_util::future::try_join_all;
use proto::worker as pb;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use super::completions::{Ident, Routed, fail, plan};
use super::error::ApiError;
use super::logprobs::Logprobs;
use super::openai::{Checked, Endpoint, Input};
use super::reasoning::{ReasoningParser, ReasoningStream, Thinking};
use super::tools::{self, AutoStream, CallMode};
use crate::scheduler::Decision;
use crate::serve::{Job, Piece, Pieces};
use crate::state::RouterState;

/// One choice, routed and ready to run.
pub struct Planned {
    /// Its place in the response (`choices[].index`).
    pub index: usize,
    /// Which prompt of the batch it answers.
    pub prompt: usize,
    pub routed: Routed,
    /// A fork waits for this to turn true (or for its sender to go) before it starts.
    after: Option<watch::Receiver<bool>>,
    /// A prompt's first sample with forks: turned true once the prompt's KV is on the decode worker.
    ready: Option<(watch::Sender<bool>, usize)>,
    /// `echo`: the prompt's text, put before the completion.
    echo: Option<String>,
}

/// Every choice of a checked request: each prompt of the batch routed as a request, then its forks.
pub async fn plan_all(
    state: &Arc<RouterState>,
    mut checked: Checked,
    ident: Ident,
    traceparent: Option<String>,
) -> Result<Vec<Planned>, ApiError> {
    let batch = std::mem::take(&mut checked.batch);
    let n = checked.n as usize;
    let mut prompts = vec![checked.clone()];
    prompts.extend(batch.into_iter().map(|input| Checked { input, ..checked.clone() }));
    let mut planned = Vec::with_capacity(prompts.len() * n);
    for (p, c) in prompts.into_iter().enumerate() {
        let mut echo = c.echo.then(|| echo_text(state, &c.input));
        let id = if p == 0 { ident.clone() } else { Ident::new(state, c.endpoint) };
        let first = plan(state, c, id, traceparent.clone(), true).await?;
        if first.checked.keep_last.is_some() && echo.is_some() {
            // A truncated prompt is echoed as it was computed: what is left of it.
            echo = Some(state.text.tokenizer().decode(&first.job.tokens));
        }
        let (ready, after) = if n > 1 {
            let (tx, rx) = watch::channel(false);
            // The first token comes from the prefill worker when disaggregated; the second follows the pull.
            let tokens = if first.decision.disaggregate { 2 } else { 1 };
            (Some((tx, tokens)), Some(rx))
        } else {
            (None, None)
        };
        let forks: Vec<Routed> =
            (1..n).map(|j| fork(state, &first, Ident::new(state, first.checked.endpoint), j as u64)).collect();
        planned.push(Planned { index: p * n, prompt: p, routed: first, after: None, ready, echo: echo.clone() });
        for (j, routed) in forks.into_iter().enumerate() {
            let index = p * n + j + 1;
            planned.push(Planned { index, prompt: p, routed, after: after.clone(), ready: None, echo: echo.clone() });
        }
    }
    Ok(planned)
}

/// The prompt tokens of a request's choices, each prompt counted once (its first sample, which no fork waits on).
pub fn prompt_tokens(planned: &[Planned]) -> usize {
    planned.iter().filter(|p| p.after.is_none()).map(|p| p.routed.job.tokens.len()).sum()
}

/// The text `echo` puts first: the prompt as given, or its token ids decoded.
fn echo_text(state: &RouterState, input: &Input) -> String {
    match input {
        Input::Text(t) => t.clone(),
        Input::Tokens(ids) => state.text.tokenizer().decode(ids),
        Input::Chat(..) => String::new(),
    }
}

/// Sample `j` of `first`'s prompt: its own request id and seed (the request's plus `j`), pinned to the worker
/// that decodes `first`, where the prompt's blocks will be, and counted there from now on.
fn fork(state: &RouterState, first: &Routed, ident: Ident, j: u64) -> Routed {
    let job = &first.job;
    let worker = first.decision.decode.id;
    let mut decode = first.decision.decode.clone();
    decode.candidates.retain(|c| c.id == worker);
    for c in &mut decode.candidates {
        // By the time the fork starts, the prompt's full blocks are there.
        (c.device_blocks, c.host_blocks, c.disk_blocks) = (job.hashes.len(), 0, 0);
    }
    let decision = Decision { prefill: None, decode, disaggregate: false, ..first.decision.clone() };
    let left = crate::serve::uncached(job.tokens.len(), job.hashes.len(), job.block_size);
    let reserved = vec![state.cluster.reserve(worker, ident.seq, &ident.id, left, job.request_blocks, &job.hashes)];
    let sampling = pb::Sampling { seed: job.sampling.seed.map(|s| s.wrapping_add(j)), ..job.sampling.clone() };
    let job = Job {
        seq: ident.seq,
        request_id: ident.id,
        tokens: job.tokens.clone(),
        sampling,
        namespace: job.namespace.clone(),
        request_blocks: job.request_blocks,
        hashes: job.hashes.clone(),
        locals: job.locals.clone(),
        block_size: job.block_size,
        traceparent: job.traceparent.clone(),
        deadline_unix_ms: job.deadline_unix_ms,
        reserved,
    };
    // A sample beyond the first is not a request of its own in a recording.
    Routed { checked: first.checked.clone(), job, decision, recorded: None }
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

fn usage(t: &Totals) -> Value {
    let mut u = json!({
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "total_tokens": t.prompt_tokens + t.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": t.cached},
    });
    // With a reasoning parser, the tokens spent thinking, as OpenAI counts them.
    if let Some(n) = t.thinking {
        u["completion_tokens_details"] = json!({"reasoning_tokens": n});
    }
    u
}

fn created() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Token pieces turned into text, with stop strings applied.
struct Text {
    stream: TextStream,
    tokens: usize,
    /// With a reasoning parser: the text so far, and where each token's text ended in it (to count the tokens spent
    /// thinking).
    said: Option<(String, Vec<usize>)>,
    stopped: bool,
    /// The request's `stop_token_ids`: like end-of-generation, not part of the text.
    stop_ids: Vec<u32>,
    /// Whether an end-of-generation token ends the sequence (not with `ignore_eos`, unless a grammar is done).
    ends_at_eog: bool,
}

impl Text {
    fn new(checked: &Checked) -> Text {
        Text {
            stream: TextStream::new(checked.stop.clone())
                .keeping_control(checked.keep_control)
                .keeping_stop(checked.keep_stop),
            tokens: 0,
            said: checked.thinking.map(|_| (String::new(), Vec::new())),
            stopped: false,
            stop_ids: checked.logits.stop_token_ids.clone(),
            ends_at_eog: !checked.ignore_eos || checked.grammar.is_some(),
        }
    }

    fn push(&mut self, state: &RouterState, id: u32) -> String {
        self.tokens += 1;
        // End-of-generation and stop tokens that end the sequence are not part of the text (as in the engine).
        if (self.ends_at_eog && state.text.tokenizer().is_end_of_generation(id)) || self.stop_ids.contains(&id) {
            return String::new();
        }
        let (text, hit) = self.stream.push(state.text.tokenizer(), id);
        self.stopped |= hit;
        if let Some((said, ends)) = &mut self.said {
            said.push_str(&text);
            ends.push(said.len());
        }
        text
    }

    /// The tokens spent thinking ([`tokens_before_content`]); none without a reasoning parser.
    fn thinking_tokens(&self, thinking: Option<Thinking>) -> Option<usize> {
        let ((said, ends), thinking) = (self.said.as_ref()?, thinking?);
        Some(tokens_before_content(said, ends, thinking.parser))
    }
}

/// Of the tokens whose texts end at `ends` in `said`, those that ended before the answer's content began as
/// `parser` splits it (the token that ends the thinking counts; an answer cut short while thinking is all thinking).
fn tokens_before_content(said: &str, ends: &[usize], parser: ReasoningParser) -> usize {
    let content_from = said.len() - parser.split(said).content.len();
    ends.iter().filter(|&&end| end <= content_from).count()
}

/// What one choice counts toward the usage.
#[derive(Clone, Copy)]
struct Counts {
    /// Which prompt (choices of one prompt share it).
    prompt: usize,
    prompt_len: usize,
    tokens: usize,
    cached: Option<u32>,
    thinking: Option<usize>,
}

/// The usage of a request's choices.
struct Totals {
    prompt_tokens: usize,
    completion_tokens: usize,
    cached: u32,
    thinking: Option<usize>,
}

/// Times the tokens a client receives (the request's first choice stands for the request).
struct Clock {
    arrived: Instant,
    last: Option<Instant>,
    on: bool,
}

impl Clock {
    fn token(&mut self, state: &RouterState) {
        if !self.on {
            return;
        }
        let now = Instant::now();
        match self.last {
            None => state.metrics.time_to_first_token.observe(now - self.arrived),
            Some(prev) => state.metrics.inter_token_latency.observe(now - prev),
        }
        self.last = Some(now);
    }
}

/// What one choice produced.
struct Done {
    index: usize,
    counts: Counts,
    /// The answer's text (its content, when its thinking is split off).
    text: String,
    /// Its thinking, split off with the router's reasoning parser (and shown).
    reasoning: Option<String>,
    logprobs: Value,
    /// vLLM's `prompt_logprobs`, when asked for (else null).
    prompt_logprobs: Value,
    finish: &'static str,
    /// The tool calls the text makes and the content beside them, when the request has tools to call and the text
    /// calls them.
    calls: Option<tools::Made>,
}

/// A choice's run: waits for its prompt (a fork), starts, and tells its forks when the prompt's KV is in place.
struct Run {
    index: usize,
    prompt: usize,
    prompt_len: usize,
    checked: Checked,
    pieces: Pieces,
    ready: Option<(watch::Sender<bool>, usize)>,
    echo: Option<String>,
    /// The prompt's token ids, when its log-probabilities were asked for (else empty).
    prompt_ids: Vec<u32>,
    /// vLLM's `prompt_logprobs`, once the prompt's log-probabilities came (null before, or when not asked for).
    prompt_logprobs: Value,
    /// Whether the prompt's log-probabilities came.
    prompt_scored: bool,
    text: Text,
    logprobs: Option<Logprobs>,
    clock: Clock,
    /// Where the traffic recording put this choice's request: its output is added there when the run ends.
    recorded: Option<(Arc<RouterState>, crate::record::Entry)>,
    /// The finish reason, once the choice has one.
    finish: Option<&'static str>,
}

impl Drop for Run {
    /// However the run ends (finished, failed, its client gone), a recorded request's output goes into the
    /// recording: the tokens it generated, and its finish reason or `incomplete`.
    fn drop(&mut self) {
        if let Some((state, entry)) = self.recorded.take() {
            state.record_output(entry, self.text.tokens, self.finish.unwrap_or("incomplete"));
        }
    }
}

impl Run {
    /// What the finished choice counts toward the usage.
    fn counts(&self, cached: Option<u32>) -> Counts {
        Counts {
            prompt: self.prompt,
            prompt_len: self.prompt_len,
            tokens: self.text.tokens,
            cached,
            thinking: self.text.thinking_tokens(self.checked.thinking),
        }
    }

    async fn start(state: &Arc<RouterState>, p: Planned, arrived: Instant) -> Run {
        if let Some(mut after) = p.after {
            // A first sample that ended without a token drops the sender: the fork then computes the prompt.
            let _ = after.wait_for(|ready| *ready).await;
        }
        let Routed { checked, job, decision, recorded } = p.routed;
        let prompt_len = job.tokens.len();
        let prompt_ids = if checked.scored_prompt().is_some() { job.tokens.clone() } else { Vec::new() };
        let pieces = crate::serve::start(Arc::clone(state), job, decision);
        Run {
            index: p.index,
            prompt: p.prompt,
            prompt_len,
            text: Text::new(&checked),
            logprobs: checked.logprobs.map(|_| Logprobs::new(checked.endpoint, checked.tokens_as_ids)),
            clock: Clock { arrived, last: None, on: p.index == 0 },
            checked,
            pieces,
            ready: p.ready,
            echo: p.echo,
            prompt_ids,
            prompt_logprobs: Value::Null,
            prompt_scored: false,
            recorded: recorded.map(|entry| (Arc::clone(state), entry)),
            finish: None,
        }
    }

    /// The prompt's log-probabilities, which come before its first token: into vLLM's `prompt_logprobs` when they
    /// were asked for so, and before the output's log-probabilities when the prompt is echoed with them. Returns
    /// (streamed) the echoed prompt's log-probabilities' JSON.
    fn prompt(&mut self, state: &RouterState, scores: &[pb::TokenLogprobs]) -> Result<Value, ApiError> {
        let tokenizer = state.text.tokenizer();
        self.prompt_scored = true;
        if let Some(top) = self.checked.prompt_logprobs {
            self.prompt_logprobs =
                super::logprobs::vllm_prompt_logprobs(tokenizer, &self.prompt_ids, scores, top as usize)?;
        }
        let mut lps = Value::Null;
        if let (true, Some(top), Some(l)) = (self.checked.echo, self.checked.logprobs, self.logprobs.as_mut()) {
            l.push_prompt(tokenizer, &self.prompt_ids, scores, top as usize)?;
            if self.checked.stream {
                lps = l.take();
            }
        }
        Ok(lps)
    }

    /// A token comes after the prompt's log-probabilities when they were asked for: a worker that sent none is an
    /// upstream error (never an answer silently without them).
    fn prompt_came(&self) -> Result<(), ApiError> {
        if self.checked.scored_prompt().is_some() && !self.prompt_scored {
            return Err(ApiError::Upstream(
                "a worker sent the first token without the prompt's log-probabilities".into(),
            ));
        }
        Ok(())
    }

    /// Whether the answer leaves its tokens out (`echo` with `max_tokens` 0: the prompt alone).
    fn echo_only(&self) -> bool {
        self.checked.echo_only
    }

    /// The choice's `finish_reason`: `length` for the prompt alone (no token was wanted), else the worker's
    /// reason, or `stop` for a stop string the router found.
    fn finish_reason(&self, reason: pb::FinishReason) -> &'static str {
        if self.echo_only() { "length" } else { finish_reason(reason, self.text.stopped) }
    }

    /// Whether the echoed prompt waits for its log-probabilities before it is streamed (they come with it).
    fn echo_waits(&self) -> bool {
        self.checked.echo && self.logprobs.is_some()
    }

    /// One token: its text, and (streamed) its log-probabilities' JSON when asked for; a whole answer takes them
    /// all at the end.
    fn token(
        &mut self,
        state: &RouterState,
        id: u32,
        lp: Option<pb::TokenLogprobs>,
    ) -> Result<(String, Value), ApiError> {
        self.prompt_came()?;
        self.clock.token(state);
        let mut lps = Value::Null;
        if let Some(l) = self.logprobs.as_mut() {
            l.push(state.text.tokenizer(), id, lp.as_ref())?;
            if self.checked.stream {
                lps = l.take();
            }
        }
        let text = self.text.push(state, id);
        if let Some((tx, after)) = &self.ready
            && self.text.tokens >= *after
        {
            let _ = tx.send(true);
        }
        Ok((text, lps))
    }
}

/// Runs every choice to the end and answers with one JSON body.
pub async fn whole(state: Arc<RouterState>, planned: Vec<Planned>, arrived: Instant, route: &'static str) -> Response {
    let Some(first) = planned.first() else { return fail(&state, route, ApiError::Upstream("no choices".into())) };
    let (id, endpoint) = (first.routed.job.request_id.clone(), first.routed.checked.endpoint);
    let ids = first.routed.checked.call_ids;
    let deadline = state.limits.request_timeout;
    let runs = planned.into_iter().map(|p| collect(&state, p, arrived));
    let done = match tokio::time::timeout(deadline, try_join_all(runs)).await {
        Err(_) => return fail(&state, route, ApiError::Deadline(deadline)),
        Ok(Err(e)) => return fail(&state, route, e),
        Ok(Ok(done)) => done,
    };
    let model = &state.served_model;
    let choices: Vec<Value> = done
        .iter()
        .map(|d| match endpoint {
            Endpoint::Chat => {
                let mut message = match &d.calls {
                    // As OpenAI answers calls: the content beside them (none for forced calls), or null.
                    Some(made) => json!({"role": "assistant", "content": made.content,
                                         "tool_calls": ids.calls_json(&id, d.index, &made.calls)}),
                    // An answer that only thought (cut short) has no content.
                    None if d.text.is_empty() && d.reasoning.is_some() => json!({"role": "assistant", "content": null}),
                    None => json!({"role": "assistant", "content": d.text}),
                };
                if let Some(r) = &d.reasoning {
                    // DeepSeek's API and SGLang name it `reasoning_content`, vLLM's newer versions `reasoning`.
                    message["reasoning_content"] = json!(r);
                    message["reasoning"] = json!(r);
                }
                json!({"index": d.index, "message": message, "logprobs": d.logprobs, "finish_reason": d.finish})
            }
            Endpoint::Completion => {
                let mut c =
                    json!({"index": d.index, "text": d.text, "logprobs": d.logprobs, "finish_reason": d.finish});
                if !d.prompt_logprobs.is_null() {
                    c["prompt_logprobs"] = d.prompt_logprobs.clone();
                }
                c
            }
        })
        .collect();
    let totals = totals(done.iter().map(|d| d.counts));
    let object = if endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" };
    let mut body = json!({"id": id, "object": object, "created": created(), "model": model, "choices": choices,
                          "usage": usage(&totals)});
    // vLLM's chat answer has one `prompt_logprobs`, beside its choices (which share the prompt).
    if let Some(d) = done.iter().find(|d| endpoint == Endpoint::Chat && !d.prompt_logprobs.is_null()) {
        body["prompt_logprobs"] = d.prompt_logprobs.clone();
    }
    let finishes: Vec<&str> = done.iter().map(|d| d.finish).collect();
    tracing::Span::current()
        .record("gen_ai.usage.output_tokens", totals.completion_tokens)
        .record("gen_ai.response.finish_reasons", finishes.join(",").as_str());
    state.metrics.request(route, 200);
    state.metrics.request_duration.observe(arrived.elapsed());
    axum::Json(body).into_response()
}

/// Usage over choices: each prompt counted once (its first choice's cached tokens), completion and thinking tokens
/// summed, as OpenAI counts `n` and batches.
fn totals(choices: impl Iterator<Item = Counts>) -> Totals {
    let mut t = Totals { prompt_tokens: 0, completion_tokens: 0, cached: 0, thinking: None };
    let mut seen = std::collections::BTreeSet::new();
    for c in choices {
        t.completion_tokens += c.tokens;
        if let Some(n) = c.thinking {
            *t.thinking.get_or_insert(0) += n;
        }
        if seen.insert(c.prompt) {
            t.prompt_tokens += c.prompt_len;
            t.cached = t.cached.saturating_add(c.cached.unwrap_or(0));
        }
    }
    t
}

/// One choice, whole.
async fn collect(state: &Arc<RouterState>, p: Planned, arrived: Instant) -> Result<Done, ApiError> {
    let mut run = Run::start(state, p, arrived).await;
    let mut out = run.echo.take().unwrap_or_default();
    let (reason, cached) = loop {
        match run.pieces.recv().await {
            Some(Ok(Piece::Prompt(scores))) => {
                run.prompt(state, &scores)?;
            }
            Some(Ok(Piece::Token(..))) if run.echo_only() => run.prompt_came()?,
            Some(Ok(Piece::Token(t, lp))) => {
                out.push_str(&run.token(state, t, lp)?.0);
                if run.text.stopped {
                    break (pb::FinishReason::Stop, None);
                }
            }
            Some(Ok(Piece::Finished { reason, cached_tokens })) => break (reason, Some(cached_tokens)),
            Some(Err(e)) => return Err(e),
            None => return Err(ApiError::Upstream("the request ended without finishing".into())),
        }
    };
    out.push_str(&run.text.stream.finish(run.text.stopped));
    let mut reasoning = None;
    if let Some(thinking) = run.checked.thinking {
        let split = thinking.parser.split(&out);
        out = split.content;
        reasoning = split.reasoning.filter(|_| thinking.shown);
    }
    let mut finish = run.finish_reason(reason);
    let calls = run.checked.tool_calls.as_ref().and_then(|mode| {
        let calls = tools::calls(mode, &out);
        finish = tools::finish_reason(mode, calls.is_some(), finish);
        calls
    });
    run.finish = Some(finish);
    Ok(Done {
        index: run.index,
        counts: run.counts(cached),
        text: out,
        reasoning,
        logprobs: run.logprobs.as_mut().map_or(Value::Null, Logprobs::take),
        prompt_logprobs: std::mem::take(&mut run.prompt_logprobs),
        finish,
        calls,
    })
}

/// What every SSE chunk of one choice carries.
#[derive(Clone, Copy)]
struct Head<'a> {
    endpoint: Endpoint,
    id: &'a str,
    model: &'a str,
    index: usize,
    /// How its tool calls' ids look.
    ids: tools::CallIds,
    /// vLLM's `continuous_usage_stats`: the choice's usage so far, in every chunk.
    usage: Option<&'a Progress>,
}

/// A streamed choice's usage so far.
struct Progress {
    prompt: usize,
    tokens: std::sync::atomic::AtomicUsize,
}

impl Head<'_> {
    /// One SSE chunk in the endpoint's shape, with the log-probabilities of its tokens, as its JSON text: written
    /// straight from borrowed fields (a chunk per token built as a `Value` tree first allocated for every key).
    fn chunk(&self, text: Option<&str>, finish: Option<&str>, role: bool, logprobs: &Value) -> String {
        match self.endpoint {
            Endpoint::Chat => {
                let delta = Delta { role: role.then_some("assistant"), content: text, ..Delta::default() };
                self.write(Some(delta), None, logprobs, finish)
            }
            Endpoint::Completion => self.write(None, Some(text.unwrap_or("")), logprobs, finish),
        }
    }

    /// A chat chunk with a piece of tool call `k`: its id, type and name come with its first piece (`name`), then
    /// the rest of its arguments' text.
    fn call_chunk(&self, k: usize, name: Option<&str>, arguments: &str, role: bool, logprobs: &Value) -> String {
        let id = name.map(|name| self.ids.id(self.id, self.index, k, name));
        let call = CallDelta {
            index: k,
            id: id.as_deref(),
            kind: name.map(|_| "function"),
            function: FunctionDelta { name, arguments },
        };
        let delta = Delta { role: role.then_some("assistant"), tool_calls: Some([call]), ..Delta::default() };
        self.write(Some(delta), None, logprobs, None)
    }

    /// A chat chunk with a piece of the answer's thinking.
    fn reasoning_chunk(&self, thought: &str, role: bool, logprobs: &Value) -> String {
        let delta = Delta {
            role: role.then_some("assistant"),
            reasoning_content: Some(thought),
            reasoning: Some(thought),
            ..Delta::default()
        };
        self.write(Some(delta), None, logprobs, None)
    }

    /// The chunk of a chat `delta` or a completion's `text`, as its JSON text.
    fn write(&self, delta: Option<Delta>, text: Option<&str>, logprobs: &Value, finish: Option<&str>) -> String {
        let object = if delta.is_some() { "chat.completion.chunk" } else { "text_completion" };
        let usage = self.usage.map(|p| {
            let completion = p.tokens.load(std::sync::atomic::Ordering::Relaxed);
            ChunkUsage { prompt_tokens: p.prompt, completion_tokens: completion, total_tokens: p.prompt + completion }
        });
        let chunk = Chunk {
            id: self.id,
            object,
            created: created(),
            model: self.model,
            choices: [ChunkChoice { index: self.index, delta, text, logprobs, finish_reason: finish }],
            usage,
        };
        // Serializing borrowed strings and numbers cannot fail.
        serde_json::to_string(&chunk).unwrap_or_default()
    }
}

/// A streamed chunk, its fields in the order OpenAI's chunks have them (and the `json!` form it replaces printed).
#[derive(serde::Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [ChunkChoice<'a>; 1],
    /// The choice's usage so far (`continuous_usage_stats`).
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<ChunkUsage>,
}

#[derive(serde::Serialize)]
struct ChunkUsage {
    prompt_tokens: usize,
    completion_tokens: usize,
    total_tokens: usize,
}

#[derive(serde::Serialize)]
struct ChunkChoice<'a> {
    index: usize,
    /// Chat chunks only.
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<Delta<'a>>,
    /// Completion chunks only.
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    logprobs: &'a Value,
    finish_reason: Option<&'a str>,
}

#[derive(serde::Serialize, Default)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    /// Thinking, under both the names clients read (as a whole message carries it).
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<[CallDelta<'a>; 1]>,
}

/// A piece of a streamed tool call, as OpenAI streams them.
#[derive(serde::Serialize)]
struct CallDelta<'a> {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    function: FunctionDelta<'a>,
}

#[derive(serde::Serialize)]
struct FunctionDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    arguments: &'a str,
}

type Sink = mpsc::Sender<Result<Event, Infallible>>;

async fn send(tx: &Sink, v: Value) -> bool {
    send_text(tx, v.to_string()).await
}

/// Sends `e` as an event (the headers are out: an error travels as an event, as OpenAI's API does) and returns
/// its status, to count.
async fn send_error(tx: &Sink, e: &ApiError) -> u16 {
    let _ = send(tx, e.body()).await;
    e.status().as_u16()
}

/// Sends one event whose data is `json`, already serialized.
async fn send_text(tx: &Sink, json: String) -> bool {
    tx.send(Ok(Event::default().data(json))).await.is_ok()
}

/// How long the response's head waits for the first event, so that both leave in one write (one wake-up of the
/// client instead of two). Past this the head goes alone and keep-alive comments follow, so a slow prefill never
/// leaves a proxy in front of the router waiting for headers.
const HEAD_WAITS_FOR_FIRST_EVENT: std::time::Duration = std::time::Duration::from_millis(250);

/// Runs every choice and streams them as server-sent events, interleaved as their tokens come.
pub async fn streamed(
    state: Arc<RouterState>,
    planned: Vec<Planned>,
    arrived: Instant,
    route: &'static str,
    permit: crate::admission::Permit,
) -> Response {
    let (tx, mut rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let span = tracing::Span::current();
    tokio::spawn(tracing::Instrument::instrument(
        async move {
            let _permit = permit;
            let status = pump(&state, planned, &tx, arrived).await;
            state.metrics.request(route, status);
            state.metrics.request_duration.observe(arrived.elapsed());
        },
        span,
    ));
    let first = tokio::time::timeout(HEAD_WAITS_FOR_FIRST_EVENT, rx.recv()).await.ok().flatten();
    let events = futures_util::stream::iter(first).chain(ReceiverStream::new(rx));
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

/// Streams every choice, then the usage and `[DONE]`; returns the status to count.
async fn pump(state: &Arc<RouterState>, planned: Vec<Planned>, tx: &Sink, arrived: Instant) -> u16 {
    let Some(first) = planned.first() else { return 502 };
    let (id, checked) = (first.routed.job.request_id.clone(), first.routed.checked.clone());
    let deadline = state.limits.request_timeout;
    let runs = planned.into_iter().map(|p| stream_choice(state, p, tx, &id, arrived));
    let done = tokio::select! {
        r = try_join_all(runs) => r,
        _ = tokio::time::sleep(deadline) => {
            return send_error(tx, &ApiError::Deadline(deadline)).await;
        }
    };
    let done = match done {
        Ok(done) => done,
        Err(status) => return status,
    };
    let totals = totals(done.iter().copied());
    tracing::Span::current().record("gen_ai.usage.output_tokens", totals.completion_tokens);
    if checked.include_usage {
        let object = if checked.endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
        let u = json!({"id": id, "object": object, "created": created(), "model": state.served_model,
                       "choices": [], "usage": usage(&totals)});
        let _ = send(tx, u).await;
    }
    let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    200
}

/// A streamed choice's text as the request asks: content, or pieces of its tool calls. A named function's arguments
/// stream as they come; required calls are an array whose text is held, each item going out as one call once it is
/// whole (the text as content if the answer has no whole item, cut short); the model's own calls (`auto`) go out
/// each whole, the content before them as it comes ([`AutoStream`]).
enum CallStream {
    Text,
    /// A named function's call; `opened` once its first chunk (id and name) has gone.
    Named {
        name: String,
        opened: bool,
    },
    /// The required calls' text so far, how much of it the calls sent so far took, and how many they are.
    Required {
        held: String,
        read: usize,
        made: usize,
    },
    /// The model's own calls.
    Auto(AutoStream),
}

impl CallStream {
    fn new(mode: Option<&CallMode>) -> CallStream {
        match mode {
            None => CallStream::Text,
            Some(CallMode::Named(name)) => CallStream::Named { name: name.clone(), opened: false },
            Some(CallMode::Required) => CallStream::Required { held: String::new(), read: 0, made: 0 },
            Some(CallMode::Auto(choosing)) => CallStream::Auto(AutoStream::new(choosing.clone())),
        }
    }

    /// The chunks for one token's text `s` (`due`: it has text, is the first, or carries log-probabilities), into
    /// `out`.
    fn token(&mut self, head: &Head, s: &str, due: bool, first: bool, lps: &Value, out: &mut Vec<String>) {
        match self {
            CallStream::Text => out.extend(due.then(|| head.chunk(Some(s), None, first, lps))),
            CallStream::Named { name, opened } => {
                let opening = !std::mem::replace(opened, true);
                out.extend(
                    (due || opening).then(|| head.call_chunk(0, opening.then_some(name.as_str()), s, first, lps)),
                );
            }
            CallStream::Required { held, read, made } => {
                held.push_str(s);
                out.extend((first || !lps.is_null()).then(|| head.chunk(None, None, first, lps)));
                // An item is whole once its object closes.
                while s.contains('}')
                    && let Some((call, used)) = tools::required_next(&held[*read..])
                {
                    *read += used;
                    out.extend(call_chunks(head, *made, std::slice::from_ref(&call)));
                    *made += 1;
                }
            }
            CallStream::Auto(auto) => {
                let sent = auto.push(s);
                let text = (!sent.content.is_empty()).then_some(sent.content.as_str());
                out.extend((text.is_some() || first || !lps.is_null()).then(|| head.chunk(text, None, first, lps)));
                out.extend(call_chunks(head, sent.first, &sent.calls));
            }
        }
    }

    /// The chunks for the text left at the end (`rest`), and whether the choice made calls.
    fn end(&mut self, head: &Head, rest: &str) -> (Vec<String>, bool) {
        let content = |text: &str| head.chunk(Some(text), None, false, &Value::Null);
        match self {
            CallStream::Text => ((!rest.is_empty()).then(|| content(rest)).into_iter().collect(), false),
            CallStream::Named { name, opened } => {
                let opening = !*opened;
                let last = (opening || !rest.is_empty())
                    .then(|| head.call_chunk(0, opening.then_some(name.as_str()), rest, false, &Value::Null));
                (last.into_iter().collect(), true)
            }
            CallStream::Required { held, made, .. } => {
                held.push_str(rest);
                match tools::calls(&CallMode::Required, held) {
                    Some(all) => (call_chunks(head, *made, &all.calls[(*made).min(all.calls.len())..]).collect(), true),
                    None if held.is_empty() => (Vec::new(), false),
                    None => (vec![content(held)], false),
                }
            }
            CallStream::Auto(auto) => {
                let sent = auto.end(rest);
                let mut chunks: Vec<String> =
                    (!sent.content.is_empty()).then(|| content(&sent.content)).into_iter().collect();
                chunks.extend(call_chunks(head, sent.first, &sent.calls));
                (chunks, auto.calls() > 0)
            }
        }
    }
}

/// The chunks of whole `calls`, numbered on from `first` (the calls that went out before).
fn call_chunks<'a>(head: &'a Head, first: usize, calls: &'a [tools::Call]) -> impl Iterator<Item = String> + 'a {
    let each = calls.iter().enumerate();
    each.map(move |(k, (name, arguments))| head.call_chunk(first + k, Some(name), arguments, false, &Value::Null))
}

/// A streamed piece of text `s` (the `last`, with whatever was held back) split by the answer's thinking, when it
/// has one: the thinking to send (when shown and not empty) and the content; without, all content.
fn split_thinking(thinking: &mut Option<(ReasoningStream, bool)>, s: String, last: bool) -> (Option<String>, String) {
    match thinking {
        None => (None, s),
        Some((stream, shown)) => {
            let split = if last { stream.end(&s) } else { stream.push(&s) };
            (split.reasoning.filter(|r| *shown && !r.is_empty()), split.content)
        }
    }
}

/// One choice, streamed; what it counts toward the usage when it finished, or
/// the status that ended the request (an error event already sent).
async fn stream_choice(
    state: &Arc<RouterState>,
    p: Planned,
    tx: &Sink,
    id: &str,
    arrived: Instant,
) -> Result<Counts, u16> {
    let model = state.served_model.as_str();
    let mut run = Run::start(state, p, arrived).await;
    let progress = Progress { prompt: run.prompt_len, tokens: Default::default() };
    let usage = run.checked.continuous_usage.then_some(&progress);
    let head = Head { endpoint: run.checked.endpoint, id, model, index: run.index, ids: run.checked.call_ids, usage };
    let mut first = true;
    let mut calls = CallStream::new(run.checked.tool_calls.as_ref());
    // A token's chunks, sent as they are made.
    let mut out = Vec::with_capacity(1);
    let mut thinking = run.checked.thinking.map(|t| (ReasoningStream::new(t.parser), t.shown));
    // The echoed prompt goes first; with log-probabilities, once they come (before the first token).
    if !run.echo_waits()
        && let Some(echo) = run.echo.take()
    {
        if !send_text(tx, head.chunk(Some(&echo), None, true, &Value::Null)).await {
            return Err(499);
        }
        first = false;
    }
    let (reason, cached) = loop {
        let piece = tokio::select! {
            p = run.pieces.recv() => p,
            // The client left (before the first token too): dropping the pieces cancels the work on every worker.
            _ = tx.closed() => return Err(499),
        };
        match piece {
            Some(Ok(Piece::Prompt(scores))) => {
                let lps = match run.prompt(state, &scores) {
                    Ok(lps) => lps,
                    Err(e) => return Err(send_error(tx, &e).await),
                };
                if let Some(echo) = run.echo.take() {
                    if !send_text(tx, head.chunk(Some(&echo), None, true, &lps)).await {
                        return Err(499);
                    }
                    first = false;
                }
            }
            Some(Ok(Piece::Token(..))) if run.echo_only() => {
                if let Err(e) = run.prompt_came() {
                    return Err(send_error(tx, &e).await);
                }
            }
            Some(Ok(Piece::Token(t, lp))) => {
                let (s, lps) = match run.token(state, t, lp) {
                    Ok(r) => r,
                    Err(e) => return Err(send_error(tx, &e).await),
                };
                progress.tokens.store(run.text.tokens, std::sync::atomic::Ordering::Relaxed);
                // With log-probabilities every token has its chunk, text or not (held back, or end-of-generation):
                // its thinking's, or else its content's.
                let (thought, s) = split_thinking(&mut thinking, s, false);
                let mut lps = &lps;
                if let Some(thought) = thought {
                    if !send_text(tx, head.reasoning_chunk(&thought, first, lps)).await {
                        return Err(499);
                    }
                    (first, lps) = (false, &Value::Null);
                }
                let due = !s.is_empty() || first || !lps.is_null();
                calls.token(&head, &s, due, first, lps, &mut out);
                for json in out.drain(..) {
                    if !send_text(tx, json).await {
                        return Err(499);
                    }
                }
                first = false;
                if run.text.stopped {
                    break (pb::FinishReason::Stop, None);
                }
            }
            Some(Ok(Piece::Finished { reason, cached_tokens })) => break (reason, Some(cached_tokens)),
            Some(Err(e)) => return Err(send_error(tx, &e).await),
            None => {
                let e = ApiError::Upstream("the request ended without finishing".into());
                return Err(send_error(tx, &e).await);
            }
        }
    };
    let rest = run.text.stream.finish(run.text.stopped);
    let (thought, rest) = split_thinking(&mut thinking, rest, true);
    if let Some(thought) = thought
        && !send_text(tx, head.reasoning_chunk(&thought, false, &Value::Null)).await
    {
        return Err(499);
    }
    let (last, made) = calls.end(&head, &rest);
    for json in last {
        if !send_text(tx, json).await {
            return Err(499);
        }
    }
    let mut finish = run.finish_reason(reason);
    if let Some(mode) = &run.checked.tool_calls {
        finish = tools::finish_reason(mode, made, finish);
    }
    run.finish = Some(finish);
    if !send_text(tx, head.chunk(None, Some(finish), false, &Value::Null)).await {
        return Err(499);
    }
    tracing::Span::current().record("gen_ai.response.finish_reasons", finish);
    Ok(run.counts(cached))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tokens_spent_thinking_are_those_before_the_content() {
        use ReasoningParser::{DeepSeekR1, Qwen3};
        // Tokens "<think>", "Hm", "m.", "</think>", "\n\nYes", ".", and an end of generation with no text.
        let pieces = ["<think>", "Hm", "m.", "</think>", "\n\nYes", ".", ""];
        let (mut said, mut ends) = (String::new(), Vec::new());
        for p in pieces {
            said.push_str(p);
            ends.push(said.len());
        }
        assert_eq!(tokens_before_content(&said, &ends, DeepSeekR1), 4);
        assert_eq!(tokens_before_content(&said, &ends, Qwen3), 4);
        // No thinking; thinking cut short (every token, the last with no text too).
        assert_eq!(tokens_before_content("Yes.", &[3, 4], Qwen3), 0);
        assert_eq!(tokens_before_content("Hmm", &[2, 3, 3], DeepSeekR1), 3);
        // A token that ends the thinking and starts the content is the content's.
        assert_eq!(tokens_before_content("<think>Hm</think>Yes", &[7, 9, 20], Qwen3), 2);
    }

    /// The chunk as a `serde_json::Value` tree printed it, before chunks were written straight: clients see the
    /// same bytes.
    fn as_value_printed(
        h: &Head<'_>,
        text: Option<&str>,
        finish: Option<&str>,
        role: bool,
        lp: &Value,
        created: u64,
    ) -> String {
        let Head { endpoint, id, model, index, .. } = *h;
        match endpoint {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]})
            }
            Endpoint::Completion => json!({"id": id, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": index, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": finish}]}),
        }
        .to_string()
    }

    #[test]
    fn chunks_are_written_as_the_value_tree_printed_them() {
        let lp = json!({"content": [{"token": "a\"b", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]});
        for endpoint in [Endpoint::Chat, Endpoint::Completion] {
            let head = Head {
                endpoint,
                id: "cmpl-\u{e9}\"1",
                model: "smol\\lm",
                index: 3,
                ids: tools::CallIds::OpenAi,
                usage: None,
            };
            for (text, finish, role, logprobs) in [
                (Some("hi \"there\"\n"), None, true, Value::Null),
                (Some(""), None, false, lp.clone()),
                (None, Some("length"), false, Value::Null),
                (Some("\u{1F600}"), Some("stop"), true, lp.clone()),
            ] {
                let written = head.chunk(text, finish, role, &logprobs);
                let created =
                    serde_json::from_str::<Value>(&written).expect("JSON")["created"].as_u64().expect("created");
                assert_eq!(written, as_value_printed(&head, text, finish, role, &logprobs, created));
            }
        }
    }

    #[test]
    fn a_chunk_carries_its_choices_usage_so_far_when_asked() {
        let progress = Progress { prompt: 7, tokens: 3.into() };
        let head =
            Head { endpoint: Endpoint::Chat, id: "c", model: "m", index: 0, ids: tools::CallIds::OpenAi, usage: None };
        let usage = |head: &Head| {
            serde_json::from_str::<Value>(&head.chunk(Some("x"), None, false, &Value::Null)).expect("JSON")["usage"]
                .clone()
        };
        assert_eq!(usage(&head), Value::Null);
        let counted = Head { usage: Some(&progress), ..head };
        assert_eq!(usage(&counted), json!({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}));
    }
}
