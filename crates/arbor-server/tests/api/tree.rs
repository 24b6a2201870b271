//! The message tree and turn control over HTTP: views (edit, branch,
//! regenerate, head moves), append without a turn, optimistic concurrency,
//! fork, queues and merges, and crash recovery.

use std::time::Duration;

use arbor_engine::Submit;
use arbor_testkit::{TestApp, spawn_app};
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(20);

fn messages(body: &Value) -> Vec<Value> {
    body["messages"].as_array().expect("messages").clone()
}

fn ids(nodes: &[Value]) -> Vec<String> {
    nodes.iter().map(|node| node["id"].as_str().expect("id").to_string()).collect()
}

async fn view(app: &TestApp, key: &str, conversation: &str, view: Value) -> Value {
    let response =
        app.post(key, &format!("/v1/conversations/{conversation}/messages"), &json!({"messages": view})).await;
    assert!(response.status < 300, "{:?}", response.body);
    response.body
}

/// u1 → a1 → u2 → a2, built through views with client ids.
async fn two_exchanges(app: &TestApp, key: &str) -> (String, String, String) {
    let conversation = app.new_conversation(key, json!({})).await;
    let first =
        view(app, key, &conversation, json!([{"id": "u1", "role": "user", "content": "weather in NYC?"}])).await;
    let a1 = first["message"]["id"].as_str().expect("a1").to_string();
    let second = view(
        app,
        key,
        &conversation,
        json!([
            {"id": "u1", "role": "user", "content": "weather in NYC?"},
            {"id": a1, "role": "assistant", "content": "ignored: matched by id"},
            {"id": "u2", "role": "user", "content": "and tomorrow?"}
        ]),
    )
    .await;
    let a2 = second["message"]["id"].as_str().expect("a2").to_string();
    (conversation, a1, a2)
}

#[tokio::test]
async fn editing_the_first_question_branches_under_it_and_keeps_the_old_branch() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let (conversation, a1, a2) = two_exchanges(&app, &key).await;

    // The seed's example: u1 matches, the id-less message starts a branch.
    let edited = view(
        &app,
        &key,
        &conversation,
        json!([{"id": "u1", "role": "user", "content": "weather in NYC?"}, {"role": "user", "content": "weather in LA instead"}]),
    )
    .await;
    assert_eq!(edited["turn"]["status"], "succeeded");
    assert!(edited["message"]["content"].as_str().expect("reply").contains("weather in LA instead"));

    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await.body;
    let nodes = messages(&tree);
    assert_eq!(nodes.len(), 6, "u1, a1, u2, a2, e1, its reply");
    let u1 = nodes.iter().find(|node| node["id"] == "u1").expect("u1");
    let children: Vec<&str> =
        u1["children"].as_array().expect("children").iter().map(|c| c.as_str().expect("id")).collect();
    assert_eq!(children.len(), 2);
    assert_eq!(children[0], a1, "the old branch stays, first");
    let e1 = nodes.iter().find(|node| node["id"] == children[1]).expect("e1");
    assert_eq!(e1["content"], "weather in LA instead");
    assert!(nodes.iter().any(|node| node["id"] == a2.as_str()), "a1 → u2 → a2 is still there");

    // The active path is u1 → e1 → reply.
    let path = app.get(&key, &format!("/v1/conversations/{conversation}?path=1")).await.body;
    let path_ids = ids(&messages(&path));
    assert_eq!(path_ids.len(), 3);
    assert_eq!(path_ids[0], "u1");
    assert_eq!(path_ids[1], children[1]);
    assert_eq!(path["head_id"].as_str(), Some(path_ids[2].as_str()));
    let path_children: Vec<Value> = messages(&path).iter().map(|node| node["children"].clone()).collect();
    assert_eq!(path_children, [json!([path_ids[1]]), json!([path_ids[2]]), json!([])], "each one's child on the path");
    let refused = app.get(&key, &format!("/v1/conversations/{conversation}?path=2")).await;
    assert_eq!(refused.status, 400, "{:?}", refused.body);
}

