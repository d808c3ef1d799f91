//! Every error a client can see, mapped once to an HTTP status and OpenAI's error JSON.

use std::borrow::Cow;
use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Why a request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest { message: String, param: Option<Cow<'static, str>> },
    #[error("the request body is not valid JSON for this endpoint: {0}")]
    MalformedJson(String),
    #[error("missing or invalid API key; send it as `Authorization: Bearer <key>`")]
    Unauthorized,
    #[error("{0}")]
    Forbidden(&'static str),
    #[error("the model `{0}` does not exist; GET /v1/models lists the served model")]
    UnknownModel(String),
    #[error(
        "the prompt has {prompt} tokens; with max_tokens {max_tokens} this exceeds the model's context of {context} tokens"
    )]
    TooLong { prompt: usize, max_tokens: u32, context: usize, param: &'static str },
    #[error("the router is at capacity; retry after {}s", .0.as_secs())]
    Overloaded(Duration),
    #[error("no worker can take the request now: {0}")]
    Unavailable(String),
    #[error("the request did not finish within its deadline of {}s", .0.as_secs())]
    Deadline(Duration),
    #[error("the request failed on the workers: {0}")]
    Upstream(String),
    #[error("not found")]
    NotFound,
    #[error(
        "no stored response `{id}` (responses are kept in this router's memory for their tenant, the oldest dropped \
         first; send the conversation whole as input items instead)"
    )]
    UnknownResponse { id: String, param: Option<&'static str> },
    #[error("this endpoint does not take {0} requests")]
    MethodNotAllowed(String),
    #[error("the request body is over the limit of {0} bytes")]
    BodyTooLarge(usize),
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
        ApiError::BadRequest { message: message.into(), param: Some(Cow::Borrowed(param)) }
    }

    /// A refused field whose name comes from the request.
    pub fn bad_field(message: impl Into<String>, field: &str) -> ApiError {
        ApiError::BadRequest { message: message.into(), param: Some(Cow::Owned(field.to_string())) }
    }

    /// A short stable name for metrics and logs (never the message).
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::BadRequest { .. } => "bad_request",
            ApiError::MalformedJson(_) => "malformed_json",
            ApiError::Unauthorized => "unauthorized",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::UnknownModel(_) => "unknown_model",
            ApiError::TooLong { .. } => "too_long",
            ApiError::Overloaded(_) => "overloaded",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::Deadline(_) => "deadline",
            ApiError::Upstream(_) => "upstream",
            ApiError::NotFound => "not_found",
            ApiError::UnknownResponse { .. } => "unknown_response",
            ApiError::MethodNotAllowed(_) => "method_not_allowed",
            ApiError::BodyTooLarge(_) => "body_too_large",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } | ApiError::MalformedJson(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::UnknownModel(_) | ApiError::NotFound | ApiError::UnknownResponse { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            // A bad request, as OpenAI and vLLM answer it: clients catch it as one and read the code.
            ApiError::TooLong { .. } => StatusCode::BAD_REQUEST,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Deadline(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Upstream(_) => StatusCode::BAD_GATEWAY,
        }
    }

    /// OpenAI's error object.
    pub fn body(&self) -> serde_json::Value {
        let (ty, code, param) = match self {
            ApiError::BadRequest { param, .. } => ("invalid_request_error", None, param.as_deref()),
            ApiError::MalformedJson(_) => ("invalid_request_error", None, None),
            ApiError::Unauthorized => ("invalid_request_error", Some("invalid_api_key"), None),
            ApiError::Forbidden(_) => ("permission_error", None, None),
            ApiError::UnknownModel(_) => ("invalid_request_error", Some("model_not_found"), Some("model")),
            ApiError::TooLong { param, .. } => ("invalid_request_error", Some("context_length_exceeded"), Some(*param)),
            ApiError::Overloaded(_) => ("rate_limit_error", Some("rate_limit_exceeded"), None),
            ApiError::Unavailable(_) | ApiError::Upstream(_) => ("server_error", None, None),
            ApiError::Deadline(_) => ("server_error", Some("timeout"), None),
            ApiError::NotFound | ApiError::MethodNotAllowed(_) => ("invalid_request_error", None, None),
            ApiError::UnknownResponse { param, .. } => ("invalid_request_error", Some("response_not_found"), *param),
            ApiError::BodyTooLarge(_) => ("invalid_request_error", Some("request_too_large"), None),
        };
        json!({"error": {"message": self.to_string(), "type": ty, "param": param, "code": code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        if let ApiError::Overloaded(after) = &self
            && let Ok(v) = HeaderValue::from_str(&after.as_secs().max(1).to_string())
        {
            resp.headers_mut().insert(header::RETRY_AFTER, v);
        }
        resp
    }
}
