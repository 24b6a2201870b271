//! Turns against real wire protocols: Arbor's adapters talking to loopback
//! mock OpenAI, Anthropic and Gemini servers, including their failures.

use std::time::Duration;

use arbor_testkit::mock::{Fault, MockServer, Protocol, Reply};
use arbor_testkit::{AppOptions, TestApp, spawn_app_with};
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(20);

/// Arbor with one mock per protocol, each serving a priced model.
struct Mocks {
    openai: MockServer,
    anthropic: MockServer,
    gemini: MockServer,
}

async fn app_with_mocks() -> (TestApp, Mocks) {
    let mocks = Mocks {
        openai: MockServer::start(Protocol::OpenAi).await,
        anthropic: MockServer::start(Protocol::Anthropic).await,
        gemini: MockServer::start(Protocol::Gemini).await,
    };
    let config = format!(
        r#"
default_model = "mock-gpt"
[providers.mockai]
kind = "openai"
base_url = "{openai}"
api_key_env = "MOCK_OPENAI_KEY"
read_timeout_secs = 2
[providers.mockclaude]
kind = "anthropic"
base_url = "{anthropic}"
api_key_env = "MOCK_ANTHROPIC_KEY"
[providers.mockgemini]
kind = "gemini"
base_url = "{gemini}"
api_key_env = "MOCK_GEMINI_KEY"
[models."mock-gpt"]
provider = "mockai"
upstream = "gpt-4o-mini"
context_window = 128000
vision = false
tools = true
prices = {{ input = 150000, output = 600000 }}
[models."claude-sonnet-4-5"]
provider = "mockclaude"
[models."gemini-2.5-flash"]
provider = "mockgemini"
"#,
        openai = mocks.openai.base_url(),
        anthropic = mocks.anthropic.base_url(),
        gemini = mocks.gemini.base_url(),
    );
    let env = vec![
        ("MOCK_OPENAI_KEY".to_string(), "sk-test-openai".to_string()),
        ("MOCK_ANTHROPIC_KEY".to_string(), "sk-ant-test".to_string()),
        ("MOCK_GEMINI_KEY".to_string(), "gemini-test".to_string()),
    ];
    let app = spawn_app_with(AppOptions { config_toml: config, env }).await;
    (app, mocks)
}

fn names(events: &[arbor_testkit::SseEvent]) -> Vec<&str> {
    events.iter().map(|event| event.event.as_str()).collect()
}

#[tokio::test]
async fn a_streamed_openai_turn_is_forwarded_stored_and_priced_from_reported_usage() {
    let (app, mocks) = app_with_mocks().await;
    mocks.openai.push(Reply::text_deltas(["Hel", "lo ", "from ", "the mock"]).with_usage(arbor_core::Usage {
        input_tokens: 1000,
        output_tokens: 200,
        ..Default::default()
    }));
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({"system_prompt": "be kind"})).await;
    let (status, events) = app
        .stream(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "hi"}), DEADLINE)
        .await;
    assert_eq!(status, 200);
    let deltas: String = events
        .iter()
        .filter(|event| event.event == "delta")
        .map(|event| event.data["text"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(deltas, "Hello from the mock");
    let done = events.last().expect("done");
    assert_eq!(done.event, "done", "{:?}", names(&events));
    // 1000 × $0.15/M + 200 × $0.60/M = 150 + 120 = 270 µ$.
    assert_eq!(done.data["cost_credits"], 270);
    assert_eq!(done.data["input_tokens"], 1000);
    assert_eq!(done.data["output_tokens"], 200);

    let call = mocks.openai.last_call().expect("the provider was called");
    assert_eq!(call.header("authorization"), Some("Bearer sk-test-openai"));
    assert_eq!(call.body["model"], "gpt-4o-mini", "the upstream name is sent");
    assert_eq!(call.body["stream"], true);
    assert_eq!(call.body["stream_options"]["include_usage"], true);
    assert_eq!(call.body["messages"][0], json!({"role": "system", "content": "be kind"}));
    assert_eq!(call.body["messages"][1]["role"], "user");

    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await.body;
    assert_eq!(tree["messages"][1]["content"], "Hello from the mock");
    assert_eq!(tree["messages"][1]["provider"], "mockai");
    assert_eq!(tree["messages"][1]["model"], "mock-gpt");
}

async fn failed_turn(app: &TestApp, conversation: &str) -> (Vec<arbor_testkit::SseEvent>, Value) {
    let key = app.admin_key.clone();
    let (_, events) = app
        .stream(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "doomed"}), DEADLINE)
        .await;
    let turn_id = events[0].data["turn_id"].as_str().expect("turn id").to_string();
    let turn = app.get(&key, &format!("/v1/conversations/{conversation}/turns/{turn_id}")).await.body;
    (events, turn)
}