#[tokio::test]
async fn a_view_that_stops_early_only_moves_the_head_and_resending_changes_nothing() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let (conversation, a1, _) = two_exchanges(&app, &key).await;
    let before = app.get(&key, &format!("/v1/conversations/{conversation}")).await.body;

    let mut events = app.open_stream(&key, &format!("/v1/conversations/{conversation}/events"), None, &[]).await;
    let moved = view(&app, &key, &conversation, json!([{"id": "u1", "role": "user", "content": "changed text, same id"}, {"id": a1, "role": "assistant", "content": "x"}])).await;
    assert_eq!(moved["head_id"], a1.as_str());
    assert!(moved["head_version"].as_i64().expect("version") > before["head_version"].as_i64().expect("version"));
    let seen = events.until("head.moved", DEADLINE).await;
    let event = seen.last().expect("head.moved is announced");
    assert_eq!(event.event, "head.moved");
    assert_eq!(event.data["head_id"], a1.as_str());

    let after = app.get(&key, &format!("/v1/conversations/{conversation}")).await.body;
    assert_eq!(messages(&after), messages(&before), "nothing written, nothing changed");
    assert_eq!(after["head_id"], a1.as_str());

    // A view that puts a known message under the wrong parent is refused.
    let wrong = app
        .post(
            &key,
            &format!("/v1/conversations/{conversation}/messages"),
            &json!({"messages": [{"id": "u2", "role": "user", "content": ""}]}),
        )
        .await;
    assert_eq!(wrong.status, 400, "{:?}", wrong.body);
}

#[tokio::test]
async fn append_without_a_turn_then_regenerate_and_move_the_head() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let path = format!("/v1/conversations/{conversation}/messages");

    // run: false records without calling the model; the next turn reads it.
    let recorded = app.post(&key, &path, &json!({"content": "context line", "id": "c1", "run": false})).await;
    assert_eq!(recorded.status, 201, "{:?}", recorded.body);
    assert_eq!(recorded.body["head_id"], "c1");
    assert!(recorded.body["head_version"].as_i64().is_some(), "{:?}", recorded.body);
    let shown = recorded.body["messages"].as_array().expect("the recorded messages");
    assert_eq!(shown.len(), 1);
    assert_eq!(
        (&shown[0]["id"], &shown[0]["role"], &shown[0]["content"]),
        (&json!("c1"), &json!("user"), &json!("context line"))
    );
    assert_eq!(shown[0]["children"], json!([]));
    let turn = app.post(&key, &path, &json!({"content": "question", "id": "q1"})).await;
    assert_eq!(turn.body["message"]["parent_id"], "q1");
    let tree = messages(&app.get(&key, &format!("/v1/conversations/{conversation}")).await.body);
    assert_eq!(tree.iter().find(|node| node["id"] == "q1").expect("q1")["parent_id"], "c1");
    let first_reply = turn.body["message"]["id"].as_str().expect("reply").to_string();

    // Regenerate: a new reply beside the old one, and the head on it.
    let again = app.post(&key, &format!("/v1/conversations/{conversation}/regenerate"), &json!({})).await;
    assert_eq!(again.status, 200, "{:?}", again.body);
    let second_reply = again.body["message"]["id"].as_str().expect("reply").to_string();
    assert_ne!(second_reply, first_reply);
    assert_eq!(again.body["message"]["parent_id"], "q1");
    let tree = app.get(&key, &format!("/v1/conversations/{conversation}")).await.body;
    assert_eq!(tree["head_id"], second_reply.as_str());
    let q1 = messages(&tree).into_iter().find(|node| node["id"] == "q1").expect("q1");
    assert_eq!(q1["children"], json!([first_reply, second_reply]));

    // PUT head back to the first reply.
    let moved = app
        .send_raw(
            &key,
            reqwest::Method::PUT,
            &format!("/v1/conversations/{conversation}/head"),
            json!({"message_id": first_reply}).to_string(),
        )
        .await;
    assert_eq!(moved.status, 200, "{:?}", moved.body);
    let path_now = app.get(&key, &format!("/v1/conversations/{conversation}?path=1")).await.body;
    assert_eq!(ids(&messages(&path_now)), ["c1", "q1", first_reply.as_str()]);
    let unknown = app
        .send_raw(
            &key,
            reqwest::Method::PUT,
            &format!("/v1/conversations/{conversation}/head"),
            json!({"message_id": "nope"}).to_string(),
        )
        .await;
    assert_eq!(unknown.status, 400);
}

