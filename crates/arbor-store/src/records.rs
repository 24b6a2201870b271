//! The rows the store keeps, as plain Rust values.

use arbor_core::Usage;
use arbor_core::ids::Millis;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    pub id: String,
    pub name: String,
    pub is_admin: bool,
    /// Credits left (1 credit = 1 micro-dollar); `None` is unlimited.
    pub balance_credits: Option<i64>,
    pub created_at: Millis,
}

/// An API key, kept only as the SHA-256 of the key (hex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub id: String,
    pub user_id: String,
    pub key_hash: String,
    /// The first characters of the key, to tell keys apart in listings.
    pub prefix: String,
    pub created_at: Millis,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conversation {
    pub id: String,
    pub owner_id: String,
    pub title: Option<String>,
    pub system_prompt: Option<String>,
    pub preset_id: Option<String>,
    /// The default model for new turns.
    pub model: String,
    pub head_id: Option<String>,
    /// Bumped on every head move, for optimistic concurrency.
    pub head_version: i64,
    pub summary: Option<String>,
    pub created_at: Millis,
    pub updated_at: Millis,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConversationUpdate {
    pub title: Option<String>,
    pub system_prompt: Option<String>,
    pub model: Option<String>,
    pub updated_at: Millis,
}

/// Where a page of conversations starts: after this (created_at, id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConversationCursor {
    pub created_at: Millis,
    pub id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TurnStatus {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    Interrupted,
}

impl TurnStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TurnStatus::Queued => "queued",
            TurnStatus::Running => "running",
            TurnStatus::Succeeded => "succeeded",
            TurnStatus::Failed => "failed",
            TurnStatus::Cancelled => "cancelled",
            TurnStatus::Interrupted => "interrupted",
        }
    }

    pub fn parse(text: &str) -> Option<TurnStatus> {
        [
            TurnStatus::Queued,
            TurnStatus::Running,
            TurnStatus::Succeeded,
            TurnStatus::Failed,
            TurnStatus::Cancelled,
            TurnStatus::Interrupted,
        ]
        .into_iter()
        .find(|status| status.as_str() == text)
    }

    pub fn is_finished(self) -> bool {
        !matches!(self, TurnStatus::Queued | TurnStatus::Running)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    pub id: String,
    pub conversation_id: String,
    pub user_id: String,
    /// The user message that started it.
    pub user_message_id: String,
    pub status: TurnStatus,
    pub model: String,
    /// Model calls made so far.
    pub iterations: u32,
    pub usage: Usage,
    pub cost_micro_usd: u64,
    /// The final assistant message, once there is one.
    pub reply_message_id: Option<String>,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub created_at: Millis,
    pub started_at: Option<Millis>,
    pub finished_at: Option<Millis>,
    /// A queued turn's messages, durable until the turn starts and records
    /// them in the tree (empty otherwise).
    #[serde(default)]
    pub pending_messages: Vec<arbor_core::Node>,
}

/// One provider call (chat or summary).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApiCall {
    pub id: String,
    pub turn_id: Option<String>,
    pub conversation_id: Option<String>,
    pub user_id: String,
    /// `chat` or `summary`.
    pub kind: String,
    pub provider: String,
    pub model: String,
    pub usage: Usage,
    pub latency_ms: u64,
    /// Time to the first streamed chunk, when streamed.
    pub ttft_ms: Option<u64>,
    /// `ok`, `error` or `cancelled`.
    pub status: String,
    pub error_code: Option<String>,
    pub cost_micro_usd: u64,
    pub created_at: Millis,
}

/// One charge against a user's credits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerEntry {
    pub id: String,
    pub user_id: String,
    pub api_call_id: String,
    pub credits: i64,
    /// The balance after this charge; `None` for unlimited users.
    pub balance_after: Option<i64>,
    pub created_at: Millis,
}

impl LedgerEntry {
    /// The charge for `call`. One charge per call, so the call's id names
    /// its ledger row too and the store invents no id of its own.
    pub(crate) fn for_call(call: &ApiCall, balance_after: Option<i64>) -> LedgerEntry {
        LedgerEntry {
            id: call.id.clone(),
            user_id: call.user_id.clone(),
            api_call_id: call.id.clone(),
            credits: crate::codec::to_i64(call.cost_micro_usd),
            balance_after,
            created_at: call.created_at,
        }
    }
}

/// Credits held for a model call before it is made, so that concurrent
/// turns of one user (on any node) can never spend past the balance: a
/// reservation succeeds only while `balance - reserved` covers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    pub id: String,
    pub user_id: String,
    /// The most the call may cost (an estimate from the model's prices).
    pub credits: i64,
    pub created_at: Millis,
    /// When a reservation its node never settled (the node died) is given
    /// back by [`crate::Store::release_expired_reservations`].
    pub expires_at: Millis,
}

/// What [`crate::Store::reserve_credits`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveOutcome {
    /// The credits are held. `available_after` is what is left to reserve
    /// (`None` for unlimited users).
    Reserved { available_after: Option<i64> },
    /// Nothing was held: only `available` credits are left.
    Insufficient { available: i64 },
}

/// What [`crate::Store::start_turn`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnStarted {
    /// The conversation's head version after the turn's messages.
    pub head_version: i64,
    /// The outcome of the reservation made with the start, when one was
    /// asked for.
    pub reserved: Option<ReserveOutcome>,
}

/// A wake-up passed between the nodes sharing a database (PostgreSQL
/// `LISTEN`/`NOTIFY`; within the process for SQLite). Notices carry no data
/// a listener must not lose: the store stays the source of truth, and a
/// listener that missed one re-reads it, so a lost notice costs latency,
/// never data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Notice {
    /// Events of the conversation are stored up to `seq`.
    Events { conversation_id: String, seq: i64 },
    /// Someone asked to cancel the turn, wherever it runs.
    CancelTurn { conversation_id: String, turn_id: String },
    /// The head moved (work on the branch left should stop).
    HeadMoved { conversation_id: String, head_id: Option<String>, head_version: i64 },
    /// The turn ended, so a queued turn of the conversation may start.
    TurnFinished { conversation_id: String, turn_id: String },
    /// Sent by the store itself when its listening connection was lost and
    /// re-made: notices may have been missed, so re-read what matters.
    Resync,
}
