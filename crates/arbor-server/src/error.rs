//! The one error type of the HTTP API. Every failure becomes
//! `{"error": {"code", "message", ...}}` with the status of DESIGN.md §4;
//! details of server faults are logged, never sent.

use arbor_engine::EngineError;
use axum::extract::rejection::{BytesRejection, JsonRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::extract::Json;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: String,
    pub message: String,
    /// Fields beside `code` and `message` (`turn_id`, `retry_after`, …).
    pub extra: Map<String, Value>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError { status, code: code.into(), message: message.into(), extra: Map::new() }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    pub fn unauthorized() -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or invalid API key: send the header `Authorization: Bearer <key>`",
        )
    }

    pub fn with(mut self, key: &str, value: impl Into<Value>) -> ApiError {
        self.extra.insert(key.to_string(), value.into());
        self
    }

    pub fn status_code(&self) -> StatusCode {
        self.status
    }
}

impl From<EngineError> for ApiError {
    fn from(error: EngineError) -> ApiError {
        let message = error.to_string();
        match error {
            EngineError::NotFound(_) => ApiError::new(StatusCode::NOT_FOUND, "not_found", message),
            EngineError::InvalidInput(_) => ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message),
            EngineError::UnknownModel(model) => {
                ApiError::new(StatusCode::BAD_REQUEST, "unknown_model", message).with("model", model)
            }
            EngineError::ModelUnavailable(_) => ApiError::new(StatusCode::BAD_REQUEST, "model_unavailable", message),
            EngineError::TurnRunning { turn_id } => {
                ApiError::new(StatusCode::CONFLICT, "turn_running", message).with("turn_id", turn_id)
            }
            EngineError::Conflict(_) => ApiError::new(StatusCode::CONFLICT, "conflict", message),
            EngineError::HeadVersionMismatch { current } => {
                ApiError::new(StatusCode::CONFLICT, "head_version_mismatch", message).with("head_version", current)
            }
            EngineError::QuotaExceeded => ApiError::new(StatusCode::PAYMENT_REQUIRED, "quota_exceeded", message),
            EngineError::ShuttingDown => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", message),
            EngineError::Store(_) | EngineError::Internal(_) => {
                tracing::error!(error = %message, "request failed on a server fault");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "the server failed to handle this request; it has been logged",
                )
            }
        }
    }
}

impl ApiError {
    /// A body not sent as JSON.
    pub(crate) fn not_json() -> ApiError {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the body as JSON with `content-type: application/json`",
        )
    }

    /// A body that is not the JSON the route takes, `problem` naming why.
    fn invalid_json(problem: String) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", problem)
    }

    fn too_large() -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            "the request body is larger than this server accepts",
        )
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> ApiError {
        match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::too_large(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::not_json(),
            // Broken syntax and well-formed JSON of the wrong shape (a
            // missing or unknown field, a wrong type) are both the
            // caller's bad input.
            _ => ApiError::invalid_json(rejection.body_text()),
        }
    }
}

/// A body that could not be read: too large, or cut off (a 400 as when
/// `axum::Json` read it).
impl From<BytesRejection> for ApiError {
    fn from(rejection: BytesRejection) -> ApiError {
        match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::too_large(),
            _ => ApiError::invalid_json(rejection.body_text()),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> ApiError {
        ApiError::bad_request(rejection.body_text())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut error = Map::new();
        error.insert("code".into(), json!(self.code));
        error.insert("message".into(), json!(self.message));
        error.extend(self.extra);
        (self.status, Json(json!({ "error": error }))).into_response()
    }
}

pub type ApiResult<T> = Result<T, ApiError>;
