//! The HTTP front end: OpenAI-compatible endpoints, health, metrics, the routing explainer and live config.

pub mod choices;
pub mod completions;
pub mod error;
pub mod fields;
pub mod harmony;
pub mod logprobs;
mod markers;
pub mod openai;
pub mod reasoning;
pub mod responses;
mod responses_route;
pub mod tools;

use std::sync::Arc;
use std::time::Instant;

use std::net::SocketAddr;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use engine::chat::ChatExtras;
use serde_json::{Value, json};
use tracing::Instrument;

use self::choices::{plan_all, streamed, whole};
use self::completions::{fail, plan, traceparent};
use self::error::ApiError;
use self::openai::{Checked, Endpoint, check_chat, check_completion};
use crate::state::RouterState;

type Shared = State<Arc<RouterState>>;
/// The client's address (admin endpoints answer only on loopback when no admin key is set).
type Peer = ConnectInfo<SocketAddr>;

/// Every route of the router.
pub fn app(state: Arc<RouterState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completion))
        .route("/v1/responses", post(responses_api))
        .route("/v1/responses/{id}", get(retrieve_response).delete(delete_response))
        .route("/v1/models", get(models))
        .route("/v1/models/{*model}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/debug/route", post(debug_route))
        .route("/admin/router-config", get(get_config).put(put_config))
        .route("/admin/recording", get(recording).post(start_recording).delete(stop_recording))
        .route("/admin/workers", get(list_workers).post(add_worker).delete(remove_worker))
        .fallback(|| async { ApiError::NotFound })
        .method_not_allowed_fallback(|method: axum::http::Method| async move {
            ApiError::MethodNotAllowed(method.to_string())
        })
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::map_response(openai_shaped))
        .with_state(state)
}

/// Largest request body taken (axum's default: a long conversation of text fits many times over).
pub const BODY_LIMIT: usize = 2 << 20;

/// Turns the plain-text refusals of the HTTP layer (a body over the limit) into OpenAI's error JSON, as every other
/// error is.
async fn openai_shaped(resp: Response) -> Response {
    let json = resp.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if resp.status() == StatusCode::PAYLOAD_TOO_LARGE && !json {
        return ApiError::BodyTooLarge(BODY_LIMIT).into_response();
    }
    resp
}

/// The bearer key a request carries. The scheme's name is case-insensitive (RFC 9110): `bearer` is `Bearer`.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim_start();
    let (scheme, key) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

/// Checks the client's bearer key when keys are configured.
fn authorize(state: &RouterState, headers: &HeaderMap) -> Result<(), ApiError> {
    tenant(state, headers).map(|_| ())
}

/// The tenant the client's bearer key names (`None`: no tenant), when the key is accepted.
pub(super) fn tenant(state: &RouterState, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    state.tenants.identify(bearer(headers)).map(|t| t.map(str::to_string)).map_err(|_| ApiError::Unauthorized)
}

/// Who may use `/admin/*` and `/debug/*`: the holder of the admin key when one is set (a client key is not
/// enough), and only loopback peers when none is.
fn authorize_admin(admin_key: Option<&str>, headers: &HeaderMap, peer: SocketAddr) -> Result<(), ApiError> {
    match admin_key {
        Some(key) => match bearer(headers) {
            Some(k) if crate::tenants::constant_time_eq(key.as_bytes(), k.as_bytes()) => Ok(()),
            _ => Err(ApiError::Unauthorized),
        },
        None if peer.ip().is_loopback() || peer.ip().to_canonical().is_loopback() => Ok(()),
        None => Err(ApiError::Forbidden(
            "the admin endpoints answer only on loopback unless the router has an admin key (--admin-key)",
        )),
    }
}

fn admin(state: &RouterState, headers: &HeaderMap, peer: &Peer) -> Result<(), ApiError> {
    authorize_admin(state.admin_key.as_deref(), headers, peer.0)
}

async fn chat(state: Shared, headers: HeaderMap, body: Bytes) -> Response {
    generate(state.0, headers, body, Route::CHAT).await
}

async fn completion(state: Shared, headers: HeaderMap, body: Bytes) -> Response {
    generate(state.0, headers, body, Route::COMPLETIONS).await
}

async fn responses_api(state: Shared, headers: HeaderMap, body: Bytes) -> Response {
    responses_route::serve(state.0, headers, body).await
}

