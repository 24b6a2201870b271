//! The Gemini adapter over real HTTP, against a tiny loopback server that
//! speaks the generateContent wire protocol: it proves the URLs and the key
//! header, a streamed reply delivered in pieces (SSE, and the JSON-array
//! form when the server ignores `alt=sse`), a non-streamed reply, a
//! two-round tool loop whose second request carries the first reply's
//! `thoughtSignature` unchanged, and the mapping of 503 and 429 answers.

mod common;

use std::time::Duration;

use arbor_core::{ErrorCode, Message, SharedMessage, ToolStatus};
use arbor_providers::gemini::{GeminiConfig, GeminiProvider};
use arbor_providers::http::HttpTimeouts;
use arbor_providers::{ChatRequest, FinishReason, Provider, ToolSpec, collect_stream};
use common::{Mock, Reply, read, serve, within};
use serde_json::json;

const RECORDED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/providers/gemini");
const WRITTEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gemini");

/// The content types Gemini answers with.
impl Reply {
    fn sse(body: Vec<u8>) -> Reply {
        Reply::new(200, "text/event-stream", body)
    }

    fn json(status: u16, body: Vec<u8>) -> Reply {
        Reply::new(status, "application/json; charset=UTF-8", body)
    }
}

async fn start(replies: Vec<Reply>) -> (Mock, GeminiProvider) {
    let (mock, address) = serve(replies, 5).await;
    let provider = GeminiProvider::new(GeminiConfig {
        base_url: format!("http://{address}/v1beta"),
        api_key: Some("AIza-test".into()),
        timeouts: HttpTimeouts { connect: Duration::from_secs(2), read_idle: Duration::from_secs(5) },
    })
    .expect("provider");
    (mock, provider)
}

fn ask(model: &str, text: &str) -> ChatRequest {
    ChatRequest { model: model.into(), messages: SharedMessage::all([Message::user(text)]), ..ChatRequest::default() }
}

#[tokio::test]
async fn streams_with_the_right_url_key_and_body() {
    within(async {
        let (mock, provider) = start(vec![Reply::sse(read(RECORDED, "stream-text-sse.response.sse"))]).await;
        assert_eq!(provider.kind(), "gemini");
        let mut request = ask("gemini-2.5-flash", "What is the capital of France?");
        request.system = Some("You are a helpful chatbot.".into());
        let reply = collect_stream(provider.stream(request).await.expect("starts")).await.expect("streams");
        assert_eq!(reply.text, "The capital of France is Paris.\n");
        assert_eq!(reply.finish, Some(FinishReason::Stop));

        let received = mock.received.lock().expect("lock");
        let call = &received[0];
        assert_eq!(call.uri.path(), "/v1beta/models/gemini-2.5-flash:streamGenerateContent");
        assert_eq!(call.uri.query(), Some("alt=sse"));
        assert_eq!(call.headers["x-goog-api-key"], "AIza-test");
        assert_eq!(call.headers["content-type"], "application/json");
        assert!(call.uri.query().is_none_or(|query| !query.contains("key=")), "the key never travels in the URL");
        assert_eq!(call.body["systemInstruction"], json!({"parts": [{"text": "You are a helpful chatbot."}]}));
    })
    .await;
}

#[tokio::test]
async fn a_json_array_stream_is_read_when_the_server_sends_one() {
    within(async {
        let (_mock, provider) =
            start(vec![Reply::json(200, read(RECORDED, "stream-json-array-thinking.response.json"))]).await;
        let reply = collect_stream(
            provider.stream(ask("gemini-flash-latest", "Name for a pet pelican")).await.expect("starts"),
        )
        .await
        .expect("streams");
        assert_eq!(reply.text, "Scoop");
    })
    .await;
}

#[tokio::test]
async fn complete_uses_generate_content() {
    within(async {
        let (mock, provider) = start(vec![Reply::json(200, read(RECORDED, "generate-text.response.json"))]).await;
        let reply = provider.complete(ask("models/gemini-2.5-flash", "Hello!")).await.expect("completes");
        assert_eq!(reply.text, "Hello! How can I help you today?");
        let received = mock.received.lock().expect("lock");
        assert_eq!(received[0].uri.path(), "/v1beta/models/gemini-2.5-flash:generateContent");
        assert_eq!(received[0].uri.query(), None);
    })
    .await;
}

#[tokio::test]
async fn a_tool_loop_sends_the_thought_signature_back_unchanged() {
    within(async {
        let round_one = read(RECORDED, "stream-function-call-thought-signature.response.sse");
        let signature = String::from_utf8(round_one.clone())
            .expect("utf-8")
            .split("\"thoughtSignature\": \"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .expect("recorded signature")
            .to_string();
        let (mock, provider) = start(vec![
            Reply::sse(round_one),
            Reply::sse(read(RECORDED, "stream-text-after-function-response.response.sse")),
        ])
        .await;
        let mut request = ask("gemini-3-pro-preview", "What is the capital of the user country? Call the tool");
        request.tools = vec![ToolSpec {
            name: "get_country".into(),
            description: String::new(),
            parameters: json!({"type": "object", "properties": {}}),
        }];
        let first = collect_stream(provider.stream(request.clone()).await.expect("starts")).await.expect("round one");
        assert_eq!(first.finish, Some(FinishReason::ToolCalls));
        let call = first.tool_calls[0].clone();
        request.messages.push(first.message().into());
        request.messages.push(Message::tool_result(&call, ToolStatus::Success, "Mexico").into());
        let second = collect_stream(provider.stream(request).await.expect("starts")).await.expect("round two");
        assert_eq!(second.text, "The capital of Mexico is Mexico City.");

        let received = mock.received.lock().expect("lock");
        let contents = &received[1].body["contents"];
        assert_eq!(
            contents[1],
            json!({"role": "model", "parts": [{
                "functionCall": {"id": call.id, "name": "get_country", "args": {}},
                "thoughtSignature": signature
            }]})
        );
        assert_eq!(
            contents[2],
            json!({"role": "user", "parts": [{"functionResponse": {
                "id": call.id, "name": "get_country", "response": {"output": "Mexico"}
            }}]})
        );
        // A parameterless tool is declared without `parameters`.
        assert_eq!(
            received[1].body["tools"],
            json!([{"functionDeclarations": [{"name": "get_country", "description": ""}]}])
        );
    })
    .await;
}

#[tokio::test]
async fn status_503_is_overloaded_and_429_waits_as_told() {
    within(async {
        let (_mock, provider) = start(vec![
            Reply::json(503, read(WRITTEN, "error-503-unavailable.response.json")),
            Reply::json(429, read(RECORDED, "error-429-resource-exhausted.response.json")),
            Reply::json(500, read(WRITTEN, "error-500-internal.response.json")),
        ])
        .await;
        let request = ask("gemini-2.5-flash", "hi");
        let error = provider.stream(request.clone()).await.err().expect("503 fails before the stream");
        assert_eq!(error.code, ErrorCode::Overloaded);
        assert_eq!(error.status, Some(503));
        let error = provider.stream(request.clone()).await.err().expect("429 fails");
        assert_eq!(error.code, ErrorCode::RateLimit);
        assert_eq!(error.retry_after, Some(Duration::from_millis(34_400)));
        let error = provider.complete(request).await.expect_err("500 fails");
        assert_eq!(error.code, ErrorCode::ProviderUnavailable);
        assert!(error.code.is_transient());
    })
    .await;
}
