//! The Anthropic Messages wire format, as `api.anthropic.com` sends it
//! (compare `shared/fixtures/providers/anthropic/`): `message_start`, then per
//! content block `content_block_start` / `content_block_delta` /
//! `content_block_stop` (thinking with `thinking_delta`s and one
//! `signature_delta`, text with `text_delta`s, tool use with
//! `input_json_delta` fragments), a `ping` after the first block opens,
//! `message_delta` with the stop reason and cumulative usage, and
//! `message_stop`. Like the real API, `data:` lines carry stray spaces before
//! their closing brace, so a client that compares bytes instead of parsing
//! JSON fails here first. Errors are compact `{"type":"error",...}` bodies.

use arbor_core::Usage;
use bytes::Bytes;
use serde::Serialize;
use serde_json::Value;

use super::reply::{Block, Reply, StopReason, split_in};
use super::wire::{CannedError, Framing, Rendered, RequestInfo, compact};

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum StreamEvent<'a> {
    MessageStart { message: MessageBody<'a> },
    ContentBlockStart { index: usize, content_block: ContentBlock<'a> },
    ContentBlockDelta { index: usize, delta: BlockDelta<'a> },
    ContentBlockStop { index: usize },
    MessageDelta { delta: MessageDeltaBody, usage: UsageBody },
    MessageStop,
}

impl StreamEvent<'_> {
    fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
        }
    }
}

#[derive(Serialize)]
struct MessageBody<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: &'a str,
    content: Vec<ContentBlock<'a>>,
    stop_reason: Option<&'static str>,
    stop_sequence: Option<()>,
    usage: UsageBody,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ContentBlock<'a> {
    Thinking { thinking: String, signature: &'a str },
    RedactedThinking { data: &'a str },
    Text { text: String },
    ToolUse { id: &'a str, name: &'a str, input: Value },
}

#[derive(Serialize)]
#[serde(tag = "type")]
enum BlockDelta<'a> {
    #[serde(rename = "text_delta")]
    Text { text: &'a str },
    #[serde(rename = "thinking_delta")]
    Thinking { thinking: &'a str },
    #[serde(rename = "signature_delta")]
    Signature { signature: &'a str },
    #[serde(rename = "input_json_delta")]
    InputJson { partial_json: &'a str },
}

#[derive(Serialize)]
struct MessageDeltaBody {
    stop_reason: &'static str,
    stop_sequence: Option<()>,
}

#[derive(Serialize)]
struct UsageBody {
    input_tokens: u64,
    cache_creation_input_tokens: u64,
    cache_read_input_tokens: u64,
    output_tokens: u64,
}

#[derive(Serialize)]
struct ErrorEnvelope<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    error: ErrorBody<'a>,
    request_id: &'a str,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    /// Only in-stream errors have been seen carrying `details`.
    #[serde(skip_serializing_if = "Option::is_none")]
    details: Option<Option<()>>,
    #[serde(rename = "type")]
    kind: &'a str,
    message: &'a str,
}

/// Spaces the real API leaves before a `data:` line's closing brace; cycled
/// deterministically so a failure reproduces.
const PADDING: [usize; 12] = [1, 15, 0, 7, 12, 3, 9, 0, 5, 14, 2, 11];

fn stop_reason(stop: StopReason) -> &'static str {
    match stop {
        StopReason::EndTurn => "end_turn",
        StopReason::MaxTokens => "max_tokens",
        StopReason::ToolUse => "tool_use",
        StopReason::ContentFilter => "refusal",
    }
}

/// Anthropic counts cached and cache-written input apart from `input_tokens`.
fn usage_body(usage: &Usage, output_tokens: u64) -> UsageBody {
    UsageBody {
        input_tokens: usage.input_tokens.saturating_sub(usage.cached_tokens + usage.cache_write_tokens),
        cache_creation_input_tokens: usage.cache_write_tokens,
        cache_read_input_tokens: usage.cached_tokens,
        output_tokens,
    }
}

pub(crate) fn render(reply: &Reply, request: &RequestInfo) -> Rendered {
    match request.framing {
        Framing::Json => render_json(reply, request),
        Framing::Sse | Framing::JsonArray => render_stream(reply, request),
    }
}

fn render_stream(reply: &Reply, request: &RequestInfo) -> Rendered {
    let id = format!("msg_mock{}", request.number);
    let usage = reply.usage();
    let mut events: Vec<Bytes> = Vec::new();
    let push = |event: StreamEvent<'_>, events: &mut Vec<Bytes>| {
        let padding = PADDING[events.len() % PADDING.len()];
        events.push(sse_event(event.name(), &compact(&event), padding));
    };

    let start = MessageBody {
        id: &id,
        kind: "message",
        role: "assistant",
        model: &request.model,
        content: Vec::new(),
        stop_reason: None,
        stop_sequence: None,
        usage: usage_body(&usage, 1),
    };
    push(StreamEvent::MessageStart { message: start }, &mut events);

    let mut index = 0;
    let mut pinged = false;
    let mut open = |index: usize, block: ContentBlock<'_>, events: &mut Vec<Bytes>| {
        push(StreamEvent::ContentBlockStart { index, content_block: block }, events);
        // The real stream pings once, right after the first block opens.
        if !pinged {
            events.push(Bytes::from_static(b"event: ping\ndata: {\"type\": \"ping\"}\n\n"));
            pinged = true;
        }
    };
    for block in reply.blocks() {
        match block {
            Block::Thinking { deltas, signature } => {
                open(index, ContentBlock::Thinking { thinking: String::new(), signature: "" }, &mut events);
                for delta in deltas {
                    let delta = BlockDelta::Thinking { thinking: delta };
                    push(StreamEvent::ContentBlockDelta { index, delta }, &mut events);
                }
                let delta = BlockDelta::Signature { signature };
                push(StreamEvent::ContentBlockDelta { index, delta }, &mut events);
                push(StreamEvent::ContentBlockStop { index }, &mut events);
                index += 1;
            }
            Block::RedactedThinking { data } => {
                open(index, ContentBlock::RedactedThinking { data }, &mut events);
                push(StreamEvent::ContentBlockStop { index }, &mut events);
                index += 1;
            }
            Block::Text { deltas } => {
                open(index, ContentBlock::Text { text: String::new() }, &mut events);
                for delta in deltas {
                    let delta = BlockDelta::Text { text: delta };
                    push(StreamEvent::ContentBlockDelta { index, delta }, &mut events);
                }
                push(StreamEvent::ContentBlockStop { index }, &mut events);
                index += 1;
            }
            Block::ToolCalls(calls) => {
                for call in calls {
                    let block = ContentBlock::ToolUse {
                        id: &call.id,
                        name: &call.name,
                        input: Value::Object(Default::default()),
                    };
                    open(index, block, &mut events);
                    // The API always opens the input with an empty fragment,
                    // and for an empty input sends nothing else.
                    let arguments = call.arguments.to_string();
                    let mut fragments = vec![String::new()];
                    if call.arguments.as_object().is_none_or(|object| !object.is_empty()) {
                        fragments.extend(split_in(&arguments, 3));
                    }
                    for fragment in &fragments {
                        let delta = BlockDelta::InputJson { partial_json: fragment };
                        push(StreamEvent::ContentBlockDelta { index, delta }, &mut events);
                    }
                    push(StreamEvent::ContentBlockStop { index }, &mut events);
                    index += 1;
                }
            }
        }
    }
    let delta = MessageDeltaBody { stop_reason: stop_reason(reply.stop_reason()), stop_sequence: None };
    push(StreamEvent::MessageDelta { delta, usage: usage_body(&usage, usage.output_tokens) }, &mut events);
    push(StreamEvent::MessageStop, &mut events);
    Rendered {
        status: 200,
        headers: vec![
            ("content-type".to_owned(), "text/event-stream; charset=utf-8".to_owned()),
            ("request-id".to_owned(), format!("req_mock{}", request.number)),
        ],
        chunks: events,
        terminal_chunks: 1,
    }
}

