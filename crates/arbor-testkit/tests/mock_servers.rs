//! The mock provider servers, checked from the outside with a plain HTTP
//! client: every protocol's streams and JSON replies are well-formed and say
//! what was scripted (parsed by hand here, so a bug in an adapter cannot hide
//! a bug in the mock), calls are recorded, scripted replies come in order,
//! and each fault really happens on the socket. Every test runs under a
//! deadline so none can hang.

use std::future::Future;
use std::time::{Duration, Instant};

use arbor_core::Usage;
use arbor_testkit::mock::{Fault, MockServer, Protocol, Reply, StopReason, provider_fixtures_dir};
use serde_json::{Value, json};

/// Upper bound for any one test.
const DEADLINE: Duration = Duration::from_secs(20);

async fn within_deadline<F: Future<Output = ()>>(test: F) {
    tokio::time::timeout(DEADLINE, test).await.expect("test exceeded its deadline");
}

fn client() -> reqwest::Client {
    // reqwest is built without a default crypto provider and will not build
    // a client until one is installed, even for plain http.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap()
}

/// The chat URL and request body a client of this protocol would send.
fn chat_request(server: &MockServer, stream: bool) -> (String, Value) {
    let base = server.base_url();
    match server.protocol() {
        Protocol::OpenAi => {
            let mut body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]});
            if stream {
                body["stream"] = json!(true);
                body["stream_options"] = json!({"include_usage": true});
            }
            (format!("{base}/chat/completions"), body)
        }
        Protocol::Anthropic => {
            let mut body = json!({
                "model": "claude-sonnet-4-5", "max_tokens": 1024,
                "messages": [{"role": "user", "content": "Hi"}]
            });
            if stream {
                body["stream"] = json!(true);
            }
            (format!("{base}/v1/messages"), body)
        }
        Protocol::Gemini => {
            let body = json!({"contents": [{"role": "user", "parts": [{"text": "Hi"}]}]});
            let url = if stream {
                format!("{base}/models/gemini-2.5-flash:streamGenerateContent?alt=sse")
            } else {
                format!("{base}/models/gemini-2.5-flash:generateContent")
            };
            (url, body)
        }
    }
}

async fn send(server: &MockServer, stream: bool) -> reqwest::Response {
    let (url, body) = chat_request(server, stream);
    client().post(url).json(&body).send().await.unwrap()
}

/// One SSE event, split by hand: its `event:` name and `data:` payload.
#[derive(Debug)]
struct Event {
    name: Option<String>,
    data: String,
}

fn parse_sse(body: &str) -> Vec<Event> {
    body.replace("\r\n", "\n")
        .split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let mut event = Event { name: None, data: String::new() };
            for line in block.lines() {
                if let Some(name) = line.strip_prefix("event: ") {
                    event.name = Some(name.to_owned());
                } else if let Some(data) = line.strip_prefix("data: ") {
                    event.data.push_str(data);
                } else {
                    panic!("unexpected SSE line {line:?} in {block:?}");
                }
            }
            event
        })
        .collect()
}

/// What a stream or JSON reply said, reduced to what every protocol shares.
#[derive(Debug, Default, PartialEq)]
struct Said {
    text: String,
    text_deltas: usize,
    thinking: String,
    signature: Option<String>,
    /// (id, name, arguments); Gemini has no ids.
    tool_calls: Vec<(String, String, Value)>,
    finish: String,
    usage: Value,
}

fn read_openai_stream(body: &str) -> Said {
    let events = parse_sse(body);
    assert_eq!(events.last().unwrap().data, "[DONE]", "an OpenAI stream ends with [DONE]");
    let mut said = Said::default();
    let mut arguments: Vec<String> = Vec::new();
    for (position, event) in events[..events.len() - 1].iter().enumerate() {
        assert!(event.name.is_none());
        let chunk: Value = serde_json::from_str(&event.data).unwrap();
        assert_eq!(chunk["object"], "chat.completion.chunk");
        let choices = chunk["choices"].as_array().unwrap();
        if choices.is_empty() {
            said.usage = chunk["usage"].clone();
            continue;
        }
        let delta = &choices[0]["delta"];
        if position == 0 {
            assert_eq!(delta["role"], "assistant", "the first chunk carries the role");
        }
        if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
            said.text.push_str(text);
            said.text_deltas += 1;
        }
        if let Some(reasoning) = delta["reasoning_content"].as_str() {
            said.thinking.push_str(reasoning);
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            if let Some(id) = call["id"].as_str() {
                assert_eq!(index, said.tool_calls.len(), "calls start in index order");
                assert_eq!(call["function"]["arguments"], "", "a call opens with empty arguments");
                said.tool_calls.push((
                    id.to_owned(),
                    call["function"]["name"].as_str().unwrap().to_owned(),
                    Value::Null,
                ));
                arguments.push(String::new());
            } else {
                assert!(call["function"].get("name").is_none());
                arguments[index].push_str(call["function"]["arguments"].as_str().unwrap());
            }
        }
        if let Some(finish) = choices[0]["finish_reason"].as_str() {
            said.finish = finish.to_owned();
        }
    }
    for (call, arguments) in said.tool_calls.iter_mut().zip(arguments) {
        call.2 = serde_json::from_str(&arguments).unwrap();
    }
    said
}

