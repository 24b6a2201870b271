//! One provider test battery, written once and run for every wire protocol
//! (issue 3, "Tests that must pass"): each case builds the real adapter
//! (`OpenAiProvider`, `AnthropicProvider`, `GeminiProvider`) pointed at a
//! fresh loopback [`MockServer`] of the same protocol, drives it through the
//! `Provider` trait exactly as the engine does, and checks what a user would
//! notice: the text, the tool calls, the thinking that must go back to the
//! provider byte-for-byte, the request bodies Arbor sent, and, for every
//! fault the mock can inject, the error code the engine acts on.
//!
//! The [`battery!`] macro turns each case into one `#[tokio::test]` per
//! protocol (`openai::streamed_text`, `anthropic::streamed_text`, ...), so a
//! failure names both, and `cargo test -- gemini::` runs one provider. Every
//! case runs under [`DEADLINE`], so a hang fails the test instead of the
//! suite.
//!
//! Time is real here, not paused: the timeouts under test are reqwest's
//! (connect and per-read idle) on real loopback sockets, and tokio's paused
//! clock would fire them while the runtime merely waits on the socket. The
//! idle timeout is therefore short ([`READ_IDLE`]) and the delays tiny.

use std::future::Future;
use std::time::{Duration, Instant};

use arbor_core::message::{Part, ProviderOpaque};
use arbor_core::{ErrorCode, Message, ProviderError, SharedMessage, ToolStatus, Usage};
use arbor_providers::anthropic::{AnthropicConfig, AnthropicProvider};
use arbor_providers::gemini::{GeminiConfig, GeminiProvider};
use arbor_providers::http::HttpTimeouts;
use arbor_providers::openai::{OpenAiConfig, OpenAiProvider};
use arbor_providers::{ChatRequest, Chunk, ChunkStream, Collected, FinishReason, Provider, Reasoning, ToolSpec};
use arbor_testkit::mock::{Fault, MockServer, Protocol, RecordedCall, Reply};
use futures_util::StreamExt;
use serde_json::{Value, json};

/// Upper bound for any one case. The slowest cases wait out one
/// [`READ_IDLE`]; everything else takes milliseconds.
const DEADLINE: Duration = Duration::from_secs(10);

/// The adapters' idle timeout: short, so that the hang and stall cases end
/// in about a second, yet far above any pause of a healthy loopback stream.
const READ_IDLE: Duration = Duration::from_secs(1);

/// How long a stream may take to end once it has yielded an error.
const END_AFTER_ERROR: Duration = Duration::from_secs(2);

/// A thinking signature shaped like Anthropic's and Google's (base64 with
/// `+`, `/` and `=` padding), so that any re-encoding would show.
const SIGNATURE: &str = "EqQBCkYIBxgCKkDk3+mZ/9xQ0aP1yR7t2u8v5w6x4y3z/AbCdEfGhIjKlMnOpQrStUvWxYz0123456789+/ErEiDA==";
const SECOND_SIGNATURE: &str = "Ev0CCkYIBxgCKkA2+second/signature+of+round+two/0aP1yR7t2u8v5w6x4y3zQrStUvWxYz==";

/// Reasoning with a newline, non-ASCII text and an emoji: Anthropic verifies
/// the thinking text along with its signature, so it must come back exact.
const REASONING: &str = "The user wants the weather in Zürich.\nI should call get_weather, then answer in °C 🌡.";
const SECOND_REASONING: &str = "The tool says 21 °C; answer briefly.";

/// A 1×1 PNG.
const PNG_BASE64: &str =
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
const IMAGE_URL: &str = "https://media.example.com/photos/cat.jpg";

// ---------------------------------------------------------------------------
// The harness: one adapter, one mock, one call
// ---------------------------------------------------------------------------

/// Runs a case under the deadline.
async fn within_deadline<F: Future<Output = ()>>(protocol: Protocol, case: F) {
    if tokio::time::timeout(DEADLINE, case).await.is_err() {
        panic!("the {protocol} case did not finish within {DEADLINE:?}: something hangs");
    }
}

/// An adapter of `protocol` wired to a fresh mock of the same protocol.
struct Bench {
    protocol: Protocol,
    server: MockServer,
    provider: Box<dyn Provider>,
}