fn render_json(reply: &Reply, request: &RequestInfo) -> Rendered {
    let id = format!("msg_mock{}", request.number);
    let usage = reply.usage();
    let mut content = Vec::new();
    for block in reply.blocks() {
        match block {
            Block::Thinking { deltas, signature } => {
                content.push(ContentBlock::Thinking { thinking: deltas.concat(), signature });
            }
            Block::RedactedThinking { data } => content.push(ContentBlock::RedactedThinking { data }),
            Block::Text { deltas } => content.push(ContentBlock::Text { text: deltas.concat() }),
            Block::ToolCalls(calls) => content.extend(calls.iter().map(|call| ContentBlock::ToolUse {
                id: &call.id,
                name: &call.name,
                input: call.arguments.clone(),
            })),
        }
    }
    let message = MessageBody {
        id: &id,
        kind: "message",
        role: "assistant",
        model: &request.model,
        content,
        stop_reason: Some(stop_reason(reply.stop_reason())),
        stop_sequence: None,
        usage: usage_body(&usage, usage.output_tokens),
    };
    Rendered::json(200, "application/json", compact(&message))
        .with_header("request-id", format!("req_mock{}", request.number))
}

/// A canned error in Anthropic's shape; `detail` is the message for
/// `BadRequest` and `NotFound`.
pub(crate) fn error(kind: CannedError, detail: &str) -> Rendered {
    let (status, error_type, message, should_retry) = match kind {
        CannedError::RateLimited { retry_after_secs } => {
            let message = "This request would exceed the rate limit for your organization of 50 requests per minute. For details, refer to: https://docs.claude.com/en/api/rate-limits. You can see the response headers for current usage. Please reduce the prompt length or the maximum tokens requested, or try again later.";
            return anthropic_error(429, "rate_limit_error", message, true)
                .with_header("retry-after", retry_after_secs.to_string())
                .with_header("anthropic-ratelimit-requests-limit", "50")
                .with_header("anthropic-ratelimit-requests-remaining", "0");
        }
        CannedError::ServerError => (500, "api_error", "Internal server error", true),
        CannedError::Unavailable => (503, "api_error", "Service temporarily unavailable", true),
        CannedError::Overloaded => (529, "overloaded_error", "Overloaded", true),
        CannedError::ContextLength => {
            (400, "invalid_request_error", "prompt is too long: 208310 tokens > 200000 maximum", false)
        }
        CannedError::BadRequest => (400, "invalid_request_error", detail, false),
        CannedError::NotFound => (404, "not_found_error", detail, false),
    };
    anthropic_error(status, error_type, message, should_retry)
}

