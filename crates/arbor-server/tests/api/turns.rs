//! Turns on the offline demo model: the streamed protocol, the JSON mode,
//! what is stored, one turn at a time, cancel, disconnects, resuming, and
//! shutdown.

use std::time::Duration;

use arbor_testkit::{AppOptions, spawn_app, spawn_app_with};
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(20);

#[tokio::test]
async fn a_streamed_turn_sends_the_protocol_in_order_and_stores_everything() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({"title": "demo"})).await;
    let (status, events) = app
        .stream(
            &key,
            &format!("/v1/conversations/{conversation}/messages"),
            &json!({"content": "hello arbor"}),
            DEADLINE,
        )
        .await;
    assert_eq!(status, 200);

    let names: Vec<&str> = events.iter().map(|event| event.event.as_str()).collect();
    assert_eq!(&names[..3], ["turn.started", "message.new", "trace_start"]);
    assert_eq!(&names[names.len() - 3..], ["trace_end", "message.new", "done"]);
    let deltas: Vec<&Value> = events.iter().filter(|event| event.event == "delta").map(|event| &event.data).collect();
    assert!(deltas.len() >= 3, "the demo streams in several chunks");
    let ids: Vec<i64> = events.iter().map(|event| event.id.expect("every event has an id")).collect();
    assert!(ids.windows(2).all(|pair| pair[0] < pair[1]), "ids increase: {ids:?}");

    assert_eq!(events[1].data["message"]["content"], "hello arbor");
    assert_eq!(events[2].data["type"], "llm_request");
    let answer: String = deltas.iter().map(|delta| delta["text"].as_str().expect("text")).collect();
    assert!(answer.contains("demo model") && answer.contains("hello arbor"), "{answer}");

    let done = &events.last().expect("done").data;
    for field in [
        "message_id",
        "model",
        "input_tokens",
        "output_tokens",
        "thinking_tokens",
        "cached_tokens",
        "latency_ms",
        "cost_credits",
        "cost_cents_usd",
    ] {
        assert!(done.get(field).is_some(), "done carries {field}: {done}");
    }
    assert_eq!(done["model"], "demo");
    let trace_end = &events[events.len() - 3].data;
    assert_eq!(trace_end["cost_credits"], done["cost_credits"]);
    assert!(done["cost_credits"].as_i64().expect("credits") > 0);

    // Stored: both messages, the head on the reply, the turn with its call.
    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await;
    let messages = tree.body["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[1]["content"].as_str(), Some(answer.as_str()), "the stored reply is what was streamed");
    assert_eq!(messages[1]["parent_id"], messages[0]["id"]);
    assert_eq!(messages[1]["model"], "demo");
    assert_eq!(tree.body["head_id"], done["message_id"]);

    let turn_id = events[0].data["turn_id"].as_str().expect("turn id");
    let turn = app.get(&key, &format!("/v1/conversations/{conversation}/turns/{turn_id}")).await;
    assert_eq!(turn.body["status"], "succeeded");
    let calls = turn.body["api_calls"].as_array().expect("api calls");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["cost_credits"], done["cost_credits"]);
    assert_eq!(calls[0]["input_tokens"], done["input_tokens"]);
    // Right after `done`, before the event writer has stored them all.
    let trace: Vec<&str> =
        turn.body["trace"].as_array().expect("trace").iter().map(|e| e["event"].as_str().unwrap_or("")).collect();
    assert_eq!(trace, names, "the turn's trace is every event the client saw");
    let shown = turn.body["trace"].as_array().expect("trace").iter();
    for (event, seen) in shown.zip(&events) {
        assert_eq!((&event["id"], &event["data"]), (&json!(seen.id), &seen.data), "as the client saw it");
    }

    // The ledger charged exactly that.
    let user = app.user(&key).await;
    let ledger = app.engine.store().ledger(&user.id, 10).await.expect("ledger");
    assert_eq!(ledger.len(), 1);
    assert_eq!(ledger[0].credits, done["cost_credits"].as_i64().expect("credits"));

    // Every event the client saw can be rebuilt from the store.
    app.engine.flush_events().await;
    let stored = app.engine.store().events_after(&conversation, 0, 1000).await.expect("events");
    assert_eq!(stored.len(), events.len());
    for (stored, seen) in stored.iter().zip(&events) {
        assert_eq!(Some(stored.seq), seen.id);
        assert_eq!(stored.name.as_str(), seen.event);
        assert_eq!(stored.data_json(), seen.data);
    }
}

