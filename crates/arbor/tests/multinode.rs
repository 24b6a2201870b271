//! Two `arbor serve` processes on one PostgreSQL database (DESIGN.md §9):
//! a turn on node A streamed live from node B, 409 from B while A runs a
//! turn, a cancel through B stopping A's turn, A killed mid-turn and B taking
//! the turn over, and 50 concurrent turns of one user over both nodes never
//! overspending the quota. Runs when `ARBOR_TEST_POSTGRES_URL` is set (CI
//! sets it); otherwise it says so and passes.

mod common;

use std::time::Duration;

use arbor_store::testing::TestDatabase;
use arbor_testkit::mock::{MockServer, Protocol, Reply};
use arbor_testkit::{SseEvent, SseReader};
use common::{DEADLINE, Node, client, get, post, start_node, write_config};
use serde_json::{Value, json};

async fn stream(node: &Node, key: &str, path: &str, body: Option<Value>) -> SseReader {
    let request = match body {
        Some(body) => client().post(format!("{}{path}", node.base_url)).json(&body),
        None => client().get(format!("{}{path}", node.base_url)),
    };
    SseReader::new(request.bearer_auth(key).header("accept", "text/event-stream").send().await.expect("sent"))
}

fn text(events: &[SseEvent]) -> String {
    events
        .iter()
        .filter(|event| event.event == "delta")
        .map(|event| event.data["text"].as_str().unwrap_or(""))
        .collect()
}

/// A reply slow enough to act on while it streams (~3 s).
fn slow_reply() -> Reply {
    Reply::text("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen")
        .with_chunk_delay(Duration::from_millis(200))
}

#[tokio::test]
async fn two_nodes_share_turns_events_cancels_failover_and_quota() {
    let Ok(server_url) = std::env::var("ARBOR_TEST_POSTGRES_URL") else {
        eprintln!("ARBOR_TEST_POSTGRES_URL is not set; skipping the multi-node test");
        return;
    };
    let database = TestDatabase::create(&server_url).await.expect("a test database");
    let outcome = tokio::spawn(run_story(database.url.clone())).await;
    database.drop_database().await.expect("drop the test database");
    if let Err(error) = outcome {
        std::panic::resume_unwind(error.into_panic());
    }
}

