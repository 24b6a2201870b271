//! The events a client sees on a conversation's SSE stream (DESIGN.md §4).
//!
//! An [`Event`] is serialized once, when the engine makes it: its `data` is
//! the JSON text that is stored, sent to every live viewer and replayed to a
//! client that resumes, so all of them see the same bytes.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::Millis;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EventName {
    #[serde(rename = "turn.started")]
    TurnStarted,
    #[serde(rename = "turn.queued")]
    TurnQueued,
    #[serde(rename = "message.new")]
    MessageNew,
    #[serde(rename = "head.moved")]
    HeadMoved,
    #[serde(rename = "trace_start")]
    TraceStart,
    #[serde(rename = "trace_delta")]
    TraceDelta,
    #[serde(rename = "trace_end")]
    TraceEnd,
    #[serde(rename = "delta")]
    Delta,
    #[serde(rename = "done")]
    Done,
    #[serde(rename = "error")]
    Error,
}

impl EventName {
    pub const ALL: [EventName; 10] = [
        EventName::TurnStarted,
        EventName::TurnQueued,
        EventName::MessageNew,
        EventName::HeadMoved,
        EventName::TraceStart,
        EventName::TraceDelta,
        EventName::TraceEnd,
        EventName::Delta,
        EventName::Done,
        EventName::Error,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventName::TurnStarted => "turn.started",
            EventName::TurnQueued => "turn.queued",
            EventName::MessageNew => "message.new",
            EventName::HeadMoved => "head.moved",
            EventName::TraceStart => "trace_start",
            EventName::TraceDelta => "trace_delta",
            EventName::TraceEnd => "trace_end",
            EventName::Delta => "delta",
            EventName::Done => "done",
            EventName::Error => "error",
        }
    }

    pub fn parse(text: &str) -> Option<EventName> {
        EventName::ALL.into_iter().find(|name| name.as_str() == text)
    }

    /// Whether a `done` or `error` ends the turn's stream.
    pub fn ends_turn(self) -> bool {
        matches!(self, EventName::Done | EventName::Error)
    }
}

/// How much of the trace a viewer wants streamed. Everything is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Visibility {
    /// Questions and answers only: no trace events.
    Minimal,
    /// Trace cards open and close, but their contents are not streamed.
    Compact,
    #[default]
    Full,
}

impl Visibility {
    pub fn parse(text: &str) -> Option<Visibility> {
        match text {
            "minimal" => Some(Visibility::Minimal),
            "compact" => Some(Visibility::Compact),
            "full" => Some(Visibility::Full),
            _ => None,
        }
    }

    pub fn shows(self, name: EventName) -> bool {
        match self {
            Visibility::Full => true,
            Visibility::Compact => name != EventName::TraceDelta,
            Visibility::Minimal => !matches!(name, EventName::TraceStart | EventName::TraceDelta | EventName::TraceEnd),
        }
    }
}

/// One event of a conversation, with its place in the conversation's
/// sequence (the SSE `id:`).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub seq: i64,
    pub conversation_id: Arc<str>,
    pub turn_id: Option<Arc<str>>,
    pub name: EventName,
    /// The event's JSON payload, serialized once.
    pub data: Arc<str>,
    pub created_at: Millis,
}

impl Event {
    pub fn data_json(&self) -> Value {
        serde_json::from_str(&self.data).unwrap_or(Value::Null)
    }
}

/// Payload of `done`: what the turn produced and what it cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DonePayload {
    pub turn_id: String,
    pub message_id: String,
    pub model: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub thinking_tokens: u64,
    pub cached_tokens: u64,
    pub latency_ms: u64,
    pub cost_credits: i64,
    pub cost_cents_usd: f64,
    /// The conversation's head version once the reply is the head.
    pub head_version: i64,
}

/// Payload of `error`: the turn ended without a (complete) answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorPayload {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<String>,
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// The kinds of trace card (DESIGN.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceType {
    Thinking,
    ToolCallRequest,
    ToolCallResult,
    LlmRequest,
    Error,
    Retry,
    ModelSwitch,
    ContextTruncation,
    GuardrailBlock,
    ToolApproval,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_text() {
        for name in EventName::ALL {
            assert_eq!(EventName::parse(name.as_str()), Some(name));
            let json = serde_json::to_string(&name).expect("serializes");
            assert_eq!(json, format!("\"{}\"", name.as_str()));
        }
        assert_eq!(EventName::parse("nope"), None);
    }

    #[test]
    fn visibility_filters_trace_events() {
        assert!(Visibility::Full.shows(EventName::TraceDelta));
        assert!(!Visibility::Compact.shows(EventName::TraceDelta));
        assert!(Visibility::Compact.shows(EventName::TraceStart));
        assert!(!Visibility::Minimal.shows(EventName::TraceEnd));
        assert!(Visibility::Minimal.shows(EventName::Delta));
        assert!(Visibility::Minimal.shows(EventName::Done));
    }
}
