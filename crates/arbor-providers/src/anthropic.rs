//! The Anthropic Messages API adapter (`POST {base}/v1/messages`).
//!
//! Going out, Arbor's messages become Anthropic's strictly alternating
//! user/assistant turns: the system prompt moves to the top-level `system`
//! field, tool results become `tool_result` blocks in a user turn, and
//! thinking blocks that Anthropic signed go back byte-for-byte (a tool loop
//! with extended thinking is refused by the API otherwise), while thinking
//! from other providers is dropped. Coming back, the SSE events (one content
//! block at a time: text, thinking with its signature, redacted thinking,
//! `tool_use` with `input_json_delta` fragments) become [`Chunk`]s, and the
//! `{"type":"error"}` bodies and in-stream `error` events become
//! [`ProviderError`]s with Arbor's codes. The wire types are private to this
//! file; [`request_body`], [`StreamDecoder`], [`decode_body`],
//! [`response_chunks`] and [`error_from_response`] are public so that the
//! fixture tests and mock servers can drive each half on its own.

use std::collections::HashMap;

use arbor_core::json::Verbatim;
use arbor_core::message::ProviderOpaque;
use arbor_core::{ErrorCode, Message, Part, ProviderError, Role, SharedMessage, ToolStatus, Usage};
use bytes::Bytes;
use futures_util::Stream;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::decode::{self, Decode, Decoded};
use crate::http::{self, ErrorResponse, HttpClient, HttpRequest, HttpResponse, HttpTimeouts};
use crate::sse::{BodyError, SseEvent, sse_events};
use crate::written::{Elements, Kept};
use crate::{ChatRequest, Chunk, ChunkStream, Collected, FinishReason, Provider};

/// The provider kind, and the owner recorded on the opaque data (thinking
/// signatures, redacted thinking) this adapter produces and accepts back.
pub const KIND: &str = "anthropic";
pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";
/// The API version every request pins, so that a server-side default change
/// cannot change the wire format under us.
pub const API_VERSION: &str = "2023-06-01";
/// Anthropic requires `max_tokens`; this is used when the request has none.
pub const DEFAULT_MAX_TOKENS: u32 = 4096;

/// How to reach the Messages API.
#[derive(Clone)]
pub struct AnthropicConfig {
    /// Without the `/v1` suffix, e.g. `https://api.anthropic.com`.
    pub base_url: String,
    /// Sent as `x-api-key`. `None` only makes sense behind a proxy that adds
    /// the key itself (or against a mock server).
    pub api_key: Option<String>,
    /// The `anthropic-version` header.
    pub version: String,
    pub timeouts: HttpTimeouts,
}

impl Default for AnthropicConfig {
    fn default() -> AnthropicConfig {
        AnthropicConfig {
            base_url: DEFAULT_BASE_URL.into(),
            api_key: None,
            version: API_VERSION.into(),
            timeouts: HttpTimeouts::default(),
        }
    }
}

// The key is a secret: never print it, not even in debug logs.
impl std::fmt::Debug for AnthropicConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnthropicConfig")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("version", &self.version)
            .field("timeouts", &self.timeouts)
            .finish()
    }
}

/// The Anthropic adapter. Cheap to share: the HTTP client pools connections.
#[derive(Debug, Clone)]
pub struct AnthropicProvider {
    client: HttpClient,
    /// `{base_url}/v1/messages`, parsed once rather than on every request.
    uri: hyper::Uri,
    /// The headers every request carries: the API version and the key.
    headers: HeaderMap,
    /// The messages of recent long requests as written, shared by the
    /// clones: a conversation's next turn writes only what is new.
    written: Kept,
}

impl AnthropicProvider {
    pub fn new(config: AnthropicConfig) -> Result<AnthropicProvider, ProviderError> {
        let client = HttpClient::new(&config.timeouts)?;
        let base_url = config.base_url.trim().trim_end_matches('/');
        let uri = http::endpoint(&format!("{base_url}/v1/messages")).map_err(|error| {
            ProviderError::new(
                ErrorCode::InvalidRequest,
                format!("anthropic base_url {base_url:?} is not a valid URL: {error}"),
            )
        })?;
        let mut headers = HeaderMap::new();
        let version = HeaderValue::from_str(&config.version).map_err(|_| {
            ProviderError::new(
                ErrorCode::InvalidRequest,
                format!("anthropic version {:?} is not valid in an HTTP header", config.version),
            )
        })?;
        headers.insert(HeaderName::from_static("anthropic-version"), version);
        let key = config.api_key.as_deref().map(|key| (HeaderName::from_static("x-api-key"), key));
        Ok(AnthropicProvider { client, uri, headers: http::request_headers(headers, key)?, written: Kept::shared() })
    }

