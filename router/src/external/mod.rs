//! Engine servers Tandem does not own (llama.cpp's `llama-server`, vLLM, SGLang), routed to next to its own
//! workers. They serve whole requests (prefill and decode together) over HTTP. Where one publishes its KV events
//! (vLLM, SGLang), the router follows them ([`events`]) and knows exactly what it holds; where it does not, the
//! router predicts that from the prompts it sent there ([`predicted`]). Their load is counted from what the router
//! sent and what has finished, and their health checked by polling.

pub mod events;
pub mod http;
pub mod llama_server;
pub mod metrics;
pub mod predicted;
pub mod sglang;
pub mod sse;
pub mod vllm;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::Stream;
use http_body_util::BodyExt;
use proto::worker as pb;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tonic::Status;

use crate::cluster::Cluster;
use crate::scheduler::view::WorkerId;

/// The request's penalties, bias, `min_tokens` (under the name the engine uses for it) and stop token ids, in the
/// sampling fields vLLM and SGLang share (both define them as Tandem's engine does).
/// The request's structured output (`None`: unconstrained; [`crate::serve::needs`] keeps a grammar of a kind it does
/// not know from external engines, so none is dropped here).
fn grammar(sampling: &pb::Sampling) -> Option<engine::grammar::Grammar> {
    let g = sampling.grammar.as_ref()?;
    engine::grammar::Grammar::from_parts(&g.kind, &g.data).ok()
}

/// A JSON schema's text as a JSON value for an engine that takes one (the router compiled it, so it parses; text that
/// did not would go as a string, which the engine refuses).
fn schema_value(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

/// OpenAI's `json_object` as a schema (what Tandem's workers allow: any object), for every engine.
const ANY_OBJECT: &str = r#"{"type": "object"}"#;

fn put_logits_rules(fields: &mut Value, sampling: &pb::Sampling, min_tokens_key: &str) {
    fields["frequency_penalty"] = sampling.frequency_penalty.into();
    fields["presence_penalty"] = sampling.presence_penalty.into();
    fields["repetition_penalty"] = sampling.repetition_penalty.unwrap_or(1.0).into();
    fields[min_tokens_key] = sampling.min_tokens.into();
    if !sampling.stop_token_ids.is_empty() {
        fields["stop_token_ids"] = sampling.stop_token_ids.clone().into();
    }
    if !sampling.logit_bias.is_empty() {
        fields["logit_bias"] = sampling.logit_bias.iter().map(|(t, v)| (t.to_string(), Value::from(*v))).collect();
    }
}

/// Generated tokens as a worker streams them, whatever carries them.
pub type TokenStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

/// Which server an external worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// llama.cpp's `llama-server` (its native `/completion` endpoint, which speaks token ids).
    LlamaServer,
    /// vLLM's OpenAI server (`/v1/completions` with token ids in and out).
    Vllm,
    /// SGLang's server (its native `/generate`, with token ids in and out).
    Sglang,
}

impl EngineKind {
    pub fn parse(s: &str) -> Result<EngineKind, String> {
        match s {
            "llama-server" | "llama.cpp" => Ok(EngineKind::LlamaServer),
            "vllm" => Ok(EngineKind::Vllm),
            "sglang" => Ok(EngineKind::Sglang),
            other => Err(format!("unknown engine {other:?} (known: llama-server, vllm, sglang)")),
        }
    }