#[tokio::test]
async fn the_json_mode_waits_and_returns_the_turn_and_the_reply() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({"system_prompt": "be brief"})).await;
    let response = app
        .post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "ping", "id": "u1"}))
        .await;
    assert_eq!(response.status, 200, "{:?}", response.body);
    assert_eq!(response.body["turn"]["status"], "succeeded");
    assert_eq!(response.body["turn"]["user_message_id"], "u1");
    assert_eq!(response.body["message"]["role"], "assistant");
    assert_eq!(response.body["message"]["parent_id"], "u1");
    assert!(response.body["message"]["content"].as_str().expect("content").contains("ping"));
    assert!(response.body["turn"]["cost_credits"].as_i64().expect("cost") > 0);

    // A second message continues from the reply; re-using the id is refused.
    let again = app
        .post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "again", "id": "u1"}))
        .await;
    assert_eq!(again.status, 409);
    let second =
        app.post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "pong"})).await;
    assert_eq!(second.status, 200);
    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await;
    let messages = tree.body["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 4);
    assert_eq!(messages[2]["parent_id"], messages[1]["id"], "the next message hangs under the head");
}

#[tokio::test]
async fn json_replies_are_labelled_json_and_carry_any_text_exactly() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let text = "say \"hi\"\n\tback\\slash \u{1}\u{1f}\u{7f} é € 😀 </script>";
    let response = app
        .client
        .post(app.url(&format!("/v1/conversations/{conversation}/messages")))
        .bearer_auth(&key)
        .json(&json!({"content": text}))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    let body: Value = response.json().await.expect("json");
    assert!(body["message"]["content"].as_str().expect("content").contains(text), "{body}");

    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await;
    assert_eq!(tree.body["messages"][0]["content"], text, "stored and read back unchanged");
    // A lone backslash, in the middle of a longer plain run.
    let path = "C:\\Users\\arbor\\notes.txt";
    let reply = app.post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": path})).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert!(reply.body["message"]["content"].as_str().expect("content").contains(path), "{:?}", reply.body);
    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await;
    assert_eq!(tree.body["messages"][2]["content"], path);

    let missing = app.client.get(app.url("/v1/conversations/nope")).bearer_auth(&key).send().await.expect("sent");
    assert_eq!(missing.status(), 404);
    assert_eq!(missing.headers()["content-type"], "application/json");
}