async fn retrieve_response(state: Shared, headers: HeaderMap, Path(id): Path<String>) -> Response {
    responses_route::retrieve(&state, &headers, &id)
}

async fn delete_response(state: Shared, headers: HeaderMap, Path(id): Path<String>) -> Response {
    responses_route::delete(&state, &headers, &id)
}

/// A route that generates: the request's shape, its path (which names it in metrics and in its span) and its
/// OpenTelemetry operation.
#[derive(Clone, Copy, Debug)]
pub(super) struct Route {
    pub endpoint: Endpoint,
    pub path: &'static str,
    pub operation: &'static str,
}

impl Route {
    pub const CHAT: Route = Route { endpoint: Endpoint::Chat, path: "/v1/chat/completions", operation: "chat" };
    pub const COMPLETIONS: Route =
        Route { endpoint: Endpoint::Completion, path: "/v1/completions", operation: "text_completion" };
    /// A Responses request, run as the chat request it becomes.
    pub const RESPONSES: Route = Route { endpoint: Endpoint::Chat, path: "/v1/responses", operation: "chat" };
}

/// The request's server span, continuing the client's trace when it sent one.
fn request_span(route: Route, headers: &HeaderMap) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        otel.name = format!("POST {}", route.path),
        otel.kind = "server",
        gen_ai.operation.name = route.operation,
        request_id = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        gen_ai.request.model = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        gen_ai.response.finish_reasons = tracing::field::Empty,
        user = tracing::field::Empty,
        safety_identifier = tracing::field::Empty,
        client_request_id = tracing::field::Empty,
    );
    let client = traceparent(headers);
    telemetry::trace::set_parent(&span, client.as_deref());
    // Every log line of the request carries its trace id (the fmt layer prints the span's fields).
    if let Some(id) = telemetry::trace::trace_id(&span, client.as_deref()) {
        span.record("trace_id", id);
    }
    span
}

/// The `what` named `s` in `names`, or an error listing the known names.
pub(crate) fn by_name<T: Copy>(names: &[(&str, T)], s: &str, what: &str) -> Result<T, String> {
    names.iter().find(|(name, _)| *name == s).map(|&(_, v)| v).ok_or_else(|| {
        let known: Vec<&str> = names.iter().map(|(name, _)| *name).collect();
        format!("unknown {what} {s:?} (known: {})", known.join(", "))
    })
}

fn check(state: &RouterState, endpoint: Endpoint, body: &[u8]) -> Result<Checked, ApiError> {
    match endpoint {
        Endpoint::Chat => check_chat(
            body,
            openai::OutputParsers { tool_call: state.tool_call_parser, reasoning: state.reasoning_parser },
        ),
        Endpoint::Completion => check_completion(body),
    }
}

/// The id OpenAI's clients may send to find a request later (`X-Client-Request-Id`): echoed back and recorded on
/// the request's span.
pub(super) const CLIENT_REQUEST_ID: &str = "x-client-request-id";
/// OpenAI's limit on it.
const CLIENT_REQUEST_ID_MAX: usize = 512;

/// Every answer of a completion endpoint names its request, errors too, as OpenAI's do: `x-request-id` (the
/// response's `id`) and the client's own `x-client-request-id`, which is refused unless it is at most 512 ASCII
/// characters.
pub(super) async fn generate(state: Arc<RouterState>, headers: HeaderMap, body: Bytes, route: Route) -> Response {
    let span = request_span(route, &headers);
    let ident = completions::Ident::new(&state, route.endpoint);
    span.record("request_id", ident.id.as_str());
    let id = header::HeaderValue::from_str(&ident.id).ok();
    let client = headers.get(CLIENT_REQUEST_ID).cloned();
    let mut response = match &client {
        Some(c) if c.len() > CLIENT_REQUEST_ID_MAX || c.to_str().is_err() => {
            let message = format!("{CLIENT_REQUEST_ID} must be at most {CLIENT_REQUEST_ID_MAX} ASCII characters");
            fail(&state, route.path, ApiError::BadRequest { message, param: None })
        }
        _ => {
            if let Some(c) = client.as_ref().and_then(|c| c.to_str().ok()) {
                span.record("client_request_id", c);
            }
            run_request(state, headers, body, route, ident).instrument(span).await
        }
    };
    let h = response.headers_mut();
    if let Some(id) = id {
        h.insert("x-request-id", id);
    }
    if let Some(c) = client {
        h.insert(CLIENT_REQUEST_ID, c);
    }
    response
}