#[tokio::test]
async fn a_provider_500_fails_the_turn_with_a_clear_error_and_keeps_the_message() {
    let (app, mocks) = app_with_mocks().await;
    mocks.openai.push(Reply::fault(Fault::server_error()));
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let (events, turn) = failed_turn(&app, &conversation).await;
    let error = events.last().expect("an error event");
    assert_eq!(error.event, "error", "{:?}", names(&events));
    assert_eq!(error.data["code"], "provider_unavailable");
    assert!(!error.data["message"].as_str().unwrap_or("").is_empty());
    assert_eq!(turn["status"], "failed");
    assert_eq!(turn["error"]["code"], "provider_unavailable");
    assert_eq!(turn["api_calls"][0]["status"], "error");
    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await.body;
    assert_eq!(tree["messages"].as_array().expect("messages").len(), 1, "the user message stays");
    assert_eq!(tree["messages"][0]["content"], "doomed");

    // In JSON mode the same failure is a 502 naming the provider's code.
    mocks.openai.push(Reply::fault(Fault::server_error()));
    let json_mode =
        app.post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "again"})).await;
    assert_eq!(json_mode.status, 502);
    assert_eq!(json_mode.body["error"]["code"], "provider_unavailable");
}

#[tokio::test]
async fn a_connection_cut_mid_stream_keeps_the_partial_answer_and_fails_the_turn() {
    let (app, mocks) = app_with_mocks().await;
    mocks
        .openai
        .push(Reply::text_deltas(["one ", "two ", "three ", "four ", "five"]).with_fault(Fault::ResetAfterChunks(3)));
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let (events, turn) = failed_turn(&app, &conversation).await;
    let error = events.last().expect("an error event");
    assert_eq!(error.event, "error", "{:?}", names(&events));
    assert_eq!(error.data["code"], "stream_interrupted");
    assert_eq!(turn["status"], "failed");
    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await.body;
    let messages = tree["messages"].as_array().expect("messages");
    assert_eq!(messages[0]["content"], "doomed");
    let partial = messages.get(1).expect("what streamed before the cut is kept");
    assert_eq!(partial["status"], "interrupted");
    let streamed: String = events
        .iter()
        .filter(|event| event.event == "delta")
        .map(|event| event.data["text"].as_str().unwrap_or(""))
        .collect();
    assert!(!streamed.is_empty());
    assert_eq!(partial["content"].as_str(), Some(streamed.as_str()), "exactly what the client saw");
}

#[tokio::test]
async fn rate_limits_pass_on_retry_after_and_a_stalled_stream_times_out() {
    let (app, mocks) = app_with_mocks().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    mocks.openai.push(Reply::fault(Fault::rate_limit(7)));
    let (events, _) = failed_turn(&app, &conversation).await;
    let error = events.last().expect("error");
    assert_eq!(error.data["code"], "rate_limit");
    assert_eq!(error.data["retry_after"], 7);
    let json_mode = {
        mocks.openai.push(Reply::fault(Fault::rate_limit(3)));
        app.post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "x"})).await
    };
    assert_eq!(json_mode.status, 429);

    // The provider read timeout is 2 s in this config: a stall ends the turn.
    mocks.openai.push(Reply::text_deltas(["a", "b", "c", "d"]).with_fault(Fault::StallAfterChunks(2)));
    let started = std::time::Instant::now();
    let (events, turn) = failed_turn(&app, &conversation).await;
    assert!(started.elapsed() < Duration::from_secs(10), "no hang");
    assert_eq!(events.last().expect("error").data["code"], "timeout");
    assert_eq!(turn["status"], "failed");
}

#[tokio::test]
async fn a_conversation_moves_from_openai_to_claude_to_gemini_and_each_gets_a_valid_history() {
    let (app, mocks) = app_with_mocks().await;
    mocks.openai.push(Reply::text("OpenAI answer"));
    mocks.anthropic.push(Reply::thinking("considering", "c2lnbmF0dXJl").then_text("Claude answer"));
    mocks.gemini.push(Reply::text("Gemini answer"));
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({"system_prompt": "You are terse."})).await;
    let path = format!("/v1/conversations/{conversation}/messages");
    let first = app.post(&key, &path, &json!({"content": "q1"})).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let second = app.post(&key, &path, &json!({"content": "q2", "model": "claude-sonnet-4-5"})).await;
    assert_eq!(second.status, 200, "{:?}", second.body);
    assert_eq!(second.body["message"]["provider"], "mockclaude");
    let third = app.post(&key, &path, &json!({"content": "q3", "model": "gemini-2.5-flash"})).await;
    assert_eq!(third.status, 200, "{:?}", third.body);
    assert_eq!(third.body["message"]["content"], "Gemini answer");

    // Claude: system at the top level, alternating user/assistant turns.
    let claude = mocks.anthropic.last_call().expect("claude called").body;
    assert_eq!(claude["system"], "You are terse.");
    let roles: Vec<&str> =
        claude["messages"].as_array().expect("messages").iter().map(|m| m["role"].as_str().unwrap_or("")).collect();
    assert_eq!(roles, ["user", "assistant", "user"]);
    assert!(claude["messages"][1].to_string().contains("OpenAI answer"));

    // Gemini: systemInstruction, user/model turns, and Claude's signed
    // thinking dropped (it belongs to Anthropic).
    let gemini = mocks.gemini.last_call().expect("gemini called").body;
    assert!(gemini["systemInstruction"].to_string().contains("You are terse."));
    let roles: Vec<&str> =
        gemini["contents"].as_array().expect("contents").iter().map(|c| c["role"].as_str().unwrap_or("")).collect();
    assert_eq!(roles, ["user", "model", "user", "model", "user"]);
    assert!(!gemini.to_string().contains("c2lnbmF0dXJl"), "another provider's signature is not sent");
    assert!(gemini["contents"][3].to_string().contains("Claude answer"));
    assert_eq!(mocks.openai.call_count(), 1);
}

