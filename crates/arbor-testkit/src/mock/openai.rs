//! The OpenAI Chat Completions wire format, as `api.openai.com` sends it
//! (compare `shared/fixtures/providers/openai/`): a stream opens with a role
//! chunk, carries content deltas and tool calls by index (id, type and name
//! first with empty arguments, then argument fragments), closes with a
//! `finish_reason` chunk, a usage chunk with `choices: []` only when the
//! request set `stream_options.include_usage`, and `data: [DONE]`.
//! Non-streaming replies and errors are pretty-printed JSON like the real
//! service (two-space responses, four-space errors). Reasoning text is not
//! sent (OpenAI hides it) unless the reply asks for an OpenAI-compatible
//! server's `reasoning_content`-style field; its size shows in
//! `completion_tokens_details.reasoning_tokens`.

use std::collections::BTreeMap;

use arbor_core::Usage;
use bytes::Bytes;
use serde::Serialize;

use super::reply::{Block, Reply, StopReason, split_in};
use super::wire::{CannedError, Framing, Rendered, RequestInfo, pretty, unix_now};

#[derive(Serialize)]
struct ChunkResponse<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    system_fingerprint: &'static str,
    choices: Vec<ChunkChoice<'a>>,
    /// Absent without `include_usage`; `null` on content chunks with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<UsageBody>>,
}

#[derive(Serialize)]
struct ChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize, Default)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    /// `Some(None)` is an explicit `"content": null`.
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    refusal: Option<Option<&'a str>>,
    /// OpenAI-compatible reasoning text under a server-specific field name.
    #[serde(flatten)]
    reasoning: BTreeMap<&'a str, &'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<ToolCallDelta<'a>>>,
}

#[derive(Serialize)]
struct ToolCallDelta<'a> {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    function: FunctionDelta<'a>,
}

#[derive(Serialize)]
struct FunctionDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    arguments: &'a str,
}

#[derive(Serialize)]
struct UsageBody {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
    prompt_tokens_details: PromptTokensDetails,
    completion_tokens_details: CompletionTokensDetails,
}

#[derive(Serialize)]
struct PromptTokensDetails {
    cached_tokens: u64,
    audio_tokens: u64,
}

#[derive(Serialize)]
struct CompletionTokensDetails {
    reasoning_tokens: u64,
    audio_tokens: u64,
    accepted_prediction_tokens: u64,
    rejected_prediction_tokens: u64,
}

#[derive(Serialize)]
struct CompletionResponse<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<CompletionChoice<'a>>,
    usage: UsageBody,
    service_tier: &'static str,
    system_fingerprint: &'static str,
}

#[derive(Serialize)]
struct CompletionChoice<'a> {
    index: u32,
    message: CompletionMessage<'a>,
    logprobs: Option<()>,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct CompletionMessage<'a> {
    role: &'static str,
    content: Option<String>,
    refusal: Option<()>,
    annotations: [(); 0],
    #[serde(flatten)]
    reasoning: BTreeMap<&'a str, String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<CompletionToolCall<'a>>,
}

#[derive(Serialize)]
struct CompletionToolCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: CompletionFunction<'a>,
}

#[derive(Serialize)]
struct CompletionFunction<'a> {
    name: &'a str,
    arguments: String,
}

#[derive(Serialize)]
struct ErrorEnvelope<'a> {
    error: ErrorBody<'a>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

const FINGERPRINT: &str = "fp_mock";

fn finish_reason(stop: StopReason) -> &'static str {
    match stop {
        StopReason::EndTurn => "stop",
        StopReason::MaxTokens => "length",
        StopReason::ToolUse => "tool_calls",
        StopReason::ContentFilter => "content_filter",
    }
}

fn usage_body(usage: &Usage) -> UsageBody {
    UsageBody {
        prompt_tokens: usage.input_tokens,
        completion_tokens: usage.output_tokens,
        total_tokens: usage.input_tokens + usage.output_tokens,
        prompt_tokens_details: PromptTokensDetails { cached_tokens: usage.cached_tokens, audio_tokens: 0 },
        completion_tokens_details: CompletionTokensDetails {
            reasoning_tokens: usage.thinking_tokens,
            audio_tokens: 0,
            accepted_prediction_tokens: 0,
            rejected_prediction_tokens: 0,
        },
    }
}

/// Encodes a scripted reply for this request.
pub(crate) fn render(reply: &Reply, request: &RequestInfo) -> Rendered {
    match request.framing {
        Framing::Json => render_json(reply, request),
        Framing::Sse | Framing::JsonArray => render_stream(reply, request),
    }
}