fn read_anthropic_stream(body: &str) -> Said {
    let events = parse_sse(body);
    let names: Vec<&str> = events.iter().map(|e| e.name.as_deref().unwrap()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names.last(), Some(&"message_stop"));
    let mut said = Said::default();
    let mut open_block: Option<(u64, Value)> = None;
    let mut input = String::new();
    for event in &events {
        let data: Value = serde_json::from_str(&event.data).unwrap();
        assert_eq!(data["type"].as_str(), event.name.as_deref(), "event name and data type agree");
        match event.name.as_deref().unwrap() {
            "content_block_start" => {
                assert!(open_block.is_none(), "blocks do not overlap");
                open_block = Some((data["index"].as_u64().unwrap(), data["content_block"].clone()));
                input.clear();
            }
            "content_block_delta" => {
                let (index, _) = open_block.as_ref().expect("a delta inside an open block");
                assert_eq!(data["index"].as_u64().unwrap(), *index);
                let delta = &data["delta"];
                match delta["type"].as_str().unwrap() {
                    "text_delta" => {
                        said.text.push_str(delta["text"].as_str().unwrap());
                        said.text_deltas += 1;
                    }
                    "thinking_delta" => said.thinking.push_str(delta["thinking"].as_str().unwrap()),
                    "signature_delta" => said.signature = Some(delta["signature"].as_str().unwrap().to_owned()),
                    "input_json_delta" => input.push_str(delta["partial_json"].as_str().unwrap()),
                    other => panic!("unknown delta {other}"),
                }
            }
            "content_block_stop" => {
                let (index, block) = open_block.take().expect("a stop closes an open block");
                assert_eq!(data["index"].as_u64().unwrap(), index);
                if block["type"] == "tool_use" {
                    let arguments = if input.is_empty() { json!({}) } else { serde_json::from_str(&input).unwrap() };
                    let id = block["id"].as_str().unwrap().to_owned();
                    said.tool_calls.push((id, block["name"].as_str().unwrap().to_owned(), arguments));
                }
            }
            "message_delta" => {
                said.finish = data["delta"]["stop_reason"].as_str().unwrap().to_owned();
                said.usage = data["usage"].clone();
            }
            "message_start" | "message_stop" | "ping" => {}
            other => panic!("unknown event {other}"),
        }
    }
    said
}

fn read_gemini_chunks(chunks: &[Value]) -> Said {
    let mut said = Said::default();
    for (position, chunk) in chunks.iter().enumerate() {
        let candidate = &chunk["candidates"][0];
        assert_eq!(candidate["content"]["role"], "model");
        for part in candidate["content"]["parts"].as_array().unwrap() {
            if let Some(signature) = part["thoughtSignature"].as_str() {
                said.signature = Some(signature.to_owned());
            }
            if let Some(call) = part.get("functionCall") {
                said.tool_calls.push((String::new(), call["name"].as_str().unwrap().to_owned(), call["args"].clone()));
            } else if part["thought"] == true {
                said.thinking.push_str(part["text"].as_str().unwrap());
            } else if let Some(text) = part["text"].as_str().filter(|t| !t.is_empty()) {
                said.text.push_str(text);
                said.text_deltas += 1;
            }
        }
        let last = position + 1 == chunks.len();
        assert_eq!(candidate.get("finishReason").is_some(), last, "only the last chunk finishes");
        if last {
            said.finish = candidate["finishReason"].as_str().unwrap().to_owned();
            said.usage = chunk["usageMetadata"].clone();
        }
    }
    said
}

fn read_gemini_stream(body: &str) -> Said {
    assert!(body.contains("\r\n\r\n") && !body.contains("[DONE]"));
    let chunks: Vec<Value> = parse_sse(body).iter().map(|e| serde_json::from_str(&e.data).unwrap()).collect();
    read_gemini_chunks(&chunks)
}

fn read_stream(protocol: Protocol, body: &str) -> Said {
    match protocol {
        Protocol::OpenAi => read_openai_stream(body),
        Protocol::Anthropic => read_anthropic_stream(body),
        Protocol::Gemini => read_gemini_stream(body),
    }
}

fn read_json(protocol: Protocol, body: &Value) -> Said {
    let mut said = Said::default();
    match protocol {
        Protocol::OpenAi => {
            let choice = &body["choices"][0];
            said.text = choice["message"]["content"].as_str().unwrap_or_default().to_owned();
            for call in choice["message"]["tool_calls"].as_array().into_iter().flatten() {
                let arguments = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
                said.tool_calls.push((
                    call["id"].as_str().unwrap().to_owned(),
                    call["function"]["name"].as_str().unwrap().to_owned(),
                    arguments,
                ));
            }
            said.finish = choice["finish_reason"].as_str().unwrap().to_owned();
            said.usage = body["usage"].clone();
        }
        Protocol::Anthropic => {
            for block in body["content"].as_array().unwrap() {
                match block["type"].as_str().unwrap() {
                    "text" => said.text.push_str(block["text"].as_str().unwrap()),
                    "thinking" => {
                        said.thinking.push_str(block["thinking"].as_str().unwrap());
                        said.signature = Some(block["signature"].as_str().unwrap().to_owned());
                    }
                    "tool_use" => said.tool_calls.push((
                        block["id"].as_str().unwrap().to_owned(),
                        block["name"].as_str().unwrap().to_owned(),
                        block["input"].clone(),
                    )),
                    other => panic!("unknown block {other}"),
                }
            }
            said.finish = body["stop_reason"].as_str().unwrap().to_owned();
            said.usage = body["usage"].clone();
        }
        Protocol::Gemini => {
            said = read_gemini_chunks(std::slice::from_ref(body));
            said.text_deltas = 0;
        }
    }
    said
}

