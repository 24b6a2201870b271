//! The Gemini `generateContent` / `streamGenerateContent` wire format, as
//! `generativelanguage.googleapis.com` sends it (compare
//! `shared/fixtures/providers/gemini/`). With `alt=sse` each chunk is a whole
//! `GenerateContentResponse` on a `data:` line, events separated by
//! `\r\n\r\n`, no `[DONE]`, JSON spaced `{"text": "The"}`; without `alt=sse`
//! the same chunks are elements of one pretty-printed JSON array. Thought
//! summaries are parts with `"thought": true`; the thought signature rides on
//! the first `functionCall` part, or on an empty final text part when the
//! answer is text. Function calls arrive whole (no argument fragments), all
//! in one chunk, without ids (the Gemini API has none). Usage is partial on
//! every chunk and complete on the last one, with `finishReason`.

use arbor_core::Usage;
use bytes::Bytes;
use serde::Serialize;
use serde_json::{Value, json};

use super::reply::{Block, Reply, StopReason};
use super::wire::{CannedError, Framing, Rendered, RequestInfo, google_compact, pretty};

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct GenerateResponse<'a> {
    candidates: Vec<Candidate<'a>>,
    usage_metadata: UsageMetadata,
    model_version: &'a str,
    response_id: &'a str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Candidate<'a> {
    content: CandidateContent<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    finish_reason: Option<&'static str>,
    index: u32,
}

#[derive(Serialize)]
struct CandidateContent<'a> {
    parts: Vec<Part<'a>>,
    role: &'static str,
}

#[derive(Serialize, Clone, Default)]
#[serde(rename_all = "camelCase")]
struct Part<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    function_call: Option<FunctionCall<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thought: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thought_signature: Option<&'a str>,
}

impl Part<'_> {
    fn text(text: impl Into<String>) -> Self {
        Part { text: Some(text.into()), ..Part::default() }
    }
    fn is_answer_text(&self) -> bool {
        self.text.is_some() && self.thought.is_none()
    }
}

#[derive(Serialize, Clone)]
struct FunctionCall<'a> {
    name: &'a str,
    args: &'a Value,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct UsageMetadata {
    prompt_token_count: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    candidates_token_count: Option<u64>,
    total_token_count: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    cached_content_token_count: Option<u64>,
    prompt_tokens_details: [ModalityCount; 1],
    #[serde(skip_serializing_if = "Option::is_none")]
    thoughts_token_count: Option<u64>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ModalityCount {
    modality: &'static str,
    token_count: u64,
}

#[derive(Serialize)]
struct ErrorEnvelope<'a> {
    error: ErrorBody<'a>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: u16,
    message: &'a str,
    status: &'a str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    details: Vec<Value>,
}

fn finish_reason(stop: StopReason) -> &'static str {
    match stop {
        StopReason::EndTurn | StopReason::ToolUse => "STOP",
        StopReason::MaxTokens => "MAX_TOKENS",
        StopReason::ContentFilter => "SAFETY",
    }
}

/// Usage so far: what intermediate chunks carry (prompt only).
fn partial_usage(usage: &Usage) -> UsageMetadata {
    UsageMetadata {
        prompt_token_count: usage.input_tokens,
        candidates_token_count: None,
        total_token_count: usage.input_tokens,
        cached_content_token_count: None,
        prompt_tokens_details: [ModalityCount { modality: "TEXT", token_count: usage.input_tokens }],
        thoughts_token_count: None,
    }
}

/// Final usage: Gemini counts thoughts apart from candidates, and the cached
/// prompt inside the prompt count.
fn full_usage(usage: &Usage) -> UsageMetadata {
    UsageMetadata {
        prompt_token_count: usage.input_tokens,
        candidates_token_count: Some(usage.output_tokens.saturating_sub(usage.thinking_tokens)),
        total_token_count: usage.input_tokens + usage.output_tokens,
        cached_content_token_count: (usage.cached_tokens > 0).then_some(usage.cached_tokens),
        prompt_tokens_details: [ModalityCount { modality: "TEXT", token_count: usage.input_tokens }],
        thoughts_token_count: (usage.thinking_tokens > 0).then_some(usage.thinking_tokens),
    }
}

pub(crate) fn render(reply: &Reply, request: &RequestInfo) -> Rendered {
    match request.framing {
        Framing::Json => render_json(reply, request),
        Framing::Sse | Framing::JsonArray => render_stream(reply, request),
    }
}