async fn run_story(database_url: String) {
    let mock = MockServer::start(Protocol::OpenAi).await;
    mock.set_default(slow_reply());
    let dir = tempfile::tempdir().expect("temp dir");
    let config = write_config(dir.path(), &database_url, &mock.base_url());
    let (mut a, key) = start_node(&config, &dir.path().join("a")).await;
    let key = key.expect("the first node prints the admin key");
    let (b, none) = start_node(&config, &dir.path().join("b")).await;
    assert!(none.is_none(), "the second node finds the admin already there");

    // (a) A turn on A, streamed live from B.
    let (_, conversation) = post(&a, &key, "/v1/conversations", json!({})).await;
    let conversation = conversation["id"].as_str().expect("id").to_string();
    let mut on_b = stream(&b, &key, &format!("/v1/conversations/{conversation}/events"), None).await;
    let mut on_a =
        stream(&a, &key, &format!("/v1/conversations/{conversation}/messages"), Some(json!({"content": "hi"}))).await;
    let seen_a = on_a.until("done", DEADLINE).await;
    let seen_b = on_b.until("done", DEADLINE).await;
    assert_eq!(seen_a.last().map(|event| event.event.as_str()), Some("done"));
    assert_eq!(seen_b.last().map(|event| event.event.as_str()), Some("done"), "B saw the turn end");
    assert_eq!(text(&seen_b), text(&seen_a), "B saw every delta A streamed");
    let ids_a: Vec<i64> = seen_a.iter().filter_map(|event| event.id).collect();
    let ids_b: Vec<i64> = seen_b.iter().filter_map(|event| event.id).collect();
    assert!(ids_b.windows(2).all(|pair| pair[1] == pair[0] + 1), "no gap on B: {ids_b:?}");
    assert!(ids_a.iter().all(|id| ids_b.contains(id)), "same numbering on both nodes");

    // Queued turns start in arrival order across nodes: one queued on B,
    // then one on A, both behind a turn running on A.
    let mut first =
        stream(&a, &key, &format!("/v1/conversations/{conversation}/messages"), Some(json!({"content": "busy"}))).await;
    first.until("delta", DEADLINE).await;
    let path = format!("/v1/conversations/{conversation}/messages");
    let (on_b_queued, on_a_queued) =
        tokio::join!(post(&b, &key, &path, json!({"content": "queued on B", "id": "qb", "queue": true})), async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            post(&a, &key, &path, json!({"content": "queued on A", "id": "qa", "queue": true})).await
        });
    assert_eq!(on_b_queued.0, 200, "{}", on_b_queued.1);
    assert_eq!(on_a_queued.0, 200, "{}", on_a_queued.1);
    let tree = get(&b, &key, &format!("/v1/conversations/{conversation}")).await;
    let nodes = tree["messages"].as_array().expect("messages").clone();
    let parent_of = |id: &str| nodes.iter().find(|node| node["id"] == id).map(|node| node["parent_id"].clone());
    assert_eq!(parent_of("qa"), Some(on_b_queued.1["message"]["id"].clone()), "A's queued turn ran after B's");

    // (b) 409 from B while A runs a turn; (c) a cancel through B stops it.
    let mut running =
        stream(&a, &key, &format!("/v1/conversations/{conversation}/messages"), Some(json!({"content": "again"})))
            .await;
    let started = running.until("delta", DEADLINE).await;
    let turn_id = started[0].data["turn_id"].as_str().expect("turn id").to_string();
    let (status, conflict) =
        post(&b, &key, &format!("/v1/conversations/{conversation}/messages"), json!({"content": "no"})).await;
    assert_eq!(status, 409, "{conflict}");
    assert_eq!(conflict["error"]["turn_id"], turn_id.as_str());
    let (status, _) =
        post(&b, &key, &format!("/v1/conversations/{conversation}/turns/{turn_id}/cancel"), json!({})).await;
    assert_eq!(status, 202);
    let rest = running.until("error", DEADLINE).await;
    assert_eq!(rest.last().expect("error").data["code"], "cancelled");
    let turn = get(&b, &key, &format!("/v1/conversations/{conversation}/turns/{turn_id}")).await;
    assert_eq!(turn["status"], "cancelled");

    // (d) A dies mid-turn; B takes the turn over once its lease expires.
    let mut doomed =
        stream(&a, &key, &format!("/v1/conversations/{conversation}/messages"), Some(json!({"content": "crash"})))
            .await;
    let started = doomed.until("delta", DEADLINE).await;
    let doomed_turn = started[0].data["turn_id"].as_str().expect("turn id").to_string();
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.child.start_kill().expect("kill A");
    let _ = a.child.wait().await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let turn = get(&b, &key, &format!("/v1/conversations/{conversation}/turns/{doomed_turn}")).await;
        if turn["status"] == "interrupted" {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "B never took the turn over: {turn}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let tree = get(&b, &key, &format!("/v1/conversations/{conversation}")).await;
    let last = tree["messages"].as_array().expect("messages").last().cloned().expect("a message");
    assert_eq!(last["status"], "interrupted", "what A streamed before dying is kept");
    assert!(!last["content"].as_str().unwrap_or("").is_empty());
    let (status, _) =
        post(&b, &key, &format!("/v1/conversations/{conversation}/messages"), json!({"content": "after"})).await;
    assert_eq!(status, 200, "the conversation works again on B");

    // (e) 50 concurrent turns of one user over both nodes: never overspent.
    let (a, _) = start_node(&config, &dir.path().join("a")).await;
    mock.set_default(Reply::text("short").with_usage(arbor_core::Usage {
        input_tokens: 100,
        output_tokens: 10,
        ..Default::default()
    }));
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["users", "credits", "admin", "--set", "20000"])
        .arg("--config")
        .arg(&config)
        .status()
        .expect("credits command");
    assert!(status.success());
    let mut conversations = Vec::new();
    for index in 0..50 {
        let node = if index % 2 == 0 { &a } else { &b };
        let (_, created) = post(node, &key, "/v1/conversations", json!({})).await;
        conversations.push(created["id"].as_str().expect("id").to_string());
    }
    let paths: Vec<String> =
        conversations.iter().map(|conversation| format!("/v1/conversations/{conversation}/messages")).collect();
    let submits = paths.iter().enumerate().map(|(index, path)| {
        let node = if index % 2 == 0 { &a } else { &b };
        post(node, &key, path, json!({"content": "spend"}))
    });
    let results = futures_util::future::join_all(submits).await;
    let succeeded = results.iter().filter(|(status, _)| *status == 200).count();
    for (status, body) in &results {
        assert!(*status == 200 || *status == 402, "{status} {body}");
    }
    assert!(succeeded >= 1);
    let store = arbor_store::open(&database_url).await.expect("store");
    let admin = store.user_by_name("admin").await.expect("read").expect("admin");
    let balance = admin.balance_credits.expect("limited");
    assert!(balance >= 0, "the quota was never overspent: balance {balance}");
    assert_eq!(store.available_credits(&admin.id).await.expect("read"), Some(balance), "nothing left reserved");
    eprintln!("quota story: {succeeded} of 50 turns fit in 20,000 credits; {balance} left");
    drop(a);
    drop(b);
}
