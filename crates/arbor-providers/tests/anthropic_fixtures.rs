//! The Anthropic adapter against recorded Messages API traffic
//! (`shared/fixtures/providers/anthropic/`) and against the error fixtures
//! written from Anthropic's API reference for the cases nobody recorded
//! (`tests/fixtures/anthropic/`, each meta says so).
//!
//! What is checked: every recorded stream folds into the reply and usage the
//! recording carries (also when the body is cut at arbitrary byte
//! boundaries), every recorded non-streamed reply likewise, every recorded
//! request whose Arbor equivalent can be expressed is rebuilt by the
//! adapter, and every error body maps to the right code.

use std::path::PathBuf;
use std::time::Duration;

use arbor_core::message::ProviderOpaque;
use arbor_core::{ErrorCode, Message, Part, ProviderError, Role, SharedMessage, ToolCall, ToolStatus, Usage};
use arbor_providers::anthropic::{self, StreamDecoder};
use arbor_providers::http::ErrorResponse;
use arbor_providers::sse::byte_chunks;
use arbor_providers::{ChatRequest, Chunk, Collected, FinishReason, Reasoning, ToolSpec};
use futures_util::{FutureExt, StreamExt};
use proptest::prelude::*;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Value, json};

const RECORDED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/providers/anthropic");
const WRITTEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/anthropic");

fn read(dir: &str, name: &str) -> Vec<u8> {
    let path = PathBuf::from(dir).join(name);
    std::fs::read(&path).unwrap_or_else(|error| panic!("fixture {}: {error}", path.display()))
}

fn read_json(dir: &str, name: &str) -> Value {
    serde_json::from_slice(&read(dir, name)).expect("fixture is JSON")
}

/// Decodes a body cut at `cuts`: the chunks before the end, and the error
/// that ended the stream, if one did.
fn decode(body: &[u8], cuts: &[usize]) -> (Vec<Chunk>, Option<ProviderError>) {
    let items: Vec<Result<Chunk, ProviderError>> = anthropic::decode_body(byte_chunks(body, cuts))
        .collect()
        .now_or_never()
        .expect("an in-memory body is always ready");
    let mut chunks = Vec::new();
    for (position, item) in items.iter().enumerate() {
        match item {
            Ok(chunk) => chunks.push(chunk.clone()),
            Err(error) => {
                assert_eq!(position, items.len() - 1, "nothing follows an error");
                return (chunks, Some(error.clone()));
            }
        }
    }
    (chunks, None)
}

fn fold(chunks: &[Chunk]) -> Collected {
    let mut collected = Collected::default();
    for chunk in chunks {
        collected.push(chunk);
    }
    collected.finish()
}

/// A recorded stream that must decode without error.
fn stream(name: &str) -> (Vec<Chunk>, Collected) {
    let (chunks, error) = decode(&read(RECORDED, name), &[]);
    assert_eq!(error, None, "{name} decodes cleanly");
    let collected = fold(&chunks);
    (chunks, collected)
}

fn usage(input: u64, output: u64, cached: u64, written: u64) -> Usage {
    Usage {
        input_tokens: input,
        output_tokens: output,
        thinking_tokens: 0,
        cached_tokens: cached,
        cache_write_tokens: written,
    }
}

fn anthropic_signed(data: &str) -> ProviderOpaque {
    ProviderOpaque { provider: "anthropic".into(), data: data.into() }
}

// ---------------------------------------------------------------------------
// Streams
// ---------------------------------------------------------------------------

#[test]
fn text_stream_gives_text_usage_and_stop() {
    let (chunks, reply) = stream("stream-text.response.sse");
    assert_eq!(
        chunks,
        vec![Chunk::Text("Hello".into()), Chunk::Usage(usage(10, 4, 0, 0)), Chunk::Finish(FinishReason::Stop),]
    );
    assert_eq!(reply.message(), Message::assistant("Hello"));
}

#[test]
fn cache_read_stream_counts_cached_input_and_stops_at_max_tokens() {
    let (_, reply) = stream("stream-text-cache-read-max-tokens.response.sse");
    // message_delta only repeats output_tokens here (older API shape): the
    // input counts of message_start must survive it.
    assert_eq!(reply.usage, Some(usage(11 + 1031, 100, 1031, 0)));
    assert_eq!(reply.finish, Some(FinishReason::Length));
    assert_eq!(reply.text.chars().count(), 496);
    assert!(reply.text.starts_with("A **system** is an organized collection"));
}

