//! The OpenAI adapter over real HTTP, against a small OpenAI-speaking server
//! on a loopback port: what it sends (path, bearer key, body), streaming,
//! the non-streamed call, and the failures a real provider produces — a 429
//! with `retry-after`, a 500, a server that goes silent before its headers or
//! in the middle of a stream (which must end in `timeout`, never a hang).
//!
//! Timeouts here are real but short (a few hundred milliseconds): the client
//! and server talk over real sockets, where tokio's paused clock would fire
//! timers while bytes are still in flight.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arbor_core::{ErrorCode, Message, ProviderError, SharedMessage};
use arbor_providers::http::HttpTimeouts;
use arbor_providers::openai::{OpenAiConfig, OpenAiProvider};
use arbor_providers::{ChatRequest, Chunk, ChunkStream, FinishReason, Provider, collect_stream};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};

/// What the mock server saw of one request.
#[derive(Debug, Clone)]
struct Seen {
    authorization: Option<String>,
    accept: Option<String>,
    custom: Option<String>,
    body: Value,
}

type Log = Arc<Mutex<Vec<Seen>>>;

const TEXT_STREAM: &str = concat!(
    ": keep-alive comment\n\n",
    "data: {\"choices\":[],\"usage\":null}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" world\"},\"finish_reason\":null}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\n",
    "data: [DONE]\n\n",
);

/// The server's behaviour is chosen by the requested model, so one server
/// plays every scenario.
async fn chat_completions(State(log): State<Log>, headers: HeaderMap, body: Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let text = |name: header::HeaderName| headers.get(name).and_then(|value| value.to_str().ok()).map(str::to_string);
    log.lock().expect("log").push(Seen {
        authorization: text(header::AUTHORIZATION),
        accept: text(header::ACCEPT),
        custom: text(header::HeaderName::from_static("x-custom")),
        body: body.clone(),
    });
    let sse = |body: Body| {
        Response::builder().header(header::CONTENT_TYPE, "text/event-stream").body(body).expect("response")
    };
    match body["model"].as_str().unwrap_or_default() {
        "text" => sse(Body::from(TEXT_STREAM)),
        "complete" => axum::Json(json!({
            "id": "chatcmpl-1", "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "Hi there"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        }))
        .into_response(),
        "ignores-stream" => axum::Json(json!({
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "not streamed"}}]
        }))
        .into_response(),
        "rate-limited" => (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "7")],
            axum::Json(json!({"error": {
                "message": "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Used 30000, Requested 10.",
                "type": "tokens", "param": null, "code": "rate_limit_exceeded"
            }})),
        )
            .into_response(),
        "broken" => (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(json!({"error": {
                "message": "The server had an error while processing your request. Sorry about that!",
                "type": "server_error", "param": null, "code": null
            }})),
        )
            .into_response(),
        "overloaded" => (
            StatusCode::SERVICE_UNAVAILABLE,
            "upstream overloaded, try again",
        )
            .into_response(),
        "stalls-mid-stream" => {
            let first = stream::once(async {
                Ok::<_, Infallible>(Bytes::from_static(
                    b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
                ))
            });
            sse(Body::from_stream(first.chain(stream::pending())))
        }
        "hangs-up-mid-stream" => {
            let first = stream::once(async {
                Ok::<_, Infallible>(Bytes::from_static(
                    b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
                ))
            });
            sse(Body::from_stream(first))
        }
        "silent" => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            sse(Body::from(TEXT_STREAM))
        }
        other => (StatusCode::NOT_FOUND, format!("no scenario {other}")).into_response(),
    }
}

struct MockServer {
    base_url: String,
    log: Log,
}

async fn spawn_server() -> MockServer {
    let log: Log = Arc::default();
    let router = Router::new().route("/v1/chat/completions", post(chat_completions)).with_state(log.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move {
        axum::serve(listener, router).await.expect("serve");
    });
    MockServer { base_url: format!("http://{address}/v1"), log }
}

fn provider(server: &MockServer, key: Option<&str>) -> OpenAiProvider {
    OpenAiProvider::new(OpenAiConfig {
        base_url: server.base_url.clone(),
        api_key: key.map(Into::into),
        timeouts: HttpTimeouts { connect: Duration::from_secs(2), read_idle: Duration::from_millis(300) },
        extra_headers: vec![("x-custom".into(), "yes".into())],
        ..OpenAiConfig::default()
    })
    .expect("valid config")
}

fn chat(model: &str) -> ChatRequest {
    ChatRequest {
        model: model.into(),
        system: Some("be brief".into()),
        messages: SharedMessage::all([Message::user("hi")]),
        ..ChatRequest::default()
    }
}

/// Reads a stream to its end, but never for long: a hang is a failure.
async fn drain(stream: ChunkStream) -> Vec<Result<Chunk, ProviderError>> {
    tokio::time::timeout(Duration::from_secs(10), stream.collect::<Vec<_>>())
        .await
        .expect("the stream ends instead of hanging")
}