    fn health_path(self) -> &'static str {
        match self {
            EngineKind::LlamaServer => llama_server::HEALTH_PATH,
            EngineKind::Vllm => vllm::HEALTH_PATH,
            EngineKind::Sglang => sglang::HEALTH_PATH,
        }
    }

    fn generate_path(self) -> &'static str {
        match self {
            EngineKind::LlamaServer => llama_server::GENERATE_PATH,
            EngineKind::Vllm => vllm::GENERATE_PATH,
            EngineKind::Sglang => sglang::GENERATE_PATH,
        }
    }

    /// The request body; `namespace`, the request's cache namespace, goes to vLLM and SGLang as their cache salt;
    /// llama-server has none, so `cache_prompt` says whether it may reuse cached prompts for the request at all.
    fn body(self, tokens: &[u32], sampling: &pb::Sampling, namespace: Option<&str>, cache_prompt: bool) -> Value {
        match self {
            EngineKind::LlamaServer => llama_server::body(tokens, sampling, cache_prompt),
            EngineKind::Vllm => vllm::body(tokens, sampling, namespace),
            EngineKind::Sglang => sglang::body(tokens, sampling, namespace),
        }
    }

    /// Whether the router relays log-probabilities from it, for a request at a temperature other than 0 and 1 or
    /// not (`tempered`): llama-server's and vLLM's (by default) are the model's own distribution's, as Tandem's
    /// workers report; SGLang's are the tempered one's (`log_softmax(logits / T)`, unless the server runs with
    /// `SGLANG_RETURN_ORIGINAL_LOGPROB`), the same only at 0 (greedy: the raw logits') and 1.
    pub fn relays_logprobs(self, tempered: bool) -> bool {
        match self {
            EngineKind::LlamaServer | EngineKind::Vllm => true,
            EngineKind::Sglang => !tempered,
        }
    }

    /// Whether it takes vLLM's `allowed_token_ids` (vLLM's own field, with the same meaning).
    pub fn takes_allowed_tokens(self) -> bool {
        self == EngineKind::Vllm
    }

    /// Whether it constrains output by a regular expression (llama-server takes JSON schemas and GBNF only).
    pub fn takes_regex(self) -> bool {
        matches!(self, EngineKind::Vllm | EngineKind::Sglang)
    }

    fn parser(self, sampling: &pb::Sampling) -> Parser {
        match self {
            EngineKind::LlamaServer => Parser::LlamaServer(sampling.logprobs),
            EngineKind::Vllm => Parser::Vllm(vllm::Parser::new(sampling.logprobs)),
            EngineKind::Sglang => Parser::Sglang(sglang::Parser::new(sampling.logprobs)),
        }
    }
}

/// One streamed chunk of generated tokens.
#[derive(Clone, Debug, PartialEq)]
pub enum Chunk {
    Tokens(Vec<u32>),
    /// Tokens, each with its log-probabilities (asked for, from an engine that relays them).
    Scored(Vec<u32>, Vec<pb::TokenLogprobs>),
    /// The last chunk, with any tokens it still carries (and their log-probabilities, when asked for).
    Finished {
        tokens: Vec<u32>,
        logprobs: Vec<pb::TokenLogprobs>,
        reason: pb::FinishReason,
        cached_tokens: u32,
    },
}

/// Reads one engine's stream, chunk by chunk.
enum Parser {
    /// With the alternatives per token asked for, when log-probabilities are.
    LlamaServer(Option<u32>),
    Vllm(vllm::Parser),
    Sglang(sglang::Parser),
}

impl Parser {
    /// The chunk an event's data carries (`None`: nothing to pass on).
    fn push(&mut self, data: &str) -> Result<Option<Chunk>, String> {
        match self {
            Parser::LlamaServer(_) if data.trim() == "[DONE]" => Ok(None),
            Parser::LlamaServer(alternatives) => llama_server::parse(data, *alternatives).map(Some),
            Parser::Vllm(p) => p.push(data),
            Parser::Sglang(p) => p.push(data),
        }
    }
}

/// A stream chunk's JSON, unless it reports an error.
pub(crate) fn chunk_json(data: &str) -> Result<Value, String> {
    let v: Value = serde_json::from_str(data).map_err(|e| format!("a stream chunk is not JSON: {e}"))?;
    match v.get("error") {
        Some(e) => Err(format!("the server reported an error: {}", e.get("message").unwrap_or(e))),
        None => Ok(v),
    }
}