/// A conversation far longer than one part of a response (64 KiB): the
/// recorded view's answer and the tree are sent as they are written, and
/// read back whole, in order, with every node's children.
#[tokio::test]
async fn a_long_tree_is_sent_in_parts_and_reads_whole() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let text = |index: usize| format!("message {index}: {}", "a \"quoted\" word, ".repeat(12));
    let trunk: Vec<Value> = (0..600)
        .map(|index| {
            let role = if index % 2 == 0 { "user" } else { "assistant" };
            json!({"id": format!("m{index}"), "role": role, "content": text(index)})
        })
        .collect();
    let recorded = app
        .post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"messages": trunk, "run": false}))
        .await;
    assert_eq!(recorded.status, 201, "{:?}", recorded.body);
    assert_eq!(ids(&messages(&recorded.body)), (0..600).map(|index| format!("m{index}")).collect::<Vec<_>>());
    assert_eq!(recorded.body["messages"][599]["content"], text(599));
    assert_eq!(recorded.body["head_id"], "m599");

    // A branch at m300: the trunk up to m299, then an edited message.
    let mut branch = trunk[..300].to_vec();
    branch.push(json!({"id": "edit", "role": "user", "content": "an edited question"}));
    let edited = app
        .post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"messages": branch, "run": false}))
        .await;
    assert_eq!(edited.status, 201, "{:?}", edited.body);

    let response = app
        .client
        .get(app.url(&format!("/v1/conversations/{conversation}")))
        .bearer_auth(&key)
        .send()
        .await
        .expect("request sent");
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["transfer-encoding"], "chunked", "sent as it is written");
    let tree: Value = serde_json::from_slice(&response.bytes().await.expect("read")).expect("the tree is JSON");
    assert_eq!(tree["id"], conversation.as_str());
    assert_eq!(tree["head_id"], "edit");
    let nodes = messages(&tree);
    let mut expected: Vec<String> = (0..600).map(|index| format!("m{index}")).collect();
    expected.push("edit".into());
    assert_eq!(ids(&nodes), expected);
    for (index, node) in nodes[..600].iter().enumerate() {
        assert_eq!(node["content"], text(index));
        let children = match index {
            299 => json!(["m300", "edit"]),
            599 => json!([]),
            _ => json!([format!("m{}", index + 1)]),
        };
        assert_eq!(node["children"], children, "m{index}");
    }

    let path = app.get(&key, &format!("/v1/conversations/{conversation}?path=1")).await.body;
    let on_path: Vec<String> = expected[..300].iter().cloned().chain(["edit".to_string()]).collect();
    let path = messages(&path);
    assert_eq!(ids(&path), on_path);
    for (index, node) in path.iter().enumerate() {
        let child: Vec<&String> = on_path.get(index + 1).into_iter().collect();
        assert_eq!(node["children"], json!(child), "{}: its child on the path only", on_path[index]);
    }
}

#[tokio::test]
async fn a_stale_head_version_is_refused_and_writes_nothing() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let path = format!("/v1/conversations/{conversation}/messages");
    let first = app.post(&key, &path, &json!({"content": "one"})).await;
    let version = first.body["head_version"].as_i64().expect("head_version in the response");

    let stale = app.post(&key, &path, &json!({"content": "two", "if_head_version": version - 1})).await;
    assert_eq!(stale.status, 409);
    assert_eq!(stale.body["error"]["code"], "head_version_mismatch");
    assert_eq!(stale.body["error"]["head_version"], version);
    assert_eq!(messages(&app.get(&key, &format!("/v1/conversations/{conversation}")).await.body).len(), 2);

    let fresh = app.post(&key, &path, &json!({"content": "two", "if_head_version": version})).await;
    assert_eq!(fresh.status, 200, "{:?}", fresh.body);
}

#[tokio::test]
async fn fork_copies_the_path_into_a_new_conversation() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let (conversation, a1, _) = two_exchanges(&app, &key).await;
    let fork = app.post(&key, &format!("/v1/conversations/{conversation}/fork"), &json!({"message_id": a1})).await;
    assert_eq!(fork.status, 201, "{:?}", fork.body);
    let fork_id = fork.body["id"].as_str().expect("id");
    assert_ne!(fork_id, conversation);
    let copied = app.get(&key, &format!("/v1/conversations/{fork_id}")).await.body;
    let nodes = messages(&copied);
    assert_eq!(ids(&nodes), ["u1", a1.as_str()]);
    assert_eq!(nodes[0]["copied_from"], "u1");
    assert_eq!(copied["head_id"], a1.as_str());
    let other = app.new_user("mallory").await;
    let stolen = app.post(&other, &format!("/v1/conversations/{conversation}/fork"), &json!({"message_id": a1})).await;
    assert_eq!(stolen.status, 404);
}