    /// The body sent for `request`: the messages a recent long request
    /// shares with it are not written again.
    fn body(&self, request: &ChatRequest, stream: bool) -> Result<Vec<u8>, ProviderError> {
        body_in(&self.written, request, stream)
    }

    /// Sends the request and returns the response if its status is a
    /// success; any other status becomes the mapped error.
    async fn send(&self, body: Vec<u8>) -> Result<HttpResponse, ProviderError> {
        let request = HttpRequest { uri: self.uri.clone(), headers: self.headers.clone(), body: body.into() };
        http::send(&self.client, request, error_from_response).await
    }
}

#[async_trait::async_trait]
impl Provider for AnthropicProvider {
    fn kind(&self) -> &'static str {
        KIND
    }

    async fn stream(&self, request: ChatRequest) -> Result<ChunkStream, ProviderError> {
        let body = self.body(&request, true)?;
        let response = self.send(body).await?;
        Ok(decode_body(response.into_stream()))
    }

    async fn complete(&self, request: ChatRequest) -> Result<Collected, ProviderError> {
        let body = self.body(&request, false)?;
        let response = self.send(body).await?;
        let bytes = response.bytes().await?;
        let mut collected = Collected::default();
        for chunk in response_chunks(&bytes)? {
            collected.push(&chunk);
        }
        Ok(collected.finish())
    }
}

// ---------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------

#[derive(Debug, Serialize)]
struct MessagesRequest<'a> {
    model: &'a str,
    max_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<&'a str>,
    messages: Verbatim<'a>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking: Option<ThinkingConfig>,
    stream: bool,
}

#[derive(Debug, Serialize)]
struct ThinkingConfig {
    #[serde(rename = "type")]
    kind: &'static str,
    budget_tokens: u32,
}

#[derive(Debug, Serialize)]
struct WireTool<'a> {
    name: &'a str,
    description: &'a str,
    input_schema: &'a Value,
}

#[derive(Debug, Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    content: Vec<Block<'a>>,
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block<'a> {
    Text {
        text: &'a str,
    },
    Image {
        source: ImageSource<'a>,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: &'a Value,
    },
    ToolResult {
        tool_use_id: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        content: Option<&'a str>,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        is_error: bool,
    },
    Thinking {
        thinking: &'a str,
        signature: &'a str,
    },
    RedactedThinking {
        data: &'a str,
    },
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ImageSource<'a> {
    Base64 { media_type: &'a str, data: &'a str },
    Url { url: &'a str },
}

/// The request body Arbor sends for `request`, as JSON (for tests, mocks and
/// debugging): the bytes the provider would send, written whole (nothing
/// kept to reuse), read back.
pub fn request_body(request: &ChatRequest, stream: bool) -> Result<Value, ProviderError> {
    serde_json::from_slice(&body_in(&Kept::alone(), request, stream)?).map_err(http::not_encoded)
}

/// The body for `request`, reusing what `written` kept.
fn body_in(written: &Kept, request: &ChatRequest, stream: bool) -> Result<Vec<u8>, ProviderError> {
    written.body(
        &request.messages,
        request.messages.len(),
        Elements::default().cut_at_starts(),
        wire_messages,
        |body, messages| arbor_core::json::write(body, &build_request(request, messages, stream)),
    )
}

/// The request as sent: `messages` is the JSON array of its messages.
fn build_request<'a>(request: &'a ChatRequest, messages: &'a str, stream: bool) -> MessagesRequest<'a> {
    let budget =
        request.reasoning.as_ref().and_then(thinking_budget).filter(|_| !unsigned_tool_loop(&request.messages));
    let thinking = budget.map(|budget_tokens| ThinkingConfig { kind: "enabled", budget_tokens });
    // `max_tokens` must exceed the thinking budget; when the caller left it
    // open, leave room for an answer after the thinking.
    let max_tokens = request.max_output_tokens.unwrap_or_else(|| match budget {
        Some(budget) => DEFAULT_MAX_TOKENS.max(budget.saturating_add(DEFAULT_MAX_TOKENS)),
        None => DEFAULT_MAX_TOKENS,
    });
    // With thinking on, the API refuses any temperature but 1; dropping a
    // configured temperature is kinder than failing every call.
    let temperature = match (thinking.is_some(), request.temperature) {
        (true, Some(temperature)) if temperature != 1.0 => None,
        (_, temperature) => temperature,
    };
    let tools = request
        .tools
        .iter()
        .map(|tool| WireTool { name: &tool.name, description: &tool.description, input_schema: &tool.parameters })
        .collect();
    MessagesRequest {
        model: &request.model,
        max_tokens,
        system: request.system.as_deref().filter(|system| !system.is_empty()),
        messages: Verbatim(messages),
        tools,
        temperature,
        thinking,
        stream,
    }
}