fn render_stream(reply: &Reply, request: &RequestInfo) -> Rendered {
    let response_id = format!("mockresp{}", request.number);
    let usage = reply.usage();

    // First lay out the parts of each chunk, then serialise, because the
    // last chunk carries the finish reason and the full usage.
    let mut chunk_parts: Vec<Vec<Part<'_>>> = Vec::new();
    let mut pending_signature: Option<&str> = None;
    for block in reply.blocks() {
        match block {
            Block::Thinking { deltas, signature } => {
                for delta in deltas {
                    chunk_parts.push(vec![Part { thought: Some(true), ..Part::text(delta.as_str()) }]);
                }
                pending_signature = Some(signature);
            }
            Block::RedactedThinking { .. } => {}
            Block::Text { deltas } => {
                for delta in deltas {
                    chunk_parts.push(vec![Part::text(delta.as_str())]);
                }
            }
            Block::ToolCalls(calls) if !calls.is_empty() => {
                let parts = calls
                    .iter()
                    .enumerate()
                    .map(|(position, call)| Part {
                        function_call: Some(FunctionCall { name: &call.name, args: &call.arguments }),
                        thought_signature: if position == 0 { pending_signature.take() } else { None },
                        ..Part::default()
                    })
                    .collect();
                chunk_parts.push(parts);
            }
            Block::ToolCalls(_) => {}
        }
    }
    let ends_with_text = chunk_parts.last().is_some_and(|parts| parts.iter().all(Part::is_answer_text));
    if !ends_with_text || pending_signature.is_some() {
        chunk_parts.push(vec![Part { thought_signature: pending_signature.take(), ..Part::text("") }]);
    }

    let count = chunk_parts.len();
    let mut chunks = Vec::with_capacity(count + 1);
    for (position, parts) in chunk_parts.into_iter().enumerate() {
        let last = position + 1 == count;
        let response = GenerateResponse {
            candidates: vec![Candidate {
                content: CandidateContent { parts, role: "model" },
                finish_reason: last.then(|| finish_reason(reply.stop_reason())),
                index: 0,
            }],
            usage_metadata: if last { full_usage(&usage) } else { partial_usage(&usage) },
            model_version: &request.model,
            response_id: &response_id,
        };
        chunks.push(frame(request.framing, &response, position == 0));
    }
    let content_type = if request.framing == Framing::Sse {
        "text/event-stream"
    } else {
        chunks.push(Bytes::from_static(b"\n]"));
        "application/json; charset=UTF-8"
    };
    Rendered {
        status: 200,
        headers: vec![("content-type".to_owned(), content_type.to_owned())],
        chunks,
        terminal_chunks: 1,
    }
}

/// One chunk on the wire: an SSE event, or an element of the JSON array
/// (`[` before the first, `\n,\r\n` between elements, as recorded).
fn frame<T: Serialize>(framing: Framing, value: &T, first: bool) -> Bytes {
    let mut out = Vec::new();
    if framing == Framing::Sse {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&google_compact(value));
        out.extend_from_slice(b"\r\n\r\n");
    } else {
        out.extend_from_slice(if first { b"[" as &[u8] } else { b"\n,\r\n" });
        out.extend_from_slice(&pretty(value, b"  "));
    }
    Bytes::from(out)
}

fn render_json(reply: &Reply, request: &RequestInfo) -> Rendered {
    let response_id = format!("mockresp{}", request.number);
    let mut parts: Vec<Part<'_>> = Vec::new();
    let mut signature: Option<&str> = None;
    let mut signature_placed = true;
    for block in reply.blocks() {
        match block {
            Block::Thinking { deltas, signature: block_signature } => {
                parts.push(Part { thought: Some(true), ..Part::text(deltas.concat()) });
                signature = Some(block_signature);
                signature_placed = false;
            }
            Block::RedactedThinking { .. } => {}
            Block::Text { deltas } => parts.push(Part::text(deltas.concat())),
            Block::ToolCalls(calls) => {
                for call in calls {
                    let mut part = Part {
                        function_call: Some(FunctionCall { name: &call.name, args: &call.arguments }),
                        ..Part::default()
                    };
                    if !signature_placed {
                        part.thought_signature = signature;
                        signature_placed = true;
                    }
                    parts.push(part);
                }
            }
        }
    }
    if !signature_placed {
        // A text answer carries the signature on its last answer part.
        match parts.iter_mut().rev().find(|part| part.is_answer_text()) {
            Some(part) => part.thought_signature = signature,
            None => parts.push(Part { thought_signature: signature, ..Part::text("") }),
        }
    }
    let response = GenerateResponse {
        candidates: vec![Candidate {
            content: CandidateContent { parts, role: "model" },
            finish_reason: Some(finish_reason(reply.stop_reason())),
            index: 0,
        }],
        usage_metadata: full_usage(&reply.usage()),
        model_version: &request.model,
        response_id: &response_id,
    };
    Rendered::json(200, "application/json; charset=UTF-8", pretty(&response, b"  "))
}

