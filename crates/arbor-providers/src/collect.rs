//! Folding a stream of [`Chunk`]s into a finished assistant message. The
//! engine uses the same fold while it forwards chunks, and tests use it to
//! compare a stream with the expected reply.

use arbor_core::message::{Part, ToolCall};
use arbor_core::{Message, ProviderError, Role, Usage};
use futures_util::StreamExt;
use serde_json::Value;

use crate::{Chunk, ChunkStream, FinishReason};

/// A reply, complete or as far as it got.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Collected {
    pub text: String,
    pub parts: Vec<Part>,
    pub tool_calls: Vec<ToolCall>,
    pub usage: Option<Usage>,
    pub finish: Option<FinishReason>,
    /// Tool calls being assembled: (index, id, name, argument text).
    pending_calls: Vec<PendingCall>,
    thinking: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Default)]
struct PendingCall {
    index: usize,
    id: String,
    name: String,
    arguments: String,
}

impl Collected {
    /// Applies one chunk.
    pub fn push(&mut self, chunk: &Chunk) {
        match chunk {
            Chunk::Text(text) => {
                self.close_thinking(None);
                self.text.push_str(text);
            }
            Chunk::Thinking(text) => self.thinking.get_or_insert_with(String::new).push_str(text),
            Chunk::ThinkingSignature(signature) => self.close_thinking(Some(signature.clone())),
            Chunk::RedactedThinking(data) => {
                self.close_thinking(None);
                self.parts.push(Part::RedactedThinking { data: data.clone() });
            }
            Chunk::ToolCallStart { index, id, name } => {
                self.close_thinking(None);
                self.pending_calls.push(PendingCall {
                    index: *index,
                    id: id.clone(),
                    name: name.clone(),
                    arguments: String::new(),
                });
            }
            Chunk::ToolCallArguments { index, fragment } => {
                if let Some(call) = self.pending_calls.iter_mut().find(|call| call.index == *index) {
                    call.arguments.push_str(fragment);
                }
            }
            Chunk::ToolCallEnd { index, signature } => {
                if let Some(position) = self.pending_calls.iter().position(|call| call.index == *index) {
                    let call = self.pending_calls.remove(position);
                    self.tool_calls.push(finish_call(call, signature.clone()));
                }
            }
            Chunk::Usage(usage) => self.usage = Some(*usage),
            Chunk::Finish(reason) => self.finish = Some(reason.clone()),
        }
    }

    /// Closes whatever is still open (a stream that ended without closing its
    /// thinking block or tool calls) and returns the reply.
    pub fn finish(mut self) -> Collected {
        self.close_thinking(None);
        let pending = std::mem::take(&mut self.pending_calls);
        for call in pending {
            self.tool_calls.push(finish_call(call, None));
        }
        self
    }

    /// The reply as an assistant message.
    pub fn message(&self) -> Message {
        Message {
            role: Role::Assistant,
            content: if self.text.is_empty() && !self.tool_calls.is_empty() { None } else { Some(self.text.clone()) },
            parts: self.parts.clone(),
            tool_calls: self.tool_calls.clone(),
            tool_call_id: None,
            tool_name: None,
            tool_status: None,
        }
    }

    fn close_thinking(&mut self, signature: Option<arbor_core::message::ProviderOpaque>) {
        match self.thinking.take() {
            Some(text) => self.parts.push(Part::Thinking { text, signature }),
            None if signature.is_some() => self.parts.push(Part::Thinking { text: String::new(), signature }),
            None => {}
        }
    }
}

fn finish_call(call: PendingCall, signature: Option<arbor_core::message::ProviderOpaque>) -> ToolCall {
    // An empty argument string means "no arguments" (Anthropic sends "" for
    // parameterless tools); unparseable text is kept as a string so the
    // model's mistake can be shown to it rather than lost.
    let arguments = if call.arguments.trim().is_empty() {
        Value::Object(Default::default())
    } else {
        serde_json::from_str(&call.arguments).unwrap_or(Value::String(call.arguments))
    };
    ToolCall { id: call.id, name: call.name, arguments, signature }
}

/// Reads a whole stream into a [`Collected`] reply.
pub async fn collect_stream(mut stream: ChunkStream) -> Result<Collected, ProviderError> {
    let mut collected = Collected::default();
    while let Some(chunk) = stream.next().await {
        collected.push(&chunk?);
    }
    Ok(collected.finish())
}
