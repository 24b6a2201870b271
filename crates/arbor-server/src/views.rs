//! How stored records look on the wire. Times are RFC 3339 text; money is
//! credits (integers) with cents of a dollar derived for display.

use std::collections::HashMap;

use arbor_core::Cost;
use arbor_core::Node;
use arbor_core::ids::rfc3339;
use arbor_store::{ApiCall, Conversation, Turn};
use serde_json::{Value, json};

pub fn conversation(conversation: &Conversation) -> Value {
    json!({
        "id": conversation.id,
        "title": conversation.title,
        "system_prompt": conversation.system_prompt,
        "model": conversation.model,
        "head_id": conversation.head_id,
        "head_version": conversation.head_version,
        "summary": conversation.summary,
        "created_at": rfc3339(conversation.created_at),
        "updated_at": rfc3339(conversation.updated_at),
    })
}

/// Tree nodes with their children's ids, in creation order.
pub fn nodes(nodes: &[Node]) -> Vec<Value> {
    let mut children: HashMap<&str, Vec<&str>> = HashMap::new();
    for node in nodes {
        if let Some(parent) = node.parent_id.as_deref() {
            children.entry(parent).or_default().push(&node.id);
        }
    }
    nodes
        .iter()
        .map(|node| {
            let mut value = serde_json::to_value(node).unwrap_or(Value::Null);
            value["children"] = json!(children.get(node.id.as_str()).cloned().unwrap_or_default());
            value
        })
        .collect()
}

pub fn turn(turn: &Turn) -> Value {
    let cost = Cost { micro_usd: turn.cost_micro_usd };
    let error = turn.error_code.as_ref().map(|code| json!({"code": code, "message": turn.error_message}));
    json!({
        "id": turn.id,
        "conversation_id": turn.conversation_id,
        "user_message_id": turn.user_message_id,
        "reply_message_id": turn.reply_message_id,
        "status": turn.status.as_str(),
        "model": turn.model,
        "iterations": turn.iterations,
        "input_tokens": turn.usage.input_tokens,
        "output_tokens": turn.usage.output_tokens,
        "thinking_tokens": turn.usage.thinking_tokens,
        "cached_tokens": turn.usage.cached_tokens,
        "cost_credits": cost.credits(),
        "cost_cents_usd": cost.cents_usd(),
        "error": error,
        "created_at": rfc3339(turn.created_at),
        "finished_at": turn.finished_at.map(rfc3339),
    })
}

pub fn api_call(call: &ApiCall) -> Value {
    let cost = Cost { micro_usd: call.cost_micro_usd };
    json!({
        "id": call.id,
        "kind": call.kind,
        "provider": call.provider,
        "model": call.model,
        "status": call.status,
        "error_code": call.error_code,
        "input_tokens": call.usage.input_tokens,
        "output_tokens": call.usage.output_tokens,
        "thinking_tokens": call.usage.thinking_tokens,
        "cached_tokens": call.usage.cached_tokens,
        "latency_ms": call.latency_ms,
        "ttft_ms": call.ttft_ms,
        "cost_credits": cost.credits(),
        "cost_cents_usd": cost.cents_usd(),
        "created_at": rfc3339(call.created_at),
    })
}