const USAGE: Usage =
    Usage { input_tokens: 100, output_tokens: 40, thinking_tokens: 15, cached_tokens: 30, cache_write_tokens: 0 };

/// The usage each provider reports for [`USAGE`], in its own terms.
fn assert_usage(protocol: Protocol, usage: &Value) {
    match protocol {
        Protocol::OpenAi => {
            assert_eq!(usage["prompt_tokens"], 100);
            assert_eq!(usage["completion_tokens"], 40);
            assert_eq!(usage["total_tokens"], 140);
            assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 30);
            assert_eq!(usage["completion_tokens_details"]["reasoning_tokens"], 15);
        }
        Protocol::Anthropic => {
            assert_eq!(usage["input_tokens"], 70, "Anthropic counts cache reads apart");
            assert_eq!(usage["cache_read_input_tokens"], 30);
            assert_eq!(usage["output_tokens"], 40);
        }
        Protocol::Gemini => {
            assert_eq!(usage["promptTokenCount"], 100);
            assert_eq!(usage["cachedContentTokenCount"], 30);
            assert_eq!(usage["candidatesTokenCount"], 25, "Gemini counts thoughts apart");
            assert_eq!(usage["thoughtsTokenCount"], 15);
            assert_eq!(usage["totalTokenCount"], 140);
        }
    }
}

fn stop_word(protocol: Protocol, tools: bool) -> &'static str {
    match (protocol, tools) {
        (Protocol::OpenAi, false) => "stop",
        (Protocol::OpenAi, true) => "tool_calls",
        (Protocol::Anthropic, false) => "end_turn",
        (Protocol::Anthropic, true) => "tool_use",
        (Protocol::Gemini, _) => "STOP",
    }
}

// ---------------------------------------------------------------- replies

#[tokio::test]
async fn text_streams_are_well_formed_for_every_protocol() {
    within_deadline(async {
        for protocol in Protocol::ALL {
            let server = MockServer::start(protocol).await;
            server.push(Reply::text("The capital of France is Paris.").with_usage(USAGE));
            let response = send(&server, true).await;
            assert_eq!(response.status(), 200, "{protocol}");
            let content_type = response.headers()["content-type"].to_str().unwrap().to_owned();
            assert!(content_type.starts_with("text/event-stream"), "{protocol}: {content_type}");
            let said = read_stream(protocol, &response.text().await.unwrap());
            assert_eq!(said.text, "The capital of France is Paris.", "{protocol}");
            assert_eq!(said.text_deltas, 6, "{protocol}: one delta per word");
            assert_eq!(said.finish, stop_word(protocol, false));
            assert_usage(protocol, &said.usage);
        }
    })
    .await;
}

#[tokio::test]
async fn parallel_tool_calls_stream_for_every_protocol() {
    within_deadline(async {
        let calls = [
            ("call_1", "get_weather", json!({"city": "Paris", "unit": "celsius"})),
            ("call_2", "get_time", json!({"zone": "Europe/Zürich"})),
        ];
        for protocol in Protocol::ALL {
            let server = MockServer::start(protocol).await;
            server.push(Reply::tool_calls(calls.clone()));
            let said = read_stream(protocol, &send(&server, true).await.text().await.unwrap());
            let expected: Vec<(String, String, Value)> = calls
                .iter()
                .map(|(id, name, args)| {
                    let id = if protocol == Protocol::Gemini { String::new() } else { (*id).to_owned() };
                    (id, (*name).to_owned(), args.clone())
                })
                .collect();
            assert_eq!(said.tool_calls, expected, "{protocol}");
            assert_eq!(said.text, "");
            assert_eq!(said.finish, stop_word(protocol, true), "{protocol}");
        }
    })
    .await;
}