impl Bench {
    async fn start(protocol: Protocol) -> Bench {
        let server = MockServer::start(protocol).await;
        let base_url = server.base_url();
        let timeouts = HttpTimeouts { connect: Duration::from_secs(2), read_idle: READ_IDLE };
        let api_key = Some("test-key".to_owned());
        let provider: Box<dyn Provider> = match protocol {
            Protocol::OpenAi => Box::new(
                OpenAiProvider::new(OpenAiConfig { base_url, api_key, timeouts, ..Default::default() }).unwrap(),
            ),
            Protocol::Anthropic => Box::new(
                AnthropicProvider::new(AnthropicConfig { base_url, api_key, timeouts, ..Default::default() }).unwrap(),
            ),
            Protocol::Gemini => Box::new(GeminiProvider::new(GeminiConfig { base_url, api_key, timeouts }).unwrap()),
        };
        assert_eq!(provider.kind(), protocol.name(), "the adapter's kind names its protocol");
        Bench { protocol, server, provider }
    }

    /// A request for this protocol's model, with `messages` as the path.
    fn request(&self, messages: Vec<Message>) -> ChatRequest {
        let model = match self.protocol {
            Protocol::OpenAi => "gpt-4.1-mini",
            Protocol::Anthropic => "claude-sonnet-4-5",
            // A Gemini 3 model: it validates thought signatures, so the
            // adapter's placeholder for foreign calls must not replace ours.
            Protocol::Gemini => "gemini-3-pro-preview",
        };
        ChatRequest {
            model: model.to_owned(),
            system: Some("You are a terse assistant.".to_owned()),
            messages: SharedMessage::all(messages),
            max_output_tokens: Some(2048),
            ..ChatRequest::default()
        }
    }

    /// A request with tools and thinking on.
    fn tool_request(&self, messages: Vec<Message>) -> ChatRequest {
        ChatRequest {
            tools: weather_tools(),
            reasoning: Some(Reasoning { effort: None, budget_tokens: Some(1024) }),
            ..self.request(messages)
        }
    }

    /// Streams one call to its end or its first error.
    async fn stream(&self, request: ChatRequest) -> Outcome {
        let started = Instant::now();
        let stream = self.provider.stream(request).await;
        let mut outcome = Outcome { chunks: Vec::new(), error: None, elapsed: Duration::ZERO };
        match stream {
            Ok(stream) => drain(stream, &mut outcome).await,
            Err(error) => outcome.error = Some(error),
        }
        outcome.elapsed = started.elapsed();
        outcome
    }

    /// The one request the mock received.
    fn only_call(&self) -> RecordedCall {
        let calls = self.server.calls();
        assert_eq!(calls.len(), 1, "the adapter made exactly one call (adapters do not retry): {calls:#?}");
        calls.into_iter().next().unwrap()
    }
}

/// What one streamed call produced.
#[derive(Debug)]
struct Outcome {
    chunks: Vec<Chunk>,
    error: Option<ProviderError>,
    elapsed: Duration,
}

