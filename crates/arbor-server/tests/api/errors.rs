//! Bad input of every kind gets a clear 4xx and changes nothing.

use arbor_testkit::{AppOptions, TestApp, spawn_app, spawn_app_with};
use reqwest::Method;
use serde_json::json;

/// How many messages the conversation's tree holds.
async fn stored_messages(app: &TestApp, key: &str, conversation: &str) -> usize {
    let tree = app.get(key, &format!("/v1/conversations/{conversation}")).await;
    tree.body["messages"].as_array().expect("messages").len()
}

#[tokio::test]
async fn missing_or_wrong_keys_are_refused_with_401() {
    let app = spawn_app().await;
    let response = app.client.get(app.url("/v1/conversations")).send().await.expect("sent");
    assert_eq!(response.status(), 401);
    let body: serde_json::Value = response.json().await.expect("json error body");
    assert_eq!(body["error"]["code"], "unauthorized");

    let wrong = app.get("arb_0000", "/v1/conversations").await;
    assert_eq!(wrong.status, 401);
    let malformed =
        app.client.get(app.url("/v1/models")).header("authorization", "Basic abc").send().await.expect("sent");
    assert_eq!(malformed.status(), 401);
    // Health needs no key.
    let health = app.client.get(app.url("/healthz")).send().await.expect("sent");
    assert_eq!(health.status(), 200);
}

#[tokio::test]
async fn malformed_json_and_unknown_fields_are_400_naming_the_problem() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let path = format!("/v1/conversations/{conversation}/messages");

    let broken = app.send_raw(&key, Method::POST, &path, "{\"content\": ".into()).await;
    assert_eq!(broken.status, 400, "{:?}", broken.body);
    assert_eq!(broken.body["error"]["code"], "invalid_json");

    let unknown = app.post(&key, &path, &json!({"content": "hi", "colour": "red"})).await;
    assert_eq!(unknown.status, 400);
    assert!(unknown.body["error"]["message"].as_str().expect("message").contains("colour"), "{:?}", unknown.body);

    let wrong_type = app.post(&key, &path, &json!({"content": 5})).await;
    assert_eq!(wrong_type.status, 400);

    let empty = app.post(&key, &path, &json!({"content": "   "})).await;
    assert_eq!(empty.status, 400);
    assert!(empty.body["error"]["message"].as_str().expect("message").contains("empty"));

    let bad_conversation = app.post(&key, "/v1/conversations", &json!({"title": "x", "extra": 1})).await;
    assert_eq!(bad_conversation.status, 400);

    // Nothing was written by any of these.
    assert_eq!(stored_messages(&app, &key, &conversation).await, 0);
    let list = app.get(&key, "/v1/conversations").await;
    assert_eq!(list.body["conversations"].as_array().expect("list").len(), 1);
}

#[tokio::test]
async fn someone_elses_conversation_is_404_exactly_like_a_missing_one() {
    let app = spawn_app().await;
    let alice = app.new_user("alice").await;
    let bob = app.new_user("bob").await;
    let conversation = app.new_conversation(&alice, json!({"title": "private"})).await;

    let theirs = app.get(&bob, &format!("/v1/conversations/{conversation}")).await;
    let missing = app.get(&bob, "/v1/conversations/does-not-exist").await;
    assert_eq!(theirs.status, 404);
    assert_eq!(theirs.body, missing.body, "no difference an attacker could see");

    let post = app.post(&bob, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "hi"})).await;
    assert_eq!(post.status, 404);
    let events = app.get(&bob, &format!("/v1/conversations/{conversation}/events")).await;
    assert_eq!(events.status, 404);
    let patch = app
        .send_raw(
            &bob,
            Method::PATCH,
            &format!("/v1/conversations/{conversation}"),
            json!({"title": "mine"}).to_string(),
        )
        .await;
    assert_eq!(patch.status, 404);
    let delete = app.send_raw(&bob, Method::DELETE, &format!("/v1/conversations/{conversation}"), String::new()).await;
    assert_eq!(delete.status, 404);

    // Bob's list does not show it; Alice's conversation is untouched.
    let list = app.get(&bob, "/v1/conversations").await;
    assert_eq!(list.body["conversations"].as_array().expect("list").len(), 0);
    let still = app.get(&alice, &format!("/v1/conversations/{conversation}")).await;
    assert_eq!(still.status, 200);
    assert_eq!(still.body["title"], "private");
}