#[tokio::test]
async fn queued_messages_run_in_order_and_each_sees_the_reply_it_waited_for() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let mut viewer = app.open_stream(&key, &format!("/v1/conversations/{conversation}/events"), None, &[]).await;
    let first = app.begin_turn(&key, &conversation, "first").await;
    let path = format!("/v1/conversations/{conversation}/messages");
    let second_body = json!({"content": "second", "id": "s2", "queue": true});
    let (second, third) = tokio::join!(app.post(&key, &path, &second_body), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        app.post(&key, &path, &json!({"content": "third", "id": "s3", "queue": true})).await
    });
    let first = first.outcome().await.expect("first ends");
    assert_eq!(second.status, 200, "{:?}", second.body);
    assert_eq!(third.status, 200, "{:?}", third.body);

    let tree = messages(&app.get(&key, &format!("/v1/conversations/{conversation}")).await.body);
    let node = |id: &str| tree.iter().find(|node| node["id"] == id).cloned().expect("node");
    let first_reply = first.reply.as_ref().expect("first reply").id.clone();
    assert_eq!(node("s2")["parent_id"], first_reply.as_str(), "the queued message follows the reply it waited for");
    assert_eq!(node("s3")["parent_id"], second.body["message"]["id"], "FIFO: third after second's reply");
    assert_eq!(tree.len(), 6);

    let seen = viewer.until("done", DEADLINE).await;
    let mut names: Vec<String> = seen.iter().map(|event| event.event.clone()).collect();
    let more = viewer.until("done", DEADLINE).await;
    names.extend(more.iter().map(|event| event.event.clone()));
    assert!(names.iter().filter(|name| *name == "turn.queued").count() >= 1, "viewers are told: {names:?}");
}

#[tokio::test]
async fn merged_messages_join_one_next_turn_without_duplicates() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let first = app.begin_turn(&key, &conversation, "first").await;
    let path = format!("/v1/conversations/{conversation}/messages");
    let first_line = json!({"content": "Sam had 120ml", "id": "m1", "queue": "merge"});
    let (a, b, again) = tokio::join!(
        app.post(&key, &path, &first_line),
        async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            app.post(&key, &path, &json!({"content": "oh and a nap at 2", "id": "m2", "queue": "merge"})).await
        },
        async {
            tokio::time::sleep(Duration::from_millis(60)).await;
            app.post(&key, &path, &json!({"content": "Sam had 120ml", "id": "m1", "queue": "merge"})).await
        }
    );
    first.outcome().await.expect("first ends");
    for response in [&a, &b, &again] {
        assert_eq!(response.status, 200, "{:?}", response.body);
    }
    let turn_id = a.body["turn"]["id"].clone();
    assert_eq!(b.body["turn"]["id"], turn_id, "each merged submit gets the same turn");
    assert_eq!(again.body["turn"]["id"], turn_id);

    let tree = messages(&app.get(&key, &format!("/v1/conversations/{conversation}")).await.body);
    assert_eq!(tree.iter().filter(|node| node["id"] == "m1").count(), 1, "a resent id is not added twice");
    let m2 = tree.iter().find(|node| node["id"] == "m2").expect("m2");
    assert_eq!(m2["parent_id"], "m1", "merged lines are recorded in order");
    assert_eq!(tree.len(), 5, "first, its reply, m1, m2, one reply for both");
    assert_eq!(a.body["message"]["parent_id"], "m2");
}

#[tokio::test]
async fn a_submit_while_a_turn_runs_is_409_unless_queued_and_cancel_removes_a_queued_turn() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let first = app.begin_turn(&key, &conversation, "first").await;
    let path = format!("/v1/conversations/{conversation}/messages");
    let mut queued =
        app.open_stream(&key, &path, Some(&json!({"content": "later", "id": "later", "queue": true})), &[]).await;
    let queued_event = queued.next(DEADLINE).await.expect("turn.queued");
    assert_eq!(queued_event.event, "turn.queued");
    let queued_turn = queued_event.data["turn_id"].as_str().expect("turn id").to_string();
    let cancel =
        app.post(&key, &format!("/v1/conversations/{conversation}/turns/{queued_turn}/cancel"), &json!({})).await;
    assert_eq!(cancel.status, 202, "{:?}", cancel.body);
    let rest = queued.until("error", DEADLINE).await;
    assert_eq!(rest.last().expect("error").data["code"], "cancelled");
    assert!(
        rest.iter().all(|event| event.event != "delta" && event.event != "trace_start"),
        "a queued turn's stream never carries the running turn's answer: {:?}",
        rest.iter().map(|event| event.event.as_str()).collect::<Vec<_>>()
    );
    first.outcome().await.expect("first ends");
    let tree = messages(&app.get(&key, &format!("/v1/conversations/{conversation}")).await.body);
    assert!(tree.iter().any(|node| node["id"] == "later"), "a cancelled queued message is still recorded");
    let turn = app.get(&key, &format!("/v1/conversations/{conversation}/turns/{queued_turn}")).await;
    assert_eq!(turn.body["status"], "cancelled");
}