/// A canned error in Google's shape; `detail` is the message for
/// `BadRequest` and `NotFound`.
pub(crate) fn error(kind: CannedError, detail: &str) -> Rendered {
    let mut details = Vec::new();
    let (code, status, message) = match kind {
        CannedError::RateLimited { retry_after_secs } => {
            // Gemini sends no retry-after header: the hint is RetryInfo.
            details.push(json!({
                "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                "violations": [{"quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier"}]
            }));
            details.push(json!({
                "@type": "type.googleapis.com/google.rpc.RetryInfo",
                "retryDelay": format!("{retry_after_secs}s")
            }));
            (429, "RESOURCE_EXHAUSTED", "You exceeded your current quota, please check your plan and billing details.")
        }
        CannedError::ServerError => (
            500,
            "INTERNAL",
            "An internal error has occurred. Please retry or report in https://developers.generativeai.google/guide/troubleshooting",
        ),
        CannedError::Unavailable => (503, "UNAVAILABLE", "The service is currently unavailable."),
        CannedError::Overloaded => (503, "UNAVAILABLE", "The model is overloaded. Please try again later."),
        CannedError::ContextLength => (
            400,
            "INVALID_ARGUMENT",
            "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).",
        ),
        CannedError::BadRequest => (400, "INVALID_ARGUMENT", detail),
        CannedError::NotFound => (404, "NOT_FOUND", detail),
    };
    let envelope = ErrorEnvelope { error: ErrorBody { code, message, status, details } };
    let mut body = pretty(&envelope, b"  ");
    body.push(b'\n');
    Rendered::json(code, "application/json; charset=UTF-8", body)
}

/// The error object Gemini puts in a 200 stream when the model fails
/// mid-answer; in JSON-array mode it is the array's last element.
pub(crate) fn in_stream_error(framing: Framing, first: bool) -> Bytes {
    let envelope = ErrorEnvelope {
        error: ErrorBody {
            code: 503,
            message: "The model is overloaded. Please try again later.",
            status: "UNAVAILABLE",
            details: Vec::new(),
        },
    };
    let mut chunk = frame(framing, &envelope, first).to_vec();
    if framing == Framing::JsonArray {
        chunk.extend_from_slice(b"\n]");
    }
    Bytes::from(chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(framing: Framing) -> RequestInfo {
        RequestInfo { model: "gemini-3-pro-preview".to_owned(), framing, include_usage: false, number: 2 }
    }

    fn sse_values(rendered: &Rendered) -> Vec<Value> {
        rendered
            .chunks
            .iter()
            .map(|chunk| {
                let text = std::str::from_utf8(chunk).unwrap();
                let json = text.strip_prefix("data: ").unwrap().strip_suffix("\r\n\r\n").unwrap();
                serde_json::from_str(json).unwrap()
            })
            .collect()
    }

    #[test]
    fn function_calls_carry_the_signature_on_the_first_call() {
        let reply = Reply::thinking("hmm", "c2ln")
            .then_tool_calls([("a", "get_country", json!({})), ("b", "get_city", json!({"q": 1}))]);
        let values = sse_values(&render(&reply, &info(Framing::Sse)));
        assert_eq!(values[0]["candidates"][0]["content"]["parts"][0], json!({"text": "hmm", "thought": true}));
        let calls = &values[1]["candidates"][0]["content"]["parts"];
        assert_eq!(calls[0], json!({"functionCall": {"name": "get_country", "args": {}}, "thoughtSignature": "c2ln"}));
        assert_eq!(calls[1], json!({"functionCall": {"name": "get_city", "args": {"q": 1}}}));
        let last = values.last().unwrap();
        assert_eq!(last["candidates"][0]["finishReason"], "STOP");
        assert_eq!(last["candidates"][0]["content"]["parts"], json!([{"text": ""}]));
        assert_eq!(last["usageMetadata"]["thoughtsTokenCount"], 2);
    }

    #[test]
    fn text_answers_finish_on_their_last_text_chunk() {
        let values = sse_values(&render(&Reply::text("The capital"), &info(Framing::Sse)));
        assert_eq!(values.len(), 2);
        assert_eq!(values[1]["candidates"][0]["content"]["parts"], json!([{"text": " capital"}]));
        assert_eq!(values[1]["candidates"][0]["finishReason"], "STOP");
        assert!(values[0]["usageMetadata"].get("candidatesTokenCount").is_none());
    }

    #[test]
    fn json_array_mode_is_one_parseable_array() {
        let rendered = render(&Reply::thinking("a b", "sig").then_text("c d"), &info(Framing::JsonArray));
        let array: Value = serde_json::from_slice(&rendered.body()).unwrap();
        assert_eq!(array.as_array().unwrap().len(), rendered.chunks.len() - 1);
        let last = array.as_array().unwrap().last().unwrap();
        assert_eq!(last["candidates"][0]["content"]["parts"][0]["thoughtSignature"], "sig");
    }
}