async fn run_request(
    state: Arc<RouterState>,
    headers: HeaderMap,
    body: Bytes,
    route: Route,
    ident: completions::Ident,
) -> Response {
    let arrived = Instant::now();
    let prepared = async {
        let tenant = tenant(&state, &headers)?;
        let mut checked = check(&state, route.endpoint, &body)?;
        checked.namespace = state.tenants.namespace(tenant.as_deref(), checked.namespace.as_deref());
        let span = tracing::Span::current();
        span.record("gen_ai.request.model", checked.model.as_str());
        if let Some(u) = &checked.user {
            span.record("user", u.as_str());
        }
        if let Some(s) = &checked.safety_identifier {
            span.record("safety_identifier", s.as_str());
        }
        let wait = state.limits.request_timeout.saturating_sub(arrived.elapsed());
        let permit = state.admission.admit(checked.priority, wait).await?;
        let stream = checked.stream;
        let planned = plan_all(&state, checked, ident, traceparent(&headers)).await?;
        tracing::Span::current().record("gen_ai.usage.input_tokens", choices::prompt_tokens(&planned));
        Ok::<_, ApiError>((permit, planned, stream))
    }
    .await;
    match prepared {
        Err(e) => fail(&state, route.path, e),
        Ok((permit, planned, true)) => streamed(state, planned, arrived, route.path, permit).await,
        Ok((permit, planned, false)) => {
            let response = whole(Arc::clone(&state), planned, arrived, route.path).await;
            drop(permit);
            response
        }
    }
}

async fn models(state: Shared, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&state, &headers) {
        return e.into_response();
    }
    axum::Json(json!({"object": "list", "data": [model_object(&state)]})).into_response()
}

/// `GET /v1/models/{model}`: OpenAI's retrieve call (`client.models.retrieve`), the served model or 404. The
/// rest of the path is the id: served names may have slashes (`org/model`).
async fn model(state: Shared, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(e) = authorize(&state, &headers) {
        return e.into_response();
    }
    if id != state.served_model {
        return ApiError::UnknownModel(id).into_response();
    }
    axum::Json(model_object(&state)).into_response()
}

fn model_object(state: &RouterState) -> Value {
    // `max_model_len` as vLLM reports it: load generators size their prompts by it.
    json!({"id": state.served_model, "object": "model", "created": 0, "owned_by": "tandem",
           "max_model_len": state.max_model_len})
}