/// A relayed token's log-probabilities as a worker reports them: the entry the engine gave for token `id`, which
/// must be the token it came with, and the alternatives `top` (id, log-probability), most likely first.
pub(crate) fn scored(token: u32, id: u32, logprob: f32, top: &[(u32, f32)]) -> Result<pb::TokenLogprobs, String> {
    if id != token {
        return Err(format!("the log-probability of token {id} came with token {token}"));
    }
    Ok(pb::TokenLogprobs {
        logprob,
        // Neither engine's stream says it.
        rank: 0,
        top_ids: top.iter().map(|t| t.0).collect(),
        top_logprobs: top.iter().map(|t| t.1).collect(),
    })
}

/// A JSON list of token ids (absent or null: none).
pub(crate) fn token_ids(v: Option<&Value>) -> Result<Vec<u32>, String> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(ids)) => ids
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| format!("a token id is {t}")))
            .collect(),
        Some(other) => Err(format!("{other} is not a list of token ids")),
    }
}

/// How external workers are followed.
#[derive(Clone, Debug, PartialEq)]
pub struct ExternalSettings {
    /// How often each server's health endpoint is asked.
    pub health_period: Duration,
    /// A predicted block not sent again for this long is forgotten (the engine will have evicted it).
    pub predicted_ttl: Duration,
    /// Blocks predicted per server at most; `None`: as many as its KV holds (`/props`).
    pub predicted_blocks: Option<u64>,
    /// Engine blocks followed per server publishing KV events at most (past it, its view is dropped).
    pub max_engine_blocks: usize,
}

/// Named defaults of [`ExternalSettings`].
pub mod defaults {
    use std::time::Duration;

    /// A server that died is out of the rotation within a second or two (requests to it fail over meanwhile).
    pub const HEALTH_PERIOD: Duration = Duration::from_secs(1);
    /// SGLang's gateway forgets predicted prefixes after 120 s; an idle engine keeps its cache longer, a busy one
    /// much shorter, which the capacity bounds.
    pub const PREDICTED_TTL: Duration = Duration::from_secs(120);
    /// 4 M blocks: 64 M tokens at vLLM's 16, more KV than one server holds (each followed block costs a map entry,
    /// its owned hashes and under one block of tail tokens: tens of bytes, so hundreds of MB at the bound).
    pub const MAX_ENGINE_BLOCKS: usize = 1 << 22;
    /// KV assumed for a server that does not say (no `/props`, `/metrics` or `/server_info` answer): it scales the
    /// load term and bounds what is sent there (without one, every request would look like too much).
    pub const ASSUMED_CAPACITY_TOKENS: u64 = 1 << 16;
}

impl Default for ExternalSettings {
    fn default() -> ExternalSettings {
        ExternalSettings {
            health_period: defaults::HEALTH_PERIOD,
            predicted_ttl: defaults::PREDICTED_TTL,
            predicted_blocks: None,
            max_engine_blocks: defaults::MAX_ENGINE_BLOCKS,
        }
    }
}

/// An external worker's server, or one data-parallel rank of it.
#[derive(Debug)]
pub struct Engine {
    pub kind: EngineKind,
    /// As configured (`http://host:port`).
    pub url: String,
    /// What the router calls it: the URL, with `#dp<rank>` for a rank.
    pub name: String,
    authority: String,
    /// Where it publishes its KV events (exact mode); `None`: its cache is predicted.
    pub events: Option<events::EventSource>,
    /// Its data-parallel rank and how many the server runs (vLLM's and SGLang's `--dp-size`): each rank has its
    /// own KV cache, events (on the ports after the configured ones) and load, and takes the requests sent to it
    /// by number. `None`: the server is one engine, or its ranks are not told apart.
    pub rank: Option<Rank>,
    /// The router keeps tenants' cached prompts apart ([`crate::tenants::Tenants::isolated`]): a server without
    /// cache salts (llama-server) then reuses no cached prompt at all.
    pub isolated: bool,
    /// How the server orders requests by priority, when it was started to (`None`: it refuses priorities).
    pub priority: Option<PriorityOrder>,
    /// What the server's ranks last read from it (health, metrics, settings), shared by them: each rank polls
    /// the one server, which answers once for all of them ([`Polled`]). `None` for a server followed whole.
    polled: Option<Arc<Polled>>,
}