#[tokio::test]
async fn unknown_models_are_400_naming_the_model() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let create = app.post(&key, "/v1/conversations", &json!({"model": "gpt-9-ultra"})).await;
    assert_eq!(create.status, 400);
    assert_eq!(create.body["error"]["code"], "unknown_model");
    assert!(create.body["error"]["message"].as_str().expect("message").contains("gpt-9-ultra"));

    let conversation = app.new_conversation(&key, json!({})).await;
    let path = format!("/v1/conversations/{conversation}/messages");
    let submit = app.post(&key, &path, &json!({"content": "hi", "model": "nope-1"})).await;
    assert_eq!(submit.status, 400);
    assert!(submit.body["error"]["message"].as_str().expect("message").contains("nope-1"));

    // A known model whose provider is not configured is refused too.
    let unconfigured = app.post(&key, &path, &json!({"content": "hi", "model": "gpt-4o"})).await;
    assert_eq!(unconfigured.status, 400);
    assert_eq!(unconfigured.body["error"]["code"], "model_unavailable");

    assert_eq!(stored_messages(&app, &key, &conversation).await, 0, "the message was not recorded");
}

#[tokio::test]
async fn a_body_over_the_limit_is_413() {
    let app =
        spawn_app_with(AppOptions { config_toml: "[server]\nmax_body_bytes = 2048\n".into(), ..AppOptions::default() })
            .await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let path = format!("/v1/conversations/{conversation}/messages");
    let big = app.post(&key, &path, &json!({"content": "x".repeat(4096)})).await;
    assert_eq!(big.status, 413, "{:?}", big.body);
    assert_eq!(big.body["error"]["code"], "payload_too_large");
    assert_eq!(stored_messages(&app, &key, &conversation).await, 0);
}

#[tokio::test]
async fn a_body_not_declared_json_is_415_and_nothing_is_written() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let path = format!("/v1/conversations/{conversation}/messages");
    let send = |content_type: Option<&'static str>| {
        let mut request = app.client.post(app.url(&path)).bearer_auth(&key).body(r#"{"content": "hi", "run": false}"#);
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        request.send()
    };
    for refused in [None, Some("text/plain"), Some("application/jsonx"), Some("json")] {
        let response = send(refused).await.expect("sent");
        assert_eq!(response.status(), 415, "{refused:?}");
        let body: serde_json::Value = response.json().await.expect("json error body");
        assert_eq!(body["error"]["code"], "unsupported_media_type", "{refused:?}");
    }
    assert_eq!(stored_messages(&app, &key, &conversation).await, 0);
    for accepted in ["application/json", "Application/JSON; charset=utf-8", "application/vnd.arbor+json"] {
        let response = send(Some(accepted)).await.expect("sent");
        assert_eq!(response.status(), 201, "{accepted}");
    }
}

#[tokio::test]
async fn bad_query_parameters_are_400() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let cursor = app.get(&key, "/v1/conversations?cursor=garbage").await;
    assert_eq!(cursor.status, 400);
    let limit = app.get(&key, "/v1/conversations?limit=many").await;
    assert_eq!(limit.status, 400);
    let conversation = app.new_conversation(&key, json!({})).await;
    let visibility = app.get(&key, &format!("/v1/conversations/{conversation}/events?visibility=loud")).await;
    assert_eq!(visibility.status, 400);
}
