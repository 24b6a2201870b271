//! Typed payloads of the events every turn emits. Each serializes straight
//! into the event's JSON text, where `json!` first built a `Value` (a map
//! with an allocated key per field, and for `message.new` a copy of the
//! whole message) only to serialize and drop it. The JSON is the same
//! (fields are declared in the alphabetical order those maps had; a
//! message's own fields now keep the order of its struct).

use arbor_core::Node;
use serde::Serialize;

/// `message.new`: a message joined the tree (the head version is left out
/// for the reply, whose `done` carries it).
#[derive(Serialize)]
pub(crate) struct MessageNew<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_version: Option<i64>,
    pub message: &'a Node,
}

/// `turn.started`.
#[derive(Serialize)]
pub(crate) struct TurnStarted<'a> {
    pub head_version: i64,
    pub message_id: &'a str,
    pub model: &'a str,
    pub turn_id: &'a str,
}

/// `trace_start` of an `llm_request` trace: one model call begins.
#[derive(Serialize)]
pub(crate) struct CallStarted<'a> {
    pub id: &'a str,
    pub iteration: u32,
    pub model: &'a str,
    pub provider: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
}

/// `trace_end` of an `llm_request` trace: what the call used and cost.
#[derive(Serialize)]
pub(crate) struct CallEnded<'a> {
    pub cached_tokens: u64,
    pub cost_cents_usd: f64,
    pub cost_credits: i64,
    pub id: &'a str,
    pub input_tokens: u64,
    pub latency_ms: u64,
    pub model: &'a str,
    pub output_tokens: u64,
    pub provider: &'a str,
    pub status: &'a str,
    pub thinking_tokens: u64,
    pub ttft_ms: Option<u64>,
    #[serde(rename = "type")]
    pub kind: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_core::message::NodeStatus;
    use arbor_core::{Message, Role};
    use serde_json::json;

    /// The typed payloads write the JSON `json!` wrote.
    #[test]
    fn each_payload_writes_what_json_wrote() {
        let node = Node {
            id: "m1".into(),
            conversation_id: "c".into(),
            parent_id: Some("m0".into()),
            message: Message::text(Role::User, "hi \"there\""),
            model: None,
            provider: None,
            turn_id: Some("t".into()),
            copied_from: None,
            status: NodeStatus::Complete,
            created_at: 1_700_000_000_123,
        };
        let same = |typed: String, value: serde_json::Value| {
            assert_eq!(serde_json::from_str::<serde_json::Value>(&typed).expect("parses"), value, "{typed}");
        };
        same(
            serde_json::to_string(&MessageNew { head_version: Some(3), message: &node }).expect("serializes"),
            json!({"message": node, "head_version": 3}),
        );
        same(
            serde_json::to_string(&MessageNew { head_version: None, message: &node }).expect("serializes"),
            json!({"message": node}),
        );
        same(
            serde_json::to_string(&TurnStarted { head_version: 2, message_id: "m1", model: "demo", turn_id: "t" })
                .expect("serializes"),
            json!({"turn_id": "t", "message_id": "m1", "model": "demo", "head_version": 2}),
        );
        same(
            serde_json::to_string(&CallStarted {
                id: "x",
                iteration: 1,
                model: "demo",
                provider: "p",
                kind: "llm_request",
            })
            .expect("serializes"),
            json!({"id": "x", "type": "llm_request", "model": "demo", "provider": "p", "iteration": 1}),
        );
        same(
            serde_json::to_string(&CallEnded {
                cached_tokens: 1,
                cost_cents_usd: 0.0014,
                cost_credits: 14,
                id: "x",
                input_tokens: 10,
                latency_ms: 5,
                model: "demo",
                output_tokens: 20,
                provider: "p",
                status: "ok",
                thinking_tokens: 0,
                ttft_ms: None,
                kind: "llm_request",
            })
            .expect("serializes"),
            json!({"id": "x", "type": "llm_request", "model": "demo", "provider": "p", "status": "ok",
                "input_tokens": 10, "output_tokens": 20, "thinking_tokens": 0, "cached_tokens": 1,
                "latency_ms": 5, "ttft_ms": null, "cost_credits": 14, "cost_cents_usd": 0.0014}),
        );
    }
}
