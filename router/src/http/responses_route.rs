//! `POST /v1/responses`: the Responses API request run as the chat completion it is, and the answer (or error)
//! converted back ([`super::responses`] holds the conversions).

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::completions::fail;
use super::error::ApiError;
use super::openai::Endpoint;
use super::{BODY_LIMIT, CLIENT_REQUEST_ID, generate, responses};
use crate::state::RouterState;

/// OpenAI's Responses API, served as the chat completion it is ([`responses`]): the chat path's answer (or error,
/// its `param` renamed to this API's field) converted, whole or as this API's events.
pub async fn serve(state: Arc<RouterState>, headers: HeaderMap, body: Bytes) -> Response {
    const ROUTE: &str = "/v1/responses";
    let (chat, asked) = match responses::to_chat(&body) {
        Ok(c) => c,
        Err(e) => return fail(&state, ROUTE, e),
    };
    let stream = chat["stream"] == json!(true);
    let answer = generate(Arc::clone(&state), headers, Bytes::from(chat.to_string()), Endpoint::Chat).await;
    let (mut parts, body) = answer.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    if parts.status != StatusCode::OK || !stream {
        let Ok(bytes) = axum::body::to_bytes(body, BODY_LIMIT * 8).await else {
            return fail(&state, ROUTE, ApiError::Upstream("the answer could not be read".into()));
        };
        let mut v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if parts.status == StatusCode::OK {
            v = responses::from_chat(&v, &asked);
        } else if let Some(p) = v.pointer_mut("/error/param")
            && let Some(name) = p.as_str()
        {
            *p = json!(responses::param_of(name));
        }
        return (parts, axum::Json(v)).into_response();
    }
    events(body, asked, parts.headers)
}

/// The chat stream `body`'s chunks as the Responses API's events, each named by its type; the chat stream is
/// dropped (and its work cancelled) when the client leaves.
fn events(body: axum::body::Body, asked: responses::Asked, headers: HeaderMap) -> Response {
    use axum::response::sse::{Event, KeepAlive, Sse};
    use futures_util::StreamExt;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        let mut events = responses::stream::Events::new(asked);
        let mut chunks = body.into_data_stream();
        let mut buffer = String::new();
        let send = |e: Value| {
            let kind = e["type"].as_str().unwrap_or("message").to_string();
            tx.send(Ok(Event::default().event(kind).data(e.to_string())))
        };
        loop {
            // A client that leaves, even while the prompt computes, drops the chat stream and so its work.
            let bytes = tokio::select! {
                next = chunks.next() => match next {
                    Some(Ok(bytes)) => bytes,
                    _ => return,
                },
                _ = tx.closed() => return,
            };
            buffer.push_str(&String::from_utf8_lossy(&bytes));
            while let Some(end) = buffer.find("\n\n") {
                let event: String = buffer.drain(..end + 2).collect();
                for data in event.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim_start) {
                    let out = match data {
                        "[DONE]" => events.end(),
                        json => serde_json::from_str(json).map(|c| events.chunk(&c)).unwrap_or_default(),
                    };
                    for e in out {
                        if send(e).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
    });
    let mut response =
        Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response();
    for name in ["x-request-id", CLIENT_REQUEST_ID] {
        if let Some(v) = headers.get(name) {
            response.headers_mut().insert(name, v.clone());
        }
    }
    response
}