impl Outcome {
    fn texts(&self) -> Vec<&str> {
        self.chunks
            .iter()
            .filter_map(|chunk| match chunk {
                Chunk::Text(text) => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }

    fn text(&self) -> String {
        self.texts().concat()
    }

    fn collected(&self) -> Collected {
        let mut collected = Collected::default();
        for chunk in &self.chunks {
            collected.push(chunk);
        }
        collected.finish()
    }

    /// The reply, which must have completed without an error.
    fn reply(&self) -> Collected {
        if let Some(error) = &self.error {
            panic!("the call failed with {error:?} after {:?}", self.chunks);
        }
        self.collected()
    }

    /// The error, which the call must have ended with.
    fn error(&self) -> &ProviderError {
        match &self.error {
            Some(error) => error,
            None => panic!("the call succeeded but should have failed; it produced {:?}", self.chunks),
        }
    }

    fn finished(&self) -> bool {
        self.chunks.iter().any(|chunk| matches!(chunk, Chunk::Finish(_)))
    }
}

/// Reads a stream to its end. After an error the stream must end at once:
/// nothing that follows a gap may pass for more of the reply.
async fn drain(mut stream: ChunkStream, outcome: &mut Outcome) {
    while let Some(item) = stream.next().await {
        match item {
            Ok(chunk) => outcome.chunks.push(chunk),
            Err(error) => {
                let after = tokio::time::timeout(END_AFTER_ERROR, stream.next()).await;
                assert!(matches!(after, Ok(None)), "the stream went on after {error:?}: {after:?}");
                outcome.error = Some(error);
                return;
            }
        }
    }
}

fn weather_tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "get_weather".to_owned(),
            description: "Current weather in a city".to_owned(),
            parameters: json!({
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city"]
            }),
        },
        ToolSpec {
            name: "get_time".to_owned(),
            description: "Current local time in a timezone".to_owned(),
            parameters: json!({"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}),
        },
    ]
}

fn opaque(protocol: Protocol, data: &str) -> ProviderOpaque {
    ProviderOpaque { provider: protocol.name().to_owned(), data: data.to_owned() }
}

/// Thinking parts of a reply that carry a signature.
fn signatures(collected: &Collected) -> Vec<&ProviderOpaque> {
    collected
        .parts
        .iter()
        .filter_map(|part| match part {
            Part::Thinking { signature: Some(signature), .. } => Some(signature),
            _ => None,
        })
        .collect()
}

/// The thinking text of a reply, all parts together.
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

/// The JSON text of a request body, for "this never appears" checks.
fn body_text(call: &RecordedCall) -> String {
    call.body.to_string()
}

/// The text before an error must be the start of what was scripted (and so
/// never the error itself, nor a broken chunk passed off as text).
fn assert_prefix_of(outcome: &Outcome, scripted: &str) {
    let text = outcome.text();
    assert!(scripted.starts_with(&text), "the text before the error, {text:?}, is not a prefix of {scripted:?}");
    assert!(text.len() < scripted.len(), "the whole text arrived although the stream broke: {outcome:?}");
    assert!(!outcome.finished(), "a broken stream must not report a finish reason: {outcome:?}");
}

// ---------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------

/// A text answer arrives as several text chunks, exactly as the provider
/// cut it, with the usage and finish reason scripted; the request went to
/// the protocol's streaming endpoint.
async fn streamed_text(protocol: Protocol) {
    let bench = Bench::start(protocol).await;
    let deltas = ["Hello", ", wor", "ld! ", "Zürich is ", "sunny 🌞", "\ntoday."];
    let usage =
        Usage { input_tokens: 25, output_tokens: 7, thinking_tokens: 0, cached_tokens: 5, cache_write_tokens: 0 };
    bench.server.push(Reply::text_deltas(deltas).with_usage(usage));

    let outcome = bench.stream(bench.request(vec![Message::user("Say hello.")])).await;
    let reply = outcome.reply();
    assert_eq!(outcome.texts(), deltas, "one text chunk per delta, none merged or split");
    assert_eq!(reply.text, deltas.concat());
    assert_eq!(reply.usage, Some(usage), "usage as the provider reported it");
    assert_eq!(reply.finish, Some(FinishReason::Stop));
    assert!(reply.tool_calls.is_empty() && reply.parts.is_empty());

    let call = bench.only_call();
    match protocol {
        Protocol::OpenAi => {
            assert_eq!(call.path, "/v1/chat/completions");
            assert_eq!(call.header("authorization"), Some("Bearer test-key"));
            assert_eq!(call.body["stream"], true);
            // Without it OpenAI reports no usage for a stream.
            assert_eq!(call.body["stream_options"]["include_usage"], true);
            assert_eq!(call.body["messages"][0], json!({"role": "system", "content": "You are a terse assistant."}));
            assert_eq!(call.body["messages"][1], json!({"role": "user", "content": "Say hello."}));
        }
        Protocol::Anthropic => {
            assert_eq!(call.path, "/v1/messages");
            assert_eq!(call.header("x-api-key"), Some("test-key"));
            assert_eq!(call.header("anthropic-version"), Some("2023-06-01"));
            assert_eq!(call.body["stream"], true);
            assert_eq!(call.body["system"], "You are a terse assistant.");
            assert_eq!(
                call.body["messages"],
                json!([{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}])
            );
        }
        Protocol::Gemini => {
            assert_eq!(call.path, "/v1beta/models/gemini-3-pro-preview:streamGenerateContent");
            assert_eq!(call.query.as_deref(), Some("alt=sse"));
            // A header, so the key stays out of URLs and their logs.
            assert_eq!(call.header("x-goog-api-key"), Some("test-key"));
            assert_eq!(call.body["systemInstruction"], json!({"parts": [{"text": "You are a terse assistant."}]}));
            assert_eq!(call.body["contents"], json!([{"role": "user", "parts": [{"text": "Say hello."}]}]));
        }
    }
}

/// Two tool calls in one reply come out whole, in order, with their ids,
/// names and arguments, and the reply waits for their results.
async fn parallel_tool_calls(protocol: Protocol) {
    let bench = Bench::start(protocol).await;
    let weather_arguments = json!({"city": "Zürich", "unit": "celsius"});
    let time_arguments = json!({"timezone": "Europe/Zurich"});
    bench.server.push(Reply::tool_calls([
        ("call_weather_1", "get_weather", weather_arguments.clone()),
        ("call_time_2", "get_time", time_arguments.clone()),
    ]));

    let request = ChatRequest { tools: weather_tools(), ..bench.request(vec![Message::user("Weather and time?")]) };
    let outcome = bench.stream(request).await;
    let reply = outcome.reply();
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
    assert_eq!(reply.text, "");
    assert_eq!(reply.message().content, None, "an assistant message that only calls tools has no content");
    let calls: Vec<(&str, &Value)> =
        reply.tool_calls.iter().map(|call| (call.name.as_str(), &call.arguments)).collect();
    assert_eq!(calls, [("get_weather", &weather_arguments), ("get_time", &time_arguments)]);
    let ids: Vec<&str> = reply.tool_calls.iter().map(|call| call.id.as_str()).collect();
    match protocol {
        Protocol::OpenAi | Protocol::Anthropic => assert_eq!(ids, ["call_weather_1", "call_time_2"]),
        // The Gemini API sends calls without ids; the adapter names them,
        // and each must be unique to pair with its result.
        Protocol::Gemini => {
            assert!(ids.iter().all(|id| !id.is_empty()), "{ids:?}");
            assert_ne!(ids[0], ids[1], "assigned ids must differ");
        }
    }
    let starts = outcome.chunks.iter().filter(|chunk| matches!(chunk, Chunk::ToolCallStart { .. })).count();
    let ends = outcome.chunks.iter().filter(|chunk| matches!(chunk, Chunk::ToolCallEnd { .. })).count();
    assert_eq!((starts, ends), (2, 2), "each call starts and ends once: {:?}", outcome.chunks);

    // The tools went out in the provider's dialect.
    let call = bench.only_call();
    let tool_names: Vec<&Value> = match protocol {
        Protocol::OpenAi => {
            call.body["tools"].as_array().unwrap().iter().map(|tool| &tool["function"]["name"]).collect()
        }
        Protocol::Anthropic => call.body["tools"].as_array().unwrap().iter().map(|tool| &tool["name"]).collect(),
        Protocol::Gemini => {
            call.body["tools"][0]["functionDeclarations"].as_array().unwrap().iter().map(|f| &f["name"]).collect()
        }
    };
    assert_eq!(tool_names, [&json!("get_weather"), &json!("get_time")]);
}

/// A tool loop of two rounds with thinking. Round one thinks (with a
/// signature) and calls a tool; round two's request carries the assistant
/// message as collected plus the tool result. Anthropic must get its
/// `thinking` block and signature back byte-for-byte, Gemini its
/// `thoughtSignature` on the `functionCall` part (a tool loop with thinking
/// is refused otherwise); OpenAI takes no reasoning back, so none may be
/// sent, while the call id and arguments must round-trip.
async fn tool_loop_with_thinking(protocol: Protocol) {
    let bench = Bench::start(protocol).await;
    let arguments = json!({"city": "Zürich", "unit": "celsius"});
    let mut first =
        Reply::thinking(REASONING, SIGNATURE).then_tool_calls([("toolu_01A", "get_weather", arguments.clone())]);
    let mut second = Reply::thinking(SECOND_REASONING, SECOND_SIGNATURE).then_text("It is 21 °C in Zürich.");
    if protocol == Protocol::OpenAi {
        // OpenAI itself hides reasoning; compatible servers (DeepSeek)
        // stream it in `reasoning_content`, which must never be sent back.
        first = first.with_openai_reasoning_field("reasoning_content");
        second = second.with_openai_reasoning_field("reasoning_content");
    }
    bench.server.push(first).push(second);

    // Round one.
    let question = Message::user("What's the weather in Zürich?");
    let round_one = bench.stream(bench.tool_request(vec![question.clone()])).await.reply();
    assert_eq!(round_one.finish, Some(FinishReason::ToolCalls));
    assert_eq!(thinking_text(&round_one), REASONING, "the reasoning arrives whole");
    assert_eq!(round_one.tool_calls.len(), 1, "{round_one:?}");
    let call = round_one.tool_calls[0].clone();
    assert_eq!((call.name.as_str(), &call.arguments), ("get_weather", &arguments));
    match protocol {
        Protocol::OpenAi => {
            assert_eq!(call.id, "toolu_01A");
            assert!(signatures(&round_one).is_empty() && call.signature.is_none());
        }
        Protocol::Anthropic => {
            assert_eq!(call.id, "toolu_01A");
            assert_eq!(
                signatures(&round_one),
                [&opaque(protocol, SIGNATURE)],
                "the thinking block keeps its signature"
            );
            assert_eq!(call.signature, None);
        }
        Protocol::Gemini => {
            assert!(!call.id.is_empty());
            assert_eq!(call.signature, Some(opaque(protocol, SIGNATURE)), "the signature rides on the call");
        }
    }

    // Round two: the path as the engine would build it.
    let assistant = round_one.message();
    let result = Message::tool_result(&call, ToolStatus::Success, r#"{"temperature_c":21}"#);
    let round_two = bench.stream(bench.tool_request(vec![question, assistant, result])).await.reply();
    assert_eq!(round_two.text, "It is 21 °C in Zürich.");
    assert_eq!(round_two.finish, Some(FinishReason::Stop));
    assert_eq!(thinking_text(&round_two), SECOND_REASONING);
    if protocol != Protocol::OpenAi {
        assert_eq!(signatures(&round_two), [&opaque(protocol, SECOND_SIGNATURE)]);
    }

    let calls = bench.server.calls();
    assert_eq!(calls.len(), 2);
    let sent = &calls[1].body;
    match protocol {
        Protocol::OpenAi => {
            let messages = sent["messages"].as_array().unwrap();
            assert_eq!(messages.len(), 4, "system, user, assistant, tool: {messages:#?}");
            let assistant = &messages[2];
            assert_eq!(assistant["role"], "assistant");
            assert_eq!(assistant["content"], Value::Null, "content is null beside tool calls");
            assert_eq!(assistant["tool_calls"][0]["id"], "toolu_01A");
            assert_eq!(assistant["tool_calls"][0]["type"], "function");
            assert_eq!(assistant["tool_calls"][0]["function"]["name"], "get_weather");
            // OpenAI wants the arguments as JSON text.
            let sent_arguments = assistant["tool_calls"][0]["function"]["arguments"].as_str().unwrap();
            assert_eq!(serde_json::from_str::<Value>(sent_arguments).unwrap(), arguments);
            assert_eq!(
                messages[3],
                json!({"role": "tool", "content": r#"{"temperature_c":21}"#, "tool_call_id": "toolu_01A"})
            );
            let text = body_text(&calls[1]);
            for foreign in ["reasoning_content", "\"reasoning\"", "thinking", "extra_content", "The user wants"] {
                assert!(!text.contains(foreign), "no thinking goes back to OpenAI, but {foreign:?} did: {text}");
            }
            assert!(!text.contains(SIGNATURE));
        }
        Protocol::Anthropic => {
            assert_eq!(sent["thinking"]["type"], "enabled", "a signed loop keeps thinking on");
            let messages = sent["messages"].as_array().unwrap();
            assert_eq!(messages.len(), 3, "user, assistant, user with the result: {messages:#?}");
            assert_eq!(
                messages[1],
                json!({"role": "assistant", "content": [
                    {"type": "thinking", "thinking": REASONING, "signature": SIGNATURE},
                    {"type": "tool_use", "id": "toolu_01A", "name": "get_weather", "input": arguments},
                ]}),
                "the thinking block goes back first and unchanged"
            );
            assert_eq!(
                messages[2],
                json!({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01A", "content": r#"{"temperature_c":21}"#}
                ]})
            );
        }
        Protocol::Gemini => {
            let contents = sent["contents"].as_array().unwrap();
            assert_eq!(contents.len(), 3, "user, model, function response: {contents:#?}");
            assert_eq!(
                contents[1],
                json!({"role": "model", "parts": [{
                    "functionCall": {"id": call.id, "name": "get_weather", "args": arguments},
                    "thoughtSignature": SIGNATURE,
                }]}),
                "the call goes back with its own thought signature (not the foreign-call placeholder)"
            );
            assert_eq!(
                contents[2],
                json!({"role": "user", "parts": [{
                    "functionResponse": {"id": call.id, "name": "get_weather", "response": {"temperature_c": 21}}
                }]})
            );
        }
    }
}

/// A user message with one image as base64 and one by URL reaches each
/// provider in the form it accepts.
async fn image_input(protocol: Protocol) {
    let bench = Bench::start(protocol).await;
    bench.server.push(Reply::text("A cat and a pixel."));
    let inline_image = Part::Image {
        media_id: Some("media_1".to_owned()),
        url: None,
        data: Some(PNG_BASE64.to_owned()),
        mime_type: Some("image/png".to_owned()),
    };
    let linked_image = Part::Image {
        media_id: Some("media_2".to_owned()),
        url: Some(IMAGE_URL.to_owned()),
        data: None,
        mime_type: Some("image/jpeg".to_owned()),
    };
    let question = Message { parts: vec![inline_image, linked_image], ..Message::user("What is in these images?") };

    let reply = bench.stream(bench.request(vec![question])).await.reply();
    assert_eq!(reply.text, "A cat and a pixel.");

    let call = bench.only_call();
    match protocol {
        Protocol::OpenAi => assert_eq!(
            call.body["messages"][1],
            json!({"role": "user", "content": [
                {"type": "text", "text": "What is in these images?"},
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{PNG_BASE64}")}},
                {"type": "image_url", "image_url": {"url": IMAGE_URL}},
            ]})
        ),
        // Images first: Anthropic documents that Claude does best that way.
        Protocol::Anthropic => assert_eq!(
            call.body["messages"][0],
            json!({"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_BASE64}},
                {"type": "image", "source": {"type": "url", "url": IMAGE_URL}},
                {"type": "text", "text": "What is in these images?"},
            ]})
        ),
        Protocol::Gemini => assert_eq!(
            call.body["contents"][0],
            json!({"role": "user", "parts": [
                {"text": "What is in these images?"},
                {"inlineData": {"mimeType": "image/png", "data": PNG_BASE64}},
                {"fileData": {"fileUri": IMAGE_URL, "mimeType": "image/jpeg"}},
            ]})
        ),
    }
}

/// `complete` (no streaming) gives the same reply for thinking and tool
/// calls, through the protocol's non-streaming endpoint.
async fn non_streamed_reply(protocol: Protocol) {
    let bench = Bench::start(protocol).await;
    let arguments = json!({"city": "Zürich"});
    let usage =
        Usage { input_tokens: 40, output_tokens: 12, thinking_tokens: 0, cached_tokens: 0, cache_write_tokens: 0 };
    let mut reply = Reply::thinking(REASONING, SIGNATURE)
        .then_tool_calls([("toolu_9", "get_weather", arguments.clone())])
        .with_usage(usage);
    if protocol == Protocol::OpenAi {
        reply = reply.with_openai_reasoning_field("reasoning_content");
    }
    bench.server.push(reply);

    let reply = bench.provider.complete(bench.tool_request(vec![Message::user("Weather?")])).await.unwrap();
    assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
    assert_eq!(reply.usage, Some(usage));
    assert_eq!(thinking_text(&reply), REASONING);
    assert_eq!(reply.tool_calls.len(), 1);
    assert_eq!((reply.tool_calls[0].name.as_str(), &reply.tool_calls[0].arguments), ("get_weather", &arguments));
    match protocol {
        Protocol::OpenAi => assert_eq!(reply.tool_calls[0].id, "toolu_9"),
        Protocol::Anthropic => {
            assert_eq!(reply.tool_calls[0].id, "toolu_9");
            assert_eq!(signatures(&reply), [&opaque(protocol, SIGNATURE)]);
        }
        Protocol::Gemini => assert_eq!(reply.tool_calls[0].signature, Some(opaque(protocol, SIGNATURE))),
    }

    let call = bench.only_call();
    match protocol {
        Protocol::OpenAi => assert_eq!(call.body["stream"], false),
        Protocol::Anthropic => assert_eq!(call.body["stream"], false),
        Protocol::Gemini => assert_eq!(call.path, "/v1beta/models/gemini-3-pro-preview:generateContent"),
    }
}

/// `complete` fails the same way as a stream: a status keeps its code and
/// wait, silence ends in `timeout` (a non-streamed body is quartered by the
/// mock, so "stall after 2 chunks" stops mid-body), a cut body is
/// `stream_interrupted`, and a broken body is an error, never a reply.
async fn non_streamed_faults(protocol: Protocol) {
    let bench = Bench::start(protocol).await;
    let text = Reply::text(FAULTY_TEXT);
    bench
        .server
        .push(Reply::fault(Fault::rate_limit(7)))
        .push(Reply::fault(Fault::HangBeforeHeaders))
        .push(text.clone().with_fault(Fault::StallAfterChunks(2)))
        .push(text.with_fault(Fault::ResetAfterChunks(2)))
        // Not `MalformedChunk`: on a quartered JSON body it may cut only
        // inside a string and leave valid JSON with garbled text.
        .push(Reply::fault(Fault::status(200, r#"{"id": "msg_broken", "content": [{"type": "te"#)));
    let mut errors = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        match bench.provider.complete(bench.request(vec![Message::user("Hello?")])).await {
            Ok(reply) => panic!("a faulty non-streamed call succeeded with {reply:?}"),
            Err(error) => errors.push((error, started.elapsed())),
        }
    }
    assert_eq!(bench.server.call_count(), 5, "one request per call, no retries");

    let (rate_limit, _) = &errors[0];
    assert_eq!((rate_limit.code, rate_limit.retry_after), (ErrorCode::RateLimit, Some(Duration::from_secs(7))));
    for (name, (error, elapsed)) in [("hang", &errors[1]), ("stall", &errors[2])] {
        assert_eq!(error.code, ErrorCode::Timeout, "{name}: {error:?}");
        assert!(*elapsed >= READ_IDLE.mul_f32(0.9), "{name} waited for the idle limit: {elapsed:?}");
    }
    let (reset, _) = &errors[3];
    assert_eq!(reset.code, ErrorCode::StreamInterrupted, "{reset:?}");
    // An unreadable complete body: the adapters differ in the code
    // (`stream_interrupted` or `provider_unavailable`), both transient.
    let (malformed, _) = &errors[4];
    assert!(malformed.code.is_transient(), "{malformed:?}");
}

/// Streams one call that `reply` makes fail: it must end in an error, after
/// exactly one request (adapters leave retries to the engine).
async fn expect_fault(protocol: Protocol, reply: Reply) -> (Outcome, Bench) {
    let bench = Bench::start(protocol).await;
    bench.server.push(reply);
    let outcome = bench.stream(bench.request(vec![Message::user("Hello?")])).await;
    outcome.error();
    bench.only_call();
    (outcome, bench)
}

/// 429: `rate_limit`, with the provider's wait (a `retry-after` header for
/// OpenAI and Anthropic, `RetryInfo.retryDelay` in Gemini's body).
async fn fault_rate_limit(protocol: Protocol) {
    let (outcome, _bench) = expect_fault(protocol, Reply::fault(Fault::rate_limit(7))).await;
    let error = outcome.error();
    assert_eq!(error.code, ErrorCode::RateLimit, "{error:?}");
    assert_eq!(error.retry_after, Some(Duration::from_secs(7)), "{error:?}");
    assert_eq!(error.status, Some(429));
    assert!(!error.message.is_empty(), "the provider's message is kept");
}

/// 500: `provider_unavailable`.
async fn fault_server_error(protocol: Protocol) {
    let (outcome, _bench) = expect_fault(protocol, Reply::fault(Fault::server_error())).await;
    let error = outcome.error();
    assert_eq!(error.code, ErrorCode::ProviderUnavailable, "{error:?}");
    assert_eq!(error.status, Some(500));
}

/// 503 without the word "overloaded": `provider_unavailable` (all three
/// adapters keep `overloaded` for a 503 that says so, and for Anthropic 529).
async fn fault_unavailable(protocol: Protocol) {
    let (outcome, _bench) = expect_fault(protocol, Reply::fault(Fault::unavailable())).await;
    let error = outcome.error();
    assert_eq!(error.code, ErrorCode::ProviderUnavailable, "{error:?}");
    assert_eq!(error.status, Some(503));
}

/// Anthropic's 529 `overloaded_error`, and the 503 "overloaded" of the
/// others: `overloaded`.
async fn fault_overloaded(protocol: Protocol) {
    let (outcome, _bench) = expect_fault(protocol, Reply::fault(Fault::overloaded())).await;
    let error = outcome.error();
    assert_eq!(error.code, ErrorCode::Overloaded, "{error:?}");
    let status = if protocol == Protocol::Anthropic { 529 } else { 503 };
    assert_eq!(error.status, Some(status));
}

/// A 400 that says the prompt is too long: `context_length_exceeded`, not a
/// generic `invalid_request`.
async fn fault_context_length(protocol: Protocol) {
    let (outcome, _bench) = expect_fault(protocol, Reply::fault(Fault::context_length())).await;
    let error = outcome.error();
    assert_eq!(error.code, ErrorCode::ContextLengthExceeded, "{error:?}");
    assert_eq!(error.status, Some(400));
}

/// No headers ever: `timeout` after the idle limit, not a hang.
async fn fault_hang_before_headers(protocol: Protocol) {
    let (outcome, _bench) = expect_fault(protocol, Reply::fault(Fault::HangBeforeHeaders)).await;
    let error = outcome.error();
    assert_eq!(error.code, ErrorCode::Timeout, "{error:?}");
    assert!(outcome.chunks.is_empty());
    assert!(outcome.elapsed >= READ_IDLE.mul_f32(0.9), "it waited for the idle limit: {:?}", outcome.elapsed);
}

const FAULTY_TEXT: &str = "One two three four five six seven eight nine ten eleven twelve.";

/// Silence in the middle of a stream: `timeout`, after the chunks sent so
/// far.
async fn fault_stall_mid_stream(protocol: Protocol) {
    let reply = Reply::text(FAULTY_TEXT).with_fault(Fault::StallAfterChunks(5));
    let (outcome, _bench) = expect_fault(protocol, reply).await;
    let error = outcome.error();
    assert_eq!(error.code, ErrorCode::Timeout, "{error:?}");
    assert!(!outcome.text().is_empty(), "text before the stall arrived: {outcome:?}");
    assert_prefix_of(&outcome, FAULTY_TEXT);
    assert!(outcome.elapsed >= READ_IDLE.mul_f32(0.9), "it waited for the idle limit: {:?}", outcome.elapsed);
}

/// The connection drops after some chunks: `stream_interrupted`, and the
/// partial text is not passed off as a complete reply.
async fn fault_reset_after_chunks(protocol: Protocol) {
    let reply = Reply::text(FAULTY_TEXT).with_fault(Fault::ResetAfterChunks(5));
    let (outcome, _bench) = expect_fault(protocol, reply).await;
    let error = outcome.error();
    assert_eq!(error.code, ErrorCode::StreamInterrupted, "{error:?}");
    assert!(!outcome.text().is_empty(), "text before the reset arrived: {outcome:?}");
    assert_prefix_of(&outcome, FAULTY_TEXT);
}

/// A chunk with broken JSON: an error (`stream_interrupted`), never text
/// and never a panic.
async fn fault_malformed_chunk(protocol: Protocol) {
    let reply = Reply::text(FAULTY_TEXT).with_fault(Fault::MalformedChunk(4));
    let (outcome, _bench) = expect_fault(protocol, reply).await;
    let error = outcome.error();
    assert_eq!(error.code, ErrorCode::StreamInterrupted, "{error:?}");
    assert_prefix_of(&outcome, FAULTY_TEXT);
}

/// Every chunk late and cut mid-line: still the whole, exact reply.
async fn fault_slow_drip(protocol: Protocol) {
    let bench = Bench::start(protocol).await;
    bench.server.push(Reply::text(FAULTY_TEXT).with_fault(Fault::SlowDrip(Duration::from_millis(5))));
    let outcome = bench.stream(bench.request(vec![Message::user("Count.")])).await;
    let reply = outcome.reply();
    assert_eq!(reply.text, FAULTY_TEXT);
    assert_eq!(reply.finish, Some(FinishReason::Stop));
    assert!(outcome.texts().len() > 1, "still streamed in pieces: {:?}", outcome.texts());
    bench.only_call();
}

/// The provider's own error event inside a 200 stream: an error with the
/// provider's meaning, not text. OpenAI's `server_error` object carries no
/// status (`provider_unavailable`); Anthropic's `overloaded_error` event and
/// Gemini's `UNAVAILABLE` "model is overloaded" object are `overloaded`.
async fn fault_in_stream_error(protocol: Protocol) {
    let reply = Reply::text(FAULTY_TEXT).with_fault(Fault::in_stream_error());
    let (outcome, _bench) = expect_fault(protocol, reply).await;
    let error = outcome.error();
    let expected = match protocol {
        Protocol::OpenAi => ErrorCode::ProviderUnavailable,
        Protocol::Anthropic | Protocol::Gemini => ErrorCode::Overloaded,
    };
    assert_eq!(error.code, expected, "{error:?}");
    assert!(!error.message.is_empty(), "the provider's message is kept");
    assert_prefix_of(&outcome, FAULTY_TEXT);
    assert!(!outcome.text().contains(&error.message));
}

// ---------------------------------------------------------------------------
// One test per protocol and case
// ---------------------------------------------------------------------------

/// `battery!(case, ...)` makes modules `openai`, `anthropic` and `gemini`,
/// each with one `#[tokio::test]` per case that runs `case(protocol)` under
/// the deadline.
macro_rules! battery {
    ($($case:ident),+ $(,)?) => {
        battery!(@protocol openai, Protocol::OpenAi, $($case),+);
        battery!(@protocol anthropic, Protocol::Anthropic, $($case),+);
        battery!(@protocol gemini, Protocol::Gemini, $($case),+);
    };
    (@protocol $module:ident, $protocol:expr, $($case:ident),+) => {
        mod $module {
            use super::{Protocol, within_deadline};
            $(
                #[tokio::test]
                async fn $case() {
                    within_deadline($protocol, super::$case($protocol)).await;
                }
            )+
        }
    };
}

battery!(
    streamed_text,
    parallel_tool_calls,
    tool_loop_with_thinking,
    image_input,
    non_streamed_reply,
    non_streamed_faults,
    fault_rate_limit,
    fault_server_error,
    fault_unavailable,
    fault_overloaded,
    fault_context_length,
    fault_hang_before_headers,
    fault_stall_mid_stream,
    fault_reset_after_chunks,
    fault_malformed_chunk,
    fault_slow_drip,
    fault_in_stream_error,
);

/// The battery must not silently skip a protocol the mocks speak.
#[test]
fn the_battery_covers_every_protocol() {
    assert_eq!(Protocol::ALL, [Protocol::OpenAi, Protocol::Anthropic, Protocol::Gemini]);
}
