//! Engine servers Tandem does not own (llama.cpp's `llama-server`), routed to next to its own workers. They serve
//! whole requests (prefill and decode together) over HTTP and publish no KV events, so the router predicts what
//! each holds from the prompts it sent there ([`predicted`]) and counts their load from what it sent and what
//! has finished, and checks their health by polling.

pub mod http;
pub mod llama_server;
pub mod predicted;
pub mod sse;

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

/// Generated tokens as a worker streams them, whatever carries them.
pub type TokenStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

/// Which server an external worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// llama.cpp's `llama-server` (its native `/completion` endpoint, which speaks token ids).
    LlamaServer,
}

impl EngineKind {
    pub fn parse(s: &str) -> Result<EngineKind, String> {
        match s {
            "llama-server" | "llama.cpp" => Ok(EngineKind::LlamaServer),
            other => Err(format!("unknown engine {other:?} (known: llama-server)")),
        }
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
}

/// Named defaults of [`ExternalSettings`].
pub mod defaults {
    use std::time::Duration;

    /// A server that died is out of the rotation within a second or two (requests to it fail over meanwhile).
    pub const HEALTH_PERIOD: Duration = Duration::from_secs(1);
    /// SGLang's gateway forgets predicted prefixes after 120 s; an idle engine keeps its cache longer, a busy one
    /// much shorter, which the capacity bounds.
    pub const PREDICTED_TTL: Duration = Duration::from_secs(120);
}

impl Default for ExternalSettings {
    fn default() -> ExternalSettings {
        ExternalSettings {
            health_period: defaults::HEALTH_PERIOD,
            predicted_ttl: defaults::PREDICTED_TTL,
            predicted_blocks: None,
        }
    }
}

/// An external worker's server.
#[derive(Debug)]
pub struct Engine {
    pub kind: EngineKind,
    /// As configured (`http://host:port`).
    pub url: String,
    authority: String,
}

impl Engine {
    /// `http://host:port` (a trailing `/` or `/v1` is ignored). Plain HTTP: the servers sit next to the router.
    pub fn new(url: &str, kind: EngineKind) -> Result<Engine, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| format!("{url:?}: only http:// URLs are supported"))?;
        let authority = rest.trim_end_matches('/').trim_end_matches("/v1");
        if authority.is_empty() || authority.contains('/') || !authority.contains(':') {
            return Err(format!("{url:?} is not http://host:port"));
        }
        Ok(Engine { kind, url: url.to_string(), authority: authority.to_string() })
    }

    /// `host:port`.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    async fn get_json(&self, path: &str, timeout: Duration) -> Result<Value, String> {
        let work = async {
            let req = hyper::Request::get(path);
            let (resp, _conn) = http::send(&self.authority, req, Bytes::new()).await?;
            let status = resp.status();
            let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
            if !status.is_success() {
                return Err(format!("GET {path}: HTTP {status}"));
            }
            serde_json::from_slice(&body).map_err(|e| format!("GET {path}: {e}"))
        };
        tokio::time::timeout(timeout, work).await.map_err(|_| format!("GET {path}: no answer within {timeout:?}"))?
    }

    /// Whether the server answers its health check now.
    pub async fn healthy(&self, timeout: Duration) -> bool {
        self.get_json(llama_server::HEALTH_PATH, timeout).await.is_ok()
    }

    /// Tokens of KV the server holds, as it says.
    pub async fn capacity_tokens(&self, timeout: Duration) -> Option<u64> {
        llama_server::capacity_tokens(&self.get_json(llama_server::PROPS_PATH, timeout).await.ok()?)
    }

    /// Starts generating after `tokens`; the stream carries the tokens and then how it finished. Dropping the
    /// stream closes the connection (the server stops).
    pub async fn generate(&self, tokens: &[u32], sampling: &pb::Sampling) -> Result<TokenStream, Status> {
        let body = llama_server::body(tokens, sampling).to_string();
        let req = hyper::Request::post(llama_server::GENERATE_PATH)
            .header("content-type", "application/json")
            .header("accept", "text/event-stream");
        let (resp, conn) = http::send(&self.authority, req, Bytes::from(body)).await.map_err(Status::unavailable)?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let message = format!("{}: HTTP {status}: {}", self.url, String::from_utf8_lossy(&text));
            // The server refused this request (too long, bad values): another server would too.
            return Err(if status.is_client_error() {
                Status::invalid_argument(message)
            } else {
                Status::unavailable(message)
            });
        }
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(forward(resp.into_body(), conn, tx));
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}

/// Moves the server's chunks to `tx` as generated tokens until the last one, an error, or `tx` closing.
async fn forward(
    mut body: hyper::body::Incoming,
    _conn: http::Connection,
    tx: mpsc::Sender<Result<pb::GenerateResponse, Status>>,
) {
    use pb::generate_response::Event;
    let token = |id| pb::GenerateResponse { event: Some(Event::Token(pb::Token { id, ..Default::default() })) };
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
            let (tokens, finished) = match llama_server::parse(&event) {
                Ok(llama_server::Chunk::Tokens(t)) => (t, None),
                Ok(llama_server::Chunk::Finished { tokens, reason, cached_tokens }) => {
                    (tokens, Some(pb::Finished { reason: reason as i32, cached_tokens, ..Default::default() }))
                }
                Err(e) => {
                    let _ = tx.send(Err(Status::internal(e))).await;
                    return;
                }
            };
            for id in tokens {
                if tx.send(Ok(token(id))).await.is_err() {
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

/// Follows one external worker until `stop`: up while its health check answers, down (its predicted blocks
/// dropped) while it does not; predicted blocks expire on the way.
pub async fn follow(
    cluster: Arc<Cluster>,
    id: WorkerId,
    addr: std::net::SocketAddr,
    engine: Arc<Engine>,
    settings: ExternalSettings,
    mut stop: watch::Receiver<bool>,
) {
    let timeout = settings.health_period.max(Duration::from_secs(1));
    loop {
        let healthy = engine.healthy(timeout).await;
        match (healthy, cluster.member(id).is_some_and(|m| m.up)) {
            (true, false) => {
                let capacity = engine.capacity_tokens(timeout).await;
                cluster.external_up(id, addr, &engine, capacity, &settings);
                tracing::info!(worker = %engine.url, "external worker joined");
            }
            (false, true) => {
                tracing::warn!(worker = %engine.url, "external worker stopped answering; dropping its predicted blocks");
                cluster.leave(id);
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
        assert!(EngineKind::parse("vllm").is_err());
    }
}