/// The thinking budget a request asks for. An effort without a budget (the
/// OpenAI way of asking) still turns thinking on, with a budget of that
/// size; Anthropic's minimum budget is 1024 tokens.
fn thinking_budget(reasoning: &crate::Reasoning) -> Option<u32> {
    if let Some(budget) = reasoning.budget_tokens {
        return Some(budget);
    }
    let budget = match reasoning.effort.as_deref()? {
        "minimal" | "low" => 1024,
        "high" => 16384,
        _ => 4096,
    };
    Some(budget)
}

/// Whether the tool loop in progress (the assistant message after the last
/// user message) called tools without a thinking block Claude signed: a
/// conversation that moved to Claude mid-loop. With thinking on, the API
/// refuses such a history ("a final assistant message must start with a
/// thinking block"), so this one call goes without thinking; the next user
/// message starts a fresh loop where thinking is on again.
fn unsigned_tool_loop(messages: &[SharedMessage]) -> bool {
    let current = messages.iter().rposition(|message| message.role == Role::User).map_or(0, |last| last + 1);
    let Some(last_assistant) = messages[current..].iter().rev().find(|message| message.role == Role::Assistant) else {
        return false;
    };
    let signed = last_assistant.parts.iter().any(|part| match part {
        Part::Thinking { signature: Some(signature), .. } => signature.provider == KIND,
        Part::RedactedThinking { data } => data.provider == KIND,
        _ => false,
    });
    !last_assistant.tool_calls.is_empty() && !signed
}

/// Appends Arbor's path to `elements` as alternating turns. Consecutive
/// messages of one side are merged into one turn, because the API wants
/// user and assistant to alternate and wants all results of one round of
/// tool calls in the single user turn that follows it. So a turn is
/// written when the next one starts (or at the end), and the text can be
/// cut only there.
fn wire_messages<'a>(messages: &'a [SharedMessage], elements: &mut Elements) -> Result<(), ProviderError> {
    let mut open: Option<WireMessage<'a>> = None;
    for message in messages {
        let (role, blocks) = match message.role {
            // The system prompt travels in `ChatRequest::system`; a stray
            // system message in the path is kept as user text rather than
            // silently lost.
            Role::User | Role::System => ("user", user_blocks(message)?),
            Role::Tool => ("user", vec![tool_result_block(message)?]),
            Role::Assistant => ("assistant", assistant_blocks(message)),
        };
        if !blocks.is_empty() {
            match &mut open {
                Some(turn) if turn.role == role => turn.content.extend(blocks),
                _ => {
                    if let Some(closed) = open.replace(WireMessage { role, content: blocks }) {
                        elements.push(&closed)?;
                        elements.cut_before();
                    }
                }
            }
        }
        elements.end_message(false);
    }
    if let Some(closed) = open {
        elements.push(&closed)?;
    }
    Ok(())
}

fn user_blocks(message: &Message) -> Result<Vec<Block<'_>>, ProviderError> {
    let mut blocks = Vec::new();
    // Images first: Anthropic documents that Claude does best with the
    // images before the question about them.
    for part in &message.parts {
        if let Part::Image { url, data, mime_type, .. } = part {
            blocks.push(Block::Image { source: image_source(url.as_deref(), data.as_deref(), mime_type.as_deref())? });
        }
    }
    // The API refuses empty text blocks.
    if let Some(text) = message.content.as_deref().filter(|text| !text.is_empty()) {
        blocks.push(Block::Text { text });
    }
    Ok(blocks)
}

fn image_source<'a>(
    url: Option<&'a str>,
    data: Option<&'a str>,
    mime_type: Option<&'a str>,
) -> Result<ImageSource<'a>, ProviderError> {
    if let Some(data) = data {
        let media_type = mime_type.unwrap_or_else(|| sniff_image_type(data));
        return Ok(ImageSource::Base64 { media_type, data });
    }
    match url {
        // A data URL is base64 in disguise; the url source only fetches
        // http(s).
        Some(url) => match parse_data_url(url) {
            Some((media_type, data)) => Ok(ImageSource::Base64 { media_type, data }),
            None => Ok(ImageSource::Url { url }),
        },
        None => Err(ProviderError::new(
            ErrorCode::InvalidRequest,
            "an image part has neither a url nor data; the engine must resolve media before the call",
        )),
    }
}