#[tokio::test]
async fn thinking_streams_carry_their_signature() {
    within_deadline(async {
        let reply = || {
            Reply::thinking("The user wants the weather.", "RXVZRENtTUlEQmdDS2tDMA==")
                .then_tool_calls([("toolu_9", "get_weather", json!({"city": "Paris"}))])
                .with_usage(USAGE)
        };
        // Anthropic: a thinking block with thinking_delta and one signature_delta.
        let server = MockServer::start(Protocol::Anthropic).await;
        server.push(reply());
        let said = read_stream(Protocol::Anthropic, &send(&server, true).await.text().await.unwrap());
        assert_eq!(said.thinking, "The user wants the weather.");
        assert_eq!(said.signature.as_deref(), Some("RXVZRENtTUlEQmdDS2tDMA=="));
        assert_eq!(said.tool_calls.len(), 1);
        assert_usage(Protocol::Anthropic, &said.usage);

        // Gemini: thought parts, then the signature on the function call.
        let server = MockServer::start(Protocol::Gemini).await;
        server.push(reply());
        let body = send(&server, true).await.text().await.unwrap();
        let said = read_gemini_stream(&body);
        assert_eq!(said.thinking, "The user wants the weather.");
        assert_eq!(said.signature.as_deref(), Some("RXVZRENtTUlEQmdDS2tDMA=="));
        let call_event = parse_sse(&body).into_iter().find(|e| e.data.contains("functionCall")).unwrap();
        let call: Value = serde_json::from_str(&call_event.data).unwrap();
        assert_eq!(call["candidates"][0]["content"]["parts"][0]["thoughtSignature"], "RXVZRENtTUlEQmdDS2tDMA==");
        assert_usage(Protocol::Gemini, &said.usage);

        // OpenAI: no reasoning text, only reasoning tokens...
        let server = MockServer::start(Protocol::OpenAi).await;
        server.push(reply());
        server.push(reply().with_openai_reasoning_field("reasoning_content"));
        let said = read_stream(Protocol::OpenAi, &send(&server, true).await.text().await.unwrap());
        assert_eq!(said.thinking, "");
        assert_usage(Protocol::OpenAi, &said.usage);
        // ...unless it plays an OpenAI-compatible server that streams it.
        let said = read_stream(Protocol::OpenAi, &send(&server, true).await.text().await.unwrap());
        assert_eq!(said.thinking, "The user wants the weather.");
    })
    .await;
}

#[tokio::test]
async fn non_streaming_requests_get_one_json_reply() {
    within_deadline(async {
        for protocol in Protocol::ALL {
            let server = MockServer::start(protocol).await;
            server.push(
                Reply::thinking("Short thought.", "c2lnbmF0dXJl")
                    .then_text("Here you go.")
                    .then_tool_calls([("call_7", "lookup", json!({"q": "x"}))])
                    .with_usage(USAGE),
            );
            let response = send(&server, false).await;
            assert_eq!(response.status(), 200);
            assert!(response.headers()["content-type"].to_str().unwrap().starts_with("application/json"));
            let body: Value = response.json().await.unwrap();
            let said = read_json(protocol, &body);
            assert_eq!(said.text, "Here you go.", "{protocol}");
            assert_eq!(said.tool_calls.len(), 1, "{protocol}");
            assert_eq!(said.tool_calls[0].1, "lookup");
            assert_eq!(said.tool_calls[0].2, json!({"q": "x"}));
            assert_eq!(said.finish, stop_word(protocol, true), "{protocol}");
            assert_usage(protocol, &said.usage);
            if protocol != Protocol::OpenAi {
                assert_eq!(said.thinking, "Short thought.", "{protocol}");
                assert_eq!(said.signature.as_deref(), Some("c2lnbmF0dXJl"), "{protocol}");
            }
        }
    })
    .await;
}

#[tokio::test]
async fn gemini_without_alt_sse_streams_one_json_array() {
    within_deadline(async {
        let server = MockServer::start(Protocol::Gemini).await;
        server.push(Reply::thinking("Hmm.", "c2ln").then_text("The answer is 4."));
        let url = format!("{}/models/gemini-3-pro-preview:streamGenerateContent", server.base_url());
        let response = client().post(url).json(&json!({"contents": []})).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let body = response.text().await.unwrap();
        assert!(body.starts_with("[{\n") && body.contains("\n,\r\n") && body.ends_with("\n]"), "{body}");
        let array: Value = serde_json::from_str(&body).unwrap();
        let said = read_gemini_chunks(array.as_array().unwrap());
        assert_eq!(said.text, "The answer is 4.");
        assert_eq!(said.thinking, "Hmm.");
        assert_eq!(said.signature.as_deref(), Some("c2ln"));
        assert_eq!(array[0]["modelVersion"], "gemini-3-pro-preview", "the model is echoed from the path");
    })
    .await;
}

#[tokio::test]
async fn openai_streams_usage_only_when_asked_and_answers_on_both_paths() {
    within_deadline(async {
        let server = MockServer::start(Protocol::OpenAi).await;
        let body = json!({"model": "gpt-4o-mini", "messages": [], "stream": true});
        for path in ["/v1/chat/completions", "/chat/completions"] {
            let text = client().post(server.url(path)).json(&body).send().await.unwrap().text().await.unwrap();
            assert!(!text.contains("usage"), "no usage without include_usage: {text}");
            let said = read_openai_stream(&text);
            assert_eq!(said.text, "mock reply");
            assert_eq!(said.usage, Value::Null);
            let first: Value = serde_json::from_str(&parse_sse(&text)[0].data).unwrap();
            assert_eq!(first["model"], "gpt-4o-mini", "the model is echoed");
        }
    })
    .await;
}

