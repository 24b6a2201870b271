//! The internal message format (`shared/seeds/provider-model.txt`): one shape
//! for every provider. Adapters translate it to and from their wire formats;
//! nothing else in Arbor sees a provider's format.
//!
//! A [`Message`] is what a model reads; a [`Node`] is a message stored in a
//! conversation's tree, with its id, parent and provenance.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::Millis;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    pub fn parse(text: &str) -> Option<Role> {
        match text {
            "system" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            "tool" => Some(Role::Tool),
            _ => None,
        }
    }
}

/// How a tool call ended, as the model is told in the tool result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolStatus {
    Success,
    Error,
    /// The turn stopped before the tool answered; written by branch repair so
    /// that every tool call keeps a matching result.
    Cancelled,
    Denied,
}

/// One tool call an assistant message asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// Parsed JSON arguments (an object for well-behaved models).
    pub arguments: Value,
    /// Opaque provider data that must travel back with this call, verbatim,
    /// to the provider that produced it (Gemini's `thoughtSignature`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<ProviderOpaque>,
}

/// Provider data Arbor does not interpret but must send back byte-for-byte
/// to the same provider, and drop when the history goes to another one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderOpaque {
    /// The provider kind that produced it (`anthropic`, `gemini`, `openai`).
    pub provider: String,
    pub data: String,
}

/// A piece of a message beside its plain text content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    /// An image the model should see. `url` is a reachable URL; `data` is
    /// base64 of the bytes. At least one is set when sent to a provider.
    Image {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        media_id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        url: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mime_type: Option<String>,
    },
    /// The model's reasoning. `signature` (Anthropic) must go back unchanged.
    Thinking {
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signature: Option<ProviderOpaque>,
    },
    /// Reasoning the provider encrypted (Anthropic `redacted_thinking`).
    RedactedThinking { data: ProviderOpaque },
}

/// A message as a model reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    /// Text, or null (an assistant message that only calls tools).
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<Part>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_status: Option<ToolStatus>,
}

impl Message {
    pub fn text(role: Role, content: impl Into<String>) -> Message {
        Message {
            role,
            content: Some(content.into()),
            parts: Vec::new(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            tool_name: None,
            tool_status: None,
        }
    }

    pub fn system(content: impl Into<String>) -> Message {
        Message::text(Role::System, content)
    }

    pub fn user(content: impl Into<String>) -> Message {
        Message::text(Role::User, content)
    }

    pub fn assistant(content: impl Into<String>) -> Message {
        Message::text(Role::Assistant, content)
    }

    /// A tool result message answering `call`.
    pub fn tool_result(call: &ToolCall, status: ToolStatus, content: impl Into<String>) -> Message {
        Message {
            role: Role::Tool,
            content: Some(content.into()),
            parts: Vec::new(),
            tool_calls: Vec::new(),
            tool_call_id: Some(call.id.clone()),
            tool_name: Some(call.name.clone()),
            tool_status: Some(status),
        }
    }

    /// Characters a model reads in this message, for token estimation.
    pub fn char_len(&self) -> usize {
        let text = self.content.as_deref().map_or(0, str::len);
        let calls: usize = self.tool_calls.iter().map(|call| call.name.len() + call.arguments.to_string().len()).sum();
        let parts: usize = self
            .parts
            .iter()
            .map(|part| match part {
                Part::Thinking { text, .. } => text.len(),
                // A typical image costs on the order of a thousand tokens.
                Part::Image { .. } => 4 * 1000,
                Part::RedactedThinking { .. } => 0,
            })
            .sum();
        text + calls + parts
    }
}

/// A message as a model call reads it: a node of the conversation's tree,
/// shared with the tree, or a message standing alone.
///
/// A turn's request names the whole path from the root to the user's
/// message. Sharing the tree's nodes makes that one pointer copy a message
/// instead of a copy of every text, part and tool call on the path, which
/// grows with the conversation and is made again on every turn.
#[derive(Clone)]
pub struct SharedMessage(Shared);

#[derive(Clone)]
enum Shared {
    Node(Arc<Node>),
    Alone(Arc<Message>),
}

impl SharedMessage {
    /// Messages that stand alone (a one-off call, a test), shared.
    pub fn all(messages: impl IntoIterator<Item = Message>) -> Vec<SharedMessage> {
        messages.into_iter().map(SharedMessage::from).collect()
    }