/// `data:image/png;base64,AAAA` → (`image/png`, `AAAA`).
pub(crate) fn parse_data_url(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("data:")?;
    let (header, data) = rest.split_once(',')?;
    let media_type = header.strip_suffix(";base64")?;
    Some((media_type, data))
}

/// The image type from the first bytes of its base64, for parts stored
/// without a mime type (the API requires one).
pub(crate) fn sniff_image_type(base64: &str) -> &'static str {
    if base64.starts_with("iVBOR") {
        "image/png"
    } else if base64.starts_with("R0lG") {
        "image/gif"
    } else if base64.starts_with("UklGR") {
        "image/webp"
    } else {
        "image/jpeg"
    }
}

fn tool_result_block(message: &Message) -> Result<Block<'_>, ProviderError> {
    let tool_use_id = message
        .tool_call_id
        .as_deref()
        .ok_or_else(|| ProviderError::new(ErrorCode::InvalidRequest, "a tool result message has no tool_call_id"))?;
    let is_error = matches!(message.tool_status, Some(ToolStatus::Error | ToolStatus::Cancelled | ToolStatus::Denied));
    Ok(Block::ToolResult { tool_use_id, content: message.content.as_deref().filter(|text| !text.is_empty()), is_error })
}

fn assistant_blocks(message: &Message) -> Vec<Block<'_>> {
    let mut blocks = Vec::new();
    // Thinking comes first in an assistant turn, as the model wrote it. Only
    // blocks this provider signed can go back: the API verifies signatures,
    // and unsigned reasoning (another provider's) means nothing to it.
    for part in &message.parts {
        match part {
            Part::Thinking { text, signature: Some(signature) } if signature.provider == KIND => {
                blocks.push(Block::Thinking { thinking: text, signature: &signature.data })
            }
            Part::RedactedThinking { data } if data.provider == KIND => {
                blocks.push(Block::RedactedThinking { data: &data.data })
            }
            _ => {}
        }
    }
    if let Some(text) = message.content.as_deref().filter(|text| !text.is_empty()) {
        blocks.push(Block::Text { text });
    }
    for call in &message.tool_calls {
        blocks.push(Block::ToolUse { id: &call.id, name: &call.name, input: &call.arguments });
    }
    blocks
}

// ---------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------

#[derive(Debug, Default, Clone, Copy, Deserialize)]
struct WireUsage {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
}

impl WireUsage {
    /// `message_delta` repeats the counts it knows (cumulatively); older
    /// API versions only send `output_tokens` there.
    fn update(&mut self, newer: &WireUsage) {
        self.input_tokens = newer.input_tokens.or(self.input_tokens);
        self.output_tokens = newer.output_tokens.or(self.output_tokens);
        self.cache_creation_input_tokens = newer.cache_creation_input_tokens.or(self.cache_creation_input_tokens);
        self.cache_read_input_tokens = newer.cache_read_input_tokens.or(self.cache_read_input_tokens);
    }

    /// Anthropic counts cached and cache-written input apart from
    /// `input_tokens`; Arbor's input is all of it.
    fn to_usage(self) -> Usage {
        let cached = self.cache_read_input_tokens.unwrap_or(0);
        let written = self.cache_creation_input_tokens.unwrap_or(0);
        Usage {
            input_tokens: self.input_tokens.unwrap_or(0) + cached + written,
            output_tokens: self.output_tokens.unwrap_or(0),
            thinking_tokens: 0,
            cached_tokens: cached,
            cache_write_tokens: written,
        }
    }
}

