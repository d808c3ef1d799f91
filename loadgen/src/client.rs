//! One streamed request to an OpenAI-compatible endpoint over HTTP/1.1, timed from the client's side: when it
//! was sent, when each content chunk arrived, what the server reported in `usage`, and how it ended.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
pub use hyper::Method;
use router::external::http::Connection;
pub use router::external::sse::SseParser;

/// Which API a request goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions` with the prompt as text: exact prompt lengths.
    Completions,
    /// `/v1/chat/completions` with the prompt as one user message (the chat template adds its tokens).
    Chat,
}

/// Where requests go.
#[derive(Clone, Debug)]
pub struct Target {
    /// `host:port`.
    pub authority: String,
    /// Path prefix before `/v1/...` (empty for most servers).
    pub base_path: String,
    pub model: String,
    pub api_key: Option<String>,
    pub endpoint: Endpoint,
    pub timeout: Duration,
}

impl Target {
    /// Parses `http://host:port[/prefix]`. Only plain HTTP: put a TLS-terminating proxy in front for HTTPS.
    pub fn parse_url(url: &str) -> Result<(String, String), String> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("{url:?}: only http:// URLs are supported (use a local proxy for https)"))?;
        let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
        if authority.is_empty() {
            return Err(format!("{url:?} names no host"));
        }
        let authority = if authority.contains(':') { authority.to_string() } else { format!("{authority}:80") };
        let base = path.trim_end_matches('/');
        let base = base.strip_suffix("v1").unwrap_or(base).trim_end_matches('/');
        Ok((authority, if base.is_empty() { String::new() } else { format!("/{base}") }))
    }

    fn path(&self) -> String {
        let tail = match self.endpoint {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        };
        format!("{}{tail}", self.base_path)
    }
}

/// What one request asks for.
#[derive(Clone, Debug)]
pub struct Ask {
    pub prompt: String,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub seed: u64,
    /// vLLM's request priority; 0 sends none.
    pub priority: i32,
}

/// How one request went.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    /// HTTP status; 0 when no response came (connection refused, reset, timed out).
    pub status: u16,
    pub error: Option<String>,
    /// Milliseconds after sending at which each content chunk arrived.
    pub chunk_ms: Vec<f64>,
    /// When the response ended, in milliseconds after sending.
    pub end_ms: f64,
    /// From `usage`, when the server sent it.
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub finish_reason: Option<String>,
}

impl Outcome {
    /// A request that got its stream to the end without an error.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none()
    }
}

/// The request body.
pub fn body(target: &Target, ask: &Ask) -> serde_json::Value {
    let mut b = serde_json::json!({
        "model": target.model,
        "max_tokens": ask.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "seed": ask.seed,
    });
    match target.endpoint {
        Endpoint::Completions => b["prompt"] = ask.prompt.clone().into(),
        Endpoint::Chat => b["messages"] = serde_json::json!([{"role": "user", "content": ask.prompt}]),
    }
    if ask.ignore_eos {
        // vLLM's and Tandem's extension; servers without it generate until end of text or max_tokens.
        b["ignore_eos"] = true.into();
    }
    if ask.priority != 0 {
        // vLLM's and Tandem's too (vLLM takes it when started with `--scheduling-policy priority`).
        b["priority"] = ask.priority.into();
    }
    b
}

/// Sends one request and reads its stream to the end (or until `target.timeout`).
pub async fn send(target: &Target, ask: &Ask) -> Outcome {
    let started = Instant::now();
    let mut out = Outcome::default();
    let result = tokio::time::timeout(target.timeout, exchange(target, ask, started, &mut out)).await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => out.error = Some(e),
        Err(_) => out.error = Some(format!("no complete answer within {:?}", target.timeout)),
    }
    out.end_ms = started.elapsed().as_secs_f64() * 1000.0;
    out
}

/// Sends one request on a connection of its own (with the target's key); the response's body can be read while
/// the returned connection lives.
async fn send_request(
    target: &Target,
    request: hyper::http::request::Builder,
    body: Bytes,
) -> Result<(hyper::Response<hyper::body::Incoming>, Connection), String> {
    let mut request = request;
    if let Some(k) = &target.api_key {
        request = request.header("authorization", format!("Bearer {k}"));
    }
    router::external::http::send(&target.authority, request, body).await
}

/// A plain GET of `path` on the target (its `/metrics`, `/v1/models`), as text.
pub async fn get(target: &Target, path: &str) -> Result<String, String> {
    call(target, Method::GET, path, None).await
}

