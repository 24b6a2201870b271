//! What a mock server answers: a [`Reply`] is one scripted model response
//! (thinking, text and tool calls, in order, with usage and a stop reason) or
//! a recorded fixture served byte-for-byte, optionally with a [`Fault`] that
//! breaks it in a way real providers do. Replies say *what* happens; the
//! protocol modules say how it looks on each wire.

use std::path::{Path, PathBuf};
use std::time::Duration;

use arbor_core::Usage;
use bytes::Bytes;
use serde_json::Value;

/// The text a reply carries when a test did not script one.
pub(crate) const DEFAULT_TEXT: &str = "mock reply";

/// A longer default for fault replies, so that "stall after k chunks" has
/// chunks to count on every protocol.
const FAULT_TEXT: &str = "This scripted mock reply is streamed in many small chunks so faults can cut it anywhere.";

/// One model response as the mock should serve it.
#[derive(Debug, Clone)]
pub struct Reply {
    pub(crate) content: Content,
    pub(crate) fault: Option<Fault>,
    /// Pause before every chunk after the first, so clients see a real stream.
    pub(crate) chunk_delay: Duration,
    /// Pause before the status line and headers (time to first byte).
    pub(crate) header_delay: Duration,
    /// `None` means "make up plausible numbers" (see [`Reply::usage`]).
    pub(crate) usage: Option<Usage>,
    pub(crate) stop_reason: Option<StopReason>,
    /// Extra response headers, e.g. rate-limit headers a test wants to see.
    pub(crate) headers: Vec<(String, String)>,
    /// OpenAI-compatible servers (DeepSeek, Ollama, Groq) stream reasoning as
    /// text in a non-standard delta field; `None` keeps OpenAI's behaviour of
    /// reporting reasoning only as a token count.
    pub(crate) openai_reasoning_field: Option<String>,
}

#[derive(Debug, Clone)]
pub(crate) enum Content {
    Script(Vec<Block>),
    Fixture(Fixture),
}

/// One content block of a scripted reply, in the order the model produced it.
#[derive(Debug, Clone, PartialEq)]
pub enum Block {
    /// Reasoning text (sent as these deltas) and the provider's opaque
    /// signature that must come back verbatim on the next call.
    Thinking { deltas: Vec<String>, signature: String },
    /// Anthropic's encrypted reasoning; other protocols leave it out.
    RedactedThinking { data: String },
    /// Answer text, sent as these deltas.
    Text { deltas: Vec<String> },
    /// Tool calls made in parallel in one response.
    ToolCalls(Vec<MockToolCall>),
}

/// A tool call the mock model makes.
#[derive(Debug, Clone, PartialEq)]
pub struct MockToolCall {
    /// Sent as the call id (OpenAI, Anthropic). Gemini has no call ids on the
    /// wire, so there it is not sent at all.
    pub id: String,
    pub name: String,
    pub arguments: Value,
}

/// Why the model stopped, in Arbor's terms; each protocol spells it its own way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    EndTurn,
    MaxTokens,
    ToolUse,
    /// OpenAI `content_filter`, Anthropic `refusal`, Gemini `SAFETY`.
    ContentFilter,
}

/// A recorded response body with its status and headers.
#[derive(Debug, Clone)]
pub(crate) struct Fixture {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    /// The body cut into events (SSE) or kept whole (JSON); concatenated, it
    /// is the recorded body byte-for-byte.
    pub(crate) chunks: Vec<Bytes>,
}