#[test]
fn thinking_stream_keeps_thinking_text_and_signature() {
    let (chunks, reply) = stream("stream-thinking.response.sse");
    let raw = String::from_utf8(read(RECORDED, "stream-thinking.response.sse")).expect("utf-8");
    let signature = raw
        .split("\"signature\":\"")
        .nth(2)
        .and_then(|rest| rest.split('"').next())
        .expect("the recording has a signature_delta");
    assert_eq!(signature.len(), 656);
    // The empty thinking_delta in the recording yields no chunk.
    assert!(!chunks.contains(&Chunk::Thinking(String::new())));
    assert_eq!(reply.parts.len(), 1);
    match &reply.parts[0] {
        Part::Thinking { text, signature: Some(opaque) } => {
            assert!(text.starts_with("The user wants two names for a pet pelican"));
            assert!(text.ends_with("Let me give two brief, catchy names:"));
            assert_eq!(opaque, &anthropic_signed(signature));
        }
        other => panic!("expected signed thinking, got {other:?}"),
    }
    assert_eq!(
        reply.text,
        "1. **Pouch** - references their iconic bill pouch\n2. **Pelé** - playful take on \"pelican\""
    );
    assert_eq!(reply.usage, Some(usage(46, 133, 0, 0)));
    assert_eq!(reply.finish, Some(FinishReason::Stop));
}

#[test]
fn redacted_thinking_stream_keeps_both_opaque_blocks() {
    let (_, reply) = stream("stream-redacted-thinking.response.sse");
    let redacted: Vec<&ProviderOpaque> = reply
        .parts
        .iter()
        .filter_map(|part| match part {
            Part::RedactedThinking { data } => Some(data),
            _ => None,
        })
        .collect();
    assert_eq!(redacted.len(), 2);
    assert!(redacted[0].data.starts_with("EqkECkYIBxgCKkA8AZ4noDfV5VcOJe"));
    assert!(redacted[1].data.starts_with("EtgBCkYIBxgCKkDQfGkwzflEJP5asG"));
    assert!(redacted.iter().all(|data| data.provider == "anthropic"));
    assert!(reply.text.starts_with("I notice that you've sent what appears"));
    assert!(reply.text.ends_with("a legitimate task or question?"));
    assert_eq!(reply.usage, Some(usage(92, 189, 0, 0)));
}

#[test]
fn tool_use_stream_assembles_arguments_from_fragments() {
    let (chunks, reply) = stream("stream-tool-use-with-args.response.sse");
    assert!(reply.text.starts_with("<thinking>\nThe get_weather tool is relevant"));
    assert_eq!(
        reply.tool_calls,
        vec![ToolCall {
            id: "toolu_01DYJo37oETVsCdLTTcCWcdq".into(),
            name: "get_weather".into(),
            arguments: json!({"location": "San Francisco, CA"}),
            signature: None,
        }]
    );
    let fragments = chunks.iter().filter(|chunk| matches!(chunk, Chunk::ToolCallArguments { .. })).count();
    assert!(fragments > 1, "arguments arrive in several fragments");
    // An old stream with no cache fields in its usage.
    assert_eq!(reply.usage, Some(usage(599, 135, 0, 0)));
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
}

#[test]
fn parallel_parameterless_tool_calls_get_empty_objects() {
    let (chunks, reply) = stream("stream-tool-use-parallel-empty-input.response.sse");
    let expected_call = |id: &str| ToolCall {
        id: id.into(),
        name: "pelican_name_generator".into(),
        arguments: json!({}),
        signature: None,
    };
    assert_eq!(
        reply.tool_calls,
        vec![expected_call("toolu_01LtHJmixrs9NcWQkK8hu8hj"), expected_call("toolu_01N8a4jWyf116qKTMqKKmjyt"),]
    );
    assert_eq!(
        chunks[..4],
        [
            Chunk::ToolCallStart {
                index: 0,
                id: "toolu_01LtHJmixrs9NcWQkK8hu8hj".into(),
                name: "pelican_name_generator".into(),
            },
            Chunk::ToolCallEnd { index: 0, signature: None },
            Chunk::ToolCallStart {
                index: 1,
                id: "toolu_01N8a4jWyf116qKTMqKKmjyt".into(),
                name: "pelican_name_generator".into(),
            },
            Chunk::ToolCallEnd { index: 1, signature: None },
        ]
    );
    assert_eq!(reply.message().content, None, "a tool-only reply has no text");
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
}