/// One non-streamed call: `method` on `path` with an optional JSON body; the response body as text when the
/// status is a success, else the status and the start of the body as the error.
pub async fn call(
    target: &Target,
    method: Method,
    path: &str,
    json: Option<&serde_json::Value>,
) -> Result<String, String> {
    let what = format!("{method} {path}");
    let work = async {
        let mut request = hyper::Request::builder().method(method).uri(path);
        let body = match json {
            Some(v) => {
                request = request.header("content-type", "application/json");
                Bytes::from(v.to_string())
            }
            None => Bytes::new(),
        };
        let (resp, _connection) = send_request(target, request, body).await.map_err(|e| format!("{what}: {e}"))?;
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|e| format!("{what}: {e}"))?.to_bytes();
        let text = String::from_utf8_lossy(&body).into_owned();
        if !status.is_success() {
            return Err(format!("{what}: HTTP {status}: {}", text.chars().take(300).collect::<String>()));
        }
        Ok(text)
    };
    tokio::time::timeout(Duration::from_secs(10), work).await.map_err(|_| format!("{what}: timed out"))?
}

async fn exchange(target: &Target, ask: &Ask, started: Instant, out: &mut Outcome) -> Result<(), String> {
    let request = hyper::Request::post(target.path())
        .header("content-type", "application/json")
        .header("accept", "text/event-stream");
    let (resp, _connection) = send_request(target, request, Bytes::from(body(target, ask).to_string())).await?;
    out.status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut parser = SseParser::default();
    let mut text = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("reading the stream: {e}"))?;
        let Some(data) = frame.data_ref() else { continue };
        let at = started.elapsed().as_secs_f64() * 1000.0;
        if out.status != 200 {
            text.extend_from_slice(data);
            continue;
        }
        for event in parser.push(data) {
            apply(&event, at, out)?;
        }
    }
    if out.status != 200 {
        let body = String::from_utf8_lossy(&text);
        return Err(format!("HTTP {}: {}", out.status, body.chars().take(300).collect::<String>()));
    }
    if !parser.done {
        return Err("the stream ended without [DONE]".into());
    }
    Ok(())
}

/// Applies one server-sent event's data to the outcome.
fn apply(data: &str, at: f64, out: &mut Outcome) -> Result<(), String> {
    if data == "[DONE]" {
        return Ok(());
    }
    let v: serde_json::Value = serde_json::from_str(data).map_err(|e| format!("a stream chunk is not JSON: {e}"))?;
    if let Some(err) = v.get("error") {
        return Err(format!("error in stream: {err}"));
    }
    if let Some(choice) = v["choices"].as_array().and_then(|c| c.first()) {
        let content = choice["text"].as_str().or_else(|| choice["delta"]["content"].as_str()).unwrap_or("");
        if !content.is_empty() {
            out.chunk_ms.push(at);
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            out.finish_reason = Some(f.to_string());
        }
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        out.prompt_tokens = u["prompt_tokens"].as_u64();
        out.completion_tokens = u["completion_tokens"].as_u64();
        out.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_to_authority_and_base() {
        assert_eq!(Target::parse_url("http://127.0.0.1:8000").expect("ok"), ("127.0.0.1:8000".into(), String::new()));
        assert_eq!(Target::parse_url("http://h:1/v1/").expect("ok"), ("h:1".into(), String::new()));
        assert_eq!(Target::parse_url("http://h/x/v1").expect("ok"), ("h:80".into(), "/x".into()));
        assert!(Target::parse_url("https://h:1").is_err());
        assert!(Target::parse_url("http:///v1").is_err());
    }

    #[test]
    fn a_priority_is_sent_when_not_0() {
        let target = Target {
            authority: "127.0.0.1:8000".into(),
            base_path: String::new(),
            model: "m".into(),
            api_key: None,
            endpoint: Endpoint::Completions,
            timeout: Duration::from_secs(1),
        };
        let ask = Ask { prompt: "x".into(), max_tokens: 2, ignore_eos: false, seed: 1, priority: 0 };
        assert_eq!(body(&target, &ask).get("priority"), None);
        assert_eq!(body(&target, &Ask { priority: -1, ..ask })["priority"], -1);
    }

    #[test]
    fn chunks_and_usage_are_read() {
        let mut o = Outcome::default();
        apply(r#"{"choices":[{"text":" a","finish_reason":null}]}"#, 5.0, &mut o).expect("ok");
        apply(r#"{"choices":[{"delta":{"content":""}}]}"#, 6.0, &mut o).expect("ok");
        apply(r#"{"choices":[{"delta":{"content":" b"},"finish_reason":"length"}]}"#, 7.0, &mut o).expect("ok");
        apply(
            r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}"#,
            8.0,
            &mut o,
        )
        .expect("ok");
        assert_eq!(o.chunk_ms, [5.0, 7.0]);
        assert_eq!((o.prompt_tokens, o.completion_tokens, o.cached_tokens), (Some(9), Some(2), Some(4)));
        assert_eq!(o.finish_reason.as_deref(), Some("length"));
        assert!(apply(r#"{"error":{"message":"x"}}"#, 9.0, &mut o).is_err());
    }
}