#[tokio::test]
async fn stop_reasons_are_spelled_per_protocol() {
    within_deadline(async {
        let expected = [
            (Protocol::OpenAi, "length", "content_filter"),
            (Protocol::Anthropic, "max_tokens", "refusal"),
            (Protocol::Gemini, "MAX_TOKENS", "SAFETY"),
        ];
        for (protocol, max_tokens, filtered) in expected {
            let server = MockServer::start(protocol).await;
            server.push(Reply::text("cut").with_stop_reason(StopReason::MaxTokens));
            server.push(Reply::text("no").with_stop_reason(StopReason::ContentFilter));
            assert_eq!(read_stream(protocol, &send(&server, true).await.text().await.unwrap()).finish, max_tokens);
            assert_eq!(read_stream(protocol, &send(&server, true).await.text().await.unwrap()).finish, filtered);
        }
    })
    .await;
}

// ------------------------------------------------- recording and scripting

#[tokio::test]
async fn calls_are_recorded_and_replies_served_in_order() {
    within_deadline(async {
        let server = MockServer::start(Protocol::Anthropic).await;
        server.push(Reply::text("first")).push(Reply::text("second"));
        server.set_default(Reply::text("fallback"));
        assert_eq!(server.pending_replies(), 2);
        let mut texts = Vec::new();
        for turn in 0..3 {
            let (url, mut body) = chat_request(&server, true);
            body["metadata"] = json!({"turn": turn});
            let response = client()
                .post(url)
                .header("x-api-key", "sk-test")
                .header("anthropic-version", "2023-06-01")
                .json(&body)
                .send()
                .await
                .unwrap();
            texts.push(read_anthropic_stream(&response.text().await.unwrap()).text);
        }
        assert_eq!(texts, ["first", "second", "fallback"]);
        assert_eq!(server.call_count(), 3);
        assert_eq!(server.pending_replies(), 0);
        let calls = server.calls();
        assert_eq!(calls[1].path, "/v1/messages");
        assert_eq!(calls[1].method, "POST");
        assert_eq!(calls[1].header("x-api-key"), Some("sk-test"));
        assert_eq!(calls[1].header("anthropic-version"), Some("2023-06-01"));
        assert_eq!(calls[1].body["metadata"]["turn"], 1);
        assert_eq!(calls[2].body["model"], "claude-sonnet-4-5");
        assert!(server.wait_for_calls(3, Duration::from_millis(10)).await);
        assert!(!server.wait_for_calls(4, Duration::from_millis(50)).await);
    })
    .await;
}

#[tokio::test]
async fn gemini_calls_keep_their_query_and_unknown_routes_get_a_provider_404() {
    within_deadline(async {
        let server = MockServer::start(Protocol::Gemini).await;
        let (url, body) = chat_request(&server, true);
        client().post(format!("{url}&key=test-key")).json(&body).send().await.unwrap();
        let call = server.last_call().unwrap();
        assert_eq!(call.path, "/v1beta/models/gemini-2.5-flash:streamGenerateContent");
        assert_eq!(call.query.as_deref(), Some("alt=sse&key=test-key"));

        let response = client().post(server.url("/v1/chat/completions")).json(&body).send().await.unwrap();
        assert_eq!(response.status(), 404);
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["status"], "NOT_FOUND");
        assert_eq!(server.call_count(), 2, "unroutable requests are recorded too");

        let response = client().post(url).body("{not json").send().await.unwrap();
        assert_eq!(response.status(), 400);
        assert_eq!(server.last_call().unwrap().body, json!("{not json"));
    })
    .await;
}

#[tokio::test]
async fn fixtures_are_served_byte_for_byte_with_their_status() {
    within_deadline(async {
        let server = MockServer::start(Protocol::Anthropic).await;
        server.push(Reply::provider_fixture("anthropic/stream-thinking.response.sse").unwrap());
        server.push(
            Reply::provider_fixture("anthropic/stream-tool-use-with-args.response.sse")
                .unwrap()
                .with_chunk_delay(Duration::from_millis(1)),
        );
        server.push(Reply::provider_fixture("anthropic/error-401-authentication.response.json").unwrap());
        let dir = provider_fixtures_dir().join("anthropic");

        let response = send(&server, true).await;
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["anthropic-ratelimit-requests-limit"], "20000", "headers from meta.json");
        let expected = std::fs::read(dir.join("stream-thinking.response.sse")).unwrap();
        assert_eq!(response.bytes().await.unwrap().to_vec(), expected);

        let response = send(&server, true).await;
        let expected = std::fs::read(dir.join("stream-tool-use-with-args.response.sse")).unwrap();
        assert_eq!(response.bytes().await.unwrap().to_vec(), expected, "chunked serving keeps the bytes");

        let response = send(&server, true).await;
        assert_eq!(response.status(), 401);
        assert_eq!(response.headers()["x-should-retry"], "false");
        let expected = std::fs::read(dir.join("error-401-authentication.response.json")).unwrap();
        assert_eq!(response.bytes().await.unwrap().to_vec(), expected);

        let gemini = MockServer::start(Protocol::Gemini).await;
        gemini.push(
            Reply::provider_fixture("gemini/error-429-resource-exhausted.response.json").unwrap().with_status(429),
        );
        assert_eq!(send(&gemini, true).await.status(), 429, "body-only fixtures take a given status");
        assert!(Reply::provider_fixture("anthropic/no-such-case.response.sse").is_err());
    })
    .await;
}