/// A way for a provider call to go wrong. Chunk counts refer to the chunks
/// the protocol sends: one SSE event each (an Anthropic `event:`+`data:` pair
/// is one chunk), one array element for Gemini's JSON-array stream, and a
/// quarter of the body for a non-streaming JSON reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// Exactly this status, body and headers (content-type defaults to JSON).
    Status { status: u16, body: String, headers: Vec<(String, String)> },
    /// 429 in the provider's shape with its retry hint: `retry-after` (and
    /// OpenAI's `retry-after-ms`) headers for OpenAI and Anthropic; Gemini
    /// sends no such header, only `RetryInfo.retryDelay` in the body.
    RateLimited { retry_after_secs: u64 },
    /// 500 in the provider's shape.
    ServerError,
    /// 503 in the provider's shape.
    Unavailable,
    /// Anthropic 529 `overloaded_error`; 503 "overloaded" for the others.
    Overloaded,
    /// 400 context-length-exceeded in the provider's shape.
    ContextLength,
    /// Accept the connection and never send headers (until the server stops).
    HangBeforeHeaders,
    /// Send this many chunks, then keep the connection open and silent.
    StallAfterChunks(usize),
    /// Send this many chunks, then abort the connection without the
    /// terminating chunk (the client sees a body error).
    ResetAfterChunks(usize),
    /// The chunk at this 0-based index carries truncated, invalid JSON.
    MalformedChunk(usize),
    /// Every chunk arrives late: each is split in two writes (so the client
    /// sees events cut mid-line) and each write waits this long.
    SlowDrip(Duration),
    /// A 200 stream that, after this many chunks, carries the provider's own
    /// error event and ends: Anthropic `event: error` `overloaded_error`,
    /// OpenAI a `{"error":{...}}` data line, Gemini an error object. A
    /// non-streaming request gets the `Overloaded` status instead.
    InStreamError { after_chunks: usize },
}

impl Fault {
    pub fn status(status: u16, body: impl Into<String>) -> Self {
        Fault::Status { status, body: body.into(), headers: Vec::new() }
    }
    pub fn rate_limit(retry_after_secs: u64) -> Self {
        Fault::RateLimited { retry_after_secs }
    }
    pub fn server_error() -> Self {
        Fault::ServerError
    }
    pub fn unavailable() -> Self {
        Fault::Unavailable
    }
    pub fn overloaded() -> Self {
        Fault::Overloaded
    }
    pub fn context_length() -> Self {
        Fault::ContextLength
    }
    /// An in-stream error after two chunks (after the opening events, before
    /// the answer is complete).
    pub fn in_stream_error() -> Self {
        Fault::InStreamError { after_chunks: 2 }
    }
}

impl Default for Reply {
    fn default() -> Self {
        Reply::text(DEFAULT_TEXT)
    }
}

impl Reply {
    fn from_blocks(blocks: Vec<Block>) -> Self {
        Reply {
            content: Content::Script(blocks),
            fault: None,
            chunk_delay: Duration::ZERO,
            header_delay: Duration::ZERO,
            usage: None,
            stop_reason: None,
            headers: Vec::new(),
            openai_reasoning_field: None,
        }
    }

    /// A text answer, streamed one word (with its leading space) per delta.
    pub fn text(text: &str) -> Self {
        Reply::from_blocks(vec![Block::Text { deltas: split_words(text) }])
    }

    /// A text answer streamed as exactly these deltas.
    pub fn text_deltas<S: Into<String>>(deltas: impl IntoIterator<Item = S>) -> Self {
        Reply::from_blocks(vec![Block::Text { deltas: deltas.into_iter().map(Into::into).collect() }])
    }

    /// An answer with no content at all (models do send these).
    pub fn empty() -> Self {
        Reply::from_blocks(vec![Block::Text { deltas: Vec::new() }])
    }

    /// Parallel tool calls `(id, name, arguments)`.
    pub fn tool_calls<I, N>(calls: impl IntoIterator<Item = (I, N, Value)>) -> Self
    where
        I: Into<String>,
        N: Into<String>,
    {
        Reply::from_blocks(Vec::new()).then_tool_calls(calls)
    }

    /// A thinking block with its signature; chain `.then_text(..)` or
    /// `.then_tool_calls(..)` for what the model does after thinking.
    pub fn thinking(reasoning: &str, signature: &str) -> Self {
        Reply::from_blocks(Vec::new()).then_thinking(reasoning, signature)
    }