#[test]
fn server_tool_blocks_are_ignored_and_the_client_call_kept() {
    let (chunks, reply) = stream("stream-server-tool-and-tool-use.response.sse");
    assert_eq!(
        reply.text,
        "Let me search for a tool that can provide current exchange rate information.\
         I found the right tool! Let me fetch the current USD to EUR exchange rate for you."
    );
    // The server_tool_use block's input must not leak into any call.
    assert_eq!(
        reply.tool_calls,
        vec![ToolCall {
            id: "toolu_01EFn5wTNBYA8Reni8rbmnHT".into(),
            name: "get_exchange_rate".into(),
            arguments: json!({"from_currency": "USD", "to_currency": "EUR"}),
            signature: None,
        }]
    );
    assert!(chunks.iter().all(|chunk| !matches!(
        chunk,
        Chunk::ToolCallStart { index, .. } if *index != 0
    )));
    // message_delta's cumulative input count supersedes message_start's.
    assert_eq!(reply.usage, Some(usage(1591, 175, 0, 0)));
}

#[test]
fn image_and_follow_up_streams_decode() {
    let (_, reply) = stream("stream-image-base64-input.response.sse");
    assert_eq!(reply.text, "Red square, green square.");
    assert_eq!(reply.usage, Some(usage(83, 9, 0, 0)));
    let (_, reply) = stream("stream-image-url-input.response.sse");
    assert_eq!(reply.text.chars().count(), 943);
    assert!(reply.text.starts_with("This image shows a **brown pelican**"));
    assert_eq!(reply.usage, Some(usage(273, 206, 0, 0)));
    let (_, reply) = stream("stream-text-after-tool-results.response.sse");
    assert!(reply.text.ends_with("for your feathered friend! 🦅"));
    assert_eq!(reply.usage, Some(usage(678, 82, 0, 0)));
}

#[test]
fn refusal_stream_from_data_lines_finishes_with_content_filter() {
    // The vercel/ai recording keeps only the `data:` payloads.
    let text = String::from_utf8(read(RECORDED, "stream-refusal.chunks.jsonl")).expect("utf-8");
    let mut decoder = StreamDecoder::new();
    let mut chunks = Vec::new();
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        chunks.extend(decoder.push(line).expect("valid event"));
    }
    chunks.extend(decoder.finish().expect("ends with message_stop"));
    let reply = fold(&chunks);
    assert_eq!(reply.finish, Some(FinishReason::ContentFilter));
    assert_eq!(reply.text, "");
    assert_eq!(reply.usage, Some(usage(18, 5, 0, 0)));
}

#[test]
fn in_stream_error_event_ends_the_stream_as_overloaded() {
    let body = read(WRITTEN, "stream-error-overloaded.response.sse");
    let (chunks, error) = decode(&body, &[]);
    assert_eq!(chunks, vec![Chunk::Text("Hello".into())]);
    let error = error.expect("the error event becomes an error");
    assert_eq!(error.code, ErrorCode::Overloaded);
    assert_eq!(error.message, "Overloaded");
}

#[test]
fn a_body_cut_mid_event_is_a_stream_interruption() {
    let body = read(RECORDED, "stream-text.response.sse");
    let cut = body.len() / 2;
    let (_, error) = decode(&body[..cut], &[]);
    assert_eq!(error.map(|error| error.code), Some(ErrorCode::StreamInterrupted));
}

const STREAMS: &[(&str, &str)] = &[
    (RECORDED, "stream-text.response.sse"),
    (RECORDED, "stream-text-cache-read-max-tokens.response.sse"),
    (RECORDED, "stream-thinking.response.sse"),
    (RECORDED, "stream-redacted-thinking.response.sse"),
    (RECORDED, "stream-tool-use-with-args.response.sse"),
    (RECORDED, "stream-tool-use-parallel-empty-input.response.sse"),
    (RECORDED, "stream-server-tool-and-tool-use.response.sse"),
    (RECORDED, "stream-image-base64-input.response.sse"),
    (RECORDED, "stream-image-url-input.response.sse"),
    (RECORDED, "stream-text-after-tool-results.response.sse"),
    (WRITTEN, "stream-error-overloaded.response.sse"),
];