/// A server's last answers to the GETs its ranks poll, by path, with when each came: a rank asking for a path whose
/// answer is fresher than [`Polled::FRESH`] takes that answer (an error too) instead of asking again. One rank asks
/// at a time, so ranks polling together (their periods start together) make one request.
#[derive(Debug, Default)]
struct Polled(tokio::sync::Mutex<HashMap<String, Answer>>);

/// When an answer came, and what it was.
type Answer = (Instant, Result<Bytes, String>);

impl Polled {
    /// How long an answer serves the other ranks: well under any health period, well over the spread of ranks
    /// polling together.
    const FRESH: Duration = Duration::from_millis(100);
}

/// The order a server started with priority scheduling serves priorities in (vLLM's `--scheduling-policy
/// priority`: lower values first; SGLang's `--enable-priority-scheduling`: higher first, lower with
/// `--schedule-low-priority-values-first`). Tandem's priorities are vLLM's, lower first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PriorityOrder {
    LowerFirst,
    HigherFirst,
}

impl PriorityOrder {
    /// The setting `priority_scheduling` of a server running `kind`: `off` (none), `on` (the engine's own order
    /// when switched on), `lower-first`, `higher-first`.
    pub fn parse(kind: EngineKind, s: &str) -> Result<Option<PriorityOrder>, String> {
        Ok(match (s, kind) {
            ("off", _) => None,
            (_, EngineKind::LlamaServer) => return Err("llama-server has no priority scheduling".into()),
            ("on", EngineKind::Vllm) | ("lower-first", _) => Some(PriorityOrder::LowerFirst),
            ("on", EngineKind::Sglang) | ("higher-first", EngineKind::Sglang) => Some(PriorityOrder::HigherFirst),
            ("higher-first", EngineKind::Vllm) => return Err("vLLM serves lower priority values first".into()),
            (other, _) => {
                return Err(format!("priority_scheduling is off, on, lower-first or higher-first, not {other:?}"));
            }
        })
    }
}

/// One of a server's data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rank {
    pub rank: u32,
    pub of: u32,
}

/// The header vLLM reads a request's data-parallel rank from (case aside).
pub const RANK_HEADER: &str = "x-data-parallel-rank";