    /// The default text with a fault applied.
    pub fn fault(fault: Fault) -> Self {
        Reply::text(FAULT_TEXT).with_fault(fault)
    }

    /// A recorded body served byte-for-byte: `<case>.response.sse`,
    /// `<case>.response.json` or `<case>.chunks.jsonl` (each line becomes a
    /// `data:` event). Status and headers come from `<case>.meta.json` when
    /// it exists; otherwise 200 (see [`Reply::with_status`] for body-only
    /// error fixtures).
    pub fn fixture(path: impl AsRef<Path>) -> std::io::Result<Self> {
        Ok(Reply::raw(load_fixture(path.as_ref())?))
    }

    /// [`Reply::fixture`] for a path relative to the shared provider
    /// recordings, e.g. `"anthropic/stream-thinking.response.sse"`.
    pub fn provider_fixture(relative: &str) -> std::io::Result<Self> {
        Reply::fixture(provider_fixtures_dir().join(relative))
    }

    /// A 200 `text/event-stream` body served as given (cut into events at
    /// its blank lines, so chunk faults and delays still apply), for streams
    /// written by hand in a test.
    pub fn raw_sse(body: impl Into<Bytes>) -> Self {
        let headers = vec![("content-type".to_owned(), "text/event-stream".to_owned())];
        Reply::raw(Fixture { status: 200, headers, chunks: split_sse_events(body.into()) })
    }

    /// A JSON body with this status, served as given.
    pub fn raw_json(status: u16, body: impl Into<Bytes>) -> Self {
        let headers = vec![("content-type".to_owned(), "application/json".to_owned())];
        Reply::raw(Fixture { status, headers, chunks: vec![body.into()] })
    }

    fn raw(fixture: Fixture) -> Self {
        let mut reply = Reply::from_blocks(Vec::new());
        reply.content = Content::Fixture(fixture);
        reply
    }

    pub fn then_text(mut self, text: &str) -> Self {
        self.push_block(Block::Text { deltas: split_words(text) });
        self
    }

    pub fn then_thinking(mut self, reasoning: &str, signature: &str) -> Self {
        self.push_block(Block::Thinking { deltas: split_words(reasoning), signature: signature.to_owned() });
        self
    }

    pub fn then_redacted_thinking(mut self, data: &str) -> Self {
        self.push_block(Block::RedactedThinking { data: data.to_owned() });
        self
    }

    pub fn then_tool_calls<I, N>(mut self, calls: impl IntoIterator<Item = (I, N, Value)>) -> Self
    where
        I: Into<String>,
        N: Into<String>,
    {
        let calls = calls
            .into_iter()
            .map(|(id, name, arguments)| MockToolCall { id: id.into(), name: name.into(), arguments })
            .collect();
        self.push_block(Block::ToolCalls(calls));
        self
    }