#[tokio::test]
async fn raw_bodies_are_served_as_given_and_still_take_faults() {
    within_deadline(async {
        let server = MockServer::start(Protocol::OpenAi).await;
        let stream = "data: {\"a\":1}\n\ndata: {\"a\":2}\n\ndata: [DONE]\n\n";
        server.push(Reply::raw_sse(stream));
        server.push(Reply::raw_sse(stream).with_fault(Fault::ResetAfterChunks(1)));
        server.push(Reply::raw_json(402, r#"{"error":{"message":"pay up"}}"#));
        let response = send(&server, true).await;
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        assert_eq!(response.text().await.unwrap(), stream);
        let (received, how) = read_until_quiet(send(&server, true).await, Duration::from_secs(5)).await;
        assert_eq!((received.as_str(), how), ("data: {\"a\":1}\n\n", "failed"));
        let response = send(&server, false).await;
        assert_eq!(response.status(), 402);
        assert_eq!(response.text().await.unwrap(), r#"{"error":{"message":"pay up"}}"#);
    })
    .await;
}

// ---------------------------------------------------------------- faults

#[tokio::test]
async fn rate_limits_carry_each_providers_retry_hint() {
    within_deadline(async {
        for protocol in Protocol::ALL {
            let server = MockServer::start(protocol).await;
            server.push(Reply::fault(Fault::rate_limit(7)));
            let response = send(&server, true).await;
            assert_eq!(response.status(), 429, "{protocol}");
            let headers = response.headers().clone();
            let body: Value = response.json().await.unwrap();
            match protocol {
                Protocol::OpenAi => {
                    assert_eq!(headers["retry-after"], "7");
                    assert_eq!(headers["retry-after-ms"], "7000");
                    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
                }
                Protocol::Anthropic => {
                    assert_eq!(headers["retry-after"], "7");
                    assert_eq!(body["type"], "error");
                    assert_eq!(body["error"]["type"], "rate_limit_error");
                }
                Protocol::Gemini => {
                    assert!(headers.get("retry-after").is_none(), "Gemini has no retry-after header");
                    assert_eq!(body["error"]["status"], "RESOURCE_EXHAUSTED");
                    let retry =
                        body["error"]["details"].as_array().unwrap().iter().find(|d| d.get("retryDelay").is_some());
                    assert_eq!(retry.unwrap()["retryDelay"], "7s");
                }
            }
        }
    })
    .await;
}

#[tokio::test]
async fn error_statuses_come_in_each_providers_shape() {
    within_deadline(async {
        // (fault, status per protocol [openai, anthropic, gemini], error kind per protocol)
        let cases = [
            (Fault::server_error(), [500, 500, 500], ["server_error", "api_error", "INTERNAL"]),
            (Fault::unavailable(), [503, 503, 503], ["server_error", "api_error", "UNAVAILABLE"]),
            (Fault::overloaded(), [503, 529, 503], ["server_error", "overloaded_error", "UNAVAILABLE"]),
            (
                Fault::context_length(),
                [400, 400, 400],
                ["invalid_request_error", "invalid_request_error", "INVALID_ARGUMENT"],
            ),
        ];
        for (fault, statuses, kinds) in cases {
            for (position, protocol) in Protocol::ALL.into_iter().enumerate() {
                let server = MockServer::start(protocol).await;
                server.push(Reply::fault(fault.clone()));
                let response = send(&server, true).await;
                assert_eq!(response.status().as_u16(), statuses[position], "{protocol} {fault:?}");
                let body: Value = response.json().await.unwrap();
                let kind = match protocol {
                    Protocol::OpenAi => &body["error"]["type"],
                    Protocol::Anthropic => &body["error"]["type"],
                    Protocol::Gemini => &body["error"]["status"],
                };
                assert_eq!(kind, kinds[position], "{protocol} {fault:?}: {body}");
                if fault == Fault::ContextLength {
                    let message = body["error"]["message"].as_str().unwrap();
                    match protocol {
                        Protocol::OpenAi => assert_eq!(body["error"]["code"], "context_length_exceeded"),
                        Protocol::Anthropic => assert!(message.starts_with("prompt is too long")),
                        Protocol::Gemini => assert!(message.contains("exceeds the maximum number of tokens")),
                    }
                }
            }
        }
    })
    .await;
}

#[tokio::test]
async fn gemini_json_array_errors_are_wrapped_in_an_array_and_extra_headers_ride_along() {
    within_deadline(async {
        let server = MockServer::start(Protocol::Gemini).await;
        server.push(Reply::fault(Fault::server_error()).with_header("x-mock-trace", "abc"));
        let url = format!("{}/models/gemini-2.5-flash:streamGenerateContent", server.base_url());
        let response = client().post(url).json(&json!({"contents": []})).send().await.unwrap();
        assert_eq!(response.status(), 500);
        assert_eq!(response.headers()["x-mock-trace"], "abc");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body[0]["error"]["status"], "INTERNAL", "{body}");
    })
    .await;
}

#[tokio::test]
async fn a_custom_status_is_served_as_given() {
    within_deadline(async {
        let server = MockServer::start(Protocol::OpenAi).await;
        server.push(Reply::fault(Fault::Status {
            status: 418,
            body: "{\"error\":{\"message\":\"teapot\"}}".to_owned(),
            headers: vec![("x-custom".to_owned(), "yes".to_owned())],
        }));
        let response = send(&server, true).await;
        assert_eq!(response.status(), 418);
        assert_eq!(response.headers()["x-custom"], "yes");
        assert_eq!(response.headers()["content-type"], "application/json");
        assert_eq!(response.text().await.unwrap(), "{\"error\":{\"message\":\"teapot\"}}");
    })
    .await;
}

#[tokio::test]
async fn a_hang_before_headers_makes_the_client_time_out() {
    within_deadline(async {
        for protocol in Protocol::ALL {
            let server = MockServer::start(protocol).await;
            server.push(Reply::fault(Fault::HangBeforeHeaders));
            let (url, body) = chat_request(&server, true);
            let started = Instant::now();
            let result = client().post(url).timeout(Duration::from_millis(200)).json(&body).send().await;
            let error = result.expect_err("a hanging server never answers");
            assert!(error.is_timeout(), "{protocol}: {error}");
            assert!(started.elapsed() >= Duration::from_millis(200));
            assert_eq!(server.call_count(), 1, "the request itself arrived");
        }
    })
    .await;
}

/// Reads a streaming body chunk by chunk until it ends, fails, or goes
/// quiet for `quiet`; returns what arrived and how it stopped.
async fn read_until_quiet(mut response: reqwest::Response, quiet: Duration) -> (String, &'static str) {
    let mut received = Vec::new();
    loop {
        match tokio::time::timeout(quiet, response.chunk()).await {
            Err(_) => return (String::from_utf8(received).unwrap(), "quiet"),
            Ok(Ok(Some(bytes))) => received.extend_from_slice(&bytes),
            Ok(Ok(None)) => return (String::from_utf8(received).unwrap(), "ended"),
            Ok(Err(_)) => return (String::from_utf8(received).unwrap(), "failed"),
        }
    }
}

#[tokio::test]
async fn a_stall_keeps_the_connection_open_and_silent() {
    within_deadline(async {
        for protocol in Protocol::ALL {
            let server = MockServer::start(protocol).await;
            server.push(Reply::fault(Fault::StallAfterChunks(3)));
            let response = send(&server, true).await;
            assert_eq!(response.status(), 200);
            let (received, how) = read_until_quiet(response, Duration::from_millis(300)).await;
            assert_eq!(how, "quiet", "{protocol}");
            assert_eq!(parse_sse(&received).len(), 3, "{protocol}: exactly three chunks before the stall");
            // Shutting down cuts the stall instead of waiting on it forever.
            tokio::time::timeout(Duration::from_secs(2), server.shutdown()).await.expect("shutdown ends stalls");
        }
    })
    .await;
}

#[tokio::test]
async fn a_reset_is_a_body_error_without_the_terminating_chunk() {
    within_deadline(async {
        for protocol in Protocol::ALL {
            let server = MockServer::start(protocol).await;
            server.push(Reply::fault(Fault::ResetAfterChunks(2)));
            server.push(Reply::fault(Fault::ResetAfterChunks(1000)));
            let response = send(&server, true).await;
            assert_eq!(response.status(), 200);
            let (received, how) = read_until_quiet(response, Duration::from_secs(5)).await;
            assert_eq!(how, "failed", "{protocol}");
            assert_eq!(parse_sse(&received).len(), 2, "{protocol}");

            // Even a count past the end never sends the terminator.
            let error = send(&server, true).await.text().await.expect_err("the body fails");
            assert!(error.is_body() || error.is_decode(), "{protocol}: {error}");
        }
        let server = MockServer::start(Protocol::OpenAi).await;
        server.push(Reply::fault(Fault::ResetAfterChunks(1000)));
        let (received, how) = read_until_quiet(send(&server, true).await, Duration::from_secs(5)).await;
        assert_eq!(how, "failed");
        assert!(!received.contains("[DONE]") && received.contains("\"usage\":{"), "{received}");
    })
    .await;
}

#[tokio::test]
async fn a_malformed_chunk_is_invalid_json_in_a_valid_frame() {
    within_deadline(async {
        for protocol in Protocol::ALL {
            let server = MockServer::start(protocol).await;
            server.push(Reply::fault(Fault::MalformedChunk(1)));
            let body = send(&server, true).await.text().await.unwrap();
            let events = parse_sse(&body);
            for (index, event) in events.iter().enumerate() {
                let parsed = serde_json::from_str::<Value>(&event.data);
                if index == 1 {
                    assert!(parsed.is_err(), "{protocol}: chunk 1 must be broken: {}", event.data);
                } else if event.data != "[DONE]" {
                    assert!(parsed.is_ok(), "{protocol}: chunk {index} must parse: {}", event.data);
                }
            }
        }
        // A JSON reply is broken too.
        let server = MockServer::start(Protocol::Anthropic).await;
        server.push(Reply::fault(Fault::MalformedChunk(0)));
        let body = send(&server, false).await.bytes().await.unwrap();
        assert!(serde_json::from_slice::<Value>(&body).is_err());
    })
    .await;
}

#[tokio::test]
async fn a_slow_drip_delays_every_chunk_but_delivers_everything() {
    within_deadline(async {
        let server = MockServer::start(Protocol::OpenAi).await;
        server.push(Reply::text("one two three").with_fault(Fault::SlowDrip(Duration::from_millis(20))));
        let started = Instant::now();
        let said = read_openai_stream(&send(&server, true).await.text().await.unwrap());
        assert_eq!(said.text, "one two three");
        // 7 chunks (role, 3 words, finish, usage, [DONE]), two writes each.
        assert!(started.elapsed() >= Duration::from_millis(14 * 20), "{:?}", started.elapsed());
    })
    .await;
}

#[tokio::test]
async fn chunk_and_header_delays_are_real() {
    within_deadline(async {
        let server = MockServer::start(Protocol::Anthropic).await;
        server.push(
            Reply::text("a b")
                .with_header_delay(Duration::from_millis(150))
                .with_chunk_delay(Duration::from_millis(10)),
        );
        let started = Instant::now();
        let response = send(&server, true).await;
        assert!(started.elapsed() >= Duration::from_millis(150), "headers waited");
        let said = read_anthropic_stream(&response.text().await.unwrap());
        assert_eq!(said.text, "a b");
        // message_start, block start, ping, 2 deltas, stop, message_delta, message_stop.
        assert!(started.elapsed() >= Duration::from_millis(150 + 7 * 10), "{:?}", started.elapsed());
    })
    .await;
}

#[tokio::test]
async fn in_stream_errors_use_each_providers_event() {
    within_deadline(async {
        for protocol in Protocol::ALL {
            let server = MockServer::start(protocol).await;
            server.push(Reply::fault(Fault::in_stream_error()));
            let response = send(&server, true).await;
            assert_eq!(response.status(), 200, "{protocol}: the error comes inside a 200 stream");
            let events = parse_sse(&response.text().await.unwrap());
            assert_eq!(events.len(), 3, "{protocol}: two chunks, then the error, then nothing");
            let last = events.last().unwrap();
            let error: Value = serde_json::from_str(&last.data).unwrap();
            match protocol {
                Protocol::OpenAi => {
                    assert!(last.name.is_none());
                    assert_eq!(error["error"]["type"], "server_error");
                }
                Protocol::Anthropic => {
                    assert_eq!(last.name.as_deref(), Some("error"));
                    assert_eq!(error["type"], "error");
                    assert_eq!(error["error"]["type"], "overloaded_error");
                }
                Protocol::Gemini => {
                    assert_eq!(error["error"]["code"], 503);
                    assert_eq!(error["error"]["status"], "UNAVAILABLE");
                }
            }
        }
        // A non-streaming request gets the overloaded status instead.
        let server = MockServer::start(Protocol::Anthropic).await;
        server.push(Reply::fault(Fault::in_stream_error()));
        assert_eq!(send(&server, false).await.status(), 529);
    })
    .await;
}

#[tokio::test]
async fn dropping_the_server_stops_it() {
    within_deadline(async {
        let server = MockServer::start(Protocol::OpenAi).await;
        let url = server.url("/v1/chat/completions");
        drop(server);
        let mut refused = false;
        for _ in 0..50 {
            let result = client().post(&url).json(&json!({})).timeout(Duration::from_millis(200)).send().await;
            if result.is_err() {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(refused, "a dropped mock stops answering");
    })
    .await;
}

// ------------------------------------------------------------- the binary

/// Kills the benchmark binary however the test ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_benchmark_binary_serves_prebuilt_replies() {
    use std::io::BufRead;
    within_deadline(async {
        let mut child = Child(
            std::process::Command::new(env!("CARGO_BIN_EXE_arbor-mock"))
                .args(["--protocol", "gemini", "--listen", "127.0.0.1:0", "--chunks", "5", "--delay-ms", "50"])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
        // The banner is the first thing the binary prints, right after binding.
        let stdout = child.0.stdout.take().unwrap();
        let banner = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            std::io::BufReader::new(stdout).read_line(&mut line).map(|_| line)
        })
        .await
        .unwrap()
        .unwrap();
        let base_url = banner.split_whitespace().find(|word| word.starts_with("http://")).unwrap().to_owned();
        assert!(base_url.ends_with("/v1beta"), "{banner}");

        let started = Instant::now();
        let url = format!("{base_url}/models/gemini-2.5-flash:streamGenerateContent?alt=sse");
        let body = client().post(&url).json(&json!({"contents": []})).send().await.unwrap().text().await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(50));
        let said = read_gemini_stream(&body);
        assert_eq!(said.text, "token0 token1 token2 token3 token4");
        assert_eq!(said.text_deltas, 5);

        let url = format!("{base_url}/models/gemini-2.5-flash:generateContent");
        let body: Value =
            client().post(&url).json(&json!({"contents": []})).send().await.unwrap().json().await.unwrap();
        assert_eq!(read_json(Protocol::Gemini, &body).text, "token0 token1 token2 token3 token4");
        let response = client().post(format!("{base_url}/models/x:countTokens")).json(&json!({})).send().await.unwrap();
        assert_eq!(response.status(), 404);
    })
    .await;
}