#[tokio::test]
async fn moving_the_head_off_a_running_turns_branch_cancels_it() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let (conversation, a1, _) = two_exchanges(&app, &key).await;
    let mut stream = app
        .open_stream(
            &key,
            &format!("/v1/conversations/{conversation}/messages"),
            Some(&json!({"content": "a long one"})),
            &[],
        )
        .await;
    let started = stream.until("delta", DEADLINE).await;
    let turn_id = started[0].data["turn_id"].as_str().expect("turn").to_string();
    let moved = app
        .send_raw(
            &key,
            reqwest::Method::PUT,
            &format!("/v1/conversations/{conversation}/head"),
            json!({"message_id": a1}).to_string(),
        )
        .await;
    assert_eq!(moved.status, 200);
    let rest = stream.until("error", DEADLINE).await;
    assert_eq!(rest.last().expect("error").data["code"], "cancelled");
    let turn = app.get(&key, &format!("/v1/conversations/{conversation}/turns/{turn_id}")).await;
    assert_eq!(turn.body["status"], "cancelled");
}

#[tokio::test]
async fn turns_left_running_by_a_crash_are_marked_interrupted_on_restart() {
    let app = spawn_app().await;
    let key = app.admin_key.clone();
    let conversation = app.new_conversation(&key, json!({})).await;
    let done =
        app.post(&key, &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "hello"})).await;
    let mut turn: arbor_store::Turn = app
        .engine
        .store()
        .turn(&conversation, done.body["turn"]["id"].as_str().expect("id"))
        .await
        .expect("read")
        .expect("turn");
    // What a process killed mid-turn leaves behind: a running turn.
    turn.id = arbor_core::ids::new_id();
    turn.status = arbor_store::TurnStatus::Running;
    turn.finished_at = None;
    app.engine.store().insert_turn(&turn).await.expect("insert");
    // …and a queued turn whose message was only in its row.
    let mut queued = turn.clone();
    queued.id = arbor_core::ids::new_id();
    queued.status = arbor_store::TurnStatus::Queued;
    queued.created_at += 1;
    queued.pending_messages = vec![arbor_core::Node {
        id: "waiting".into(),
        conversation_id: conversation.clone(),
        parent_id: None,
        message: arbor_core::Message::user("sent while the other turn ran"),
        model: None,
        provider: None,
        turn_id: Some(queued.id.clone()),
        copied_from: None,
        status: Default::default(),
        created_at: arbor_core::ids::now_millis(),
    }];
    app.engine.store().insert_turn(&queued).await.expect("insert");
    let data_dir = app.stop().await;

    let restarted = arbor_testkit::restart_app(data_dir, "").await;
    let recovered = restarted.engine.store().turn(&conversation, &turn.id).await.expect("read").expect("turn");
    assert_eq!(recovered.status.as_str(), "interrupted");
    let recovered_queue = restarted.engine.store().turn(&conversation, &queued.id).await.expect("read").expect("turn");
    assert_eq!(recovered_queue.status.as_str(), "interrupted");
    let waiting = restarted.engine.store().message(&conversation, "waiting").await.expect("read");
    assert_eq!(
        waiting.map(|node| node.message.content),
        Some(Some("sent while the other turn ran".to_string())),
        "the queued message is in the tree, not lost"
    );
    // Viewers that resume are told, and the conversation works again.
    let user = restarted.engine.store().user_by_name("admin").await.expect("read").expect("admin");
    let mut stream =
        restarted.engine.events(&user, &conversation, 0, arbor_engine::Until::Forever).await.expect("events");
    let mut saw_interrupted = false;
    while let Ok(Some(event)) =
        tokio::time::timeout(Duration::from_secs(2), futures_util::StreamExt::next(&mut stream)).await
    {
        if event.name.as_str() == "error" && event.data_json()["code"] == "interrupted" {
            saw_interrupted = true;
            break;
        }
    }
    assert!(saw_interrupted);
    let next = restarted.engine.submit(&user, &conversation, Submit::message("again")).await.expect("the slot is free");
    next.into_turn().expect("turn").outcome().await.expect("runs");
}