impl Engine {
    /// `http://host:port` (a trailing `/` or `/v1` is ignored). Plain HTTP: the servers sit next to the router.
    pub fn new(url: &str, kind: EngineKind) -> Result<Engine, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| format!("{url:?}: only http:// URLs are supported"))?;
        let authority = rest.trim_end_matches('/').trim_end_matches("/v1");
        if authority.is_empty() || authority.contains('/') || !authority.contains(':') {
            return Err(format!("{url:?} is not http://host:port"));
        }
        Ok(Engine {
            kind,
            url: url.to_string(),
            name: url.to_string(),
            authority: authority.to_string(),
            events: None,
            rank: None,
            isolated: false,
            priority: None,
            polled: None,
        })
    }

    /// The same server, scheduling by priority in `order` (`None`: not at all).
    pub fn with_priority(self, order: Option<PriorityOrder>) -> Engine {
        Engine { priority: order, ..self }
    }

    /// The same server, for a router that keeps tenants' cached prompts apart or not.
    pub fn isolated(self, isolated: bool) -> Engine {
        Engine { isolated, ..self }
    }

    /// Whether the server may serve a request in cache namespace `namespace` from its cached prompts (and so
    /// whether what it caches for it is predicted): vLLM and SGLang keep namespaces apart themselves (their cache
    /// salt); llama-server has no salt, so it caches only requests of no namespace, and none while the router
    /// keeps tenants apart (a request of no namespace would find what a tenant's left in a slot).
    pub fn caches(&self, namespace: Option<&str>) -> bool {
        self.kind != EngineKind::LlamaServer || (namespace.is_none() && !self.isolated)
    }

    /// The same server, its KV events followed at `source`.
    pub fn with_events(self, source: Option<events::EventSource>) -> Engine {
        Engine { events: source, ..self }
    }

    /// Each of the server's `ranks` data-parallel ranks as an engine of its own, their events at `source`'s ports
    /// plus the rank, as vLLM and SGLang publish them; one rank: the server itself. llama-server has no ranks.
    pub fn ranks(self, ranks: u32) -> Result<Vec<Engine>, String> {
        if ranks <= 1 {
            return Ok(vec![self]);
        }
        if self.kind == EngineKind::LlamaServer {
            return Err(format!("{}: llama-server has no data-parallel ranks", self.url));
        }
        let polled = Arc::new(Polled::default());
        (0..ranks)
            .map(|rank| {
                let events = self.events.as_ref().map(|s| s.for_rank(rank)).transpose()?;
                Ok(Engine {
                    kind: self.kind,
                    url: self.url.clone(),
                    name: format!("{}#dp{rank}", self.url),
                    authority: self.authority.clone(),
                    events,
                    rank: Some(Rank { rank, of: ranks }),
                    isolated: self.isolated,
                    priority: self.priority,
                    polled: Some(Arc::clone(&polled)),
                })
            })
            .collect()
    }

    /// Addresses a request `body` to this engine's rank: the header to send (vLLM's), or a field of the body
    /// (SGLang's `/generate` field, `routed_dp_rank` in newer releases, this name still taken).
    fn address_rank(&self, body: &mut Value) -> Option<(&'static str, u32)> {
        let Rank { rank, .. } = self.rank?;
        match self.kind {
            EngineKind::Vllm => Some((RANK_HEADER, rank)),
            EngineKind::Sglang => {
                body["data_parallel_rank"] = rank.into();
                None
            }
            EngineKind::LlamaServer => None,
        }
    }

    /// A request's `priority` (Tandem's, lower first) in the body, in the server's order; 0 is not sent (a server
    /// without priority scheduling refuses any other value, and takes no request that has one: `Needs`).
    fn put_priority(&self, body: &mut Value, priority: i32) {
        let (Some(order), false) = (self.priority, priority == 0) else { return };
        body["priority"] = match order {
            PriorityOrder::LowerFirst => priority,
            PriorityOrder::HigherFirst => priority.saturating_neg(),
        }
        .into();
    }

    /// `host:port`.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// GETs `path` (a poll: health, metrics, settings); for a rank, the server's answer to another rank's GET of
    /// the same moment when there is one ([`Polled`]).
    async fn get(&self, path: &str, timeout: Duration) -> Result<Bytes, String> {
        let Some(polled) = &self.polled else { return self.fetch(path, timeout).await };
        let mut answers = polled.0.lock().await;
        if let Some((at, answer)) = answers.get(path)
            && at.elapsed() < Polled::FRESH
        {
            return answer.clone();
        }
        let answer = self.fetch(path, timeout).await;
        answers.insert(path.to_string(), (Instant::now(), answer.clone()));
        answer
    }

    async fn fetch(&self, path: &str, timeout: Duration) -> Result<Bytes, String> {
        let work = async {
            let req = hyper::Request::get(path);
            let (resp, _conn) = http::send(&self.authority, req, Bytes::new()).await?;
            let status = resp.status();
            let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
            if !status.is_success() {
                return Err(format!("GET {path}: HTTP {status}"));
            }
            Ok(body)
        };
        tokio::time::timeout(timeout, work).await.map_err(|_| format!("GET {path}: no answer within {timeout:?}"))?
    }

    async fn get_json(&self, path: &str, timeout: Duration) -> Result<Value, String> {
        let body = self.get(path, timeout).await?;
        serde_json::from_slice(&body).map_err(|e| format!("GET {path}: {e}"))
    }

    /// Whether the server answers its health check now.
    pub async fn healthy(&self, timeout: Duration) -> bool {
        self.get(self.kind.health_path(), timeout).await.is_ok()
    }

    /// Tokens of KV the server holds, as it says.
    pub async fn capacity_tokens(&self, timeout: Duration) -> Option<u64> {
        match self.kind {
            EngineKind::LlamaServer => {
                llama_server::capacity_tokens(&self.get_json(llama_server::PROPS_PATH, timeout).await.ok()?)
            }
            EngineKind::Vllm => {
                let text = self.get(metrics::PATH, timeout).await.ok()?;
                vllm::capacity_tokens(&String::from_utf8_lossy(&text), self.rank.map(|r| r.rank))
            }
            EngineKind::Sglang => {
                sglang::capacity_tokens(&self.get_json(sglang::INFO_PATH, timeout).await.ok()?, self.rank.is_some())
            }
        }
    }

    /// The load its metrics report, where it serves them.
    pub async fn load(&self, timeout: Duration) -> Option<metrics::EngineLoad> {
        let text = self.get(metrics::PATH, timeout).await.ok()?;
        metrics::parse(self.kind, &String::from_utf8_lossy(&text), self.rank)
    }

    /// Starts generating after `tokens`, in the cache namespace `namespace`; the stream carries the tokens and then
    /// how it finished. Dropping the stream closes the connection (the server stops).
    /// `traceparent`: the W3C trace context the server's own spans continue from.
    pub async fn generate(
        &self,
        tokens: &[u32],
        sampling: &pb::Sampling,
        namespace: Option<&str>,
        traceparent: Option<&str>,
    ) -> Result<TokenStream, Status> {
        if !crate::serve::needs(sampling).met_by_external(self) {
            let why = match &sampling.grammar {
                Some(_) if sampling.prior_generated > 0 => {
                    "a structured output cannot go on after tokens generated elsewhere (the engine would start it over)"
                }
                Some(g) if g.kind == "regex" => "it takes no regular expressions",
                Some(g) if g.kind == "lark" => "Lark grammars go to Tandem's workers only",
                _ => "what the request asks is not relayed to external engines",
            };
            return Err(Status::invalid_argument(format!("{}: {why}", self.name)));
        }
        if self.kind == EngineKind::LlamaServer
            && let Some(field) = llama_server::unsupported(sampling)
        {
            return Err(Status::invalid_argument(format!("{}: llama-server does not support {field}", self.name)));
        }
        let mut body = self.kind.body(tokens, sampling, namespace, self.caches(namespace));
        let mut req = hyper::Request::post(self.kind.generate_path())
            .header("content-type", "application/json")
            .header("accept", "text/event-stream");
        self.put_priority(&mut body, sampling.priority);
        if let Some((header, rank)) = self.address_rank(&mut body) {
            req = req.header(header, rank);
        }
        let body = body.to_string();
        if let Some(tp) = traceparent {
            req = req.header("traceparent", tp);
        }
        let (resp, conn) = http::send(&self.authority, req, Bytes::from(body)).await.map_err(Status::unavailable)?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let message = format!("{}: HTTP {status}: {}", self.name, String::from_utf8_lossy(&text));
            // The server refused this request (too long, bad values): another server would too.
            return Err(if status.is_client_error() {
                Status::invalid_argument(message)
            } else {
                Status::unavailable(message)
            });
        }
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(forward(resp.into_body(), conn, self.kind.parser(sampling), tx));
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}