#[test]
fn every_cut_of_a_short_stream_gives_the_same_chunks() {
    let body = read(RECORDED, "stream-text.response.sse");
    let whole = decode(&body, &[]);
    for cut in 0..=body.len() {
        assert_eq!(decode(&body, &[cut]), whole, "cut at byte {cut}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Where the network splits the body never changes the reply: the
    /// events, and so the chunks and the error, are the same.
    #[test]
    fn chunk_boundaries_never_change_a_recorded_stream(
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..40)
    ) {
        for (dir, name) in STREAMS {
            let body = read(dir, name);
            let offsets: Vec<usize> = cuts.iter().map(|index| index.index(body.len() + 1)).collect();
            prop_assert_eq!(decode(&body, &offsets), decode(&body, &[]), "{}", name);
        }
    }
}

// ---------------------------------------------------------------------------
// Non-streamed replies
// ---------------------------------------------------------------------------

fn response(name: &str) -> Collected {
    let chunks = anthropic::response_chunks(&read(RECORDED, name)).expect("readable response");
    fold(&chunks)
}

#[test]
fn non_streamed_replies_fold_like_streams() {
    let reply = response("messages-text.response.json");
    assert_eq!(reply.text, "The capital of France is Paris.");
    assert_eq!(reply.usage, Some(usage(20, 10, 0, 0)));
    assert_eq!(reply.finish, Some(FinishReason::Stop));

    let reply = response("messages-cache-write.response.json");
    assert_eq!(reply.usage, Some(usage(3 + 1111, 406, 1111, 0)));
    let reply = response("messages-cache-read.response.json");
    assert_eq!(reply.usage, Some(usage(3 + 1111 + 418, 33, 1111, 418)));

    let reply = response("messages-tool-use-parallel.response.json");
    assert!(reply.text.starts_with("I'll help you find out who is the youngest"));
    let names: Vec<Value> = reply.tool_calls.iter().map(|call| call.arguments["name"].clone()).collect();
    assert_eq!(names, vec!["Alice", "Bob", "Charlie", "Daisy"]);
    assert_eq!(reply.tool_calls[3].id, "toolu_013mnQZbgtK2oe3Mo3XKJsx3");
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));

    let reply = response("messages-redacted-thinking.response.json");
    assert!(matches!(
        &reply.parts[..],
        [Part::RedactedThinking { data }] if data.data.starts_with("EvgFCkYIBxgCKkBmxKtCnM3x")
    ));

    let reply = response("messages-refusal.response.json");
    assert_eq!(reply.finish, Some(FinishReason::ContentFilter));
    assert_eq!(reply.usage, Some(usage(18, 5, 0, 0)));
}

#[test]
fn non_streamed_thinking_keeps_its_signature() {
    let reply = response("messages-thinking.response.json");
    let recorded = read_json(RECORDED, "messages-thinking.response.json");
    assert_eq!(
        reply.parts,
        vec![Part::Thinking {
            text: recorded["content"][0]["thinking"].as_str().expect("text").into(),
            signature: Some(anthropic_signed(recorded["content"][0]["signature"].as_str().expect("signature"))),
        }]
    );
    assert_eq!(reply.text, recorded["content"][1]["text"]);
}

// ---------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------

/// Puts a recorded request and ours in one canonical form. Each rule is a
/// documented equivalence, not a way to hide a difference:
/// - a message's `content` string is shorthand for one text block;
/// - `tool_choice: {"type": "auto"}` is the API's default when tools are
///   given (Arbor never sets a tool choice).
fn canonical(mut body: Value) -> Value {
    if let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) {
        for message in messages {
            if let Some(text) = message["content"].as_str() {
                message["content"] = json!([{"type": "text", "text": text}]);
            }
        }
    }
    if body.get("tool_choice") == Some(&json!({"type": "auto"})) {
        body.as_object_mut().map(|map| map.remove("tool_choice"));
    }
    body
}

