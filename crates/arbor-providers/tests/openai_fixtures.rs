//! The OpenAI adapter against recorded traffic from OpenAI and from
//! OpenAI-compatible servers (`shared/fixtures/providers/openai*/`, see the
//! README there): every recorded stream and reply parses into the reply the
//! recording shows, whatever the chunk boundaries; every recorded request
//! Arbor can express is reproduced; every recorded error maps to its code.
//! A last test fails when a fixture appears that no test here reads.

use std::collections::BTreeSet;
use std::time::Duration;

use arbor_core::message::ProviderOpaque;
use arbor_core::{ErrorCode, Message, Part, ProviderError, SharedMessage, ToolCall, ToolStatus, Usage};
use arbor_providers::http::ErrorResponse;
use arbor_providers::openai::{
    MaxTokensField, OpenAiConfig, OpenAiProvider, decode_stream, error_from_response, parse_response,
};
use arbor_providers::sse::byte_chunks;
use arbor_providers::{ChatRequest, Chunk, Collected, FinishReason, Reasoning, ToolSpec};
use futures_util::{FutureExt, StreamExt};
use proptest::prelude::*;
use reqwest::header::{HeaderMap, HeaderValue};
use serde_json::{Value, json};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/providers");

fn read(path: &str) -> Vec<u8> {
    let full = format!("{FIXTURES}/{path}");
    std::fs::read(&full).unwrap_or_else(|error| panic!("fixture {full}: {error}"))
}

fn read_json(path: &str) -> Value {
    serde_json::from_slice(&read(path)).unwrap_or_else(|error| panic!("{path}: {error}"))
}

/// A recorded stream body. `.chunks.jsonl` files hold the `data:` payloads
/// without framing; they get the framing back (and nothing else: no
/// `[DONE]` is invented).
fn stream_body(case: &str) -> Vec<u8> {
    let sse = format!("{FIXTURES}/{case}.response.sse");
    if std::path::Path::new(&sse).exists() {
        return read(&format!("{case}.response.sse"));
    }
    let lines = String::from_utf8(read(&format!("{case}.chunks.jsonl"))).expect("utf-8");
    lines
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| format!("data: {line}\n\n"))
        .collect::<String>()
        .into_bytes()
}

fn decode(body: &[u8], cuts: &[usize]) -> Vec<Result<Chunk, ProviderError>> {
    decode_stream(byte_chunks(body, cuts)).collect::<Vec<_>>().now_or_never().expect("an in-memory body never waits")
}

/// Folds chunks as the engine does; the first error ends the reply.
fn fold(items: &[Result<Chunk, ProviderError>]) -> Result<Collected, ProviderError> {
    let mut collected = Collected::default();
    for item in items {
        collected.push(item.as_ref().map_err(Clone::clone)?);
    }
    Ok(collected.finish())
}

fn streamed(case: &str) -> Collected {
    fold(&decode(&stream_body(case), &[])).unwrap_or_else(|error| panic!("{case}: {error}"))
}

fn completed(case: &str) -> Collected {
    parse_response(&read(&format!("{case}.response.json"))).unwrap_or_else(|error| panic!("{case}: {error}"))
}

fn usage(input: u64, output: u64, thinking: u64, cached: u64) -> Usage {
    Usage {
        input_tokens: input,
        output_tokens: output,
        thinking_tokens: thinking,
        cached_tokens: cached,
        cache_write_tokens: 0,
    }
}

fn call(id: &str, name: &str, arguments: Value) -> ToolCall {
    ToolCall { id: id.into(), name: name.into(), arguments, signature: None }
}