/// Moves the server's chunks to `tx` as generated tokens until the last one, an error, or `tx` closing.
async fn forward(
    mut body: hyper::body::Incoming,
    _conn: http::Connection,
    mut chunks: Parser,
    tx: mpsc::Sender<Result<pb::GenerateResponse, Status>>,
) {
    use pb::generate_response::Event;
    let token = |id, logprobs| pb::GenerateResponse {
        event: Some(Event::Token(pb::Token { id, logprobs, ..Default::default() })),
    };
    let mut parser = sse::SseParser::default();
    loop {
        let frame = tokio::select! {
            f = body.frame() => f,
            _ = tx.closed() => return,
        };
        let data = match frame {
            Some(Ok(f)) => f.into_data().unwrap_or_default(),
            Some(Err(e)) => {
                let _ = tx.send(Err(Status::unavailable(format!("reading the stream: {e}")))).await;
                return;
            }
            None => return,
        };
        for event in parser.push(&data) {
            let (tokens, mut logprobs, finished) = match chunks.push(&event) {
                Ok(None) => continue,
                Ok(Some(Chunk::Tokens(t))) => (t, Vec::new(), None),
                Ok(Some(Chunk::Scored(t, lps))) => (t, lps, None),
                Ok(Some(Chunk::Finished { tokens, logprobs, reason, cached_tokens })) => (
                    tokens,
                    logprobs,
                    Some(pb::Finished { reason: reason as i32, cached_tokens, ..Default::default() }),
                ),
                Err(e) => {
                    let _ = tx.send(Err(Status::internal(e))).await;
                    return;
                }
            };
            logprobs.reverse();
            for id in tokens {
                if tx.send(Ok(token(id, logprobs.pop()))).await.is_err() {
                    return;
                }
            }
            if let Some(f) = finished {
                let _ = tx.send(Ok(pb::GenerateResponse { event: Some(Event::Finished(f)) })).await;
                return;
            }
        }
    }
}