fn assert_rebuilt(name: &str, request: &ChatRequest) {
    let recorded = read_json(RECORDED, name);
    let stream = recorded["stream"].as_bool().unwrap_or(false);
    let ours = anthropic::request_body(request, stream).expect("builds");
    assert_eq!(canonical(ours), canonical(recorded), "{name}");
}

fn user_text(text: &str) -> Message {
    Message::user(text)
}

fn image(url: Option<&str>, data: Option<&str>, mime_type: Option<&str>) -> Part {
    Part::Image {
        media_id: None,
        url: url.map(Into::into),
        data: data.map(Into::into),
        mime_type: mime_type.map(Into::into),
    }
}

fn thinking(budget: u32) -> Option<Reasoning> {
    Some(Reasoning { effort: None, budget_tokens: Some(budget) })
}

#[test]
fn plain_requests_are_rebuilt() {
    assert_rebuilt(
        "messages-text.request.json",
        &ChatRequest {
            model: "claude-3-opus-latest".into(),
            system: Some("You are a helpful assistant.\n\n".into()),
            messages: SharedMessage::all([user_text("What is the capital of France?")]),
            max_output_tokens: Some(4096),
            ..ChatRequest::default()
        },
    );
    assert_rebuilt(
        "stream-text.request.json",
        &ChatRequest {
            model: "claude-haiku-4-5-20251001".into(),
            messages: SharedMessage::all([user_text("Say just hello")]),
            max_output_tokens: Some(8192),
            temperature: Some(1.0),
            ..ChatRequest::default()
        },
    );
    // Recorded with `"content": "..."` strings and no temperature.
    assert_rebuilt(
        "error-401-authentication.request.json",
        &ChatRequest {
            model: "claude-3-7-sonnet-20250219".into(),
            messages: SharedMessage::all([user_text("Hello, world!")]),
            max_output_tokens: Some(100),
            temperature: Some(0.5),
            ..ChatRequest::default()
        },
    );
    assert_rebuilt(
        "error-404-not-found-model.request.json",
        &ChatRequest {
            model: "claude-sonet-4-5".into(),
            messages: SharedMessage::all([user_text("hello")]),
            max_output_tokens: Some(4096),
            ..ChatRequest::default()
        },
    );
}

#[test]
fn thinking_requests_are_rebuilt() {
    assert_rebuilt(
        "stream-thinking.request.json",
        &ChatRequest {
            model: "claude-haiku-4-5-20251001".into(),
            messages: SharedMessage::all([user_text("Two names for a pet pelican, be brief")]),
            max_output_tokens: Some(8192),
            temperature: Some(1.0),
            reasoning: thinking(1024),
            ..ChatRequest::default()
        },
    );
    assert_rebuilt(
        "messages-thinking.request.json",
        &ChatRequest {
            model: "claude-sonnet-4-5".into(),
            messages: SharedMessage::all([user_text("How do I cross the street?")]),
            max_output_tokens: Some(4096),
            reasoning: thinking(1024),
            ..ChatRequest::default()
        },
    );
    let magic = "ANTHROPIC_MAGIC_STRING_TRIGGER_REDACTED_THINKING_46C9A13E193C177646C7398A98432ECCCE4C1253D5E2D82641AC0E52CC2876CB";
    for name in ["messages-redacted-thinking.request.json", "stream-redacted-thinking.request.json"] {
        assert_rebuilt(
            name,
            &ChatRequest {
                model: "claude-sonnet-4-5-20250929".into(),
                messages: SharedMessage::all([user_text(magic)]),
                max_output_tokens: Some(4096),
                reasoning: thinking(1024),
                ..ChatRequest::default()
            },
        );
    }
}

