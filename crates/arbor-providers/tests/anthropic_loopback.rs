//! The Anthropic adapter over real HTTP, against a tiny loopback server that
//! speaks the Messages API wire protocol: it proves the URL and headers, a
//! streamed reply delivered in pieces, a non-streamed reply, a two-round
//! tool loop with thinking whose second request carries the first reply's
//! signed thinking block unchanged, and the mapping of 529 and 429 answers.

mod common;

use std::time::Duration;

use arbor_core::{ErrorCode, Message, Part, SharedMessage, ToolStatus};
use arbor_providers::anthropic::{AnthropicConfig, AnthropicProvider};
use arbor_providers::http::HttpTimeouts;
use arbor_providers::{ChatRequest, FinishReason, Provider, Reasoning, ToolSpec, collect_stream};
use common::{Mock, Reply, read, serve, within};
use futures_util::StreamExt;
use serde_json::json;

const RECORDED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/providers/anthropic");
const WRITTEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/anthropic");

/// The content types Anthropic answers with.
impl Reply {
    fn sse(body: Vec<u8>) -> Reply {
        Reply::new(200, "text/event-stream; charset=utf-8", body)
    }

    fn json(status: u16, body: Vec<u8>) -> Reply {
        Reply::new(status, "application/json", body)
    }
}

async fn start(replies: Vec<Reply>) -> (Mock, AnthropicProvider) {
    let (mock, address) = serve(replies, 7).await;
    let provider = AnthropicProvider::new(AnthropicConfig {
        base_url: format!("http://{address}/"),
        api_key: Some("sk-ant-test".into()),
        timeouts: HttpTimeouts { connect: Duration::from_secs(2), read_idle: Duration::from_secs(5) },
        ..AnthropicConfig::default()
    })
    .expect("provider");
    (mock, provider)
}

#[tokio::test]
async fn streams_with_the_right_url_headers_and_body() {
    within(async {
        let (mock, provider) = start(vec![Reply::sse(read(RECORDED, "stream-thinking.response.sse"))]).await;
        assert_eq!(provider.kind(), "anthropic");
        let request = ChatRequest {
            model: "claude-haiku-4-5".into(),
            system: Some("Be brief.".into()),
            messages: SharedMessage::all([Message::user("Two names for a pet pelican")]),
            reasoning: Some(Reasoning { effort: None, budget_tokens: Some(1024) }),
            ..ChatRequest::default()
        };
        let reply = collect_stream(provider.stream(request).await.expect("starts")).await.expect("streams");
        assert!(reply.text.starts_with("1. **Pouch**"));
        assert!(matches!(
            &reply.parts[..],
            [Part::Thinking { signature: Some(signature), .. }] if signature.provider == "anthropic"
        ));
        assert_eq!(reply.finish, Some(FinishReason::Stop));

        let received = mock.received.lock().expect("lock");
        let call = &received[0];
        assert_eq!(call.uri.path(), "/v1/messages");
        assert_eq!(call.headers["x-api-key"], "sk-ant-test");
        assert_eq!(call.headers["anthropic-version"], "2023-06-01");
        assert_eq!(call.headers["content-type"], "application/json");
        assert_eq!(call.body["stream"], true);
        assert_eq!(call.body["system"], "Be brief.");
        assert_eq!(call.body["model"], "claude-haiku-4-5");
        assert_eq!(call.body["thinking"], json!({"type": "enabled", "budget_tokens": 1024}));
    })
    .await;
}

#[tokio::test]
async fn complete_reads_a_non_streamed_reply() {
    within(async {
        let (mock, provider) =
            start(vec![Reply::json(200, read(RECORDED, "messages-tool-use-parallel.response.json"))]).await;
        let reply = provider
            .complete(ChatRequest {
                model: "claude-haiku-4-5".into(),
                messages: SharedMessage::all([Message::user("Who is the youngest?")]),
                ..ChatRequest::default()
            })
            .await
            .expect("completes");
        assert_eq!(reply.tool_calls.len(), 4);
        assert_eq!(reply.finish, Some(FinishReason::ToolCalls));
        assert_eq!(mock.received.lock().expect("lock")[0].body["stream"], false);
    })
    .await;
}

/// Round one of a tool loop: the recorded thinking block (with its real
/// signature) followed by a `tool_use` block, as Claude streams it.
fn thinking_then_tool_use() -> (Vec<u8>, String) {
    let recorded = String::from_utf8(read(RECORDED, "stream-thinking.response.sse")).expect("utf-8");
    // Keep the events up to the thinking block's content_block_stop.
    let end = recorded
        .find("event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1")
        .expect("the text block follows the thinking block");
    let mut body = recorded[..end].to_string();
    body.push_str(concat!(
        "event: content_block_start\n",
        "data: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_01Pelican\",\"name\":\"pelican_name_generator\",\"input\":{}}}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"style\\\": \"}}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\\\"brief\\\"}\"}}\n\n",
        "event: content_block_stop\n",
        "data: {\"type\":\"content_block_stop\",\"index\":1}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":90}}\n\n",
        "event: message_stop\n",
        "data: {\"type\":\"message_stop\"}\n\n",
    ));
    let signature = recorded
        .split("\"signature\":\"")
        .nth(2)
        .and_then(|rest| rest.split('"').next())
        .expect("signature_delta")
        .to_string();
    (body.into_bytes(), signature)
}