    pub fn with_fault(mut self, fault: Fault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// Usage as Arbor counts it ([`arbor_core::Usage`]: input includes cached
    /// and cache-write tokens, output includes thinking tokens); each
    /// protocol splits it the way its provider reports it.
    pub fn with_usage(mut self, usage: Usage) -> Self {
        self.usage = Some(usage);
        self
    }

    pub fn with_chunk_delay(mut self, delay: Duration) -> Self {
        self.chunk_delay = delay;
        self
    }

    pub fn with_header_delay(mut self, delay: Duration) -> Self {
        self.header_delay = delay;
        self
    }

    pub fn with_stop_reason(mut self, stop_reason: StopReason) -> Self {
        self.stop_reason = Some(stop_reason);
        self
    }

    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Fixtures only: override the status (for body-only recordings).
    pub fn with_status(mut self, status: u16) -> Self {
        if let Content::Fixture(fixture) = &mut self.content {
            fixture.status = status;
        }
        self
    }

    /// OpenAI protocol only: stream thinking text in this delta field
    /// (`reasoning_content` like DeepSeek, `reasoning` like Ollama and Groq),
    /// as OpenAI-compatible servers do.
    pub fn with_openai_reasoning_field(mut self, field: &str) -> Self {
        self.openai_reasoning_field = Some(field.to_owned());
        self
    }

    /// The scripted blocks (empty for a fixture).
    pub fn blocks(&self) -> &[Block] {
        match &self.content {
            Content::Script(blocks) => blocks,
            Content::Fixture(_) => &[],
        }
    }

    /// The usage this reply reports: the configured one, else numbers that
    /// look real and are stable (input 10; output one per delta or argument
    /// fragment, at least 1; thinking one per thinking delta).
    pub fn usage(&self) -> Usage {
        if let Some(usage) = self.usage {
            return usage;
        }
        let mut output = 0u64;
        let mut thinking = 0u64;
        for block in self.blocks() {
            match block {
                Block::Thinking { deltas, .. } => thinking += deltas.len() as u64 + 1,
                Block::RedactedThinking { .. } => thinking += 1,
                Block::Text { deltas } => output += deltas.len() as u64,
                Block::ToolCalls(calls) => output += 5 * calls.len() as u64,
            }
        }
        Usage {
            input_tokens: 10,
            output_tokens: (output + thinking).max(1),
            thinking_tokens: thinking,
            ..Usage::default()
        }
    }

    /// The stop reason this reply reports: the configured one, else
    /// `ToolUse` when it calls tools and `EndTurn` otherwise.
    pub fn stop_reason(&self) -> StopReason {
        self.stop_reason.unwrap_or_else(|| {
            let calls_tools = self.blocks().iter().any(|b| matches!(b, Block::ToolCalls(c) if !c.is_empty()));
            if calls_tools { StopReason::ToolUse } else { StopReason::EndTurn }
        })
    }

    /// The fault, if any.
    pub fn fault_ref(&self) -> Option<&Fault> {
        self.fault.as_ref()
    }

    fn push_block(&mut self, block: Block) {
        if let Content::Script(blocks) = &mut self.content {
            blocks.push(block);
        }
    }
}

/// Where the shared provider recordings live: `ARBOR_FIXTURES_DIR` when set,
/// else `shared/fixtures/providers` beside the workspace.
pub fn provider_fixtures_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ARBOR_FIXTURES_DIR") {
        return PathBuf::from(dir);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/providers")
}

/// Splits text into word deltas (`"a b c"` → `["a", " b", " c"]`) whose
/// concatenation is the text, the way tokenizers tend to cut English.
pub(crate) fn split_words(text: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut previous_was_space = true;
    for (index, character) in text.char_indices() {
        let is_space = character.is_whitespace();
        if is_space && !previous_was_space && index > start {
            pieces.push(text[start..index].to_owned());
            start = index;
        }
        previous_was_space = is_space;
    }
    if start < text.len() {
        pieces.push(text[start..].to_owned());
    }
    pieces
}

/// Cuts a string into at most `parts` non-empty pieces on character
/// boundaries (for tool-call argument fragments).
pub(crate) fn split_in(text: &str, parts: usize) -> Vec<String> {
    let boundaries: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    let count = boundaries.len();
    if count == 0 {
        return Vec::new();
    }
    let parts = parts.clamp(1, count);
    let mut pieces = Vec::with_capacity(parts);
    for part in 0..parts {
        let from = boundaries[part * count / parts];
        let to = if part + 1 == parts { text.len() } else { boundaries[(part + 1) * count / parts] };
        pieces.push(text[from..to].to_owned());
    }
    pieces
}

