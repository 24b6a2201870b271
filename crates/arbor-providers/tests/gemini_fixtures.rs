//! The Gemini adapter against recorded generateContent / streamGenerateContent
//! traffic (`shared/fixtures/providers/gemini/`), against error fixtures
//! written from Google's API reference for the cases nobody recorded
//! (`tests/fixtures/gemini/`, each meta says so), and the JSON Schema
//! conversion for function declarations.
//!
//! Also here, because it needs both adapters: a history produced by one
//! provider, sent to the other, loses the first provider's opaque data
//! cleanly and stays a valid request.

use std::path::PathBuf;
use std::time::Duration;

use arbor_core::message::ProviderOpaque;
use arbor_core::{ErrorCode, Message, Part, ProviderError, Role, SharedMessage, ToolCall, ToolStatus, Usage};
use arbor_providers::gemini::{self, StreamDecoder, gemini_schema};
use arbor_providers::http::ErrorResponse;
use arbor_providers::sse::byte_chunks;
use arbor_providers::{ChatRequest, Chunk, Collected, FinishReason, Reasoning, ToolSpec, anthropic};
use futures_util::{FutureExt, StreamExt};
use proptest::prelude::*;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Value, json};

const RECORDED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/providers/gemini");
const RECORDED_ANTHROPIC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/providers/anthropic");
const WRITTEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gemini");

fn read(dir: &str, name: &str) -> Vec<u8> {
    let path = PathBuf::from(dir).join(name);
    std::fs::read(&path).unwrap_or_else(|error| panic!("fixture {}: {error}", path.display()))
}

fn read_json(dir: &str, name: &str) -> Value {
    serde_json::from_slice(&read(dir, name)).expect("fixture is JSON")
}

type Decoded = (Vec<Chunk>, Option<ProviderError>);