fn thinking_text(collected: &Collected) -> String {
    collected
        .parts
        .iter()
        .filter_map(|part| match part {
            Part::Thinking { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Streams

const STREAM_CASES: &[&str] = &[
    "openai/stream-text-usage",
    "openai/stream-text-cached-tokens-length",
    "openai/stream-text-n2",
    "openai/stream-tool-call-single",
    "openai/stream-text-after-tool-result",
    "openai/stream-tool-calls-parallel",
    "openai-compatible/azure-openai-stream-content-filter",
    "openai-compatible/deepseek-stream-reasoning-content",
    "openai-compatible/groq-stream-error-event",
    "openai-compatible/openrouter-stream-tool-call",
    "openai-compatible/xai-stream-tool-call",
];

#[test]
fn openai_text_stream_with_usage() {
    let reply = streamed("openai/stream-text-usage");
    assert_eq!(reply.text, "The capital of Mexico is Mexico City.");
    assert_eq!(reply.finish, Some(FinishReason::Stop));
    assert_eq!(reply.usage, Some(usage(14, 8, 0, 0)));
    assert!(reply.tool_calls.is_empty() && reply.parts.is_empty());
}

#[test]
fn openai_stream_with_cached_prompt_stopped_by_length() {
    let reply = streamed("openai/stream-text-cached-tokens-length");
    assert!(reply.text.starts_with("Structuring a database schema effectively is crucial"));
    assert!(reply.text.ends_with("in an e-commerce application, entities might"));
    assert_eq!(reply.text.chars().count(), 529);
    assert_eq!(reply.finish, Some(FinishReason::Length));
    assert_eq!(reply.usage, Some(usage(1420, 100, 0, 1280)));
}

#[test]
fn only_the_first_of_several_choices_becomes_the_reply() {
    let reply = streamed("openai/stream-text-n2");
    assert_eq!(
        reply.text,
        "Hey there! Not much, just here to help with anything you need. How can I assist you today?"
    );
    assert_eq!(reply.finish, Some(FinishReason::Stop));
    assert_eq!(reply.usage, Some(usage(13, 43, 0, 0)));
}

#[test]
fn openai_single_tool_call_stream() {
    let items = decode(&stream_body("openai/stream-tool-call-single"), &[]);
    let chunks: Vec<Chunk> = items.iter().map(|item| item.clone().expect("ok")).collect();
    // The call opens with its id and name, grows by fragments, and is
    // closed before the finish reason.
    assert_eq!(
        chunks[0],
        Chunk::ToolCallStart { index: 0, id: "call_ZR5UUuTt3pf61kjwAJIYdVMj".into(), name: "get_capital".into() }
    );
    let fragments: String = chunks
        .iter()
        .filter_map(|chunk| match chunk {
            Chunk::ToolCallArguments { index: 0, fragment } => Some(fragment.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(fragments, "{\"country\":\"UK\"}");
    let end = chunks.iter().position(|chunk| matches!(chunk, Chunk::ToolCallEnd { index: 0, .. })).expect("closed");
    let finish = chunks.iter().position(|chunk| matches!(chunk, Chunk::Finish(_))).expect("finished");
    assert!(end < finish);
    let reply = fold(&items).expect("ok");
    assert_eq!(reply.tool_calls, vec![call("call_ZR5UUuTt3pf61kjwAJIYdVMj", "get_capital", json!({"country": "UK"}))]);
    assert_eq!(reply.message().content, None);
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
    assert_eq!(reply.usage, Some(usage(53, 15, 0, 0)));
}

#[test]
fn openai_text_after_tool_result_stream() {
    let reply = streamed("openai/stream-text-after-tool-result");
    assert_eq!(reply.text, "The capital of the UK is London.");
    assert_eq!(reply.usage, Some(usage(78, 9, 0, 0)));
}

#[test]
fn openai_parallel_tool_calls_stream() {
    let reply = streamed("openai/stream-tool-calls-parallel");
    assert_eq!(
        reply.tool_calls,
        vec![
            call("call_q2UyBRP7eXNTzAoR8lEhjc9Z", "get_country", json!({})),
            call("call_b51ijcpFkDiTQG1bQzsrmtW5", "get_product_name", json!({})),
        ]
    );
    assert_eq!(reply.text, "");
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
    assert_eq!(reply.usage, Some(usage(364, 40, 0, 0)));
}

#[test]
fn azure_stream_with_filter_results_and_empty_first_chunk() {
    let reply = streamed("openai-compatible/azure-openai-stream-content-filter");
    assert!(reply.text.starts_with("I'm unable to provide real-time weather updates."));
    assert_eq!(reply.text.chars().count(), 199);
    assert_eq!(reply.finish, Some(FinishReason::Stop));
    assert_eq!(reply.usage, None, "no usage was asked for or sent");
}

#[test]
fn deepseek_reasoning_content_becomes_thinking() {
    let items = decode(&stream_body("openai-compatible/deepseek-stream-reasoning-content"), &[]);
    assert!(matches!(&items[0], Ok(Chunk::Thinking(text)) if text == "We"));
    let reply = fold(&items).expect("ok");
    assert_eq!(
        thinking_text(&reply),
        "We are asked: \"What is 17 * 23?\" This is a simple multiplication. 17 * 23 = 391. I'll provide the answer."
    );
    assert_eq!(reply.text, "The product of 17 and 23 is 391.");
    // One thinking block, before the text, without a signature.
    assert!(matches!(reply.parts.as_slice(), [Part::Thinking { signature: None, .. }]));
    assert_eq!(reply.usage, Some(usage(17, 47, 34, 0)));
    assert_eq!(reply.finish, Some(FinishReason::Stop));
}

#[test]
fn groq_error_event_in_a_200_stream_is_an_error_not_text() {
    let items = decode(&stream_body("openai-compatible/groq-stream-error-event"), &[]);
    let (last, before) = items.split_last().expect("items");
    let error = last.as_ref().expect_err("ends in an error");
    assert_eq!(error.code, ErrorCode::InvalidRequest);
    assert_eq!(error.status, Some(400));
    assert!(error.message.starts_with("Tool call validation failed"));
    // What came before is Groq's `reasoning` field, read as thinking; no
    // error text leaked into the answer.
    assert!(before.iter().all(|item| matches!(item, Ok(Chunk::Thinking(_)))));
    let thinking: String = before
        .iter()
        .filter_map(|item| match item {
            Ok(Chunk::Thinking(text)) => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(thinking.chars().count(), 412);
    assert!(fold(&items).is_err());
}

#[test]
fn openrouter_tool_call_stream_with_repeated_roles_and_late_arguments() {
    let reply = streamed("openai-compatible/openrouter-stream-tool-call");
    assert_eq!(reply.tool_calls, vec![call("llm_version:0", "llm_version", json!({}))]);
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
    assert_eq!(reply.usage, Some(usage(56, 12, 0, 0)));
}

#[test]
fn xai_reasoning_content_and_tool_call_with_reasoning_outside_completion_tokens() {
    let reply = streamed("openai-compatible/xai-stream-tool-call");
    let thinking = thinking_text(&reply);
    assert!(thinking.starts_with("First, the user is asking about the weather in San Francisco."));
    assert_eq!(thinking.chars().count(), 1069);
    assert_eq!(reply.tool_calls, vec![call("call_79382389", "weather", json!({"location": "San Francisco"}))]);
    // completion_tokens (26) leaves out the 227 reasoning tokens that
    // total_tokens (560 = 307 + 26 + 227) counts: both are output.
    assert_eq!(reply.usage, Some(usage(307, 253, 227, 306)));
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
}

#[test]
fn every_stream_cut_short_is_interrupted_or_complete_never_silently_partial() {
    // Cutting a recording at an event boundary before its finish reason
    // must give an error, not a shorter reply that looks whole.
    let body = stream_body("openai/stream-text-usage");
    let text = String::from_utf8(body.clone()).expect("utf-8");
    let finish_at = text.find("\"finish_reason\":\"stop\"").expect("finish");
    let cut = text[..finish_at].rfind("\n\n").expect("event boundary") + 2;
    let items = decode(&body[..cut], &[]);
    assert_eq!(
        items.last().and_then(|item| item.as_ref().err()).map(|error| error.code),
        Some(ErrorCode::StreamInterrupted)
    );
    // Cut after the finish reason but before [DONE]: the reply is whole.
    let after_finish = finish_at + text[finish_at..].find("\n\n").expect("end") + 2;
    assert!(fold(&decode(&body[..after_finish], &[])).is_ok());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The same bytes cut anywhere give exactly the same chunks.
    #[test]
    fn chunk_boundaries_never_change_a_parsed_stream(
        case in prop::sample::select(STREAM_CASES),
        fractions in prop::collection::vec(0.0f64..=1.0, 0..24),
    ) {
        let body = stream_body(case);
        let whole = decode(&body, &[]);
        let cuts: Vec<usize> = fractions
            .iter()
            .map(|fraction| (fraction * body.len() as f64) as usize)
            .collect();
        prop_assert_eq!(decode(&body, &cuts), whole);
    }

    /// Byte-by-byte delivery is the worst case: try it near the interesting
    /// parts (multi-byte text, tool call fragments).
    #[test]
    fn tiny_pieces_give_the_same_chunks(
        case in prop::sample::select(STREAM_CASES),
        start in 0.0f64..1.0,
        step in 1usize..4,
    ) {
        let body = stream_body(case);
        let from = (start * body.len() as f64) as usize;
        let cuts: Vec<usize> = (from..body.len().min(from + 600)).step_by(step).collect();
        prop_assert_eq!(decode(&body, &cuts), decode(&body, &[]));
    }
}

// ---------------------------------------------------------------------------
// Complete replies

#[test]
fn openai_complete_text() {
    let reply = completed("openai/chat-text");
    assert_eq!(reply.text, "Hello! How can I assist you today?");
    assert_eq!(reply.finish, Some(FinishReason::Stop));
    assert_eq!(reply.usage, Some(usage(8, 9, 0, 0)));
}

#[test]
fn openai_complete_reasoning_tokens_counted_as_thinking() {
    let reply = completed("openai/chat-reasoning-tokens");
    assert!(reply.text.starts_with("That's right—I am a potato!"));
    assert_eq!(reply.usage, Some(usage(11, 809, 768, 0)));
    let image_reply = completed("openai/chat-image-url-input");
    assert!(image_reply.text.starts_with("The image is a close-up of a single rose"));
    assert_eq!(image_reply.usage, Some(usage(334, 429, 256, 0)));
    let vegetable = completed("openai/chat-image-base64-input");
    assert!(!vegetable.text.is_empty());
    assert_eq!(vegetable.finish, Some(FinishReason::Stop));
}

#[test]
fn openai_complete_parallel_tool_calls() {
    let reply = completed("openai/chat-tool-calls-parallel");
    assert_eq!(
        reply.tool_calls,
        vec![
            call("call_jYdIdRZHxZTn5bWCq5jlMrJi", "delete_file", json!({"path": ".env"})),
            call("call_TmlTVWQbzrXCZ4jNsCVNbNqu", "create_file", json!({"path": "test.txt"})),
        ]
    );
    assert_eq!(reply.message().content, None);
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
    assert_eq!(reply.usage, Some(usage(71, 46, 0, 0)));
}

#[test]
fn reasoning_field_of_compatible_servers_becomes_thinking() {
    let cerebras = completed("openai-compatible/cerebras-chat-reasoning-field");
    assert_eq!(cerebras.text, "The capital of France is **Paris**.");
    assert_eq!(
        thinking_text(&cerebras),
        "User asks simple question: capital of France. Answer: Paris. Provide concise answer."
    );
    assert_eq!(cerebras.usage, Some(usage(74, 36, 0, 0)));

    let ollama = completed("openai-compatible/ollama-cloud-chat-reasoning");
    assert_eq!(ollama.text, "Paris.");
    assert!(thinking_text(&ollama).starts_with("We need to answer question"));
    assert_eq!(ollama.usage, Some(usage(134, 122, 0, 0)));

    let local = completed("openai-compatible/ollama-local-chat-json-schema");
    assert_eq!(local.text, "{ \"city\": \"Paris\", \"country\": \"France\" }");
    assert!(thinking_text(&local).starts_with("Okay, the user is asking"));
    assert_eq!(local.usage, Some(usage(136, 15, 0, 0)));
}

#[test]
fn ollama_tool_call_with_reasoning_and_index() {
    let reply = completed("openai-compatible/ollama-cloud-chat-tool-call");
    assert_eq!(
        reply.tool_calls,
        vec![call("call_o2vnpxrw", "final_result", json!({"city": "Paris", "country": "France"}))]
    );
    assert!(thinking_text(&reply).starts_with("The conversation: user asked"));
    assert_eq!(reply.text, "");
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
}

#[test]
fn gemini_compat_tool_call_without_id_gets_one_and_keeps_its_signature() {
    let reply = completed("openai-compatible/gemini-openai-compat-tool-call");
    assert_eq!(reply.tool_calls.len(), 1);
    let tool_call = &reply.tool_calls[0];
    assert_eq!(tool_call.id, "call_0", "an empty id is replaced");
    assert_eq!(tool_call.name, "get_current_time");
    assert_eq!(tool_call.arguments, json!({}));
    let signature = tool_call.signature.as_ref().expect("signature kept");
    assert_eq!(signature.provider, "openai");
    assert!(signature.data.starts_with("AVSoXO4AzAXs7GGvOY63fp8C"));
    // 109 total = 35 input + 12 completion + 62 hidden thinking.
    assert_eq!(reply.usage, Some(usage(35, 74, 62, 0)));
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));

    let after = completed("openai-compatible/gemini-openai-compat-after-tool-result");
    assert_eq!(after.text, "The current time is Noon.");
    assert_eq!(after.usage, Some(usage(66, 34, 28, 0)));
}

#[test]
fn streamed_tool_calls_without_ids_get_distinct_assigned_ids() {
    // Gemini's endpoint and Ollama stream calls with empty or missing ids.
    let body = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"tool_calls\":[",
        "{\"index\":0,\"id\":\"\",\"type\":\"function\",\"function\":{\"name\":\"a\",\"arguments\":\"{\\\"x\\\":\"}},",
        "{\"index\":1,\"type\":\"function\",\"function\":{\"name\":\"b\",\"arguments\":\"{}\"}}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"1}\"}}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
        "data: [DONE]\n\n",
    );
    let reply = fold(&decode(body.as_bytes(), &[])).expect("ok");
    assert_eq!(reply.tool_calls, vec![call("call_0", "a", json!({"x": 1})), call("call_1", "b", json!({})),]);
}

// ---------------------------------------------------------------------------
// Requests

/// The recorded request minus `ignored` (JSON pointers, `*` for any array
/// element): fields Arbor does not set, each listed with its reason at the
/// call site. The rest must match exactly, in both directions.
fn assert_reproduces(case: &str, provider: &OpenAiProvider, request: &ChatRequest, stream: bool, ignored: &[&str]) {
    let mut recorded = read_json(&format!("{case}.request.json"));
    for pointer in ignored {
        let removed = remove_pointer(&mut recorded, pointer);
        assert!(removed, "{case}: nothing at {pointer} to ignore");
    }
    // An assistant message that only calls tools may leave `content` out
    // or set it to null: the same message. Arbor sends null.
    if let Some(messages) = recorded["messages"].as_array_mut() {
        for message in messages {
            if message.get("tool_calls").is_some() && message.get("content").is_none() {
                message["content"] = Value::Null;
            }
        }
    }
    let ours = provider.request_body(request, stream);
    assert_eq!(ours, recorded, "{case}\nours:     {}\nrecorded: {}", ours, recorded);
}

fn remove_pointer(value: &mut Value, pointer: &str) -> bool {
    let segments: Vec<&str> = pointer.trim_start_matches('/').split('/').collect();
    remove_segments(value, &segments)
}

fn remove_segments(value: &mut Value, segments: &[&str]) -> bool {
    match segments {
        [] => false,
        [last] => match value {
            Value::Object(map) => map.remove(*last).is_some(),
            _ => false,
        },
        [first, rest @ ..] => match (value, *first) {
            (Value::Array(items), "*") => {
                let mut any = false;
                for item in items {
                    any |= remove_segments(item, rest);
                }
                any
            }
            (Value::Array(items), index) => index
                .parse::<usize>()
                .ok()
                .and_then(|index| items.get_mut(index))
                .is_some_and(|item| remove_segments(item, rest)),
            (Value::Object(map), key) => map.get_mut(key).is_some_and(|item| remove_segments(item, rest)),
            _ => false,
        },
    }
}

fn openai() -> OpenAiProvider {
    OpenAiProvider::new(OpenAiConfig::default()).expect("valid config")
}

fn legacy(stream_usage: bool) -> OpenAiProvider {
    OpenAiProvider::new(OpenAiConfig {
        max_tokens_field: MaxTokensField::MaxTokens,
        stream_usage,
        ..OpenAiConfig::default()
    })
    .expect("valid config")
}

fn no_stream_usage() -> OpenAiProvider {
    OpenAiProvider::new(OpenAiConfig { stream_usage: false, ..OpenAiConfig::default() }).expect("valid config")
}

/// The tools offered in a recording, as Arbor tool specs (name, description
/// and schema are copied; the wrapping around them is what is checked).
fn recorded_tools(case: &str) -> Vec<ToolSpec> {
    let recorded = read_json(&format!("{case}.request.json"));
    recorded["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .map(|tool| ToolSpec {
            name: tool["function"]["name"].as_str().expect("name").into(),
            description: tool["function"]["description"].as_str().unwrap_or_default().into(),
            parameters: tool["function"]["parameters"].clone(),
        })
        .collect()
}

fn request(model: &str, messages: Vec<Message>) -> ChatRequest {
    ChatRequest { model: model.into(), messages: SharedMessage::all(messages), ..ChatRequest::default() }
}

fn assistant_calls(calls: Vec<ToolCall>) -> Message {
    Message { content: None, tool_calls: calls, ..Message::assistant("") }
}

fn image(url: Option<&str>, data: Option<&str>, mime_type: Option<&str>) -> Part {
    Part::Image {
        media_id: None,
        url: url.map(Into::into),
        data: data.map(Into::into),
        mime_type: mime_type.map(Into::into),
    }
}

// Fields Arbor never sets, so never reproduces:
// - `tool_choice`: Arbor leaves the default ("auto").
// - `tools/*/function/strict`: Arbor's tools carry no strict flag.
// - `n`, `user`, `top_p`, `response_format`, `web_search_options`,
//   DeepSeek's `thinking`: not in ChatRequest.
const TOOL_CHOICE: &str = "/tool_choice";
const STRICT: &str = "/tools/*/function/strict";

#[test]
fn openai_requests_are_reproduced() {
    let provider = openai();

    let mut chat_text = request("gpt-4o-mini", vec![Message::user("hello")]);
    chat_text.max_output_tokens = Some(100);
    assert_reproduces("openai/chat-text", &provider, &chat_text, false, &[]);

    let mut potato = request("o3-mini", vec![]);
    potato.system = Some("You are a potato.".into());
    assert_reproduces("openai/chat-reasoning-tokens", &provider, &potato, false, &["/n"]);

    let mut files = request("gpt-4o", vec![Message::user("Delete the file `.env` and create `test.txt`")]);
    files.system = Some("Just call tools without asking for confirmation.".into());
    files.tools = recorded_tools("openai/chat-tool-calls-parallel");
    assert_reproduces("openai/chat-tool-calls-parallel", &provider, &files, false, &[TOOL_CHOICE, STRICT]);

    let get_file = call("call_qLQ1cE6MlqfhbxeGig6LIw9D", "get_file", json!({}));
    let mut look = Message::user("This is file 6a18c6:");
    look.parts.push(image(Some("https://www.gstatic.com/webp/gallery3/1.png"), None, None));
    let mut image_url = request(
        "gpt-5-mini",
        vec![
            Message::user("Use the get_file tool now to retrieve a image file, then describe what you received."),
            assistant_calls(vec![get_file.clone()]),
            Message::tool_result(&get_file, ToolStatus::Success, "See file 6a18c6."),
            look,
        ],
    );
    image_url.tools = recorded_tools("openai/chat-image-url-input");
    assert_reproduces("openai/chat-image-url-input", &provider, &image_url, false, &[TOOL_CHOICE]);

    // The image bytes are taken from the recording; Arbor's part holds the
    // base64 and the adapter must rebuild the data URL around it, with the
    // media type given or, when missing, recognised from the bytes.
    let recorded = read_json("openai/chat-image-base64-input.request.json");
    let data_url = recorded["messages"][0]["content"][1]["image_url"]["url"].as_str().expect("url");
    let base64 = data_url.strip_prefix("data:image/jpeg;base64,").expect("a jpeg data url");
    for mime_type in [Some("image/jpeg"), None] {
        let mut vegetable = Message::user("What is this vegetable?");
        vegetable.parts.push(image(None, Some(base64), mime_type));
        assert_reproduces(
            "openai/chat-image-base64-input",
            &provider,
            &request("gpt-4.1-nano", vec![vegetable]),
            false,
            &[],
        );
    }

    let get_capital = call("call_ZR5UUuTt3pf61kjwAJIYdVMj", "get_capital", json!({"country": "UK"}));
    let question = Message::user("What is the capital of the UK? Use the tool, then answer.");
    let mut single = request("gpt-4o-mini", vec![question.clone()]);
    single.tools = recorded_tools("openai/stream-tool-call-single");
    assert_reproduces("openai/stream-tool-call-single", &provider, &single, true, &[TOOL_CHOICE, STRICT]);
    let mut after = request(
        "gpt-4o-mini",
        vec![
            question,
            assistant_calls(vec![get_capital.clone()]),
            Message::tool_result(&get_capital, ToolStatus::Success, "London"),
        ],
    );
    after.tools = single.tools.clone();
    assert_reproduces("openai/stream-text-after-tool-result", &provider, &after, true, &[TOOL_CHOICE, STRICT]);

    let mut parallel = request(
        "gpt-4o",
        vec![Message::user("Tell me: the capital of the country; the weather there; the product name")],
    );
    parallel.tools = recorded_tools("openai/stream-tool-calls-parallel");
    assert_eq!(parallel.tools.len(), 19);
    assert_reproduces("openai/stream-tool-calls-parallel", &provider, &parallel, true, &[TOOL_CHOICE, STRICT]);

    assert_reproduces(
        "openai/stream-text-usage",
        &provider,
        &request("gpt-4o", vec![Message::user("What is the capital of Mexico?")]),
        true,
        &[],
    );
    assert_reproduces(
        "openai/stream-text-n2",
        &provider,
        &request("gpt-3.5-turbo", vec![Message::user("Hey, what is up?")]),
        true,
        &["/n"],
    );

    let mut cached = request("gpt-4o", vec![Message::user("How should I structure my database schema?")]);
    cached.system = Some("you are not an expert software engineer ".repeat(200));
    cached.max_output_tokens = Some(100);
    cached.temperature = Some(0.1);
    assert_reproduces("openai/stream-text-cached-tokens-length", &legacy(true), &cached, true, &["/user"]);

    let mut no_search = request("gpt-4o", vec![Message::user("What day is today?")]);
    no_search.system = Some("You are a helpful assistant.".into());
    assert_reproduces("openai/error-400-param-code-null", &provider, &no_search, false, &["/web_search_options"]);

    // The recording sends the system prompt as `developer` (which o1-mini
    // refused); Arbor sends `system`. Otherwise the request is the same.
    let mut developer = request("o1-mini", vec![Message::user("Hello")]);
    developer.system = Some("You are a helpful assistant.".into());
    let mut recorded = read_json("openai/error-400-unsupported-value.request.json");
    assert_eq!(recorded["messages"][0]["role"], "developer");
    recorded["messages"][0]["role"] = json!("system");
    recorded.as_object_mut().expect("object").remove("n");
    assert_eq!(provider.request_body(&developer, false), recorded);

    assert_reproduces(
        "openai/error-404-model-not-found",
        &provider,
        &request("gpt-5.2-proo", vec![Message::user("hello")]),
        false,
        &[],
    );
}

#[test]
fn openai_request_without_stream_field_is_reproduced_but_for_stream() {
    // This recording leaves `stream` out (false by default); Arbor always
    // says it, so compare after adding the default.
    let mut recorded = read_json("openai/error-401-invalid-api-key.request.json");
    for field in ["n", "top_p", "user"] {
        recorded.as_object_mut().expect("object").remove(field);
    }
    recorded["stream"] = json!(false);
    let mut series = request(
        "gpt-3.5-turbo",
        vec![
            Message::user("Who won the world series in 2020?"),
            Message::assistant("The Los Angeles Dodgers won the World Series in 2020."),
            Message::user("Where was it played?"),
        ],
    );
    series.system = Some("You are a helpful assistant.".into());
    assert_eq!(openai().request_body(&series, false), recorded);
}

#[test]
fn compatible_server_requests_are_reproduced() {
    let provider = openai();
    let france = || Message::user("What is the capital of France?");

    assert_reproduces(
        "openai-compatible/cerebras-chat-reasoning-field",
        &provider,
        &request("gpt-oss-120b", vec![france()]),
        false,
        &[],
    );

    let final_result = recorded_tools("openai-compatible/ollama-cloud-chat-reasoning");
    let mut reasoning = request("gpt-oss:20b", vec![france()]);
    reasoning.tools = final_result.clone();
    assert_reproduces("openai-compatible/ollama-cloud-chat-reasoning", &provider, &reasoning, false, &[TOOL_CHOICE]);

    // The recorded client replayed the model's `reasoning`; Arbor does not
    // send thinking back (DeepSeek refuses it), so that field is the one
    // difference, and the thinking part must not leak into the content.
    let recorded = read_json("openai-compatible/ollama-cloud-chat-tool-call.request.json");
    let mut paris = Message::assistant("Paris.");
    paris.parts.push(Part::Thinking {
        text: recorded["messages"][1]["reasoning"].as_str().expect("reasoning").into(),
        signature: None,
    });
    let mut tool_call = request(
        "gpt-oss:20b",
        vec![france(), paris, Message::user(recorded["messages"][2]["content"].as_str().expect("text"))],
    );
    tool_call.tools = final_result;
    assert_reproduces(
        "openai-compatible/ollama-cloud-chat-tool-call",
        &provider,
        &tool_call,
        false,
        &[TOOL_CHOICE, "/messages/1/reasoning"],
    );

    assert_reproduces(
        "openai-compatible/ollama-local-chat-json-schema",
        &provider,
        &request("qwen3:0.6b", vec![france()]),
        false,
        &["/response_format"],
    );

    let time = || Message::user("What is the current time?");
    let mut gemini = request("gemini-2.5-pro-preview-05-06", vec![time()]);
    gemini.tools = recorded_tools("openai-compatible/gemini-openai-compat-tool-call");
    let google = OpenAiProvider::new(OpenAiConfig {
        base_url: "https://generativelanguage.googleapis.com/v1beta/openai".into(),
        ..OpenAiConfig::default()
    })
    .expect("valid");
    assert_reproduces("openai-compatible/gemini-openai-compat-tool-call", &google, &gemini, false, &[TOOL_CHOICE]);
    let get_time = call("pyd_ai_cee885c699414386a7e14b7ec43cadbc", "get_current_time", json!({}));
    let mut gemini_after = request(
        "gemini-2.5-pro-preview-05-06",
        vec![
            time(),
            assistant_calls(vec![get_time.clone()]),
            Message::tool_result(&get_time, ToolStatus::Success, "Noon"),
        ],
    );
    gemini_after.tools = gemini.tools.clone();
    assert_reproduces(
        "openai-compatible/gemini-openai-compat-after-tool-result",
        &google,
        &gemini_after,
        false,
        &[TOOL_CHOICE],
    );

    let mut groq = request(
        "openai/gpt-oss-120b",
        vec![Message::user(
            "Please call the \"get_something_by_name\" tool with non-existent parameters to test error handling; on the second try you can use valid args",
        )],
    );
    groq.system = Some("Be concise. Never use pretty double quotes, just regular ones.".into());
    groq.tools = recorded_tools("openai-compatible/groq-error-400-tool-use-failed");
    assert_reproduces(
        "openai-compatible/groq-error-400-tool-use-failed",
        &provider,
        &groq,
        false,
        &["/n", TOOL_CHOICE],
    );
    assert_reproduces(
        "openai-compatible/groq-stream-error-event",
        &no_stream_usage(),
        &groq,
        true,
        &["/n", TOOL_CHOICE],
    );
    assert_reproduces(
        "openai-compatible/groq-error-404-model-not-found",
        &provider,
        &request("non-existent", vec![Message::user("hello")]),
        false,
        &["/n"],
    );

    let mut joke = request("google/gemini-2.0-flash-exp:free", vec![Message::user("Tell me a joke.")]);
    joke.system = Some("Be helpful.".into());
    assert_reproduces("openai-compatible/openrouter-error-429", &provider, &joke, false, &[]);

    let mut version = request("gpt-4.1-mini", vec![Message::user("What is the current llm version?")]);
    version.tools = recorded_tools("openai-compatible/openrouter-stream-tool-call");
    assert_reproduces("openai-compatible/openrouter-stream-tool-call", &provider, &version, true, &[]);

    let mut deepseek = request("deepseek-v4-pro", vec![Message::user("What is 17 * 23?")]);
    deepseek.system = Some("You are a helpful assistant".into());
    deepseek.max_output_tokens = Some(1024);
    deepseek.reasoning = Some(Reasoning { effort: Some("high".into()), budget_tokens: None });
    assert_reproduces(
        "openai-compatible/deepseek-stream-reasoning-content",
        &legacy(true),
        &deepseek,
        true,
        &["/thinking"],
    );

    let mut azure = request("gpt-4o-mini", vec![Message::user("What's the weather like in NYC right now?")]);
    azure.max_output_tokens = Some(300);
    azure.temperature = Some(0.0);
    assert_reproduces(
        "openai-compatible/azure-openai-stream-content-filter",
        &legacy(false),
        &azure,
        true,
        &["/n", "/user"],
    );
}

#[test]
fn thinking_and_foreign_signatures_are_not_sent() {
    let mut reply = Message::assistant("42");
    reply.parts.push(Part::Thinking {
        text: "let me add".into(),
        signature: Some(ProviderOpaque { provider: "anthropic".into(), data: "EqQBCkYI==".into() }),
    });
    reply
        .parts
        .push(Part::RedactedThinking { data: ProviderOpaque { provider: "anthropic".into(), data: "opaque".into() } });
    let mut gemini_call = call("c1", "add", json!({"a": 1}));
    gemini_call.signature = Some(ProviderOpaque { provider: "gemini".into(), data: "sig".into() });
    let body = openai()
        .request_body(&request("gpt-4o", vec![Message::user("add"), reply, assistant_calls(vec![gemini_call])]), false);
    assert_eq!(
        body["messages"],
        json!([
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": "42"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\":1}"}}
            ]},
        ])
    );
}