fn load_fixture(path: &Path) -> std::io::Result<Fixture> {
    let body = std::fs::read(path)?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let (case, kind) = ["response.sse", "response.json", "chunks.jsonl"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix).map(|case| (case.trim_end_matches('.'), *suffix)))
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{}: a fixture must end in .response.sse, .response.json or .chunks.jsonl", path.display()),
            )
        })?;
    let meta_path = path.with_file_name(format!("{case}.meta.json"));
    let (status, mut headers) = match std::fs::read(&meta_path) {
        Ok(meta) => parse_meta(&meta).map_err(|error| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {error}", meta_path.display()))
        })?,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => (200, Vec::new()),
        Err(error) => return Err(error),
    };
    let chunks = match kind {
        "response.sse" => split_sse_events(Bytes::from(body)),
        "chunks.jsonl" => String::from_utf8_lossy(&body)
            .lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| Bytes::from(format!("data: {line}\n\n")))
            .collect(),
        _ => vec![Bytes::from(body)],
    };
    if !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("content-type")) {
        let content_type = if kind == "response.json" { "application/json" } else { "text/event-stream" };
        headers.push(("content-type".to_owned(), content_type.to_owned()));
    }
    Ok(Fixture { status, headers, chunks })
}

fn parse_meta(meta: &[u8]) -> Result<(u16, Vec<(String, String)>), serde_json::Error> {
    let meta: Value = serde_json::from_slice(meta)?;
    let response = &meta["response"];
    let status = response["status"].as_u64().and_then(|s| u16::try_from(s).ok()).unwrap_or(200);
    let headers = response["headers"]
        .as_object()
        .map(|headers| {
            headers
                .iter()
                .filter_map(|(name, value)| value.as_str().map(|value| (name.clone(), value.to_owned())))
                .collect()
        })
        .unwrap_or_default();
    Ok((status, headers))
}

/// Cuts a recorded SSE body after each blank line (`\n\n` or `\r\n\r\n`), so
/// chunk faults and delays fall between events as they would on the wire.
pub(crate) fn split_sse_events(body: Bytes) -> Vec<Bytes> {
    let mut events = Vec::new();
    let mut start = 0;
    let mut index = 0;
    while index < body.len() {
        let rest = &body[index..];
        let separator = if rest.starts_with(b"\r\n\r\n") {
            4
        } else if rest.starts_with(b"\n\n") {
            2
        } else {
            0
        };
        if separator > 0 {
            events.push(body.slice(start..index + separator));
            index += separator;
            start = index;
        } else {
            index += 1;
        }
    }
    if start < body.len() {
        events.push(body.slice(start..));
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_concatenate_back_to_the_text() {
        let text = "The capital  of France\nis Paris. ";
        let words = split_words(text);
        assert_eq!(words.concat(), text);
        assert_eq!(words[0], "The");
        assert_eq!(words[1], " capital");
        assert!(split_words("").is_empty());
    }

    #[test]
    fn fragments_respect_character_boundaries() {
        let text = r#"{"city":"Zürich 🌧"}"#;
        for parts in 1..30 {
            let pieces = split_in(text, parts);
            assert_eq!(pieces.concat(), text);
            assert!(pieces.iter().all(|p| !p.is_empty()));
        }
        assert_eq!(split_in("{}", 3), vec!["{", "}"]);
    }

    #[test]
    fn sse_bodies_split_into_whole_events() {
        let body = Bytes::from_static(b"data: 1\r\n\r\ndata: 2\r\n\r\nevent: x\ndata: 3\n\ntrailing");
        let events = split_sse_events(body.clone());
        assert_eq!(events.len(), 4);
        assert_eq!(&events[0][..], b"data: 1\r\n\r\n");
        assert_eq!(&events[2][..], b"event: x\ndata: 3\n\n");
        assert_eq!(events.concat(), body.to_vec());
    }

    #[test]
    fn default_usage_counts_thinking_inside_output() {
        let reply = Reply::thinking("a b c", "sig").then_text("x y");
        let usage = reply.usage();
        assert_eq!(usage.thinking_tokens, 4);
        assert_eq!(usage.output_tokens, 6);
        assert_eq!(reply.stop_reason(), StopReason::EndTurn);
        let tools = Reply::tool_calls([("c1", "f", serde_json::json!({}))]);
        assert_eq!(tools.stop_reason(), StopReason::ToolUse);
    }
}