#[tokio::test]
async fn a_tool_loop_with_thinking_sends_the_signed_block_back_unchanged() {
    within(async {
        let (round_one, signature) = thinking_then_tool_use();
        let (mock, provider) = start(vec![
            Reply::sse(round_one),
            Reply::sse(read(RECORDED, "stream-text.response.sse")),
        ])
        .await;
        let tool = ToolSpec {
            name: "pelican_name_generator".into(),
            description: "Names pelicans".into(),
            parameters: json!({"type": "object", "properties": {"style": {"type": "string"}}}),
        };
        let mut request = ChatRequest {
            model: "claude-haiku-4-5".into(),
            messages: SharedMessage::all([Message::user("Two names for a pet pelican, be brief")]),
            tools: vec![tool],
            reasoning: Some(Reasoning {
                effort: None,
                budget_tokens: Some(1024),
            }),
            ..ChatRequest::default()
        };
        let first = collect_stream(provider.stream(request.clone()).await.expect("starts"))
            .await
            .expect("round one");
        assert_eq!(first.finish, Some(FinishReason::ToolCalls));
        let call = first.tool_calls[0].clone();
        assert_eq!(call.arguments, json!({"style": "brief"}));
        request.messages.push(first.message().into());
        request.messages.push(Message::tool_result(&call, ToolStatus::Success, "Pouch").into());
        let second = collect_stream(provider.stream(request).await.expect("starts"))
            .await
            .expect("round two");
        assert_eq!(second.text, "Hello");

        let received = mock.received.lock().expect("lock");
        let replayed = &received[1].body["messages"][1];
        assert_eq!(replayed["role"], "assistant");
        assert_eq!(replayed["content"][0]["type"], "thinking");
        assert_eq!(replayed["content"][0]["signature"], signature.as_str());
        assert!(
            replayed["content"][0]["thinking"]
                .as_str()
                .expect("text")
                .starts_with("The user wants two names")
        );
        assert_eq!(
            replayed["content"][1],
            json!({"type": "tool_use", "id": "toolu_01Pelican", "name": "pelican_name_generator", "input": {"style": "brief"}})
        );
        assert_eq!(
            received[1].body["messages"][2],
            json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01Pelican", "content": "Pouch"}]})
        );
    })
    .await;
}

#[tokio::test]
async fn status_529_is_overloaded_and_429_carries_retry_after() {
    within(async {
        let mut rate_limited = Reply::json(429, read(WRITTEN, "error-429-rate-limit.response.json"));
        rate_limited.headers.push(("retry-after", "20".into()));
        let (_mock, provider) =
            start(vec![Reply::json(529, read(WRITTEN, "error-529-overloaded.response.json")), rate_limited]).await;
        let request = ChatRequest {
            model: "claude-haiku-4-5".into(),
            messages: SharedMessage::all([Message::user("hi")]),
            ..ChatRequest::default()
        };
        let error = provider.stream(request.clone()).await.err().expect("529 fails before the stream");
        assert_eq!(error.code, ErrorCode::Overloaded);
        assert_eq!(error.status, Some(529));
        assert_eq!(error.message, "Overloaded");
        let error = provider.complete(request).await.expect_err("429 fails");
        assert_eq!(error.code, ErrorCode::RateLimit);
        assert_eq!(error.retry_after, Some(Duration::from_secs(20)));
    })
    .await;
}

#[tokio::test]
async fn an_error_event_inside_a_200_stream_ends_it_with_the_code() {
    within(async {
        let (_mock, provider) = start(vec![Reply::sse(read(WRITTEN, "stream-error-overloaded.response.sse"))]).await;
        let mut stream = provider
            .stream(ChatRequest {
                model: "claude-haiku-4-5".into(),
                messages: SharedMessage::all([Message::user("hi")]),
                ..ChatRequest::default()
            })
            .await
            .expect("200 starts the stream");
        let mut items = Vec::new();
        while let Some(item) = stream.next().await {
            items.push(item);
        }
        assert_eq!(items.len(), 2);
        assert!(items[0].is_ok());
        assert_eq!(items[1].as_ref().map_err(|error| error.code).err(), Some(ErrorCode::Overloaded));
    })
    .await;
}