// ---------------------------------------------------------------------------
// Errors

fn recorded_error(case: &str, status: u16, headers: HeaderMap) -> ProviderError {
    let body = String::from_utf8(read(&format!("{case}.response.json"))).expect("utf-8");
    error_from_response(&ErrorResponse { status, headers, body })
}

fn recorded_status(case: &str) -> u16 {
    let meta = read_json(&format!("{case}.meta.json"));
    u16::try_from(meta["response"]["status"].as_u64().expect("status")).expect("u16")
}

#[test]
fn recorded_error_bodies_map_to_codes_and_keep_the_message() {
    let cases = [
        (
            "openai/error-400-param-code-null",
            ErrorCode::InvalidRequest,
            "Web search options not supported with this model.",
        ),
        (
            "openai/error-400-unsupported-value",
            ErrorCode::InvalidRequest,
            "Unsupported value: 'messages[0].role' does not support 'developer' with this model.",
        ),
        (
            "openai/error-401-invalid-api-key",
            ErrorCode::Authentication,
            "Incorrect API key provided: <not-a-r****key>. You can find your API key at https://platform.openai.com/account/api-keys.",
        ),
        (
            "openai/error-404-model-not-found",
            ErrorCode::NotFound,
            "The model `gpt-5.2-proo` does not exist or you do not have access to it.",
        ),
        (
            "openai-compatible/groq-error-400-tool-use-failed",
            ErrorCode::InvalidRequest,
            "Tool call validation failed: tool call validation failed: parameters for tool get_something_by_name did not match schema: errors: [missing properties: 'name', additionalProperties 'foo' not allowed]",
        ),
        (
            "openai-compatible/groq-error-404-model-not-found",
            ErrorCode::NotFound,
            "The model `non-existent` does not exist or you do not have access to it.",
        ),
        (
            "openai-compatible/openrouter-error-429",
            ErrorCode::RateLimit,
            "Provider returned error: google/gemini-2.0-flash-exp:free is temporarily rate-limited upstream. Please retry shortly, or add your own key to accumulate your rate limits: https://openrouter.ai/settings/integrations",
        ),
    ];
    for (case, code, message) in cases {
        let status = recorded_status(case);
        let error = recorded_error(case, status, HeaderMap::new());
        assert_eq!(error.code, code, "{case}");
        assert_eq!(error.message, message, "{case}");
        assert_eq!(error.status, Some(status), "{case}");
        assert_eq!(error.retry_after, None, "{case}: no retry-after was recorded");
    }
    // A body without request or meta: its status is in the README.
    let error = recorded_error("openai/error-400-unsupported-parameter", 400, HeaderMap::new());
    assert_eq!(error.code, ErrorCode::InvalidRequest);
    assert!(error.message.contains("Use 'max_completion_tokens' instead."));
}

