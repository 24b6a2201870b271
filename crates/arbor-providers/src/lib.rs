//! Provider adapters. Each adapter translates Arbor's internal message format
//! ([`arbor_core::Message`]) into one provider's wire format and the
//! provider's replies back into normalised [`Chunk`]s, so that nothing else in
//! Arbor ever sees a provider's format. Adapters do not keep conversation
//! state, price calls or retry: that is the engine's work. (The adapters
//! keep the text they wrote for long paths, to write only what is new on
//! the next turn: a cache, see `written`.)
#![forbid(unsafe_code)]

pub mod anthropic;
pub mod collect;
mod decode;
pub mod demo;
pub mod gemini;
pub mod http;
pub mod openai;
pub mod registry;
pub mod sse;
mod written;

use std::pin::Pin;

use arbor_core::message::ProviderOpaque;
use arbor_core::{ProviderError, SharedMessage, Usage};
use futures_util::Stream;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use collect::{Collected, collect_stream};
pub use registry::{ModelInfo, Registry};

/// A tool the model may call, with its parameters as JSON Schema.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub parameters: Value,
}

/// How hard a reasoning model should think.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reasoning {
    /// OpenAI `reasoning_effort`: `low`, `medium`, `high`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effort: Option<String>,
    /// Anthropic / Gemini thinking budget in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_tokens: Option<u32>,
}

/// One model call, in Arbor's terms.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChatRequest {
    /// The provider's name for the model (e.g. `gpt-4o-mini`).
    pub model: String,
    /// The system prompt; adapters place it where their provider wants it.
    pub system: Option<String>,
    /// The conversation path, oldest first. No `system` messages here.
    /// Shared with the conversation's tree, not copied from it.
    pub messages: Vec<SharedMessage>,
    pub tools: Vec<ToolSpec>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub reasoning: Option<Reasoning>,
}

/// Why the model stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
    ContentFilter,
    Other(String),
}

/// A normalised piece of a streamed reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Chunk {
    /// Answer text.
    Text(String),
    /// Reasoning text.
    Thinking(String),
    /// Closes the current thinking block, with the signature the provider
    /// gave it (to be sent back verbatim).
    ThinkingSignature(ProviderOpaque),
    /// A thinking block the provider encrypted.
    RedactedThinking(ProviderOpaque),
    /// A tool call begins. `index` identifies it among the reply's calls.
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// A fragment of a tool call's JSON arguments.
    ToolCallArguments {
        index: usize,
        fragment: String,
    },
    /// A tool call is complete; `signature` is opaque provider data that must
    /// go back with it (Gemini `thoughtSignature`).
    ToolCallEnd {
        index: usize,
        signature: Option<ProviderOpaque>,
    },
    /// Usage for the whole call (the last one reported wins).
    Usage(Usage),
    Finish(FinishReason),
}

pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<Chunk, ProviderError>> + Send>>;

/// A model provider: one wire protocol, one adapter.
#[async_trait::async_trait]
pub trait Provider: Send + Sync {
    /// The wire protocol (`openai`, `anthropic`, `gemini`, `demo`); opaque
    /// provider data is only sent back to an adapter of the same kind.
    fn kind(&self) -> &'static str;

    /// Starts a streamed call. Errors before the first byte of the body
    /// (HTTP status errors) are returned here; later ones come in the stream.
    async fn stream(&self, request: ChatRequest) -> Result<ChunkStream, ProviderError>;

    /// A non-streamed call. The default collects the stream.
    async fn complete(&self, request: ChatRequest) -> Result<Collected, ProviderError> {
        let stream = self.stream(request).await?;
        collect_stream(stream).await
    }
}