/// `POST /tokenize` as vLLM serves it: a `prompt`, or `messages` through the chat template, to token ids.
async fn tokenize(state: Shared, headers: HeaderMap, body: Bytes) -> Response {
    let answer = async {
        authorize(&state, &headers)?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
        check_model(&state, &v)?;
        let flag = |name: &str| match v.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(ApiError::bad_field(format!("`{name}` is true or false"), name)),
        };
        // vLLM's fields; any other is refused by name, as on the completion endpoints.
        only_fields(
            &v,
            &[
                "model",
                "prompt",
                "messages",
                "add_special_tokens",
                "add_generation_prompt",
                "continue_final_message",
                "return_token_strs",
                "tools",
                "chat_template_kwargs",
            ],
        )?;
        let tokenizer = state.text.tokenizer();
        let (text, chat) = match (v.get("prompt"), v.get("messages")) {
            (Some(Value::String(p)), None) => (p.clone(), false),
            (None, Some(_)) => {
                // Rendered as a chat request with the same fields is.
                let (add, cont) = (flag("add_generation_prompt")?, flag("continue_final_message")?);
                let mut chat = json!({"model": state.served_model, "messages": v["messages"],
                    "add_generation_prompt": add, "continue_final_message": cont,
                    "chat_template_kwargs": v.get("chat_template_kwargs")});
                // Tools reach the template as a chat request's do (with no call forced, which changes nothing in
                // the prompt).
                if let Some(tools) = v.get("tools").filter(|t| !t.is_null()) {
                    chat["tools"] = tools.clone();
                    chat["tool_choice"] = json!("none");
                }
                let c = check_chat(
                    &serde_json::to_vec(&chat).map_err(|e| ApiError::MalformedJson(e.to_string()))?,
                    Default::default(),
                )?;
                let openai::Input::Chat(messages, ending, tools) = c.input else { unreachable!("a chat request") };
                let extras = ChatExtras { tools: &tools, arguments: c.template_arguments.as_ref() };
                let text = completions::render_chat(&state, &messages, extras, ending)?;
                (text, true)
            }
            _ => return Err(ApiError::bad("give either `prompt` (a string) or `messages`", "prompt")),
        };
        // As the request with the same fields would be tokenized.
        let tokens = tokenizer.encode_prompt(&text, chat, flag("add_special_tokens")?);
        let mut answer = json!({"count": tokens.len(), "max_model_len": state.max_model_len, "tokens": tokens});
        if flag("return_token_strs")? == Some(true) {
            let strs: Vec<&str> = tokens.iter().map(|&t| tokenizer.token_text(t).unwrap_or("")).collect();
            answer["token_strs"] = json!(strs);
        }
        Ok(answer)
    };
    match answer.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize` as vLLM serves it: token ids to text.
async fn detokenize(state: Shared, headers: HeaderMap, body: Bytes) -> Response {
    let answer = async {
        authorize(&state, &headers)?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
        check_model(&state, &v)?;
        only_fields(&v, &["model", "tokens"])?;
        let ids: Vec<u32> = v
            .get("tokens")
            .and_then(|t| serde_json::from_value(t.clone()).ok())
            .ok_or_else(|| ApiError::bad("`tokens` must be a list of token ids", "tokens"))?;
        completions::in_vocabulary(&state, &ids, "tokens")?;
        Ok::<_, ApiError>(json!({"prompt": state.text.tokenizer().decode(&ids)}))
    };
    match answer.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A tokenizer endpoint's body has only vLLM's fields for it: any other is refused by name, as on the completion
/// endpoints.
fn only_fields(v: &Value, known: &[&str]) -> Result<(), ApiError> {
    match v.as_object().into_iter().flat_map(|o| o.keys()).find(|k| !known.contains(&k.as_str())) {
        Some(name) => Err(fields::unknown_field(name)),
        None => Ok(()),
    }
}

/// A `model` field, when given, must name the served model.
fn check_model(state: &RouterState, v: &Value) -> Result<(), ApiError> {
    match v.get("model").and_then(Value::as_str) {
        Some(m) if m != state.served_model => Err(ApiError::UnknownModel(m.to_string())),
        _ => Ok(()),
    }
}

/// Ready when at least one worker can decode and the index knows what every followed worker holds (its first
/// snapshot is applied), or the ready timeout has passed: a router that routes before it knows where prefixes live
/// sends them to cold workers.
async fn ready(state: Shared) -> Response {
    let up = state.cluster.up_members();
    let decoders = up.iter().filter(|(_, m)| m.role.decodes()).count();
    let (synced, waiting) = state.cluster.synced(Instant::now());
    let waiting: Vec<String> = waiting.iter().map(ToString::to_string).collect();
    let body = json!({"workers_up": up.len(), "decode_workers_up": decoders, "index_synced": synced,
                      "waiting_for_snapshots": waiting});
    let status = if decoders > 0 && synced { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(body)).into_response()
}

async fn metrics(state: Shared) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], crate::metrics::render(&state)).into_response()
}

/// The decision for a chat or completion body, without running it.
async fn debug_route(state: Shared, peer: Peer, headers: HeaderMap, body: Bytes) -> Response {
    let explained = async {
        admin(&state, &headers, &peer)?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
        let endpoint = if v.get("messages").is_some() { Endpoint::Chat } else { Endpoint::Completion };
        let ident = completions::Ident::new(&state, endpoint);
        let routed = plan(&state, check(&state, endpoint, &body)?, ident, None, false).await?;
        serde_json::to_value(&routed.decision).map_err(|e| ApiError::Upstream(e.to_string()))
    }
    .await;
    match explained {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn get_config(state: Shared, peer: Peer, headers: HeaderMap) -> Response {
    match admin(&state, &headers, &peer) {
        Ok(()) => axum::Json(state.scheduler_config()).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Whether the traffic is being recorded, where, and how many requests so far.
fn recording_json(r: Option<&crate::record::Recording>) -> Value {
    match r {
        Some(r) => json!({"recording": true, "file": r.path().display().to_string(), "requests": r.requests()}),
        None => json!({"recording": false}),
    }
}

async fn recording(state: Shared, peer: Peer, headers: HeaderMap) -> Response {
    if let Err(e) = admin(&state, &headers, &peer) {
        return e.into_response();
    }
    let guard = state.recording.lock().unwrap_or_else(|p| p.into_inner());
    axum::Json(recording_json(guard.as_ref())).into_response()
}

/// Starts recording the traffic to a new file on the router's machine: `{"file": "/path/traffic.jsonl"}`, with
/// `"candidates": true` for each decision's candidates as scored.
async fn start_recording(state: Shared, peer: Peer, headers: HeaderMap, body: Bytes) -> Response {
    let started = (|| {
        admin(&state, &headers, &peer)?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
        let file = v.get("file").and_then(Value::as_str).filter(|f| !f.is_empty());
        let file = file.ok_or_else(|| ApiError::bad("name the new file to record to: {\"file\": \"...\"}", "file"))?;
        let candidates = match v.get("candidates") {
            None | Some(Value::Null) => false,
            Some(c) => c.as_bool().ok_or_else(|| ApiError::bad("\"candidates\" is true or false", "candidates"))?,
        };
        let mut guard = state.recording.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = guard.as_ref() {
            let why = format!("already recording to {}; DELETE /admin/recording first", r.path().display());
            return Err(ApiError::bad(why, "file"));
        }
        let block_size = state.cluster.model().block_size;
        let r = crate::record::Recording::start(std::path::Path::new(file), block_size, candidates)
            .map_err(|e| ApiError::bad(e.to_string(), "file"))?;
        tracing::info!(file, "traffic recording started");
        let answer = recording_json(Some(&r));
        *guard = Some(r);
        Ok(answer)
    })();
    match started {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Stops the recording; answers with what it wrote.
async fn stop_recording(state: Shared, peer: Peer, headers: HeaderMap) -> Response {
    if let Err(e) = admin(&state, &headers, &peer) {
        return e.into_response();
    }
    let stopped = state.recording.lock().unwrap_or_else(|p| p.into_inner()).take();
    let mut v = recording_json(stopped.as_ref());
    if let (Some(r), Value::Object(m)) = (&stopped, &mut v) {
        tracing::info!(file = %r.path().display(), requests = r.requests(), "traffic recording stopped");
        m.insert("recording".into(), json!(false));
        m.insert("stopped".into(), json!(true));
    }
    axum::Json(v).into_response()
}

/// Changes the scheduler's weights live: the body names the fields to change; the result is validated whole.
async fn put_config(state: Shared, peer: Peer, headers: HeaderMap, body: Bytes) -> Response {
    let updated = (|| {
        admin(&state, &headers, &peer)?;
        let patch: Value = serde_json::from_slice(&body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
        let Value::Object(fields) = patch else {
            return Err(ApiError::bad("the body must be a JSON object of fields to change", "body"));
        };
        let next = state.scheduler_config().patched(fields).map_err(|e| ApiError::bad(e, "body"))?;
        state.set_scheduler_config(next.clone());
        tracing::info!(policy = next.policy.as_str(), "router config changed");
        Ok(next)
    })();
    match updated {
        Ok(c) => axum::Json(c).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Whether `addr` can be a worker's gRPC address: a unicast host and a real port.
fn routable(addr: SocketAddr) -> Result<SocketAddr, &'static str> {
    let ip = addr.ip().to_canonical();
    if addr.port() == 0 {
        return Err("port 0 is not a worker's port");
    }
    if ip.is_unspecified() || ip.is_multicast() || ip == std::net::IpAddr::from([255, 255, 255, 255]) {
        return Err("not a unicast address");
    }
    Ok(addr)
}

/// The worker address in a `{"address": "host:port"}` body, resolved and checked.
async fn worker_address(body: &[u8]) -> Result<SocketAddr, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
    let addr = v["address"].as_str().ok_or_else(|| ApiError::bad("`address` (host:port) is required", "address"))?;
    if addr.len() > 255 {
        return Err(ApiError::bad("the worker address is too long", "address"));
    }
    let resolved = tokio::net::lookup_host(addr)
        .await
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| ApiError::bad(format!("cannot resolve worker address {addr:?}"), "address"))?;
    routable(resolved).map_err(|why| ApiError::bad(format!("worker address {addr:?}: {why}"), "address"))
}

async fn list_workers(state: Shared, peer: Peer, headers: HeaderMap) -> Response {
    if let Err(e) = admin(&state, &headers, &peer) {
        return e.into_response();
    }
    let up: std::collections::HashMap<std::net::SocketAddr, String> =
        state.cluster.up_members().into_iter().map(|(_, m)| (m.addr, format!("{:?}", m.role).to_lowercase())).collect();
    let mut followed = state.cluster.followed();
    followed.sort();
    let list: Vec<Value> = followed
        .iter()
        .map(|a| json!({"address": a.to_string(), "up": up.contains_key(a), "role": up.get(a)}))
        .collect();
    axum::Json(json!({"workers": list})).into_response()
}

/// A worker registers itself (or an operator adds one); idempotent.
async fn add_worker(state: Shared, peer: Peer, headers: HeaderMap, body: Bytes) -> Response {
    let added = async {
        admin(&state, &headers, &peer)?;
        let addr = worker_address(&body).await?;
        state
            .cluster
            .follow(addr, crate::cluster::Origin::Registered, None)
            .map_err(|e| ApiError::bad(e.to_string(), "address"))?;
        Ok::<_, ApiError>(addr)
    }
    .await;
    match added {
        Ok(addr) => (StatusCode::ACCEPTED, axum::Json(json!({"address": addr.to_string()}))).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A worker leaves (graceful shutdown) or an operator removes it.
async fn remove_worker(state: Shared, peer: Peer, headers: HeaderMap, body: Bytes) -> Response {
    let removed = async {
        admin(&state, &headers, &peer)?;
        let addr = worker_address(&body).await?;
        if state.cluster.unfollow(addr) { Ok(()) } else { Err(ApiError::NotFound) }
    }
    .await;
    match removed {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_key(k: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, format!("Bearer {k}").parse().expect("header"));
        h
    }

    #[test]
    fn the_bearer_scheme_is_read_in_any_case() {
        let with = |v: &str| HeaderMap::from_iter([(header::AUTHORIZATION, v.parse().expect("header"))]);
        for v in ["Bearer sk-a", "bearer sk-a", "BEARER  sk-a ", " Bearer sk-a"] {
            assert_eq!(bearer(&with(v)), Some("sk-a"), "{v:?}");
        }
        for v in ["Basic sk-a", "Bearersk-a", "sk-a", "Bearer"] {
            assert_eq!(bearer(&with(v)), None, "{v:?}");
        }
        assert_eq!(bearer(&HeaderMap::new()), None);
    }

    #[test]
    fn admin_needs_the_admin_key_or_loopback() {
        let (local, remote): (SocketAddr, SocketAddr) = (([127, 0, 0, 1], 5000).into(), ([10, 0, 0, 7], 5000).into());
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:5000".parse().expect("addr");
        // No admin key: loopback only (also as an IPv4-mapped IPv6 peer).
        assert_eq!(authorize_admin(None, &HeaderMap::new(), local).map_err(|e| e.kind()), Ok(()));
        assert_eq!(authorize_admin(None, &HeaderMap::new(), mapped).map_err(|e| e.kind()), Ok(()));
        assert_eq!(authorize_admin(None, &with_key("x"), remote).map_err(|e| e.kind()), Err("forbidden"));
        // An admin key: required from everywhere, loopback included; nothing else will do.
        assert_eq!(authorize_admin(Some("adm"), &with_key("adm"), remote).map_err(|e| e.kind()), Ok(()));
        for h in [HeaderMap::new(), with_key("client-key"), with_key("adm2")] {
            assert_eq!(authorize_admin(Some("adm"), &h, local).map_err(|e| e.kind()), Err("unauthorized"));
        }
    }

    #[test]
    fn only_unicast_addresses_with_a_port_can_be_workers() {
        for bad in
            ["0.0.0.0:9000", "10.0.0.1:0", "224.0.0.1:9000", "255.255.255.255:9000", "[::]:9000", "[ff02::1]:9000"]
        {
            assert!(routable(bad.parse().expect("addr")).is_err(), "{bad}");
        }
        for good in ["10.0.0.1:9000", "127.0.0.1:9000", "[fd00::1]:9000"] {
            assert!(routable(good.parse().expect("addr")).is_ok(), "{good}");
        }
    }
}