#[test]
fn rate_limit_takes_retry_after_from_headers() {
    let mut headers = HeaderMap::new();
    headers.insert("retry-after", HeaderValue::from_static("7"));
    let error = recorded_error("openai-compatible/openrouter-error-429", 429, headers);
    assert_eq!(error.code, ErrorCode::RateLimit);
    assert_eq!(error.retry_after, Some(Duration::from_secs(7)));
}

#[test]
fn context_length_errors_are_recognised() {
    // The README's shape for OpenAI (no recording exists), and the same
    // words from a server that sets no code.
    let body = json!({"error": {
        "message": "This model's maximum context length is 128000 tokens. However, your messages resulted in 130532 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"
    }});
    for body in [body.clone(), json!({"error": {"message": body["error"]["message"], "type": "invalid_request_error"}})]
    {
        let error =
            error_from_response(&ErrorResponse { status: 400, headers: HeaderMap::new(), body: body.to_string() });
        assert_eq!(error.code, ErrorCode::ContextLengthExceeded);
        assert!(error.message.starts_with("This model's maximum context length"));
    }
}

#[test]
fn an_error_object_in_a_200_stream_is_an_error() {
    let body = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
        "data: {\"error\":{\"message\":\"The server had an error while processing your request.\",\"type\":\"server_error\"}}\n\n",
    );
    let items = decode(body.as_bytes(), &[]);
    assert_eq!(items[0], Ok(Chunk::Text("Hi".into())));
    let error = items[1].as_ref().expect_err("error");
    assert_eq!(error.code, ErrorCode::ProviderUnavailable);
    assert_eq!(items.len(), 2, "nothing after the error");
    let content_filter = "data: {\"error\":{\"message\":\"blocked\",\"code\":\"content_filter\",\"status\":400}}\n\n";
    let items = decode(content_filter.as_bytes(), &[]);
    assert_eq!(items[0].as_ref().map_err(|error| error.code), Err(ErrorCode::ContentFilter));
}