#[test]
fn image_requests_are_rebuilt() {
    let recorded = read_json(RECORDED, "stream-image-base64-input.request.json");
    let data = recorded["messages"][0]["content"][0]["source"]["data"].as_str().expect("base64");
    let mut message = user_text("Describe image in three words");
    message.parts = vec![image(None, Some(data), Some("image/png"))];
    let request = ChatRequest {
        model: "claude-sonnet-4-5".into(),
        messages: SharedMessage::all([message]),
        max_output_tokens: Some(8192),
        temperature: Some(1.0),
        ..ChatRequest::default()
    };
    assert_rebuilt("stream-image-base64-input.request.json", &request);

    // The same image as a data URL, or without a mime type, gives the same
    // request: the type is read from the URL or from the PNG signature.
    let mut from_data_url = request.clone();
    from_data_url.messages[0].to_mut().parts = vec![image(Some(&format!("data:image/png;base64,{data}")), None, None)];
    assert_rebuilt("stream-image-base64-input.request.json", &from_data_url);
    let mut sniffed = request.clone();
    sniffed.messages[0].to_mut().parts = vec![image(None, Some(data), None)];
    assert_rebuilt("stream-image-base64-input.request.json", &sniffed);

    let mut message = user_text("describe image");
    message.parts = vec![image(Some("https://static.simonwillison.net/static/2024/pelican.jpg"), None, None)];
    assert_rebuilt(
        "stream-image-url-input.request.json",
        &ChatRequest {
            model: "claude-sonnet-4-5".into(),
            messages: SharedMessage::all([message]),
            max_output_tokens: Some(8192),
            temperature: Some(1.0),
            ..ChatRequest::default()
        },
    );
}

fn pelican_tool() -> ToolSpec {
    ToolSpec {
        name: "pelican_name_generator".into(),
        description: String::new(),
        parameters: json!({"properties": {}, "type": "object"}),
    }
}

#[test]
fn tool_requests_are_rebuilt() {
    assert_rebuilt(
        "stream-tool-use-with-args.request.json",
        &ChatRequest {
            model: "claude-3-opus-20240229".into(),
            messages: SharedMessage::all([user_text("What is the weather in San Francisco, CA?")]),
            tools: vec![ToolSpec {
                name: "get_weather".into(),
                description: "Get the weather for a specific location".into(),
                parameters: json!({"type": "object", "properties": {"location": {"type": "string"}}}),
            }],
            max_output_tokens: Some(200),
            ..ChatRequest::default()
        },
    );
    assert_rebuilt(
        "stream-tool-use-parallel-empty-input.request.json",
        &ChatRequest {
            model: "claude-haiku-4-5-20251001".into(),
            messages: SharedMessage::all([user_text("Two names for a pet pelican")]),
            tools: vec![pelican_tool()],
            max_output_tokens: Some(8192),
            temperature: Some(1.0),
            ..ChatRequest::default()
        },
    );
    assert_rebuilt(
        "messages-tool-use-parallel.request.json",
        &ChatRequest {
            model: "claude-haiku-4-5".into(),
            system: Some(
                read_json(RECORDED, "messages-tool-use-parallel.request.json")["system"]
                    .as_str()
                    .expect("system")
                    .into(),
            ),
            messages: SharedMessage::all([user_text(
                "Alice, Bob, Charlie and Daisy are a family. Who is the youngest?",
            )]),
            tools: vec![ToolSpec {
                name: "retrieve_entity_info".into(),
                description: "Get the knowledge about the given entity.".into(),
                parameters: json!({
                    "additionalProperties": false,
                    "properties": {"name": {"type": "string"}},
                    "required": ["name"],
                    "type": "object"
                }),
            }],
            max_output_tokens: Some(4096),
            ..ChatRequest::default()
        },
    );
}

#[test]
fn the_recorded_tool_round_trip_is_rebuilt_from_the_streamed_reply() {
    // Round one's reply, as Arbor collected it from the recorded stream...
    let (_, reply) = stream("stream-tool-use-parallel-empty-input.response.sse");
    let mut assistant = reply.message();
    // ...except that the recorded client replayed a " " text block that the
    // stream did not contain (llm-anthropic adds it).
    assistant.content = Some(" ".into());
    let results = ["Charles", "Sammy"];
    let mut messages = vec![user_text("Two names for a pet pelican"), assistant.clone()];
    for (call, result) in assistant.tool_calls.iter().zip(results) {
        messages.push(Message::tool_result(call, ToolStatus::Success, result));
    }
    assert_rebuilt(
        "stream-text-after-tool-results.request.json",
        &ChatRequest {
            model: "claude-haiku-4-5-20251001".into(),
            messages: SharedMessage::all(messages),
            tools: vec![pelican_tool()],
            max_output_tokens: Some(8192),
            temperature: Some(1.0),
            ..ChatRequest::default()
        },
    );
}

