//! The engine's error vocabulary: variants a caller (the HTTP layer, the
//! CLI) can act on. Messages are lowercase and say what to do.

use arbor_store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Anything the caller does not own looks exactly like nothing at all.
    #[error("{0} not found")]
    NotFound(&'static str),
    #[error("{0}")]
    InvalidInput(String),
    #[error("unknown model {0:?}: see GET /v1/models for the models this server knows")]
    UnknownModel(String),
    #[error("{0}")]
    ModelUnavailable(String),
    /// A turn is already running on the conversation.
    #[error(
        "turn {turn_id} is still running on this conversation; wait for it, cancel it, or send with \"queue\": true"
    )]
    TurnRunning { turn_id: String },
    #[error("{0}")]
    Conflict(String),
    #[error("the conversation's head moved (head_version is now {current}); reload and retry")]
    HeadVersionMismatch { current: i64 },
    #[error("the credit quota is used up; ask an administrator for more credits")]
    QuotaExceeded,
    #[error("the server is shutting down; retry in a moment")]
    ShuttingDown,
    #[error("storage failed: {0}")]
    Store(#[from] StoreError),
    #[error("internal error: {0}")]
    Internal(String),
}

pub type EngineResult<T> = Result<T, EngineError>;
