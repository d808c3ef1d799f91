//! `POST /v1/responses`: the Responses API request run as the chat completion it is, and the answer (or error)
//! converted back ([`super::responses`] holds the conversions).

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::completions::fail;
use super::error::ApiError;
use super::{BODY_LIMIT, CLIENT_REQUEST_ID, Route, generate, responses};
use crate::response_store::Stored;
use crate::state::RouterState;

/// How the Responses API's requests are named in metrics and traces.
const ROUTE: Route = Route::RESPONSES;

/// OpenAI's Responses API, served as the chat completion it is ([`responses`]): the chat path's answer (or error,
/// its `param` renamed to this API's field) converted, whole or as this API's events.
pub async fn serve(state: Arc<RouterState>, headers: HeaderMap, body: Bytes) -> Response {
    let prepared = (|| {
        let tenant = super::tenant(&state, &headers)?;
        let (mut chat, mut asked) = responses::to_chat(&body)?;
        if !state.responses.keeps() {
            if asked.store && asked.store_sent {
                let why = "this router keeps no responses (responses_store_mb = 0): send store: false";
                return Err(ApiError::bad(why, "store"));
            }
            asked.store = false;
        }
        if let Some(id) = &asked.previous {
            let not_found = || ApiError::UnknownResponse { id: id.clone(), param: Some("previous_response_id") };
            let prior = state.responses.get(id, tenant.as_deref()).ok_or_else(not_found)?;
            responses::continue_from(&mut chat, &asked, &prior.conversation);
        }
        Ok::<_, ApiError>((chat, asked, tenant))
    })();
    let (chat, asked, tenant) = match prepared {
        Ok(p) => p,
        Err(e) => return fail(&state, ROUTE.path, e),
    };
    // What a stored response keeps: its conversation, to which its answer is added.
    let keep = asked.store.then(|| Keep {
        state: Arc::clone(&state),
        tenant,
        conversation: responses::conversation_of(&chat, &asked),
    });
    let stream = chat["stream"] == json!(true);
    let answer = generate(Arc::clone(&state), headers, Bytes::from(chat.to_string()), ROUTE).await;
    let (mut parts, body) = answer.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    if parts.status != StatusCode::OK || !stream {
        let Ok(bytes) = axum::body::to_bytes(body, BODY_LIMIT * 8).await else {
            return fail(&state, ROUTE.path, ApiError::Upstream("the answer could not be read".into()));
        };
        let mut v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if parts.status == StatusCode::OK {
            v = responses::from_chat(&v, &asked);
            if let Some(keep) = keep {
                keep.store(&v);
            }
        } else if let Some(p) = v.pointer_mut("/error/param")
            && let Some(name) = p.as_str()
        {
            *p = json!(responses::param_of(name));
        }
        return (parts, axum::Json(v)).into_response();
    }
    events(body, asked, keep, parts.headers)
}

/// Where a finished response is kept.
struct Keep {
    state: Arc<RouterState>,
    tenant: Option<String>,
    conversation: Vec<Value>,
}

impl Keep {
    /// Keeps `response` with the conversation it ends.
    fn store(mut self, response: &Value) {
        let (Some(id), Some(output)) = (response["id"].as_str(), response["output"].as_array()) else { return };
        self.conversation.push(responses::assistant_turn(output));
        let stored = Stored { conversation: Arc::new(self.conversation), response: Arc::new(response.clone()) };
        self.state.responses.put(id, self.tenant.as_deref(), stored);
    }
}

/// `GET /v1/responses/{id}`: a stored response, to the tenant that made it.
pub fn retrieve(state: &RouterState, headers: &HeaderMap, id: &str) -> Response {
    let found = super::tenant(state, headers).and_then(|tenant| {
        let not_found = || ApiError::UnknownResponse { id: id.to_string(), param: None };
        state.responses.get(id, tenant.as_deref()).ok_or_else(not_found)
    });
    match found {
        Ok(stored) => axum::Json(stored.response.as_ref().clone()).into_response(),
        Err(e) => fail(state, "/v1/responses/{id}", e),
    }
}

/// `DELETE /v1/responses/{id}`: forgets a stored response.
pub fn delete(state: &RouterState, headers: &HeaderMap, id: &str) -> Response {
    let deleted = super::tenant(state, headers).and_then(|tenant| {
        let gone = state.responses.delete(id, tenant.as_deref());
        if gone { Ok(()) } else { Err(ApiError::UnknownResponse { id: id.to_string(), param: None }) }
    });
    match deleted {
        Ok(()) => axum::Json(json!({"id": id, "object": "response", "deleted": true})).into_response(),
        Err(e) => fail(state, "/v1/responses/{id}", e),
    }
}

/// The chat stream `body`'s chunks as the Responses API's events, each named by its type; the chat stream is
/// dropped (and its work cancelled) when the client leaves.
fn events(body: axum::body::Body, asked: responses::Asked, keep: Option<Keep>, headers: HeaderMap) -> Response {
    use axum::response::sse::{Event, KeepAlive, Sse};
    use futures_util::StreamExt;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        let mut keep = keep;
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
                        "[DONE]" => {
                            let last = events.end();
                            // Kept once whole, before the client hears it is.
                            if let (Some(keep), Some(e)) = (keep.take(), last.last()) {
                                keep.store(&e["response"]);
                            }
                            last
                        }
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
