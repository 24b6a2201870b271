//! The error vocabulary shared by every crate. Providers map their HTTP
//! statuses and bodies onto [`ErrorCode`]; the engine records the code on a
//! failed turn; clients see it in `error` events.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What went wrong with a model call, in terms a caller can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    RateLimit,
    Overloaded,
    ContextLengthExceeded,
    InvalidRequest,
    Authentication,
    Permission,
    NotFound,
    ContentFilter,
    Timeout,
    ProviderUnavailable,
    /// The provider's stream broke off or sent something unreadable.
    StreamInterrupted,
    Cancelled,
    Internal,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::RateLimit => "rate_limit",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::ContextLengthExceeded => "context_length_exceeded",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::Authentication => "authentication",
            ErrorCode::Permission => "permission",
            ErrorCode::NotFound => "not_found",
            ErrorCode::ContentFilter => "content_filter",
            ErrorCode::Timeout => "timeout",
            ErrorCode::ProviderUnavailable => "provider_unavailable",
            ErrorCode::StreamInterrupted => "stream_interrupted",
            ErrorCode::Cancelled => "cancelled",
            ErrorCode::Internal => "internal",
        }
    }

    /// Whether the same call may succeed if tried again later.
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            ErrorCode::RateLimit
                | ErrorCode::Overloaded
                | ErrorCode::Timeout
                | ErrorCode::ProviderUnavailable
                | ErrorCode::StreamInterrupted
        )
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed provider call, keeping the provider's own message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ProviderError {
    pub code: ErrorCode,
    pub message: String,
    /// How long the provider asked us to wait (`retry-after`).
    pub retry_after: Option<Duration>,
    /// The HTTP status, when the error came from one.
    pub status: Option<u16>,
}

impl ProviderError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ProviderError {
        ProviderError { code, message: message.into(), retry_after: None, status: None }
    }

    pub fn with_status(mut self, status: u16) -> ProviderError {
        self.status = Some(status);
        self
    }

    pub fn with_retry_after(mut self, retry_after: Option<Duration>) -> ProviderError {
        self.retry_after = retry_after;
        self
    }
}