#[tokio::test]
async fn an_image_for_a_model_without_vision_is_refused_before_any_call() {
    let (app, mocks) = app_with_mocks().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let response = app
        .post(
            &key,
            &format!("/v1/conversations/{conversation}/messages"),
            &json!({"messages": [{"role": "user", "content": "what is this?", "parts": [{"type": "image", "url": "https://example.invalid/cat.png"}]}]}),
        )
        .await;
    assert_eq!(response.status, 400, "{:?}", response.body);
    let message = response.body["error"]["message"].as_str().expect("message");
    assert!(message.contains("mock-gpt") && message.contains("vision"), "{message}");
    assert_eq!(mocks.openai.call_count(), 0);
    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await.body;
    assert_eq!(tree["messages"].as_array().expect("messages").len(), 0);
}

#[tokio::test]
async fn the_model_sees_messages_written_by_another_node_between_turns() {
    let (app, mocks) = app_with_mocks().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let path = format!("/v1/conversations/{conversation}/messages");
    let first = app.post(&key, &path, &json!({"content": "first question"})).await;
    assert_eq!(first.status, 200);
    // Another process appends to the same conversation directly in the store
    // (the head moves there), behind this node's in-memory tree.
    let reply_id = first.body["message"]["id"].as_str().expect("reply id").to_string();
    let outside = arbor_core::Node {
        id: "outside".into(),
        conversation_id: conversation.clone(),
        parent_id: Some(reply_id),
        message: arbor_core::Message::user("written elsewhere"),
        model: None,
        provider: None,
        turn_id: None,
        copied_from: None,
        status: Default::default(),
        created_at: arbor_core::ids::now_millis(),
    };
    app.engine.store().append_messages(&[outside], arbor_core::ids::now_millis()).await.expect("appended");
    let second = app.post(&key, &path, &json!({"content": "second question"})).await;
    assert_eq!(second.status, 200, "{:?}", second.body);
    let sent = mocks.openai.last_call().expect("called").body;
    let contents: Vec<&str> = sent["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|message| message["content"].as_str())
        .collect();
    assert_eq!(contents, ["first question", "mock reply", "written elsewhere", "second question"]);
}

#[tokio::test]
async fn a_limited_users_turn_refused_before_its_call_holds_no_credits() {
    let (app, mocks) = app_with_mocks().await;
    let key = app.new_user("limited").await;
    let user = app.user(&key).await;
    app.engine.store().set_balance(&user.id, Some(1_000_000)).await.expect("balance set");
    let conversation = app.new_conversation(&key, json!({})).await;
    let path = format!("/v1/conversations/{conversation}/messages");
    mocks.anthropic.push(Reply::text_deltas(["a cat"]));
    let first = app
        .post(
            &key,
            &path,
            &json!({"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "what is this?", "parts": [{"type": "image", "url": "https://example.invalid/cat.png"}]}]}),
        )
        .await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let balance = app.engine.store().user(&user.id).await.expect("read").expect("user").balance_credits;

    // The history now holds an image, which mock-gpt cannot read: the turn
    // fails before its call, after its start held credits for that call.
    let second = app.post(&key, &path, &json!({"model": "mock-gpt", "content": "and now?"})).await;
    assert_ne!(second.status, 200, "{:?}", second.body);
    assert!(second.body.to_string().contains("vision"), "{:?}", second.body);
    assert_eq!(mocks.openai.call_count(), 0);
    assert_eq!(
        app.engine.store().available_credits(&user.id).await.expect("read"),
        balance,
        "what was held for the call that was not made is given back"
    );
    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await.body;
    assert!(tree.to_string().contains("and now?"), "the user's message is kept: {tree}");
}