fn render_stream(reply: &Reply, request: &RequestInfo) -> Rendered {
    let id = format!("chatcmpl-mock{}", request.number);
    let created = unix_now();
    let reasoning_field = reply.openai_reasoning_field.as_deref();
    let chunk = |delta: Delta<'_>, finish: Option<&'static str>| -> Bytes {
        let chunk = ChunkResponse {
            id: &id,
            object: "chat.completion.chunk",
            created,
            model: &request.model,
            system_fingerprint: FINGERPRINT,
            choices: vec![ChunkChoice { index: 0, delta, logprobs: None, finish_reason: finish }],
            usage: request.include_usage.then_some(None),
        };
        sse_data(&chunk)
    };

    let mut chunks = Vec::new();
    let has_text = reply.blocks().iter().any(|b| matches!(b, Block::Text { .. }));
    // The recordings open a text answer with `content: "", refusal: null`
    // and a tool-call answer with `content: null`.
    let opening = if has_text {
        Delta { role: Some("assistant"), content: Some(Some("")), refusal: Some(None), ..Delta::default() }
    } else {
        Delta { role: Some("assistant"), content: Some(None), ..Delta::default() }
    };
    chunks.push(chunk(opening, None));

    let mut tool_index = 0;
    for block in reply.blocks() {
        match block {
            Block::Thinking { deltas, .. } => {
                if let Some(field) = reasoning_field {
                    for delta in deltas {
                        let reasoning = BTreeMap::from([(field, delta.as_str())]);
                        chunks.push(chunk(Delta { reasoning, ..Delta::default() }, None));
                    }
                }
            }
            Block::RedactedThinking { .. } => {}
            Block::Text { deltas } => {
                for delta in deltas {
                    chunks.push(chunk(Delta { content: Some(Some(delta)), ..Delta::default() }, None));
                }
            }
            Block::ToolCalls(calls) => {
                for call in calls {
                    let arguments = call.arguments.to_string();
                    let start = ToolCallDelta {
                        index: tool_index,
                        id: Some(&call.id),
                        kind: Some("function"),
                        function: FunctionDelta { name: Some(&call.name), arguments: "" },
                    };
                    chunks.push(chunk(Delta { tool_calls: Some(vec![start]), ..Delta::default() }, None));
                    for fragment in split_in(&arguments, 3) {
                        let part = ToolCallDelta {
                            index: tool_index,
                            id: None,
                            kind: None,
                            function: FunctionDelta { name: None, arguments: &fragment },
                        };
                        chunks.push(chunk(Delta { tool_calls: Some(vec![part]), ..Delta::default() }, None));
                    }
                    tool_index += 1;
                }
            }
        }
    }
    chunks.push(chunk(Delta::default(), Some(finish_reason(reply.stop_reason()))));
    if request.include_usage {
        let usage_chunk = ChunkResponse {
            id: &id,
            object: "chat.completion.chunk",
            created,
            model: &request.model,
            system_fingerprint: FINGERPRINT,
            choices: Vec::new(),
            usage: Some(Some(usage_body(&reply.usage()))),
        };
        chunks.push(sse_data(&usage_chunk));
    }
    chunks.push(Bytes::from_static(b"data: [DONE]\n\n"));
    Rendered {
        status: 200,
        headers: vec![("content-type".to_owned(), "text/event-stream; charset=utf-8".to_owned())],
        chunks,
        terminal_chunks: 1,
    }
}

fn render_json(reply: &Reply, request: &RequestInfo) -> Rendered {
    let id = format!("chatcmpl-mock{}", request.number);
    let mut text: Option<String> = None;
    let mut reasoning_text = String::new();
    let mut tool_calls = Vec::new();
    for block in reply.blocks() {
        match block {
            Block::Thinking { deltas, .. } => reasoning_text.push_str(&deltas.concat()),
            Block::RedactedThinking { .. } => {}
            Block::Text { deltas } => text.get_or_insert_with(String::new).push_str(&deltas.concat()),
            Block::ToolCalls(calls) => tool_calls.extend(calls.iter().map(|call| CompletionToolCall {
                id: &call.id,
                kind: "function",
                function: CompletionFunction { name: &call.name, arguments: call.arguments.to_string() },
            })),
        }
    }
    let reasoning = match reply.openai_reasoning_field.as_deref() {
        Some(field) if !reasoning_text.is_empty() => BTreeMap::from([(field, reasoning_text)]),
        _ => BTreeMap::new(),
    };
    let response = CompletionResponse {
        id: &id,
        object: "chat.completion",
        created: unix_now(),
        model: &request.model,
        choices: vec![CompletionChoice {
            index: 0,
            message: CompletionMessage {
                role: "assistant",
                content: text,
                refusal: None,
                annotations: [],
                reasoning,
                tool_calls,
            },
            logprobs: None,
            finish_reason: finish_reason(reply.stop_reason()),
        }],
        usage: usage_body(&reply.usage()),
        service_tier: "default",
        system_fingerprint: FINGERPRINT,
    };
    Rendered::json(200, "application/json", pretty(&response, b"  "))
}