/// Follows one external worker until `stop`: up while its health check answers, down (what the index holds for
/// it dropped) while it does not; its KV events followed meanwhile where it publishes them, else predicted blocks
/// expire on the way. One task, so that unfollowing the worker ends both.
pub async fn follow(
    cluster: Arc<Cluster>,
    id: WorkerId,
    addr: std::net::SocketAddr,
    engine: Arc<Engine>,
    settings: ExternalSettings,
    stop: watch::Receiver<bool>,
) {
    let source = engine.events.clone();
    let events = async {
        if let Some(source) = source {
            let blocks = settings.max_engine_blocks;
            let rank = engine.rank.map(|r| r.rank);
            events::follow(&cluster, id, &engine.name, &source, rank, blocks, stop.clone()).await;
        }
    };
    tokio::join!(health(&cluster, id, addr, &engine, &settings, stop.clone()), events);
}

async fn health(
    cluster: &Arc<Cluster>,
    id: WorkerId,
    addr: std::net::SocketAddr,
    engine: &Arc<Engine>,
    settings: &ExternalSettings,
    mut stop: watch::Receiver<bool>,
) {
    let timeout = settings.health_period.max(Duration::from_secs(1));
    loop {
        let healthy = engine.healthy(timeout).await;
        match (healthy, cluster.member(id).is_some_and(|m| m.up)) {
            (true, false) => {
                let capacity = engine.capacity_tokens(timeout).await;
                cluster.external_up(id, addr, engine, capacity, settings);
                tracing::info!(worker = %engine.name, "external worker joined");
            }
            (false, true) => {
                tracing::warn!(worker = %engine.name, "external worker stopped answering; dropping what it held");
                cluster.leave(id);
            }
            (true, true) => {
                if let Some(load) = engine.load(timeout).await {
                    cluster.engine_load(id, load);
                }
            }
            _ => {}
        }
        cluster.expire_predicted(id, Instant::now());
        tokio::select! {
            _ = tokio::time::sleep(settings.health_period) => {}
            _ = stop.wait_for(|&s| s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_host_and_port() {
        let e = Engine::new("http://127.0.0.1:8080/v1/", EngineKind::LlamaServer).expect("ok");
        assert_eq!(e.authority(), "127.0.0.1:8080");
        assert!(Engine::new("https://h:1", EngineKind::LlamaServer).is_err());
        assert!(Engine::new("http://h", EngineKind::LlamaServer).is_err());
        assert!(Engine::new("http://h:1/x", EngineKind::LlamaServer).is_err());
        assert_eq!(EngineKind::parse("llama-server"), Ok(EngineKind::LlamaServer));
        assert_eq!(EngineKind::parse("vllm"), Ok(EngineKind::Vllm));
        assert!(EngineKind::parse("tgi").is_err());
    }

    #[test]
    fn only_a_server_that_keeps_namespaces_apart_caches_a_namespaced_request() {
        let engine = |kind, isolated| Engine::new("http://h:1", kind).expect("ok").isolated(isolated);
        for kind in [EngineKind::Vllm, EngineKind::Sglang] {
            assert!(engine(kind, true).caches(Some("t\0")) && engine(kind, false).caches(None));
        }
        let llama = engine(EngineKind::LlamaServer, false);
        assert!(llama.caches(None) && !llama.caches(Some("salt")));
        assert!(!engine(EngineKind::LlamaServer, true).caches(None));
        let body = |caches| EngineKind::LlamaServer.body(&[1], &pb::Sampling::default(), None, caches);
        assert_eq!(
            (body(true)["cache_prompt"].as_bool(), body(false)["cache_prompt"].as_bool()),
            (Some(true), Some(false))
        );
    }

    #[test]
    fn priorities_go_in_the_servers_order() {
        use PriorityOrder::{HigherFirst, LowerFirst};
        let parse = |kind, s| PriorityOrder::parse(kind, s);
        assert_eq!(parse(EngineKind::Vllm, "on"), Ok(Some(LowerFirst)));
        assert_eq!(parse(EngineKind::Sglang, "on"), Ok(Some(HigherFirst)), "SGLang's default order");
        assert_eq!(parse(EngineKind::Sglang, "lower-first"), Ok(Some(LowerFirst)));
        assert_eq!(parse(EngineKind::LlamaServer, "off"), Ok(None));
        for (kind, s) in
            [(EngineKind::LlamaServer, "on"), (EngineKind::Vllm, "higher-first"), (EngineKind::Vllm, "yes")]
        {
            assert!(parse(kind, s).is_err(), "{kind:?} {s}");
        }
        let sent = |order, priority| {
            let engine = Engine::new("http://h:1", EngineKind::Sglang).expect("ok").with_priority(order);
            let mut body = serde_json::json!({});
            engine.put_priority(&mut body, priority);
            body.get("priority").cloned()
        };
        assert_eq!(sent(Some(LowerFirst), -3), Some(serde_json::json!(-3)));
        assert_eq!(sent(Some(HigherFirst), -3), Some(serde_json::json!(3)), "Tandem's first is the server's first");
        assert_eq!(sent(Some(HigherFirst), 0), None);
        assert_eq!(sent(None, 5), None);
    }

    /// A server's ranks poll it together and it answers once; later, or followed whole, it is asked each time.
    #[tokio::test]
    async fn ranks_polling_together_ask_their_server_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let url = format!("http://{}", listener.local_addr().expect("an address"));
        let asked = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&asked);
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    let _ = conn.read(&mut buf).await;
                    let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
                });
            }
        });
        let timeout = Duration::from_secs(5);
        let ranks = Engine::new(&url, EngineKind::Vllm).expect("a URL").ranks(4).expect("ranks");
        let all = futures_util::future::join_all(ranks.iter().map(|r| r.healthy(timeout))).await;
        assert!(all.iter().all(|&h| h));
        assert_eq!(asked.load(Ordering::SeqCst), 1, "four ranks, one request");
        tokio::time::sleep(Polled::FRESH * 2).await;
        assert!(ranks[2].healthy(timeout).await);
        assert_eq!(asked.load(Ordering::SeqCst), 2, "a later poll asks again");
        let whole = Engine::new(&url, EngineKind::Vllm).expect("a URL");
        assert!(whole.healthy(timeout).await && whole.healthy(timeout).await);
        assert_eq!(asked.load(Ordering::SeqCst), 4, "a server followed whole is asked each time");
    }

    #[test]
    fn a_request_is_addressed_to_its_rank() {
        let ranks = |kind| Engine::new("http://h:1", kind).expect("ok").ranks(2).expect("ranks");
        let (vllm, sglang) = (ranks(EngineKind::Vllm), ranks(EngineKind::Sglang));
        let mut body = serde_json::json!({});
        assert_eq!(vllm[1].address_rank(&mut body), Some((RANK_HEADER, 1)));
        assert_eq!(body, serde_json::json!({}));
        assert_eq!(sglang[1].address_rank(&mut body), None);
        assert_eq!(body["data_parallel_rank"], 1);
        // A server of one engine is not addressed.
        let one = Engine::new("http://h:1", EngineKind::Vllm).expect("ok").ranks(1).expect("one");
        assert_eq!((one.len(), one[0].rank, one[0].name.as_str()), (1, None, "http://h:1"));
        assert_eq!(one[0].address_rank(&mut body), None);
    }
}