#[tokio::test]
async fn a_conversation_sent_out_of_memory_comes_back_from_the_store() {
    // No quiet conversation is kept: loading another one sends the first
    // out of memory (its hub, event numbering and cached tree).
    let options = AppOptions { config_toml: "[server]\nidle_conversations_kept = 0\n".into(), ..AppOptions::default() };
    let app = spawn_app_with(options).await;
    let key = app.admin_key.clone();
    let loaded = || async {
        let metrics = app.client.get(app.url("/metrics")).send().await.expect("sent").text().await.expect("text");
        let line = metrics.lines().find(|line| line.starts_with("arbor_conversations_loaded ")).expect("the gauge");
        line["arbor_conversations_loaded ".len()..].parse::<usize>().expect("a count")
    };
    let first = app.new_conversation(&key, json!({})).await;
    let other = app.new_conversation(&key, json!({})).await;
    let turn = |conversation: &str, content: &str| {
        let path = format!("/v1/conversations/{conversation}/messages");
        let body = json!({"content": content});
        let app = &app;
        let key = &key;
        async move {
            let response = app.post(key, &path, &body).await;
            assert_eq!(response.status, 200, "{:?}", response.body);
        }
    };
    turn(&first, "one").await;
    app.engine.flush_events().await;
    assert_eq!(loaded().await, 1);
    let metrics = app.client.get(app.url("/metrics")).send().await.expect("sent").text().await.expect("text");
    let trees = metrics.lines().find(|line| line.starts_with("arbor_conversations_bytes ")).expect("the gauge");
    assert!(trees["arbor_conversations_bytes ".len()..].parse::<usize>().expect("bytes") > 0, "{trees}");
    turn(&other, "elsewhere").await;
    app.engine.flush_events().await;
    assert_eq!(loaded().await, 1, "the first conversation left memory when the other was loaded");
    // Its active path is read from the store while it is out of memory.
    let path = app.get(&key, &format!("/v1/conversations/{first}?path=1")).await;
    let on_path: Vec<&str> =
        path.body["messages"].as_array().expect("messages").iter().map(|m| m["role"].as_str().expect("role")).collect();
    assert_eq!(on_path, ["user", "assistant"], "{:?}", path.body);
    assert_eq!(path.body["messages"][0]["content"], "one");
    assert_eq!(path.body["head_id"], path.body["messages"][1]["id"]);
    assert_eq!(loaded().await, 1, "reading the path does not load the conversation");

    turn(&first, "two").await;
    app.engine.flush_events().await;
    let tree = app.get(&key, &format!("/v1/conversations/{first}")).await;
    let messages = tree.body["messages"].as_array().expect("messages");
    let contents: Vec<&str> = messages.iter().map(|m| m["content"].as_str().expect("text")).collect();
    assert_eq!(contents.len(), 4, "{contents:?}");
    assert_eq!((contents[0], contents[2]), ("one", "two"));
    assert_eq!(messages[2]["parent_id"], messages[1]["id"], "the second turn continues from the stored head");

    // Its events are numbered on from where the first hub stopped: one
    // replay holds both turns, each id once, in order.
    let mut replay = app.open_stream(&key, &format!("/v1/conversations/{first}/events?after=0"), None, &[]).await;
    let mut events = replay.until("done", DEADLINE).await;
    events.extend(replay.until("done", DEADLINE).await);
    let ids: Vec<i64> = events.iter().map(|event| event.id.expect("an id")).collect();
    assert!(ids.windows(2).all(|pair| pair[0] < pair[1]), "ids increase: {ids:?}");
    assert_eq!(events.iter().filter(|event| event.event == "done").count(), 2);
}

#[tokio::test]
async fn conversations_are_listed_newest_first_in_pages() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let mut created = Vec::new();
    for index in 0..5 {
        created.push(app.new_conversation(&key, json!({"title": format!("c{index}")})).await);
    }
    let first = app.get(&key, "/v1/conversations?limit=3").await;
    let page: Vec<&str> =
        first.body["conversations"].as_array().expect("page").iter().map(|c| c["id"].as_str().expect("id")).collect();
    assert_eq!(page, [created[4].as_str(), created[3].as_str(), created[2].as_str()]);
    let cursor = first.body["next_cursor"].as_str().expect("another page");
    let second = app.get(&key, &format!("/v1/conversations?limit=3&cursor={cursor}")).await;
    let page: Vec<&str> =
        second.body["conversations"].as_array().expect("page").iter().map(|c| c["id"].as_str().expect("id")).collect();
    assert_eq!(page, [created[1].as_str(), created[0].as_str()]);
    assert!(second.body["next_cursor"].is_null());
}

#[tokio::test]
async fn a_second_submit_during_a_turn_gets_409_naming_the_running_turn() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let running = app.begin_turn(&key, &conversation, "first").await;

    let second =
        app.post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "second"})).await;
    assert_eq!(second.status, 409);
    assert_eq!(second.body["error"]["code"], "turn_running");
    assert_eq!(second.body["error"]["turn_id"], running.turn.id.as_str());

    let outcome = running.outcome().await.expect("first finishes");
    assert_eq!(outcome.turn.status.as_str(), "succeeded");
    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await;
    assert_eq!(tree.body["messages"].as_array().expect("messages").len(), 2, "the refused message was not recorded");
    let third =
        app.post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "third"})).await;
    assert_eq!(third.status, 200, "the slot is free once the turn ended");
}