    /// The message, to change it: copied first while anything else holds
    /// it (a node the tree holds is copied whole, so the tree keeps its
    /// own).
    pub fn to_mut(&mut self) -> &mut Message {
        match &mut self.0 {
            Shared::Node(node) => &mut Arc::make_mut(node).message,
            Shared::Alone(message) => Arc::make_mut(message),
        }
    }

    /// Whether the two are one message held in one place (the same node
    /// of one tree, or the same shared message), not merely equal. A
    /// message held so is never changed in place (`to_mut` copies it while
    /// it is shared), so what was written from it still holds.
    pub fn same(&self, other: &SharedMessage) -> bool {
        match (&self.0, &other.0) {
            (Shared::Node(one), Shared::Node(other)) => Arc::ptr_eq(one, other),
            (Shared::Alone(one), Shared::Alone(other)) => Arc::ptr_eq(one, other),
            _ => false,
        }
    }
}

impl Deref for SharedMessage {
    type Target = Message;

    fn deref(&self) -> &Message {
        match &self.0 {
            Shared::Node(node) => &node.message,
            Shared::Alone(message) => message,
        }
    }
}

impl Borrow<Message> for SharedMessage {
    fn borrow(&self) -> &Message {
        self
    }
}

impl From<Message> for SharedMessage {
    fn from(message: Message) -> SharedMessage {
        SharedMessage(Shared::Alone(Arc::new(message)))
    }
}

/// The node's message, without a copy.
impl From<Arc<Node>> for SharedMessage {
    fn from(node: Arc<Node>) -> SharedMessage {
        SharedMessage(Shared::Node(node))
    }
}

/// Shown and compared as the message it is: where it is held is not part
/// of it.
impl fmt::Debug for SharedMessage {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        Message::fmt(self, formatter)
    }
}

impl PartialEq for SharedMessage {
    fn eq(&self, other: &SharedMessage) -> bool {
        **self == **other
    }
}

/// Whether a stored message is complete. A message cut short by a
/// cancellation, an error or a crash is kept, marked `interrupted`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum NodeStatus {
    #[default]
    Complete,
    Interrupted,
}

impl NodeStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeStatus::Complete => "complete",
            NodeStatus::Interrupted => "interrupted",
        }
    }

    pub fn parse(text: &str) -> Option<NodeStatus> {
        match text {
            "complete" => Some(NodeStatus::Complete),
            "interrupted" => Some(NodeStatus::Interrupted),
            _ => None,
        }
    }
}

/// A message stored as a node of a conversation's tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// Unique within the conversation; client-chosen or generated.
    pub id: String,
    pub conversation_id: String,
    pub parent_id: Option<String>,
    #[serde(flatten)]
    pub message: Message,
    /// The model that wrote it (assistant messages).
    #[serde(default)]
    pub model: Option<String>,
    /// The provider that served `model`.
    #[serde(default)]
    pub provider: Option<String>,
    #[serde(default)]
    pub turn_id: Option<String>,
    #[serde(default)]
    pub copied_from: Option<String>,
    #[serde(default)]
    pub status: NodeStatus,
    #[serde(with = "crate::ids::serde_rfc3339")]
    pub created_at: Millis,
}

impl Node {
    /// A complete message with no provenance (no model, provider, turn or
    /// original): what a user or a client's view records. Set the others
    /// with struct update syntax.
    pub fn new(
        id: impl Into<String>,
        conversation_id: impl Into<String>,
        parent_id: Option<String>,
        message: Message,
        created_at: Millis,
    ) -> Node {
        Node {
            id: id.into(),
            conversation_id: conversation_id.into(),
            parent_id,
            message,
            model: None,
            provider: None,
            turn_id: None,
            copied_from: None,
            status: NodeStatus::Complete,
            created_at,
        }
    }