#[test]
fn the_recorded_thinking_round_trip_is_rebuilt_byte_for_byte() {
    let reply = response("messages-thinking.response.json");
    let request = ChatRequest {
        model: "claude-sonnet-4-5".into(),
        messages: SharedMessage::all([
            user_text("How do I cross the street?"),
            reply.message(),
            user_text("Considering the way to cross the street, analogously, how do I cross the river?"),
        ]),
        max_output_tokens: Some(4096),
        reasoning: thinking(1024),
        ..ChatRequest::default()
    };
    assert_rebuilt("messages-thinking-roundtrip.request.json", &request);

    // And byte-for-byte on the wire: the signature's exact text, as the
    // response carried it, is in the body we would send.
    let body = serde_json::to_string(&anthropic::request_body(&request, false).expect("builds")).expect("serialises");
    let recorded = read_json(RECORDED, "messages-thinking.response.json");
    let signature = recorded["content"][0]["signature"].as_str().expect("sig");
    assert!(body.contains(&format!("\"signature\":\"{signature}\"")));
}

#[test]
fn thinking_from_other_providers_is_dropped_cleanly() {
    let gemini = |data: &str| ProviderOpaque { provider: "gemini".into(), data: data.into() };
    let call = ToolCall {
        id: "call_1".into(),
        name: "lookup".into(),
        arguments: json!({"q": "x"}),
        signature: Some(gemini("CiIB0e2K")),
    };
    let assistant = Message {
        role: Role::Assistant,
        content: Some("Let me look.".into()),
        parts: vec![
            Part::Thinking { text: "gemini thought summary".into(), signature: Some(gemini("EpwICpkI")) },
            Part::Thinking { text: "unsigned reasoning (an OpenAI-compatible server)".into(), signature: None },
            Part::RedactedThinking { data: gemini("opaque") },
        ],
        tool_calls: vec![call.clone()],
        tool_call_id: None,
        tool_name: None,
        tool_status: None,
    };
    let request = ChatRequest {
        model: "claude-sonnet-4-5".into(),
        messages: SharedMessage::all([
            user_text("look up x"),
            assistant,
            Message::tool_result(&call, ToolStatus::Error, "lookup failed: timeout"),
        ]),
        reasoning: thinking(2048),
        ..ChatRequest::default()
    };
    let body = anthropic::request_body(&request, true).expect("builds");
    assert_eq!(
        body["messages"][1],
        json!({"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"q": "x"}}
        ]})
    );
    assert_eq!(
        body["messages"][2],
        json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": "lookup failed: timeout", "is_error": true}
        ]})
    );
    // Claude refuses a tool loop, with thinking on, whose last assistant turn
    // has no Claude thinking block; this call goes without thinking...
    assert_eq!(body.get("thinking"), None);
    // ...and the next user message starts a loop where thinking is on again.
    let mut next = request.clone();
    next.messages.push(Message::assistant("The lookup failed.").into());
    next.messages.push(user_text("try again").into());
    let body = anthropic::request_body(&next, true).expect("builds");
    assert_eq!(body["thinking"], json!({"type": "enabled", "budget_tokens": 2048}));
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

fn error_response(dir: &str, case: &str) -> ErrorResponse {
    let meta = read_json(dir, &format!("{case}.meta.json"));
    let mut headers = HeaderMap::new();
    if let Some(map) = meta["response"]["headers"].as_object() {
        for (name, value) in map {
            headers.insert(
                HeaderName::from_bytes(name.as_bytes()).expect("header name"),
                HeaderValue::from_str(value.as_str().expect("text")).expect("header value"),
            );
        }
    }
    ErrorResponse {
        status: meta["response"]["status"].as_u64().expect("status") as u16,
        headers,
        body: String::from_utf8(read(dir, &format!("{case}.response.json"))).expect("utf-8"),
    }
}