#[tokio::test]
async fn a_client_that_disconnects_does_not_stop_the_turn_and_can_resume() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let mut stream = app
        .open_stream(
            &key,
            &format!("/v1/conversations/{conversation}/messages"),
            Some(&json!({"content": "keep going"})),
            &[],
        )
        .await;
    // Served as an event stream that no cache keeps.
    assert_eq!(stream.headers.get("content-type").map(|value| value.as_bytes()), Some(&b"text/event-stream"[..]));
    assert_eq!(stream.headers.get("cache-control").map(|value| value.as_bytes()), Some(&b"no-cache"[..]));
    let first_part = stream.until("delta", DEADLINE).await;
    let last_seen = first_part.last().and_then(|event| event.id).expect("an event id");
    let turn_id = first_part[0].data["turn_id"].as_str().expect("turn id").to_string();
    drop(stream);

    // Resume with Last-Event-ID: the rest arrives, nothing twice.
    let mut resumed = app
        .open_stream(
            &key,
            &format!("/v1/conversations/{conversation}/events"),
            None,
            &[("last-event-id", &last_seen.to_string())],
        )
        .await;
    let rest = resumed.until("done", DEADLINE).await;
    assert_eq!(rest.first().and_then(|event| event.id), Some(last_seen + 1), "no gap");
    assert_eq!(rest.last().map(|event| event.event.as_str()), Some("done"));
    let mut answer: String = first_part
        .iter()
        .filter(|e| e.event == "delta")
        .map(|e| e.data["text"].as_str().unwrap_or("").to_string())
        .collect();
    answer
        .extend(rest.iter().filter(|e| e.event == "delta").map(|e| e.data["text"].as_str().unwrap_or("").to_string()));

    let turn = app.get(&key, &format!("/v1/conversations/{conversation}/turns/{turn_id}")).await;
    assert_eq!(turn.body["status"], "succeeded");
    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await;
    assert_eq!(tree.body["messages"][1]["content"].as_str(), Some(answer.as_str()), "byte-exact reconstruction");

    // ?after= does the same as the header.
    let mut again = app
        .open_stream(
            &key,
            &format!("/v1/conversations/{conversation}/events?after={last_seen}&visibility=minimal"),
            None,
            &[],
        )
        .await;
    let minimal = again.until("done", DEADLINE).await;
    assert!(minimal.iter().all(|event| !event.event.starts_with("trace_")), "minimal hides traces");
    assert!(minimal.iter().any(|event| event.event == "delta"));
}

#[tokio::test]
async fn cancelling_a_turn_keeps_the_partial_answer_marked_interrupted() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let mut stream = app
        .open_stream(
            &key,
            &format!("/v1/conversations/{conversation}/messages"),
            Some(&json!({"content": "stop me"})),
            &[],
        )
        .await;
    let started = stream.until("delta", DEADLINE).await;
    let turn_id = started[0].data["turn_id"].as_str().expect("turn id").to_string();
    let cancel = app.post(&key, &format!("/v1/conversations/{conversation}/turns/{turn_id}/cancel"), &json!({})).await;
    assert_eq!(cancel.status, 202);
    let rest = stream.until("error", DEADLINE).await;
    let error = rest.last().expect("an error event");
    assert_eq!(error.event, "error");
    assert_eq!(error.data["code"], "cancelled");

    let turn = app.get(&key, &format!("/v1/conversations/{conversation}/turns/{turn_id}")).await;
    assert_eq!(turn.body["status"], "cancelled");
    assert_eq!(turn.body["api_calls"][0]["status"], "cancelled");
    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await;
    let messages = tree.body["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 2, "the user message and the partial reply");
    assert_eq!(messages[1]["status"], "interrupted");
    assert!(!messages[1]["content"].as_str().expect("partial text").is_empty());
}

#[tokio::test]
async fn shutdown_lets_a_running_turn_finish() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let handle = app.begin_turn(&key, &conversation, "finish me").await;
    let turn_id = handle.turn.id.clone();
    let engine = app.engine.clone();
    let _data = app.stop().await;
    let turn = engine.store().turn(&conversation, &turn_id).await.expect("read").expect("turn");
    assert_eq!(turn.status.as_str(), "succeeded", "the grace period let it finish");
}