// ---------------------------------------------------------------------------
// Coverage

/// Every recorded case in the OpenAI folders is read by a test above; a new
/// fixture fails this test until it is.
#[test]
fn every_openai_fixture_is_covered() {
    let covered: BTreeSet<&str> = [
        "openai/chat-image-base64-input",
        "openai/chat-image-url-input",
        "openai/chat-reasoning-tokens",
        "openai/chat-text",
        "openai/chat-tool-calls-parallel",
        "openai/error-400-param-code-null",
        "openai/error-400-unsupported-parameter",
        "openai/error-400-unsupported-value",
        "openai/error-401-invalid-api-key",
        "openai/error-404-model-not-found",
        "openai-compatible/cerebras-chat-reasoning-field",
        "openai-compatible/gemini-openai-compat-after-tool-result",
        "openai-compatible/gemini-openai-compat-tool-call",
        "openai-compatible/groq-error-400-tool-use-failed",
        "openai-compatible/groq-error-404-model-not-found",
        "openai-compatible/ollama-cloud-chat-reasoning",
        "openai-compatible/ollama-cloud-chat-tool-call",
        "openai-compatible/ollama-local-chat-json-schema",
        "openai-compatible/openrouter-error-429",
    ]
    .into_iter()
    .chain(STREAM_CASES.iter().copied())
    .collect();
    let mut found = BTreeSet::new();
    for folder in ["openai", "openai-compatible"] {
        let entries = std::fs::read_dir(format!("{FIXTURES}/{folder}")).expect("fixture folder");
        for entry in entries {
            let name = entry.expect("entry").file_name();
            let name = name.to_string_lossy();
            for suffix in [".response.json", ".response.sse", ".chunks.jsonl"] {
                if let Some(case) = name.strip_suffix(suffix) {
                    found.insert(format!("{folder}/{case}"));
                }
            }
        }
    }
    let found: BTreeSet<&str> = found.iter().map(String::as_str).collect();
    assert_eq!(found, covered);
}