fn anthropic_error(status: u16, kind: &str, message: &str, should_retry: bool) -> Rendered {
    let envelope = ErrorEnvelope {
        kind: "error",
        error: ErrorBody { details: None, kind, message },
        request_id: "req_mock_error",
    };
    Rendered::json(status, "application/json", compact(&envelope))
        .with_header("x-should-retry", if should_retry { "true" } else { "false" })
}

/// The `event: error` Anthropic sends inside a 200 stream when it runs out
/// of capacity mid-answer.
pub(crate) fn in_stream_error() -> Bytes {
    let envelope = ErrorEnvelope {
        kind: "error",
        error: ErrorBody { details: Some(None), kind: "overloaded_error", message: "Overloaded" },
        request_id: "req_mock_error",
    };
    sse_event("error", &compact(&envelope), 0)
}

fn sse_event(name: &str, json: &[u8], padding: usize) -> Bytes {
    let mut event = Vec::with_capacity(json.len() + name.len() + padding + 16);
    event.extend_from_slice(b"event: ");
    event.extend_from_slice(name.as_bytes());
    event.extend_from_slice(b"\ndata: ");
    match json.split_last() {
        Some((b'}', head)) => {
            event.extend_from_slice(head);
            event.resize(event.len() + padding, b' ');
            event.push(b'}');
        }
        _ => event.extend_from_slice(json),
    }
    event.extend_from_slice(b"\n\n");
    Bytes::from(event)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn events(rendered: &Rendered) -> Vec<(String, Value)> {
        rendered
            .chunks
            .iter()
            .map(|chunk| {
                let text = std::str::from_utf8(chunk).unwrap();
                let (event, data) = text.trim_end().split_once('\n').unwrap();
                let name = event.strip_prefix("event: ").unwrap().to_owned();
                (name, serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap())
            })
            .collect()
    }

    #[test]
    fn thinking_then_tool_use_streams_in_order() {
        let reply = Reply::thinking("let me think", "sig==").then_tool_calls([(
            "toolu_1",
            "get_weather",
            json!({"city": "Paris"}),
        )]);
        let info = RequestInfo { model: "claude".to_owned(), framing: Framing::Sse, include_usage: false, number: 7 };
        let events = events(&render(&reply, &info));
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names[..3], ["message_start", "content_block_start", "ping"]);
        assert_eq!(names.last(), Some(&"message_stop"));
        let signature = events.iter().find(|(_, d)| d["delta"]["type"] == "signature_delta").unwrap();
        assert_eq!(signature.1["delta"]["signature"], "sig==");
        let input: String = events
            .iter()
            .filter(|(_, d)| d["delta"]["type"] == "input_json_delta")
            .map(|(_, d)| d["delta"]["partial_json"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(serde_json::from_str::<Value>(&input).unwrap(), json!({"city": "Paris"}));
        let message_delta = &events[events.len() - 2].1;
        assert_eq!(message_delta["delta"]["stop_reason"], "tool_use");
    }

    #[test]
    fn empty_input_sends_a_single_empty_fragment() {
        let reply = Reply::tool_calls([("toolu_1", "now", json!({}))]);
        let info = RequestInfo { model: "claude".to_owned(), framing: Framing::Sse, include_usage: false, number: 1 };
        let fragments: Vec<Value> = events(&render(&reply, &info))
            .into_iter()
            .filter(|(_, d)| d["delta"]["type"] == "input_json_delta")
            .map(|(_, d)| d["delta"]["partial_json"].clone())
            .collect();
        assert_eq!(fragments, vec![json!("")]);
    }
}