#[tokio::test]
async fn arbor_reports_its_own_overhead_per_turn_and_as_a_metric() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let response = app
        .client
        .post(app.url(&format!("/v1/conversations/{conversation}/messages")))
        .bearer_auth(&key)
        .json(&json!({"content": "measure me"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 200);
    let micros = |name: &str| -> u64 {
        let value = response.headers().get(name).and_then(|value| value.to_str().ok());
        value.and_then(|value| value.parse().ok()).unwrap_or_else(|| panic!("a {name} header in microseconds"))
    };
    let overhead = micros("x-arbor-overhead-us");
    // The demo model paces its chunks (~300 ms): that is upstream time, not overhead.
    assert!(overhead < 250_000, "overhead {overhead} µs excludes the model's own time");
    // Of that, the wait for the turn's two durable writes (start and end).
    let store_wait = micros("x-arbor-store-wait-us");
    assert!(store_wait > 0 && store_wait <= overhead, "store wait {store_wait} µs is part of overhead {overhead} µs");
    let metrics = app.client.get(app.url("/metrics")).send().await.expect("sent").text().await.expect("text");
    assert!(metrics.contains("arbor_turn_overhead_seconds_count 1"), "{metrics}");
    assert!(metrics.contains("arbor_turn_store_wait_seconds_count 1"), "{metrics}");
    assert!(metrics.contains("arbor_turns_total{status=\"succeeded\"} 1"), "{metrics}");
}

#[tokio::test]
async fn concurrent_turns_never_spend_past_a_users_credits() {
    let app = spawn_app().await;
    let key = app.new_user("limited").await;
    let user = app.user(&key).await;
    // A demo reply costs ~20 credits, but each call first holds its worst
    // case (~1,700 credits for 4,096 output tokens): 2,000 covers one at a time.
    app.engine.store().set_balance(&user.id, Some(2_000)).await.expect("balance set");
    let mut conversations = Vec::new();
    for _ in 0..8 {
        conversations.push(app.new_conversation(&key, json!({})).await);
    }
    let body = json!({"content": "spend"});
    let paths: Vec<String> =
        conversations.iter().map(|conversation| format!("/v1/conversations/{conversation}/messages")).collect();
    let posts = paths.iter().map(|path| app.post(&key, path, &body));
    let responses = futures_util::future::join_all(posts).await;
    let succeeded = responses.iter().filter(|response| response.status == 200).count();
    assert!(succeeded >= 1, "at least one turn fits");
    for (conversation, response) in conversations.iter().zip(&responses).filter(|(_, response)| response.status != 200)
    {
        assert_eq!(response.status, 402, "{:?}", response.body);
        assert_eq!(response.body["error"]["code"], "quota_exceeded");
        // Refused by the hold its start tried to make: the message is kept.
        let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await.body;
        assert!(tree["messages"].to_string().contains("spend"), "{tree}");
    }
    let after = app.engine.store().user(&user.id).await.expect("read").expect("user");
    let balance = after.balance_credits.expect("still limited");
    assert!(balance >= 0, "never below zero: {balance}");
    let ledger = app.engine.store().ledger(&user.id, 100).await.expect("ledger");
    let charged: i64 = ledger.iter().map(|entry| entry.credits).sum();
    assert_eq!(charged, 2_000 - balance, "every credit spent is in the ledger");
    assert_eq!(
        app.engine.store().available_credits(&user.id).await.expect("read"),
        Some(balance),
        "no credits left held"
    );

    // With nothing left, a submit is refused up front with 402.
    app.engine.store().set_balance(&user.id, Some(0)).await.expect("balance set");
    let refused =
        app.post(&key, &format!("/v1/conversations/{}/messages", conversations[0]), &json!({"content": "more"})).await;
    assert_eq!(refused.status, 402);
    assert_eq!(refused.body["error"]["code"], "quota_exceeded");
}

#[tokio::test]
async fn a_turn_still_running_after_the_grace_period_is_interrupted_and_kept() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let user = app.user(&key).await;
    let mut stream = app
        .open_stream(
            &key,
            &format!("/v1/conversations/{conversation}/messages"),
            Some(&json!({"content": "long"})),
            &[],
        )
        .await;
    let started = stream.until("delta", DEADLINE).await;
    let turn_id = started[0].data["turn_id"].as_str().expect("turn").to_string();
    // The demo takes ~300 ms; a 20 ms grace period runs out first.
    app.engine.shutdown(Duration::from_millis(20)).await;
    let turn = app.engine.store().turn(&conversation, &turn_id).await.expect("read").expect("turn");
    assert_eq!(turn.status.as_str(), "interrupted");
    let tree = app.engine.conversation_tree(&user, &conversation).await.expect("tree");
    assert_eq!(tree.tree.len(), 2);
    assert_eq!(tree.tree.at(1).status.as_str(), "interrupted", "the partial answer is kept");
    // New turns are refused while stopping.
    let refused = app.post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "x"})).await;
    assert_eq!(refused.status, 503);
}