/// A canned error in OpenAI's shape; `detail` is the message for
/// `BadRequest` and `NotFound`.
pub(crate) fn error(kind: CannedError, detail: &str) -> Rendered {
    let (status, message, error_type, param, code) = match kind {
        CannedError::RateLimited { retry_after_secs } => {
            let message = format!(
                "Rate limit reached for requests per min (RPM): Limit 500, Used 500, Requested 1. Please try again in {retry_after_secs}s. Visit https://platform.openai.com/account/rate-limits to learn more."
            );
            let rendered = openai_error(429, &message, "requests", None, Some("rate_limit_exceeded"));
            return rendered
                .with_header("retry-after", retry_after_secs.to_string())
                .with_header("retry-after-ms", (retry_after_secs * 1000).to_string())
                .with_header("x-ratelimit-remaining-requests", "0");
        }
        CannedError::ServerError => (
            500,
            "The server had an error while processing your request. Sorry about that!".to_owned(),
            "server_error",
            None,
            None,
        ),
        CannedError::Unavailable => {
            (503, "The service is temporarily unavailable. Please try again later.".to_owned(), "server_error", None, None)
        }
        CannedError::Overloaded => {
            (503, "The engine is currently overloaded, please try again later".to_owned(), "server_error", None, None)
        }
        CannedError::ContextLength => (
            400,
            "This model's maximum context length is 128000 tokens. However, your messages resulted in 131072 tokens. Please reduce the length of the messages.".to_owned(),
            "invalid_request_error",
            Some("messages"),
            Some("context_length_exceeded"),
        ),
        CannedError::BadRequest => (400, detail.to_owned(), "invalid_request_error", None, None),
        CannedError::NotFound => (404, detail.to_owned(), "invalid_request_error", None, Some("unknown_url")),
    };
    openai_error(status, &message, error_type, param, code)
}

fn openai_error(status: u16, message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Rendered {
    let envelope = ErrorEnvelope { error: ErrorBody { message, kind, param, code } };
    let mut body = pretty(&envelope, b"    ");
    body.push(b'\n');
    Rendered::json(status, "application/json; charset=utf-8", body)
}

/// The error OpenAI puts in a 200 stream when the model fails mid-answer.
pub(crate) fn in_stream_error() -> Bytes {
    let envelope = ErrorEnvelope {
        error: ErrorBody {
            message: "The server had an error while processing your request. Sorry about that!",
            kind: "server_error",
            param: None,
            code: None,
        },
    };
    sse_data(&envelope)
}

fn sse_data<T: Serialize>(value: &T) -> Bytes {
    let mut line = b"data: ".to_vec();
    line.extend_from_slice(&super::wire::compact(value));
    line.extend_from_slice(b"\n\n");
    Bytes::from(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn info(framing: Framing, include_usage: bool) -> RequestInfo {
        RequestInfo { model: "gpt-4o".to_owned(), framing, include_usage, number: 1 }
    }

    fn payloads(rendered: &Rendered) -> Vec<String> {
        rendered
            .chunks
            .iter()
            .map(|c| {
                let text = std::str::from_utf8(c).unwrap();
                assert!(text.starts_with("data: ") && text.ends_with("\n\n"), "{text:?}");
                text["data: ".len()..text.len() - 2].to_owned()
            })
            .collect()
    }

    #[test]
    fn parallel_tool_calls_stream_like_the_recording() {
        let reply =
            Reply::tool_calls([("call_a", "get_country", json!({})), ("call_b", "get_product", json!({"x": 1}))]);
        let rendered = render(&reply, &info(Framing::Sse, true));
        let payloads = payloads(&rendered);
        assert_eq!(payloads.last().unwrap(), "[DONE]");
        let first: Value = serde_json::from_str(&payloads[0]).unwrap();
        assert_eq!(first["choices"][0]["delta"], json!({"role": "assistant", "content": null}));
        assert_eq!(first["usage"], Value::Null);
        // Call a is its opening chunk plus "{" and "}"; then call b opens.
        let start_b: Value = serde_json::from_str(&payloads[4]).unwrap();
        assert_eq!(
            start_b["choices"][0]["delta"]["tool_calls"][0],
            json!({"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_product", "arguments": ""}})
        );
        let usage: Value = serde_json::from_str(&payloads[payloads.len() - 2]).unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["prompt_tokens"], 10);
    }

    #[test]
    fn without_include_usage_there_is_no_usage_anywhere() {
        let rendered = render(&Reply::text("hi there"), &info(Framing::Sse, false));
        assert!(rendered.chunks.iter().all(|c| !std::str::from_utf8(c).unwrap().contains("usage")));
    }
}