#[derive(Debug, Deserialize)]
struct MessagesResponse {
    #[serde(default)]
    content: Vec<ResponseBlock>,
    stop_reason: Option<String>,
    #[serde(default)]
    usage: WireUsage,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ResponseBlock {
    Text {
        text: String,
    },
    Thinking {
        thinking: String,
        #[serde(default)]
        signature: String,
    },
    RedactedThinking {
        data: String,
    },
    ToolUse {
        id: String,
        name: String,
        #[serde(default)]
        input: Value,
    },
    /// Server tools and their results, and block types newer than this
    /// adapter: the API ran them itself, Arbor has nothing to do.
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum StreamEvent {
    MessageStart {
        message: StartMessage,
    },
    ContentBlockStart {
        index: usize,
        content_block: ResponseBlock,
    },
    ContentBlockDelta {
        index: usize,
        delta: Delta,
    },
    ContentBlockStop {
        index: usize,
    },
    MessageDelta {
        delta: MessageDeltaBody,
        #[serde(default)]
        usage: Option<WireUsage>,
    },
    MessageStop,
    Error {
        error: WireError,
    },
    /// `ping` and any event type newer than this adapter.
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
struct StartMessage {
    #[serde(default)]
    usage: WireUsage,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type")]
enum Delta {
    #[serde(rename = "text_delta")]
    Text { text: String },
    #[serde(rename = "thinking_delta")]
    Thinking { thinking: String },
    #[serde(rename = "signature_delta")]
    Signature { signature: String },
    #[serde(rename = "input_json_delta")]
    InputJson { partial_json: String },
    /// `citations_delta` and newer kinds.
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
struct MessageDeltaBody {
    stop_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ErrorBody {
    error: WireError,
}

#[derive(Debug, Deserialize)]
struct WireError {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    message: String,
    #[serde(default)]
    details: Option<Value>,
}

fn finish_reason(stop_reason: &str) -> FinishReason {
    match stop_reason {
        "end_turn" | "stop_sequence" => FinishReason::Stop,
        "max_tokens" | "model_context_window_exceeded" => FinishReason::Length,
        "tool_use" => FinishReason::ToolCalls,
        "refusal" => FinishReason::ContentFilter,
        other => FinishReason::Other(other.to_string()),
    }
}

fn signed(data: String) -> ProviderOpaque {
    ProviderOpaque { provider: KIND.into(), data }
}

fn unreadable(what: &str, error: &serde_json::Error) -> ProviderError {
    ProviderError::new(ErrorCode::StreamInterrupted, format!("the provider sent an unreadable {what}: {error}"))
}

/// A non-streamed reply as the chunks a stream of it would have carried, so
/// that `complete` and `stream` fold through the same [`Collected`].
pub fn response_chunks(body: &[u8]) -> Result<Vec<Chunk>, ProviderError> {
    let response: MessagesResponse = serde_json::from_slice(body).map_err(|error| unreadable("response", &error))?;
    let mut chunks = Vec::new();
    let mut calls = 0;
    for block in response.content {
        match block {
            ResponseBlock::Text { text } => chunks.push(Chunk::Text(text)),
            ResponseBlock::Thinking { thinking, signature } => {
                chunks.push(Chunk::Thinking(thinking));
                if !signature.is_empty() {
                    chunks.push(Chunk::ThinkingSignature(signed(signature)));
                }
            }
            ResponseBlock::RedactedThinking { data } => chunks.push(Chunk::RedactedThinking(signed(data))),
            ResponseBlock::ToolUse { id, name, input } => {
                let index = calls;
                calls += 1;
                chunks.push(Chunk::ToolCallStart { index, id, name });
                chunks.push(Chunk::ToolCallArguments { index, fragment: arguments_text(&input) });
                chunks.push(Chunk::ToolCallEnd { index, signature: None });
            }
            ResponseBlock::Other => {}
        }
    }
    chunks.push(Chunk::Usage(response.usage.to_usage()));
    if let Some(reason) = response.stop_reason {
        chunks.push(Chunk::Finish(finish_reason(&reason)));
    }
    Ok(chunks)
}

/// A tool's input as argument text: `{}` for none, so that the fold always
/// sees an object.
fn arguments_text(input: &Value) -> String {
    match input {
        Value::Null => "{}".into(),
        other => other.to_string(),
    }
}

/// What a content block of the stream is, between its start and stop.
#[derive(Debug)]
enum OpenBlock {
    Text,
    Thinking {
        signature: String,
    },
    ToolUse {
        call: usize,
        /// The input given whole in `content_block_start`, used only when no
        /// `input_json_delta` follows (the deltas are the input otherwise).
        initial_input: Value,
        streamed: bool,
    },
    Ignored,
}

/// Turns the Messages API's stream events into chunks, one event at a time.
/// Feed it each event's `data`; call [`StreamDecoder::finish`] when the body
/// ends.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    blocks: HashMap<usize, OpenBlock>,
    calls: usize,
    usage: WireUsage,
    stopped: bool,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// The chunks one event's data carries. An `error` event becomes the
    /// error; so does data that is not a readable event.
    pub fn push(&mut self, data: &str) -> Result<Vec<Chunk>, ProviderError> {
        let event: StreamEvent = serde_json::from_str(data).map_err(|error| unreadable("stream event", &error))?;
        let mut chunks = Vec::new();
        match event {
            StreamEvent::MessageStart { message } => self.usage.update(&message.usage),
            StreamEvent::ContentBlockStart { index, content_block } => {
                let block = match content_block {
                    ResponseBlock::Text { text } => {
                        if !text.is_empty() {
                            chunks.push(Chunk::Text(text));
                        }
                        OpenBlock::Text
                    }
                    ResponseBlock::Thinking { thinking, signature } => {
                        if !thinking.is_empty() {
                            chunks.push(Chunk::Thinking(thinking));
                        }
                        OpenBlock::Thinking { signature }
                    }
                    ResponseBlock::RedactedThinking { data } => {
                        chunks.push(Chunk::RedactedThinking(signed(data)));
                        OpenBlock::Ignored
                    }
                    ResponseBlock::ToolUse { id, name, input } => {
                        let call = self.calls;
                        self.calls += 1;
                        chunks.push(Chunk::ToolCallStart { index: call, id, name });
                        OpenBlock::ToolUse { call, initial_input: input, streamed: false }
                    }
                    ResponseBlock::Other => OpenBlock::Ignored,
                };
                self.blocks.insert(index, block);
            }
            StreamEvent::ContentBlockDelta { index, delta } => {
                match (self.blocks.get_mut(&index), delta) {
                    (Some(OpenBlock::Text), Delta::Text { text }) if !text.is_empty() => chunks.push(Chunk::Text(text)),
                    (Some(OpenBlock::Thinking { .. }), Delta::Thinking { thinking }) if !thinking.is_empty() => {
                        chunks.push(Chunk::Thinking(thinking))
                    }
                    (Some(OpenBlock::Thinking { signature }), Delta::Signature { signature: more }) => {
                        signature.push_str(&more)
                    }
                    (Some(OpenBlock::ToolUse { call, streamed, .. }), Delta::InputJson { partial_json }) => {
                        *streamed = true;
                        // An empty fragment is how a parameterless call says
                        // "no input"; the fold reads no text as `{}`.
                        if !partial_json.is_empty() {
                            chunks.push(Chunk::ToolCallArguments { index: *call, fragment: partial_json });
                        }
                    }
                    // Deltas of ignored blocks (a server tool's input) and
                    // delta kinds this adapter does not know.
                    _ => {}
                }
            }
            StreamEvent::ContentBlockStop { index } => match self.blocks.remove(&index) {
                Some(OpenBlock::Thinking { signature }) if !signature.is_empty() => {
                    chunks.push(Chunk::ThinkingSignature(signed(signature)))
                }
                Some(OpenBlock::ToolUse { call, initial_input, streamed }) => {
                    let given = matches!(&initial_input, Value::Object(map) if !map.is_empty());
                    if !streamed && given {
                        chunks.push(Chunk::ToolCallArguments { index: call, fragment: initial_input.to_string() });
                    }
                    chunks.push(Chunk::ToolCallEnd { index: call, signature: None });
                }
                _ => {}
            },
            StreamEvent::MessageDelta { delta, usage } => {
                if let Some(usage) = usage {
                    self.usage.update(&usage);
                }
                chunks.push(Chunk::Usage(self.usage.to_usage()));
                if let Some(reason) = delta.stop_reason {
                    chunks.push(Chunk::Finish(finish_reason(&reason)));
                }
            }
            StreamEvent::MessageStop => self.stopped = true,
            StreamEvent::Error { error } => return Err(map_error(None, error)),
            StreamEvent::Other => {}
        }
        Ok(chunks)
    }

    /// The body ended. A stream that stops before `message_stop` was cut
    /// off, and its reply must not pass for a complete one.
    pub fn finish(self) -> Result<Vec<Chunk>, ProviderError> {
        if self.stopped {
            Ok(Vec::new())
        } else {
            Err(ProviderError::new(ErrorCode::StreamInterrupted, "the provider's stream ended before message_stop"))
        }
    }
}

/// Decodes a streamed response body (SSE) into chunks. The stream ends
/// after the first error.
pub fn decode_body<S, E>(body: S) -> ChunkStream
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: BodyError + Send + 'static,
{
    decode_events(sse_events(body))
}

/// Decodes already-framed events (the recorded `chunks.jsonl` fixtures have
/// no SSE framing).
pub fn decode_events<S>(events: S) -> ChunkStream
where
    S: Stream<Item = Result<SseEvent, ProviderError>> + Send + 'static,
{
    Box::pin(decode::drive(events, StreamDecoder::new()))
}

impl Decode for StreamDecoder {
    type Piece = SseEvent;
    type Item = Chunk;

    fn feed(&mut self, event: SseEvent, out: &mut Decoded<Chunk>) {
        decode::items(event.text().and_then(|data| self.push(data)), out);
    }

    fn end(self, out: &mut Decoded<Chunk>) {
        decode::items(self.finish(), out);
    }
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// The error an HTTP failure stands for: the body's `error.type` decides,
/// the status is the fallback, and the provider's message is kept.
pub fn error_from_response(response: &ErrorResponse) -> ProviderError {
    let error = match serde_json::from_str::<ErrorBody>(&response.body) {
        Ok(body) => map_error(Some(response.status), body.error),
        Err(_) => ProviderError::new(crate::http::status_code(response.status), response.fallback_message()),
    };
    ProviderError { status: Some(response.status), retry_after: crate::http::retry_after(&response.headers), ..error }
}

/// An Anthropic error object (from a body or an in-stream `error` event).
fn map_error(status: Option<u16>, error: WireError) -> ProviderError {
    let code = match error.kind.as_str() {
        "invalid_request_error" if crate::http::mentions_context_length(&error.message) => {
            ErrorCode::ContextLengthExceeded
        }
        "invalid_request_error" => ErrorCode::InvalidRequest,
        "authentication_error" => ErrorCode::Authentication,
        "permission_error" | "billing_error" => ErrorCode::Permission,
        "not_found_error" => ErrorCode::NotFound,
        "request_too_large" => ErrorCode::ContextLengthExceeded,
        // A spending limit is a 429 too, but waiting will not lift it.
        "rate_limit_error" if spend_limit_reached(error.details.as_ref()) => ErrorCode::Permission,
        "rate_limit_error" => ErrorCode::RateLimit,
        "api_error" => ErrorCode::ProviderUnavailable,
        "overloaded_error" => ErrorCode::Overloaded,
        "timeout_error" => ErrorCode::Timeout,
        _ => status.map_or(ErrorCode::ProviderUnavailable, crate::http::status_code),
    };
    let message = if error.message.is_empty() { error.kind } else { error.message };
    ProviderError::new(code, message)
}

fn spend_limit_reached(details: Option<&Value>) -> bool {
    details.and_then(|details| details.get("error_code")).and_then(Value::as_str)
        == Some("enforced_spend_limit_reached")
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_core::ToolCall;
    use serde_json::json;

    #[test]
    fn a_base_url_that_is_not_a_url_is_refused_when_the_provider_is_made() {
        let made = |base_url: &str| {
            AnthropicProvider::new(AnthropicConfig { base_url: base_url.into(), ..Default::default() })
        };
        let error = made("not a url").expect_err("refused");
        assert_eq!(error.code, ErrorCode::InvalidRequest);
        assert!(error.message.contains("not a url"), "{}", error.message);
        let provider = made("http://127.0.0.1:9/ ").expect("a URL");
        assert_eq!(provider.uri.to_string(), "http://127.0.0.1:9/v1/messages");
    }

    /// A long conversation's turns, one after another, with runs that
    /// merge into one turn (tool results, two user messages in a row), a
    /// message that writes nothing and signed thinking: each body equals
    /// the one a provider that keeps nothing writes, and a turn writes only
    /// from the last turn it shares with the request before.
    #[test]
    fn a_long_conversations_bodies_are_written_as_if_whole_and_only_their_new_turns_are() {
        let exchange = |index: usize| -> Vec<Message> {
            let calls: Vec<ToolCall> = (0..2)
                .map(|n| ToolCall {
                    id: format!("c{index}-{n}"),
                    name: "look".into(),
                    arguments: json!({"n": n}),
                    signature: None,
                })
                .collect();
            let mut thinking = Message { tool_calls: calls.clone(), content: None, ..Message::assistant("") };
            thinking.parts.push(Part::Thinking {
                text: "hmm".into(),
                signature: Some(ProviderOpaque { provider: KIND.into(), data: format!("sig{index}") }),
            });
            let mut turn = vec![Message::user(format!("question {index}")), thinking];
            turn.extend(calls.iter().map(|call| Message::tool_result(call, ToolStatus::Success, "\"seen\"\n")));
            crate::written::tests::answer(index, &mut turn);
            turn
        };
        let request = |messages: &[SharedMessage]| ChatRequest {
            model: "m".into(),
            messages: messages.to_vec(),
            ..ChatRequest::default()
        };
        // Its own list, which no other test pushes its paths out of.
        let keeping = AnthropicProvider {
            written: Kept::alone(),
            ..AnthropicProvider::new(AnthropicConfig::default()).expect("made")
        };
        let check = |messages: &[SharedMessage], label: &str| {
            let whole = body_in(&Kept::alone(), &request(messages), true).expect("body");
            let body = keeping.body(&request(messages), true).expect("body");
            assert_eq!(String::from_utf8(body).unwrap(), String::from_utf8(whole).unwrap(), "{label}");
            let value = request_body(&request(messages), true).expect("body");
            let turns = value["messages"].as_array().expect("turns");
            assert!(turns.windows(2).all(|pair| pair[0]["role"] != pair[1]["role"]), "{label}: turns alternate");
        };

        let mut trunk: Vec<SharedMessage> = SharedMessage::all((0..12).flat_map(exchange));
        check(&trunk, "first turn");
        trunk.extend(SharedMessage::all([Message::assistant("reply"), Message::user("next")]));
        check(&trunk, "grown by a reply and a question");
        // The last message's turn is open: written again, with the one
        // before it when that one's end is not where a turn starts.
        assert!(keeping.written.reusable(&trunk) >= trunk.len() - 2, "all but the end kept");
        check(&trunk, "the same path again");
        // The reply's turn was closed because the question started one:
        // another assistant message in the question's place joins it.
        let mut replaced = trunk[..trunk.len() - 1].to_vec();
        replaced.push(SharedMessage::from(Message::assistant("said more")));
        check(&replaced, "a message of the same side where a turn started");
        check(&trunk, "and back");

        crate::written::tests::check_variations(&trunk, check, |fork| {
            let reused = keeping.written.reusable(&trunk);
            assert!((fork - 8..=fork + 1).contains(&reused), "up to the last turn before the fork: {reused}");
        });
        let mut empty = trunk.clone();
        empty.extend(SharedMessage::all([Message::assistant(""), Message::user("after nothing")]));
        check(&empty, "an assistant message that writes nothing, then one that joins the last turn");
    }

    #[test]
    fn data_urls_split_into_type_and_base64() {
        assert_eq!(parse_data_url("data:image/png;base64,iVBORw0"), Some(("image/png", "iVBORw0")));
        assert_eq!(parse_data_url("https://example.com/a.png"), None);
        assert_eq!(parse_data_url("data:text/plain,hello"), None);
    }

    #[test]
    fn thinking_changes_max_tokens_default_and_drops_other_temperatures() {
        let request = ChatRequest {
            model: "claude-sonnet-4-5".into(),
            messages: SharedMessage::all([Message::user("hi")]),
            temperature: Some(0.3),
            reasoning: Some(crate::Reasoning { effort: None, budget_tokens: Some(8000) }),
            ..ChatRequest::default()
        };
        let body = request_body(&request, true).expect("builds");
        assert_eq!(body["max_tokens"], 12096);
        assert_eq!(body["thinking"], json!({"type": "enabled", "budget_tokens": 8000}));
        assert!(body.get("temperature").is_none());
        let effort = ChatRequest {
            reasoning: Some(crate::Reasoning { effort: Some("high".into()), budget_tokens: None }),
            ..request.clone()
        };
        let body = request_body(&effort, true).expect("builds");
        assert_eq!(body["thinking"], json!({"type": "enabled", "budget_tokens": 16384}));
        let plain = ChatRequest { reasoning: None, ..request };
        let body = request_body(&plain, false).expect("builds");
        assert_eq!(body["max_tokens"], DEFAULT_MAX_TOKENS);
        assert!(body["temperature"].as_f64().is_some());
        assert_eq!(body["stream"], false);
    }

    #[test]
    fn tool_results_merge_into_one_user_turn_with_errors_flagged() {
        let first = ToolCall { id: "toolu_1".into(), name: "add".into(), arguments: json!({"a": 1}), signature: None };
        let second = ToolCall { id: "toolu_2".into(), name: "add".into(), arguments: json!({}), signature: None };
        let mut assistant = Message::assistant("");
        assistant.content = None;
        assistant.tool_calls = vec![first.clone(), second.clone()];
        let request = ChatRequest {
            model: "m".into(),
            messages: SharedMessage::all([
                Message::user("add"),
                assistant,
                Message::tool_result(&first, ToolStatus::Success, "2"),
                Message::tool_result(&second, ToolStatus::Denied, "the user said no"),
                Message::user("and now?"),
            ]),
            ..ChatRequest::default()
        };
        let body = request_body(&request, true).expect("builds");
        assert_eq!(
            body["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "add"}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}},
                    {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "the user said no", "is_error": true},
                    {"type": "text", "text": "and now?"}
                ]}
            ])
        );
    }

    #[test]
    fn a_stream_cut_before_message_stop_is_an_interruption() {
        let mut decoder = StreamDecoder::new();
        let chunks = decoder
            .push(r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":"Hi"}}"#)
            .expect("valid");
        assert_eq!(chunks, vec![Chunk::Text("Hi".into())]);
        let error = decoder.finish().expect_err("cut off");
        assert_eq!(error.code, ErrorCode::StreamInterrupted);
    }
}