    /// About how many bytes this node holds in memory: the struct and the
    /// text of its strings, parts and tool calls (allocator rounding and
    /// the `Value` tree's own nodes are not counted exactly). The engine
    /// bounds the memory of quiet conversations' cached trees with it.
    pub fn size_in_memory(&self) -> usize {
        let text = |text: &Option<String>| text.as_ref().map_or(0, String::len);
        let message = &self.message;
        let parts: usize = message
            .parts
            .iter()
            .map(|part| {
                size_of::<Part>()
                    + match part {
                        Part::Image { media_id, url, data, mime_type } => {
                            text(media_id) + text(url) + text(data) + text(mime_type)
                        }
                        Part::Thinking { text, signature } => text.len() + signature.as_ref().map_or(0, opaque_len),
                        Part::RedactedThinking { data } => opaque_len(data),
                    }
            })
            .sum();
        let tool_calls: usize = message
            .tool_calls
            .iter()
            .map(|call| {
                size_of::<ToolCall>()
                    + call.id.len()
                    + call.name.len()
                    + value_len(&call.arguments)
                    + call.signature.as_ref().map_or(0, opaque_len)
            })
            .sum();
        size_of::<Node>()
            + self.id.len()
            + self.conversation_id.len()
            + text(&self.parent_id)
            + text(&self.model)
            + text(&self.provider)
            + text(&self.turn_id)
            + text(&self.copied_from)
            + text(&message.content)
            + text(&message.tool_call_id)
            + text(&message.tool_name)
            + parts
            + tool_calls
    }
}

fn opaque_len(opaque: &ProviderOpaque) -> usize {
    opaque.provider.len() + opaque.data.len()
}

/// The bytes a JSON value holds, about: each value's slot and its text.
fn value_len(value: &Value) -> usize {
    size_of::<Value>()
        + match value {
            Value::String(text) => text.len(),
            Value::Array(items) => items.iter().map(value_len).sum(),
            Value::Object(fields) => {
                fields.iter().map(|(key, value)| size_of::<String>() + key.len() + value_len(value)).sum()
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => 0,
        }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_node_counts_its_text_in_its_size() {
        let node = |content: &str| Node::new("m1", "c1", None, Message::user(content), 0);
        let short = node("hi").size_in_memory();
        assert!(short >= size_of::<Node>());
        assert_eq!(node(&"x".repeat(10_002)).size_in_memory(), short + 10_000);
        let mut calling = node("hi");
        calling.message.tool_calls.push(ToolCall {
            id: "call_1".into(),
            name: "search".into(),
            arguments: json!({"query": "y".repeat(5_000)}),
            signature: None,
        });
        assert!(calling.size_in_memory() > short + 5_000, "a tool call's arguments count");
    }

    #[test]
    fn seed_messages_round_trip() {
        // The four shapes of shared/seeds/provider-model.txt.
        let seeds = [
            json!({"role": "system", "content": "You are a clinical reasoning assistant..."}),
            json!({"role": "assistant", "content": "The differential diagnosis for chest pain includes..."}),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_abc123", "name": "web_search", "arguments": {"query": "chest pain differential diagnosis"}}
            ]}),
            json!({"role": "tool", "tool_call_id": "call_abc123", "tool_name": "web_search",
                   "content": "{\"results\": [...]}", "tool_status": "success"}),
        ];
        for seed in seeds {
            let message: Message = serde_json::from_value(seed.clone()).expect("seed parses");
            assert_eq!(serde_json::to_value(&message).expect("serializes"), seed);
        }
    }

    #[test]
    fn parts_round_trip_with_opaque_provider_data() {
        let message = Message {
            role: Role::Assistant,
            content: Some("42".into()),
            parts: vec![
                Part::Thinking {
                    text: "let me add".into(),
                    signature: Some(ProviderOpaque { provider: "anthropic".into(), data: "EqQBCkYI==".into() }),
                },
                Part::RedactedThinking { data: ProviderOpaque { provider: "anthropic".into(), data: "opaque".into() } },
                Part::Image {
                    media_id: Some("m1".into()),
                    url: None,
                    data: Some("aGk=".into()),
                    mime_type: Some("image/png".into()),
                },
            ],
            tool_calls: vec![ToolCall {
                id: "c1".into(),
                name: "add".into(),
                arguments: json!({"a": 1}),
                signature: Some(ProviderOpaque { provider: "gemini".into(), data: "sig".into() }),
            }],
            tool_call_id: None,
            tool_name: None,
            tool_status: None,
        };
        let text = serde_json::to_string(&message).expect("serializes");
        let back: Message = serde_json::from_str(&text).expect("parses");
        assert_eq!(back, message);
    }

    #[test]
    fn node_flattens_its_message_and_shows_rfc3339_time() {
        let node = Node::new("u1", "c", None, Message::user("hi"), 0);
        let value = serde_json::to_value(&node).expect("serializes");
        assert_eq!(value["role"], "user");
        assert_eq!(value["content"], "hi");
        assert_eq!(value["created_at"], "1970-01-01T00:00:00Z");
        let back: Node = serde_json::from_value(value).expect("parses");
        assert_eq!(back, node);
    }
}