#[tokio::test]
async fn streams_a_reply_with_the_bearer_key_to_chat_completions() {
    let server = spawn_server().await;
    let provider = provider(&server, Some("sk-test-123"));
    let stream = provider.stream(chat("text")).await.expect("starts");
    let reply = collect_stream(stream).await.expect("streams");
    assert_eq!(reply.text, "Hello world");
    assert_eq!(reply.finish, Some(FinishReason::Stop));
    let usage = reply.usage.expect("usage");
    assert_eq!((usage.input_tokens, usage.output_tokens), (5, 2));

    let seen = server.log.lock().expect("log")[0].clone();
    assert_eq!(seen.authorization.as_deref(), Some("Bearer sk-test-123"));
    assert_eq!(seen.accept.as_deref(), Some("text/event-stream"));
    assert_eq!(seen.custom.as_deref(), Some("yes"));
    assert_eq!(seen.body["stream"], true);
    assert_eq!(seen.body["stream_options"], json!({"include_usage": true}));
    assert_eq!(
        seen.body["messages"],
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    );
}

#[tokio::test]
async fn a_local_server_without_key_gets_no_authorization_header() {
    let server = spawn_server().await;
    let reply = provider(&server, None).complete(chat("complete")).await.expect("completes");
    assert_eq!(reply.text, "Hi there");
    assert_eq!(reply.usage.map(|usage| usage.output_tokens), Some(2));
    let seen = server.log.lock().expect("log")[0].clone();
    assert_eq!(seen.authorization, None);
    assert_eq!(seen.body["stream"], false);
    assert!(seen.body.get("stream_options").is_none());
}

#[tokio::test]
async fn a_server_that_ignores_stream_true_is_still_read() {
    let server = spawn_server().await;
    let stream = provider(&server, None).stream(chat("ignores-stream")).await.expect("starts");
    let reply = collect_stream(stream).await.expect("reads");
    assert_eq!(reply.text, "not streamed");
}

#[tokio::test]
async fn http_429_is_a_rate_limit_with_retry_after() {
    let server = spawn_server().await;
    let provider = provider(&server, Some("k"));
    for error in
        [provider.stream(chat("rate-limited")).await.err(), provider.complete(chat("rate-limited")).await.err()]
    {
        let error = error.expect("fails");
        assert_eq!(error.code, ErrorCode::RateLimit);
        assert_eq!(error.retry_after, Some(Duration::from_secs(7)));
        assert_eq!(error.status, Some(429));
        assert!(error.message.starts_with("Rate limit reached for gpt-4o"));
    }
}

#[tokio::test]
async fn http_500_and_503_are_provider_failures() {
    let server = spawn_server().await;
    let provider = provider(&server, Some("k"));
    let error = provider.stream(chat("broken")).await.err().expect("fails");
    assert_eq!(error.code, ErrorCode::ProviderUnavailable);
    assert_eq!(error.status, Some(500));
    assert!(error.message.starts_with("The server had an error"));
    assert!(error.code.is_transient());

    let error = provider.stream(chat("overloaded")).await.err().expect("fails");
    assert_eq!(error.code, ErrorCode::Overloaded, "{error}");
    assert!(error.message.contains("upstream overloaded"));
}

#[tokio::test]
async fn a_stall_mid_stream_ends_in_timeout_not_a_hang() {
    let server = spawn_server().await;
    let stream = provider(&server, None).stream(chat("stalls-mid-stream")).await.expect("headers arrive");
    let items = drain(stream).await;
    assert_eq!(items[0], Ok(Chunk::Text("Hel".into())));
    let error = items.last().and_then(|item| item.as_ref().err()).expect("an error");
    assert_eq!(error.code, ErrorCode::Timeout, "{error}");
}

#[tokio::test]
async fn silence_before_the_headers_ends_in_timeout() {
    let server = spawn_server().await;
    let error = tokio::time::timeout(Duration::from_secs(10), provider(&server, None).stream(chat("silent")))
        .await
        .expect("returns instead of hanging")
        .err()
        .expect("fails");
    assert_eq!(error.code, ErrorCode::Timeout, "{error}");
}

#[tokio::test]
async fn a_connection_closed_mid_reply_is_interrupted() {
    let server = spawn_server().await;
    let stream = provider(&server, None).stream(chat("hangs-up-mid-stream")).await.expect("starts");
    let items = drain(stream).await;
    assert_eq!(items[0], Ok(Chunk::Text("Hel".into())));
    let error = items.last().and_then(|item| item.as_ref().err()).expect("an error");
    assert_eq!(error.code, ErrorCode::StreamInterrupted, "{error}");
}

#[tokio::test]
async fn nothing_listening_is_provider_unavailable() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    drop(listener);
    let provider =
        OpenAiProvider::new(OpenAiConfig { base_url: format!("http://{address}/v1"), ..OpenAiConfig::default() })
            .expect("valid config");
    let error = provider.stream(chat("text")).await.err().expect("fails");
    assert_eq!(error.code, ErrorCode::ProviderUnavailable, "{error}");
}