fn drain(stream: arbor_providers::ChunkStream) -> Decoded {
    let items: Vec<Result<Chunk, ProviderError>> =
        stream.collect().now_or_never().expect("an in-memory body is always ready");
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

/// An `alt=sse` body cut at `cuts`.
fn decode_sse(body: &[u8], cuts: &[usize]) -> Decoded {
    drain(gemini::decode_body(byte_chunks(body, cuts)))
}

/// A JSON-array body (no `alt=sse`) cut at `cuts`.
fn decode_array(body: &[u8], cuts: &[usize]) -> Decoded {
    drain(gemini::decode_json_array_body(byte_chunks(body, cuts)))
}

/// The recorded `chunks.jsonl` files: one response per line, no framing.
fn decode_lines(name: &str) -> Decoded {
    let text = String::from_utf8(read(RECORDED, name)).expect("utf-8");
    let mut decoder = StreamDecoder::new();
    let mut chunks = Vec::new();
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        match decoder.push(line) {
            Ok(more) => chunks.extend(more),
            Err(error) => return (chunks, Some(error)),
        }
    }
    match decoder.finish() {
        Ok(more) => chunks.extend(more),
        Err(error) => return (chunks, Some(error)),
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

fn clean((chunks, error): Decoded, name: &str) -> (Vec<Chunk>, Collected) {
    assert_eq!(error, None, "{name} decodes cleanly");
    let reply = fold(&chunks);
    (chunks, reply)
}

fn sse(name: &str) -> (Vec<Chunk>, Collected) {
    clean(decode_sse(&read(RECORDED, name), &[]), name)
}

fn response(name: &str) -> Result<Collected, ProviderError> {
    gemini::response_chunks(&read(RECORDED, name)).map(|chunks| fold(&chunks))
}

fn usage(input: u64, candidates: u64, thoughts: u64, cached: u64) -> Usage {
    Usage {
        input_tokens: input,
        output_tokens: candidates + thoughts,
        thinking_tokens: thoughts,
        cached_tokens: cached,
        cache_write_tokens: 0,
    }
}

fn gemini_signed(data: &str) -> ProviderOpaque {
    ProviderOpaque { provider: "gemini".into(), data: data.into() }
}

/// The `n`th `thoughtSignature` value in a recorded body, as its bytes are.
fn recorded_signature(body: &[u8], n: usize) -> String {
    let text = String::from_utf8(body.to_vec()).expect("utf-8");
    text.split("\"thoughtSignature\": \"")
        .nth(n + 1)
        .and_then(|rest| rest.split('"').next())
        .expect("the recording has a thought signature")
        .to_string()
}

// ---------------------------------------------------------------------------
// Streams
// ---------------------------------------------------------------------------

#[test]
fn text_stream_gives_text_usage_and_stop() {
    let (chunks, reply) = sse("stream-text-sse.response.sse");
    assert_eq!(
        chunks,
        vec![
            Chunk::Text("The".into()),
            Chunk::Text(" capital of France".into()),
            Chunk::Text(" is Paris.\n".into()),
            // The last usageMetadata wins (earlier chunks carry partial
            // counts).
            Chunk::Usage(usage(13, 8, 0, 0)),
            Chunk::Finish(FinishReason::Stop),
        ]
    );
    assert_eq!(reply.message(), Message::assistant("The capital of France is Paris.\n"));
}

#[test]
fn thought_parts_become_thinking_and_the_answer_signature_closes_it() {
    let body = read(RECORDED, "stream-thinking-sse.response.sse");
    let (_, reply) = sse("stream-thinking-sse.response.sse");
    assert_eq!(reply.parts.len(), 1);
    match &reply.parts[0] {
        Part::Thinking { text, signature: Some(signature) } => {
            assert!(text.starts_with("**Clarifying User Goals**"));
            assert_eq!(text.chars().count(), 1575);
            assert_eq!(signature, &gemini_signed(&recorded_signature(&body, 0)));
        }
        other => panic!("expected signed thinking, got {other:?}"),
    }
    assert!(reply.text.starts_with("This is a great question! Safely crossing"));
    assert!(reply.text.ends_with("driver might not see you."));
    assert_eq!(reply.usage, Some(usage(34, 469, 787, 0)));
    assert_eq!(reply.finish, Some(FinishReason::Stop));
}

#[test]
fn a_function_call_arrives_whole_with_its_signature_and_an_assigned_id() {
    let body = read(RECORDED, "stream-function-call-thought-signature.response.sse");
    let (chunks, reply) = sse("stream-function-call-thought-signature.response.sse");
    let signature = gemini_signed(&recorded_signature(&body, 0));
    assert_eq!(
        chunks,
        vec![
            Chunk::ToolCallStart { index: 0, id: "call_QUVVadTSNJ6_qtsPvN7J8Q0_0".into(), name: "get_country".into() },
            Chunk::ToolCallArguments { index: 0, fragment: "{}".into() },
            Chunk::ToolCallEnd { index: 0, signature: Some(signature.clone()) },
            Chunk::Usage(usage(29, 10, 202, 0)),
            Chunk::Finish(FinishReason::ToolCalls),
        ]
    );
    assert_eq!(reply.tool_calls[0].signature, Some(signature));
    assert_eq!(reply.message().content, None);
}

#[test]
fn follow_up_stream_decodes() {
    let (_, reply) = sse("stream-text-after-function-response.response.sse");
    assert_eq!(reply.text, "The capital of Mexico is Mexico City.");
    assert_eq!(reply.usage, Some(usage(257, 8, 0, 0)));
}

#[test]
fn json_array_streams_decode_like_sse() {
    let body = read(RECORDED, "stream-json-array-thinking.response.json");
    let (_, reply) = clean(decode_array(&body, &[]), "stream-json-array-thinking");
    assert_eq!(reply.text, "Scoop");
    // Thoughts, then the answer; the signature came on a trailing empty
    // text part, so it stands in a thinking part of its own.
    assert!(matches!(
        &reply.parts[..],
        [
            Part::Thinking { text, signature: None },
            Part::Thinking { text: empty, signature: Some(signature) },
        ] if text.starts_with("**Considering the Constraint**")
            && empty.is_empty()
            && signature.data.starts_with("Eq0JCqoJARFN")
    ));
    assert_eq!(reply.usage, Some(usage(11, 2, 291, 0)));

    let body = read(RECORDED, "stream-json-array-function-call.response.json");
    let (_, reply) = clean(decode_array(&body, &[]), "stream-json-array-function-call");
    assert_eq!(reply.tool_calls.len(), 1);
    assert_eq!(reply.tool_calls[0].name, "multiply");
    assert_eq!(reply.tool_calls[0].arguments, json!({"x": 5, "y": 3}));
    assert!(reply.tool_calls[0].signature.as_ref().is_some_and(|signature| signature.data.starts_with("Et0BCtoBAXLI")));
    assert_eq!(reply.usage, Some(usage(60, 16, 32, 0)));
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
}

#[test]
fn line_recordings_decode() {
    let (_, reply) = clean(decode_lines("stream-function-call-gemini3.chunks.jsonl"), "gemini3 call");
    assert_eq!(reply.tool_calls[0].name, "weather");
    assert_eq!(reply.tool_calls[0].arguments, json!({"location": "San Francisco"}));
    assert!(reply.tool_calls[0].signature.is_some());
    assert_eq!(reply.usage, Some(usage(29, 15, 804, 0)));

    let (_, reply) = clean(decode_lines("stream-thinking-gemini3.chunks.jsonl"), "gemini3 thinking");
    assert_eq!(reply.text, "There are **3** \"r\"s in strawberry.\n\nHere is the breakdown: st**r**awbe**rr**y.");
    assert!(matches!(
        &reply.parts[..],
        [Part::Thinking { text, signature: Some(signature) }]
            if text.is_empty() && signature.data.starts_with("Eo0HCooHAb4+")
    ));
    assert_eq!(reply.usage, Some(usage(9, 29, 256, 0)));
}

#[test]
fn streamed_function_arguments_are_assembled() {
    // Vertex AI's streamed arguments: `partialArgs` pieces, each call ended
    // by an empty functionCall.
    let (chunks, reply) = clean(decode_lines("vertex-stream-function-call-partial-args.chunks.jsonl"), "partial args");
    let calls: Vec<(&str, &Value)> =
        reply.tool_calls.iter().map(|call| (call.name.as_str(), &call.arguments)).collect();
    assert_eq!(
        calls,
        vec![("getWeather", &json!({"location": "Boston"})), ("getWeather", &json!({"location": "San Francisco"})),]
    );
    assert!(reply.tool_calls[0].signature.as_ref().is_some_and(|signature| signature.data.starts_with("CiMBjz1rX25K")));
    assert_eq!(reply.tool_calls[1].signature, None);
    assert_ne!(reply.tool_calls[0].id, reply.tool_calls[1].id);
    // The first call is started before its arguments arrive.
    assert!(matches!(&chunks[0], Chunk::ToolCallStart { index: 0, .. }));
    assert_eq!(reply.usage, Some(usage(26, 23, 132, 0)));
}

#[test]
fn a_body_cut_before_the_finish_reason_is_a_stream_interruption() {
    let body = read(RECORDED, "stream-text-sse.response.sse");
    let cut = String::from_utf8(body.clone()).expect("utf-8").rfind("data: ").expect("several events");
    let (chunks, error) = decode_sse(&body[..cut], &[]);
    assert_eq!(chunks.len(), 2, "the text before the cut is delivered");
    assert_eq!(error.map(|error| error.code), Some(ErrorCode::StreamInterrupted));
    let array = read(RECORDED, "stream-json-array-thinking.response.json");
    let (_, error) = decode_array(&array[..array.len() - 3], &[]);
    assert_eq!(error.map(|error| error.code), Some(ErrorCode::StreamInterrupted));
}

#[test]
fn an_error_object_inside_a_stream_ends_it_with_its_code() {
    let body = b"data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"Hi\"}],\"role\": \"model\"}}]}\r\n\r\n\
data: {\"error\": {\"code\": 503, \"message\": \"The model is overloaded. Please try again later.\", \"status\": \"UNAVAILABLE\"}}\r\n\r\n";
    let (chunks, error) = decode_sse(body, &[]);
    assert_eq!(chunks, vec![Chunk::Text("Hi".into())]);
    assert_eq!(error.map(|error| error.code), Some(ErrorCode::Overloaded));
}

const SSE_STREAMS: &[&str] = &[
    "stream-text-sse.response.sse",
    "stream-thinking-sse.response.sse",
    "stream-function-call-thought-signature.response.sse",
    "stream-text-after-function-response.response.sse",
];
const ARRAY_STREAMS: &[&str] =
    &["stream-json-array-thinking.response.json", "stream-json-array-function-call.response.json"];

#[test]
fn every_cut_of_short_streams_gives_the_same_chunks() {
    let body = read(RECORDED, "stream-text-sse.response.sse");
    let whole = decode_sse(&body, &[]);
    for cut in 0..=body.len() {
        assert_eq!(decode_sse(&body, &[cut]), whole, "sse cut at byte {cut}");
    }
    let body = read(RECORDED, "stream-json-array-function-call.response.json");
    let whole = decode_array(&body, &[]);
    for cut in 0..=body.len() {
        assert_eq!(decode_array(&body, &[cut]), whole, "array cut at byte {cut}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Where the network splits the body never changes the reply.
    #[test]
    fn chunk_boundaries_never_change_a_recorded_stream(
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..40)
    ) {
        for name in SSE_STREAMS {
            let body = read(RECORDED, name);
            let offsets: Vec<usize> = cuts.iter().map(|index| index.index(body.len() + 1)).collect();
            prop_assert_eq!(decode_sse(&body, &offsets), decode_sse(&body, &[]), "{}", name);
        }
        for name in ARRAY_STREAMS {
            let body = read(RECORDED, name);
            let offsets: Vec<usize> = cuts.iter().map(|index| index.index(body.len() + 1)).collect();
            prop_assert_eq!(decode_array(&body, &offsets), decode_array(&body, &[]), "{}", name);
        }
    }
}

// ---------------------------------------------------------------------------
// Non-streamed replies
// ---------------------------------------------------------------------------

#[test]
fn non_streamed_replies_fold_like_streams() {
    let reply = response("generate-text.response.json").expect("reply");
    assert_eq!(reply.text, "Hello! How can I help you today?");
    assert_eq!(reply.usage, Some(usage(9, 9, 34, 0)));
    assert_eq!(reply.finish, Some(FinishReason::Stop));

    let reply = response("generate-cached-content.response.json").expect("reply");
    assert_eq!(reply.text, "Paris.");
    assert_eq!(reply.usage, Some(usage(3520, 2, 42, 3512)));

    let reply = response("generate-function-calls-parallel.response.json").expect("reply");
    assert_eq!(reply.tool_calls.len(), 3);
    assert!(reply.tool_calls.iter().all(|call| call.name == "generate_topic"));
    // Only the first of parallel calls carries a signature (Gemini 3).
    assert!(reply.tool_calls[0].signature.is_some());
    assert!(reply.tool_calls[1..].iter().all(|call| call.signature.is_none()));
    let ids: std::collections::HashSet<&str> = reply.tool_calls.iter().map(|call| call.id.as_str()).collect();
    assert_eq!(ids.len(), 3, "assigned ids are distinct");
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));

    let reply = response("generate-image-file-uri.response.json").expect("reply");
    assert!(reply.text.starts_with("The image you provided is a close-up of a kiwi"));
    assert!(matches!(&reply.parts[..], [Part::Thinking { signature: Some(_), .. }]));
    assert_eq!(reply.usage, Some(usage(345, 84, 44, 0)));

    let reply = response("generate-image-inline-base64.response.json").expect("reply");
    assert_eq!(reply.text, "That is a potato.");
    let reply = response("vertex-generate-image-https-url.response.json").expect("reply");
    assert!(reply.text.starts_with("The URL's main content is the landing page of Wikipedia"));

    let reply = response("generate-max-tokens.response.json").expect("reply");
    assert_eq!(reply.text, "The capital of France is");
    assert_eq!(reply.finish, Some(FinishReason::Length));

    // Thinking used the whole budget: no parts at all, still a valid reply.
    let reply = response("generate-max-tokens-empty-content.response.json").expect("reply");
    assert_eq!(reply.text, "");
    assert_eq!(reply.usage, Some(usage(15, 0, 2, 0)));
    assert_eq!(reply.finish, Some(FinishReason::Length));

    let reply = response("generate-safety-blocked.response.json").expect("reply");
    assert_eq!(reply.finish, Some(FinishReason::ContentFilter));
    assert_eq!(reply.usage, Some(usage(14, 0, 0, 0)));
}

#[test]
fn a_blocked_prompt_is_a_content_filter_error() {
    let error = response("vertex-generate-prompt-blocked.response.json").expect_err("blocked");
    assert_eq!(error.code, ErrorCode::ContentFilter);
    assert!(error.message.contains("MODEL_ARMOR"));
    assert!(error.message.contains("Prompt Injection and Jailbreak"));
}

// ---------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------

/// The recorded requests came from Google's Python SDK (and llm-gemini),
/// so they are put in the API's canonical form before comparing. Each rule
/// is an equivalence the API documents or a field Arbor does not control,
/// said here so that nothing is hidden:
/// - snake_case field names (`file_uri`, `thinking_budget`, ...) are the
///   proto names the API accepts beside camelCase: renamed to camelCase;
/// - bytes (`inlineData.data`, `thoughtSignature`) in the SDK's URL-safe
///   base64 are the same bytes as the standard base64 Arbor sends;
/// - `responseModalities: ["TEXT"]` is the default for text models, an
///   empty `generationConfig` is no config, and `systemInstruction.role`
///   is ignored by the API;
/// - `safetySettings` and `toolConfig` are not Arbor's to set (Arbor
///   leaves both at the API's defaults), so they are removed;
/// - function parameters: the SDK sends full JSON Schema in
///   `parametersJsonSchema`, Arbor sends the converted subset in
///   `parameters`; the recorded schema is passed through the same
///   converter, so this compares placement and presence, while the
///   conversion itself is checked against hand-written expectations below.
fn canonical(mut body: Value) -> Value {
    rename_proto_fields(&mut body);
    if let Some(contents) = body.get_mut("contents").and_then(Value::as_array_mut) {
        for content in contents {
            for part in content["parts"].as_array_mut().into_iter().flatten() {
                standard_base64(part.pointer_mut("/inlineData/data"));
                standard_base64(part.get_mut("thoughtSignature"));
            }
        }
    }
    let object = body.as_object_mut().expect("a request is an object");
    object.remove("safetySettings");
    object.remove("toolConfig");
    if let Some(system) = object.get_mut("systemInstruction").and_then(Value::as_object_mut) {
        system.remove("role");
    }
    if let Some(config) = object.get_mut("generationConfig").and_then(Value::as_object_mut) {
        if config.get("responseModalities") == Some(&json!(["TEXT"])) {
            config.remove("responseModalities");
        }
        if config.is_empty() {
            object.remove("generationConfig");
        }
    }
    for tools in object.get_mut("tools").and_then(Value::as_array_mut).into_iter().flatten() {
        for declaration in tools["functionDeclarations"].as_array_mut().into_iter().flatten() {
            let declaration = declaration.as_object_mut().expect("declaration");
            let schema = declaration.remove("parametersJsonSchema").or_else(|| declaration.remove("parameters"));
            if let Some(converted) = schema.as_ref().and_then(gemini_schema) {
                declaration.insert("parameters".into(), converted);
            }
        }
    }
    body
}

/// Renames the API field names the SDK wrote in snake_case. Only these
/// names: property names inside schemas and arguments are data, not fields.
fn rename_proto_fields(value: &mut Value) {
    const NAMES: &[(&str, &str)] = &[
        ("thinking_budget", "thinkingBudget"),
        ("include_thoughts", "includeThoughts"),
        ("parameters_json_schema", "parametersJsonSchema"),
        ("file_uri", "fileUri"),
        ("mime_type", "mimeType"),
        ("inline_data", "inlineData"),
        ("file_data", "fileData"),
        ("function_call", "functionCall"),
        ("function_response", "functionResponse"),
        ("thought_signature", "thoughtSignature"),
    ];
    match value {
        Value::Object(map) => {
            for (snake, camel) in NAMES {
                if let Some(inner) = map.remove(*snake) {
                    map.insert((*camel).into(), inner);
                }
            }
            for (key, inner) in map.iter_mut() {
                if key != "args" && key != "response" && key != "properties" {
                    rename_proto_fields(inner);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(rename_proto_fields),
        _ => {}
    }
}

fn standard_base64(value: Option<&mut Value>) {
    if let Some(Value::String(text)) = value {
        *text = text.replace('-', "+").replace('_', "/");
    }
}

fn assert_rebuilt(name: &str, request: &ChatRequest) {
    let recorded = read_json(RECORDED, name);
    let ours = gemini::request_body(request).expect("builds");
    assert_eq!(canonical(ours), canonical(recorded), "{name}");
}

fn chat(model: &str, system: Option<&str>, messages: Vec<Message>) -> ChatRequest {
    ChatRequest {
        model: model.into(),
        system: system.map(Into::into),
        messages: SharedMessage::all(messages),
        ..ChatRequest::default()
    }
}

fn tool(name: &str, description: &str, parameters: Value) -> ToolSpec {
    ToolSpec { name: name.into(), description: description.into(), parameters }
}

fn image(url: Option<&str>, data: Option<&str>, mime_type: &str) -> Part {
    Part::Image {
        media_id: None,
        url: url.map(Into::into),
        data: data.map(Into::into),
        mime_type: Some(mime_type.into()),
    }
}

#[test]
fn plain_requests_are_rebuilt() {
    let chatbot = Some("You are a helpful chatbot.");
    assert_rebuilt(
        "generate-text.request.json",
        &chat("gemini-2.5-flash", Some("You are a chatbot."), vec![Message::user("Hello!")]),
    );
    let mut request = chat("gemini-2.0-flash-exp", chatbot, vec![Message::user("What is the capital of France?")]);
    request.temperature = Some(0.0);
    assert_rebuilt("stream-text-sse.request.json", &request);

    let mut request = chat("gemini-2.5-pro", chatbot, vec![Message::user("What is the capital of France?")]);
    request.max_output_tokens = Some(5);
    assert_rebuilt("generate-max-tokens-empty-content.request.json", &request);
    // A budget of 0 turns thinking off (and asks for no thoughts).
    request.reasoning = Some(Reasoning { effort: None, budget_tokens: Some(0) });
    assert_rebuilt("generate-max-tokens.request.json", &request);

    assert_rebuilt(
        "generate-safety-blocked.request.json",
        &chat(
            "gemini-1.5-flash",
            Some("You hate the world!"),
            vec![Message::user("Tell me a joke about a Brazilians.")],
        ),
    );
    assert_rebuilt(
        "error-404-model-not-found.request.json",
        &chat("gemini-3.6-flahs", None, vec![Message::user("hello")]),
    );
}

#[test]
fn thinking_requests_are_rebuilt() {
    let effort = Some(Reasoning { effort: Some("medium".into()), budget_tokens: None });
    let mut request =
        chat("gemini-2.5-pro", Some("You are a helpful assistant."), vec![Message::user("How do I cross the street?")]);
    request.reasoning = effort.clone();
    request.tools = vec![tool("dummy", "", json!({"properties": {}, "type": "object"}))];
    assert_rebuilt("stream-thinking-sse.request.json", &request);

    let mut request = chat("gemini-flash-latest", None, vec![Message::user("Name for a pet pelican, just the name")]);
    request.reasoning = effort;
    assert_rebuilt("stream-json-array-thinking.request.json", &request);
}

#[test]
fn tool_requests_are_rebuilt() {
    let mut request = chat("gemini-3-flash-preview", None, vec![Message::user("What is 5 times 3?")]);
    request.tools = vec![tool(
        "multiply",
        "Multiply two numbers.",
        json!({
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
            "type": "object"
        }),
    )];
    assert_rebuilt("stream-json-array-function-call.request.json", &request);

    let mut request = chat(
        "gemini-3-pro-preview",
        None,
        vec![Message::user("What is the capital of the user country? Call the tool")],
    );
    request.tools =
        vec![tool("get_country", "", json!({"additionalProperties": false, "properties": {}, "type": "object"}))];
    assert_rebuilt("stream-function-call-thought-signature.request.json", &request);

    // An empty prompt is sent as an empty text part.
    let mut request = chat(
        "gemini-3-flash-preview",
        Some("Tell three jokes. Generate topics with the generate_topic tool."),
        vec![Message::user("")],
    );
    request.tools = vec![
        tool("generate_topic", "", json!({"additionalProperties": false, "properties": {}, "type": "object"})),
        tool(
            "final_result",
            "The final response which ends this conversation",
            json!({
                "properties": {"response": {"items": {"type": "string"}, "type": "array"}},
                "required": ["response"],
                "type": "object"
            }),
        ),
    ];
    assert_rebuilt("generate-function-calls-parallel.request.json", &request);
}

/// URL-safe base64 (as the SDK recorded it) to the standard alphabet.
fn standard(text: &str) -> String {
    text.replace('-', "+").replace('_', "/")
}

#[test]
fn image_requests_are_rebuilt() {
    let recorded = read_json(RECORDED, "generate-image-inline-base64.request.json");
    let data = standard(recorded["contents"][0]["parts"][1]["inlineData"]["data"].as_str().expect("data"));
    let mut message = Message::user("What is this vegetable?");
    message.parts = vec![image(None, Some(&data), "image/jpeg")];
    assert_rebuilt(
        "generate-image-inline-base64.request.json",
        &chat("gemini-2.0-flash", Some("You are a helpful chatbot."), vec![message]),
    );

    let url = "https://upload.wikimedia.org/wikipedia/commons/6/6a/Www.wikipedia_screenshot_%282021%29.png";
    let mut message = Message::user("What is the main content of this URL?");
    message.parts = vec![image(Some(url), None, "image/png")];
    assert_rebuilt(
        "vertex-generate-image-https-url.request.json",
        &chat("gemini-2.0-flash", None, vec![message.clone()]),
    );
    // Without a stored mime type the URL's extension gives it.
    message.parts = vec![Part::Image { media_id: None, url: Some(url.into()), data: None, mime_type: None }];
    assert_rebuilt("vertex-generate-image-https-url.request.json", &chat("gemini-2.0-flash", None, vec![message]));
}

#[test]
fn a_tool_round_with_an_image_after_it_is_rebuilt() {
    let recorded = read_json(RECORDED, "generate-image-file-uri.request.json");
    let signature = standard(recorded["contents"][1]["parts"][0]["thoughtSignature"].as_str().expect("signature"));
    let call = ToolCall {
        id: "pyd_ai_4e1aa04b91dc4ccc9b5254aae846e015".into(),
        name: "get_file".into(),
        arguments: json!({}),
        signature: Some(gemini_signed(&signature)),
    };
    let mut assistant = Message::assistant("");
    assistant.content = None;
    assistant.tool_calls = vec![call.clone()];
    let mut result = Message::tool_result(&call, ToolStatus::Success, r#"{"output": [{}, "See file a2496f."]}"#);
    // The name comes from the call when the result does not carry it.
    result.tool_name = None;
    let mut file = Message::user("This is file a2496f:");
    file.parts =
        vec![image(Some("https://generativelanguage.googleapis.com/v1beta/files/3qswqtk02p7x"), None, "image/jpeg")];
    let mut request = chat(
        "gemini-2.5-flash",
        None,
        vec![
            Message::user("Use the get_file tool now to retrieve a image file, then describe what you received."),
            assistant,
            result,
            file,
        ],
    );
    request.tools =
        vec![tool("get_file", "", json!({"additionalProperties": false, "properties": {}, "type": "object"}))];
    assert_rebuilt("generate-image-file-uri.request.json", &request);
}

#[test]
fn the_recorded_tool_loop_sends_the_signature_back_byte_for_byte() {
    // Round one as Arbor collected it from the recorded stream.
    let round_one = read(RECORDED, "stream-function-call-thought-signature.response.sse");
    let (_, reply) = sse("stream-function-call-thought-signature.response.sse");
    let mut assistant = reply.message();
    // pydantic-ai gave the call its own id, as Arbor does; use the same one
    // so that the recorded request can be compared whole.
    let call = &mut assistant.tool_calls[0];
    call.id = "pyd_ai_29bf73b69e02448588e15893d47a3e7e".into();
    let call = call.clone();
    let mut request = chat(
        "gemini-3-pro-preview",
        None,
        vec![
            Message::user("What is the capital of the user country? Call the tool"),
            assistant,
            Message::tool_result(&call, ToolStatus::Success, r#"{"return_value": "Mexico"}"#),
        ],
    );
    request.tools =
        vec![tool("get_country", "", json!({"additionalProperties": false, "properties": {}, "type": "object"}))];
    assert_rebuilt("stream-text-after-function-response.request.json", &request);

    // Byte-for-byte: the signature text exactly as the stream carried it.
    let body = gemini::request_body(&request).expect("builds");
    let sent = body["contents"][1]["parts"][0]["thoughtSignature"].as_str().expect("signature sent");
    assert_eq!(sent, recorded_signature(&round_one, 0));
}

#[test]
fn text_part_signatures_go_back_with_the_text() {
    // A recorded reply whose answer text carried a signature...
    let body = read(RECORDED, "generate-image-file-uri.response.json");
    let reply = response("generate-image-file-uri.response.json").expect("reply");
    let signature = recorded_signature(&body, 0);
    let request =
        chat("gemini-2.5-flash", None, vec![Message::user("describe"), reply.message(), Message::user("more")]);
    let sent = gemini::request_body(&request).expect("builds");
    assert_eq!(
        sent["contents"][1],
        json!({"role": "model", "parts": [{"text": reply.text, "thoughtSignature": signature}]})
    );
    // ...and one whose signature came on a trailing empty part, after
    // thought summaries that are not sent back.
    let array = read(RECORDED, "stream-json-array-thinking.response.json");
    let (_, reply) = clean(decode_array(&array, &[]), "stream-json-array-thinking");
    let request =
        chat("gemini-flash-latest", None, vec![Message::user("name?"), reply.message(), Message::user("another")]);
    let sent = gemini::request_body(&request).expect("builds");
    assert_eq!(
        sent["contents"][1],
        json!({"role": "model", "parts": [
            {"text": "Scoop", "thoughtSignature": recorded_signature(&array, 0)}
        ]})
    );
    // A tool-only reply with a text signature keeps it on an empty part.
    let mut tool_only = reply.message();
    tool_only.content = None;
    tool_only.tool_calls = vec![ToolCall { id: "c".into(), name: "f".into(), arguments: json!({}), signature: None }];
    let sent = gemini::request_body(&chat("m", None, vec![Message::user("x"), tool_only])).expect("builds");
    assert_eq!(sent["contents"][1]["parts"][0]["text"], "");
    assert_eq!(sent["contents"][1]["parts"][0]["thoughtSignature"], recorded_signature(&array, 0).as_str());
}

#[test]
fn tool_results_wrap_non_objects_and_report_failures_as_errors() {
    let call = ToolCall { id: "c1".into(), name: "add".into(), arguments: json!({"a": 1, "b": 2}), signature: None };
    let mut assistant = Message::assistant("Adding.");
    assistant.tool_calls = vec![call.clone()];
    let request = chat(
        "gemini-2.5-flash",
        None,
        vec![
            Message::user("1+2, then 3+4"),
            assistant.clone(),
            Message::tool_result(&call, ToolStatus::Success, "3"),
            assistant,
            Message::tool_result(&call, ToolStatus::Cancelled, "the turn was cancelled"),
            Message::user("thanks"),
        ],
    );
    let body = gemini::request_body(&request).expect("builds");
    let contents = body["contents"].as_array().expect("contents");
    let roles: Vec<&str> = contents.iter().map(|content| content["role"].as_str().expect("role")).collect();
    assert_eq!(roles, ["user", "model", "user", "model", "user", "user"]);
    assert_eq!(
        contents[1]["parts"],
        json!([{"text": "Adding."}, {"functionCall": {"id": "c1", "name": "add", "args": {"a": 1, "b": 2}}}])
    );
    assert_eq!(
        contents[2]["parts"][0]["functionResponse"],
        json!({"id": "c1", "name": "add", "response": {"output": "3"}})
    );
    assert_eq!(contents[4]["parts"][0]["functionResponse"]["response"], json!({"error": "the turn was cancelled"}));
}

// ---------------------------------------------------------------------------
// Tool schemas
// ---------------------------------------------------------------------------

#[test]
fn schemas_are_converted_to_the_subset_gemini_accepts() {
    let schema = json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Search",
        "type": "object",
        "additionalProperties": false,
        "properties": {
            "query": {"type": "string", "description": "What to look for", "minLength": 1,
                      "examples": ["rust"], "default": "", "pattern": "^.+$"},
            "limit": {"type": ["integer", "null"], "format": "int32", "default": 10,
                      "minimum": 1, "maximum": 50},
            "since": {"type": "string", "format": "date-time"},
            "site": {"type": "string", "format": "uri"},
            "mode": {"enum": ["fast", "deep", null]},
            "level": {"type": "integer", "enum": [1, 2, 3], "description": "Depth."},
            "fixed": {"const": "yes"},
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": true, "maxItems": 5},
            "filters": {"$ref": "#/$defs/Filter", "description": "Narrowing."},
            "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "maybe": {"oneOf": [{"$ref": "#/definitions/Point"}, {"type": "null"}]},
            "merged": {"allOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]},
                                  {"properties": {"b": {"type": "number"}}}],
                       "type": "object"},
            "anything": {},
            "extra": {"type": "object", "patternProperties": {"^x-": {"type": "string"}}}
        },
        "required": ["query", "not_a_property"],
        "$defs": {
            "Filter": {"type": "object", "properties": {"lang": {"type": "string"}},
                       "additionalProperties": false, "required": ["lang"]}
        },
        "definitions": {
            "Point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}
        }
    });
    let converted = gemini_schema(&schema).expect("has parameters");
    assert_eq!(
        converted,
        json!({
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to look for", "minLength": 1},
                "limit": {"type": "integer", "format": "int32", "minimum": 1, "maximum": 50, "nullable": true},
                "since": {"type": "string", "format": "date-time"},
                "site": {"type": "string"},
                "mode": {"type": "string", "enum": ["fast", "deep"], "nullable": true},
                "level": {"type": "integer", "description": "Depth. Allowed values: 1, 2, 3."},
                "fixed": {"type": "string", "enum": ["yes"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                "filters": {"type": "object", "description": "Narrowing.",
                            "properties": {"lang": {"type": "string"}}, "required": ["lang"]},
                "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                "maybe": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                          "nullable": true},
                "merged": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "number"}},
                           "required": ["a"]},
                "anything": {"type": "string"},
                "extra": {"type": "object"}
            },
            "required": ["query"]
        })
    );
}

#[test]
fn recursive_and_parameterless_schemas_are_handled() {
    assert_eq!(gemini_schema(&json!({"type": "object", "properties": {}})), None);
    assert_eq!(gemini_schema(&json!({"type": "object"})), None);
    let tree = json!({
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/Node"}},
        "$defs": {"Node": {"type": "object", "properties": {
            "name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}
        }}}
    });
    let converted = gemini_schema(&tree).expect("converts");
    let text = converted.to_string();
    assert!(!text.contains("$ref"), "references are inlined");
    assert!(text.contains("nested too deeply"), "recursion is cut off");
    // Type arrays of several types become a union.
    assert_eq!(
        gemini_schema(&json!({"type": "object", "properties": {"v": {"type": ["string", "number", "null"]}}}))
            .expect("converts")["properties"]["v"],
        json!({"anyOf": [{"type": "string"}, {"type": "number"}], "nullable": true})
    );
}

// ---------------------------------------------------------------------------
// Across providers
// ---------------------------------------------------------------------------

#[test]
fn a_gemini_history_goes_to_anthropic_without_gemini_signatures() {
    let (_, reply) = sse("stream-function-call-thought-signature.response.sse");
    let call = reply.tool_calls[0].clone();
    let request = ChatRequest {
        model: "claude-sonnet-4-5".into(),
        messages: SharedMessage::all([
            Message::user("What is the capital of the user country? Call the tool"),
            reply.message(),
            Message::tool_result(&call, ToolStatus::Success, "Mexico"),
        ]),
        tools: vec![tool("get_country", "", json!({"type": "object", "properties": {}}))],
        ..ChatRequest::default()
    };
    let body = anthropic::request_body(&request, true).expect("builds");
    assert_eq!(
        body["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "What is the capital of the user country? Call the tool"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_QUVVadTSNJ6_qtsPvN7J8Q0_0", "name": "get_country", "input": {}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_QUVVadTSNJ6_qtsPvN7J8Q0_0", "content": "Mexico"}
            ]}
        ])
    );
    // The thinking summaries and text-part signatures of a Gemini reply are
    // dropped as well.
    let (_, thinking) = sse("stream-thinking-sse.response.sse");
    let request = ChatRequest {
        model: "claude-sonnet-4-5".into(),
        messages: SharedMessage::all([
            Message::user("How do I cross the street?"),
            thinking.message(),
            Message::user("and a river?"),
        ]),
        ..ChatRequest::default()
    };
    let body = anthropic::request_body(&request, true).expect("builds");
    let assistant = &body["messages"][1]["content"];
    assert_eq!(assistant.as_array().map(Vec::len), Some(1));
    assert_eq!(assistant[0]["type"], "text");
}