#[test]
fn every_error_body_maps_to_its_code() {
    let cases: &[(&str, &str, ErrorCode, &str)] = &[
        (
            RECORDED,
            "error-400-invalid-request",
            ErrorCode::InvalidRequest,
            "messages.0: Input does not match the expected shape.",
        ),
        (
            RECORDED,
            "error-400-unsupported-option",
            ErrorCode::InvalidRequest,
            "This model does not support effort level 'xhigh'.",
        ),
        (RECORDED, "error-401-authentication", ErrorCode::Authentication, "invalid x-api-key"),
        (RECORDED, "error-404-not-found-model", ErrorCode::NotFound, "model: claude-sonet-4-5"),
        (
            WRITTEN,
            "error-400-prompt-too-long",
            ErrorCode::ContextLengthExceeded,
            "prompt is too long: 208431 tokens > 200000 maximum",
        ),
        (
            WRITTEN,
            "error-413-request-too-large",
            ErrorCode::ContextLengthExceeded,
            "Request exceeds the maximum allowed number of bytes.",
        ),
        (WRITTEN, "error-429-rate-limit", ErrorCode::RateLimit, "This request would exceed the rate limit"),
        (WRITTEN, "error-500-api-error", ErrorCode::ProviderUnavailable, "Internal server error"),
        (WRITTEN, "error-529-overloaded", ErrorCode::Overloaded, "Overloaded"),
    ];
    for (dir, case, code, message) in cases {
        let response = error_response(dir, case);
        let error = anthropic::error_from_response(&response);
        assert_eq!(error.code, *code, "{case}");
        assert!(error.message.starts_with(message), "{case}: the provider's message is kept, got {:?}", error.message);
        assert_eq!(error.status, Some(response.status), "{case}");
        let expected_wait = (*case == "error-429-rate-limit").then(|| Duration::from_secs(20));
        assert_eq!(error.retry_after, expected_wait, "{case}");
    }
}

#[test]
fn written_fixtures_say_they_come_from_the_docs() {
    for entry in std::fs::read_dir(WRITTEN).expect("fixture folder") {
        let path = entry.expect("entry").path();
        if path.to_string_lossy().ends_with(".meta.json") {
            let meta: Value = serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
            assert_eq!(meta["written_from"], "the provider's API reference (docs)", "{}", path.display());
        }
    }
}

#[test]
fn unreadable_error_bodies_fall_back_to_the_status() {
    let response =
        ErrorResponse { status: 529, headers: HeaderMap::new(), body: "<html>upstream overloaded</html>".into() };
    let error = anthropic::error_from_response(&response);
    assert_eq!(error.code, ErrorCode::Overloaded);
    assert!(error.message.contains("529"));
    let spend = ErrorResponse {
        status: 429,
        headers: HeaderMap::new(),
        body: json!({"type": "error", "error": {"type": "rate_limit_error",
            "message": "You have reached your specified API usage limits.",
            "details": {"error_code": "enforced_spend_limit_reached"}}})
        .to_string(),
    };
    assert_eq!(
        anthropic::error_from_response(&spend).code,
        ErrorCode::Permission,
        "a spending limit does not lift by waiting"
    );
}

// ---------------------------------------------------------------------------
// Registry
// ---------------------------------------------------------------------------

#[test]
fn shipped_claude_models_are_priced_with_cache_rates() {
    let registry = arbor_providers::Registry::shipped();
    let claude: Vec<_> = registry.iter().filter(|model| model.provider == "anthropic").collect();
    for id in
        ["claude-sonnet-4-5", "claude-sonnet-4-20250514", "claude-opus-4-1", "claude-haiku-4-5", "claude-3-5-haiku"]
    {
        assert!(claude.iter().any(|model| model.id == id), "{id} is shipped");
    }
    for model in claude {
        let prices = model.prices;
        // Anthropic bills a cache write at 1.25x and a cache read at 0.1x.
        assert_eq!(prices.cache_write, Some(prices.input * 5 / 4), "{}", model.id);
        assert_eq!(prices.cached_input, Some(prices.input / 10), "{}", model.id);
        assert!(prices.output > prices.input, "{}", model.id);
        assert_eq!(model.context_window, 200_000, "{}", model.id);
        assert!(model.capabilities.vision && model.capabilities.tools);
    }
    let sonnet = registry.get("claude-sonnet-4-5").expect("shipped");
    assert_eq!(sonnet.prices.input, 3_000_000);
    assert!(sonnet.capabilities.thinking);
    assert_eq!(registry.get("claude-3-5-haiku").expect("shipped").upstream_name(), "claude-3-5-haiku-latest");
}