#[test]
fn a_tool_loop_moved_to_gemini_3_gets_the_documented_placeholder_signature() {
    // Round one came from Claude (recorded): a tool call with no Gemini
    // signature. The conversation moves to Gemini in the middle of the loop.
    let (_, reply) = {
        let body = read(RECORDED_ANTHROPIC, "stream-tool-use-with-args.response.sse");
        let items: Vec<_> = anthropic::decode_body(byte_chunks(&body, &[])).collect().now_or_never().expect("ready");
        let chunks: Vec<Chunk> = items.into_iter().map(|item| item.expect("clean")).collect();
        let reply = fold(&chunks);
        (chunks, reply)
    };
    let call = reply.tool_calls[0].clone();
    let history = vec![
        Message::user("What is the weather in San Francisco, CA?"),
        reply.message(),
        Message::tool_result(&call, ToolStatus::Success, r#"{"forecast": "fog"}"#),
    ];
    let body = gemini::request_body(&chat("gemini-3-pro-preview", None, history.clone())).expect("builds");
    let parts = &body["contents"][1]["parts"];
    assert_eq!(parts[0]["text"], reply.text.as_str(), "Claude's text, no signature");
    assert!(parts[0].get("thoughtSignature").is_none());
    assert_eq!(parts[1]["functionCall"]["name"], "get_weather");
    assert_eq!(parts[1]["thoughtSignature"], gemini::FOREIGN_CALL_SIGNATURE);
    // Earlier models do not check signatures and get none.
    let body = gemini::request_body(&chat("gemini-2.5-flash", None, history.clone())).expect("builds");
    assert!(body["contents"][1]["parts"][1].get("thoughtSignature").is_none());
    // Once a new user message starts a turn, the old calls are history and
    // are not validated: no placeholder.
    let mut later = history;
    later.push(Message::assistant("Foggy."));
    later.push(Message::user("and tomorrow?"));
    let body = gemini::request_body(&chat("gemini-3-pro-preview", None, later)).expect("builds");
    assert!(!body.to_string().contains(gemini::FOREIGN_CALL_SIGNATURE));
}

#[test]
fn an_anthropic_history_goes_to_gemini_without_thinking_blocks() {
    // Round one of a recorded Anthropic conversation with signed thinking
    // and one with redacted thinking.
    let chunks =
        anthropic::response_chunks(&read(RECORDED_ANTHROPIC, "messages-thinking.response.json")).expect("reply");
    let thinking = fold(&chunks).message();
    assert!(matches!(&thinking.parts[..], [Part::Thinking { signature: Some(_), .. }]));
    let chunks = anthropic::response_chunks(&read(RECORDED_ANTHROPIC, "messages-redacted-thinking.response.json"))
        .expect("reply");
    let redacted = fold(&chunks).message();
    let request = chat(
        "gemini-2.5-flash",
        None,
        vec![
            Message::user("How do I cross the street?"),
            thinking.clone(),
            Message::user("hmm"),
            redacted.clone(),
            Message::user("And a river?"),
        ],
    );
    let body = gemini::request_body(&request).expect("builds");
    assert_eq!(
        body["contents"][1],
        json!({"role": "model", "parts": [{"text": thinking.content.as_deref().expect("text")}]})
    );
    assert_eq!(
        body["contents"][3],
        json!({"role": "model", "parts": [{"text": redacted.content.as_deref().expect("text")}]})
    );
    let text = body.to_string();
    assert!(!text.contains("thoughtSignature") && !text.contains("\"thought\""));
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

fn error_response(dir: &str, case: &str, status: Option<u16>) -> ErrorResponse {
    let mut headers = HeaderMap::new();
    let meta_path = PathBuf::from(dir).join(format!("{case}.meta.json"));
    let status = match status {
        Some(status) => status,
        None => {
            let meta: Value = serde_json::from_slice(&std::fs::read(&meta_path).expect("meta")).expect("json");
            if let Some(map) = meta["response"]["headers"].as_object() {
                for (name, value) in map {
                    headers.insert(
                        HeaderName::from_bytes(name.as_bytes()).expect("header name"),
                        HeaderValue::from_str(value.as_str().expect("text")).expect("value"),
                    );
                }
            }
            meta["response"]["status"].as_u64().expect("status") as u16
        }
    };
    ErrorResponse {
        status,
        headers,
        body: String::from_utf8(read(dir, &format!("{case}.response.json"))).expect("utf-8"),
    }
}

/// (folder, case, status when the recording has no meta, code, start of the
/// message, wait).
type ErrorCase = (&'static str, &'static str, Option<u16>, ErrorCode, &'static str, Option<Duration>);

#[test]
fn every_error_body_maps_to_its_code() {
    let cases: &[ErrorCase] = &[
        (
            RECORDED,
            "error-404-model-not-found",
            None,
            ErrorCode::NotFound,
            "models/gemini-3.6-flahs is not found",
            None,
        ),
        (
            RECORDED,
            "vertex-error-400-invalid-argument",
            None,
            ErrorCode::InvalidRequest,
            "Cannot fetch content from the provided URL",
            None,
        ),
        // Body only; the README gives the status.
        (
            RECORDED,
            "error-429-resource-exhausted",
            Some(429),
            ErrorCode::RateLimit,
            "You exceeded your current quota",
            Some(Duration::from_millis(34_400)),
        ),
        (
            WRITTEN,
            "error-400-context-length",
            None,
            ErrorCode::ContextLengthExceeded,
            "The input token count (1194521) exceeds the maximum",
            None,
        ),
        (WRITTEN, "error-400-api-key-invalid", None, ErrorCode::Authentication, "API key not valid.", None),
        (
            WRITTEN,
            "error-403-permission-denied",
            None,
            ErrorCode::Permission,
            "Method doesn't allow unregistered callers",
            None,
        ),
        (
            WRITTEN,
            "error-429-retry-after-header",
            None,
            ErrorCode::RateLimit,
            "Resource has been exhausted",
            Some(Duration::from_secs(7)),
        ),
        (WRITTEN, "error-500-internal", None, ErrorCode::ProviderUnavailable, "An internal error has occurred.", None),
        (WRITTEN, "error-503-unavailable", None, ErrorCode::Overloaded, "The model is overloaded.", None),
        (WRITTEN, "error-504-deadline-exceeded", None, ErrorCode::Timeout, "Deadline expired", None),
    ];
    for (dir, case, status, code, message, wait) in cases {
        let response = error_response(dir, case, *status);
        let error = gemini::error_from_response(&response);
        assert_eq!(error.code, *code, "{case}");
        assert!(error.message.starts_with(message), "{case}: the provider's message is kept, got {:?}", error.message);
        assert_eq!(error.status, Some(response.status), "{case}");
        assert_eq!(error.retry_after, *wait, "{case}");
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
fn unreadable_and_array_wrapped_error_bodies_are_understood() {
    let html =
        ErrorResponse { status: 503, headers: HeaderMap::new(), body: "<html>Service Unavailable</html>".into() };
    let error = gemini::error_from_response(&html);
    assert_eq!(error.code, ErrorCode::ProviderUnavailable);
    assert!(error.message.contains("503"));
    // streamGenerateContent without alt=sse wraps the error in an array.
    let wrapped = ErrorResponse {
        status: 400,
        headers: HeaderMap::new(),
        body: json!([{"error": {"code": 400, "message": "The input token count (2000000) exceeds the maximum number of tokens allowed (1048576).", "status": "INVALID_ARGUMENT"}}]).to_string(),
    };
    assert_eq!(gemini::error_from_response(&wrapped).code, ErrorCode::ContextLengthExceeded);
}

#[test]
fn roles_of_a_message_are_only_user_and_model() {
    // A stray system message in the path is kept as user text, never as an
    // unknown role.
    let request = chat("gemini-2.5-flash", None, vec![Message::text(Role::System, "be terse"), Message::user("hi")]);
    let body = gemini::request_body(&request).expect("builds");
    assert_eq!(body["contents"], json!([{"role": "user", "parts": [{"text": "be terse"}, {"text": "hi"}]}]));
}

// ---------------------------------------------------------------------------
// Registry
// ---------------------------------------------------------------------------

#[test]
fn shipped_gemini_models_are_priced_and_sized() {
    let registry = arbor_providers::Registry::shipped();
    for id in ["gemini-2.5-pro", "gemini-2.5-flash", "gemini-2.5-flash-lite", "gemini-2.0-flash"] {
        let model = registry.get(id).expect("shipped");
        assert_eq!(model.provider, "gemini", "{id}");
        assert_eq!(model.context_window, 1_048_576, "{id}");
        assert!(model.capabilities.vision && model.capabilities.tools, "{id}");
        let cached = model.prices.cached_input.expect("cached price");
        assert!(cached < model.prices.input, "{id}");
    }
    assert!(registry.get("gemini-2.5-pro").expect("shipped").capabilities.thinking);
    assert!(!registry.get("gemini-2.0-flash").expect("shipped").capabilities.thinking);
    assert_eq!(registry.get("gemini-2.5-flash").expect("shipped").prices.output, 2_500_000);
}
