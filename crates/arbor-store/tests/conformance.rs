//! The store conformance suite: each story is written once against the
//! [`Store`] trait and run against every backend, so SQLite and PostgreSQL
//! cannot drift apart in what the engine may rely on.
//!
//! SQLite runs always (a fresh file in a temp folder per story). PostgreSQL
//! runs when `ARBOR_TEST_POSTGRES_URL` names a server (for example
//! `postgres://postgres@127.0.0.1:5432/test`): each story gets a database of
//! its own, `arbor_test_<random>`, created from that URL and dropped after
//! the story, pass or fail, so runs never see each other's rows.

use std::future::Future;
use std::sync::Arc;

use arbor_core::message::NodeStatus;
use arbor_core::{Event, EventName, Message, Node, Part, Role, ToolCall, ToolStatus, Usage, message::ProviderOpaque};
use arbor_store::*;
use serde_json::json;

// ---------------------------------------------------------------- harness

/// Runs `story` against a new SQLite file.
async fn on_sqlite<F, Fut>(story: F)
where
    F: FnOnce(Arc<dyn Store>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    on_sqlite_pair(|store, _| story(store)).await;
}

/// Runs `story` against a new SQLite file opened with `locking=exclusive`
/// (its connections lock each other in memory).
async fn on_sqlite_exclusive<F, Fut>(story: F)
where
    F: FnOnce(Arc<dyn Store>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    on_sqlite_file("?locking=exclusive", |store, _| story(store)).await;
}

/// Runs `story` against two stores on one new SQLite file, as two processes
/// on one machine would share it.
async fn on_sqlite_pair<F, Fut>(story: F)
where
    F: FnOnce(Arc<dyn Store>, Arc<dyn Store>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    on_sqlite_file("", story).await;
}

/// Runs `story` against two stores on one new SQLite file opened with the
/// URL's `query`.
async fn on_sqlite_file<F, Fut>(query: &str, story: F)
where
    F: FnOnce(Arc<dyn Store>, Arc<dyn Store>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let folder = tempfile::tempdir().expect("temp dir");
    // A folder that does not exist yet: open must create it.
    let path = folder.path().join("nested").join("arbor.db");
    let url = format!("sqlite://{}{query}", path.display());
    let first = arbor_store::open(&url).await.expect("sqlite store opens");
    let second = arbor_store::open(&url).await.expect("sqlite store opens twice");
    story(first, second).await;
    // Reopening the same file applies no migration twice and keeps the rows.
    let again = arbor_store::open(&url).await.expect("sqlite store reopens");
    again.count_users().await.expect("reopened store answers");
}

/// Runs `story` against a fresh PostgreSQL database, when one is configured.
async fn on_postgres<F, Fut>(story: F)
where
    F: FnOnce(Arc<dyn Store>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    on_postgres_pair(|store, _| story(store)).await;
}

/// Runs `story` against two stores (two nodes) on one fresh PostgreSQL
/// database, when one is configured.
async fn on_postgres_pair<F, Fut>(story: F)
where
    F: FnOnce(Arc<dyn Store>, Arc<dyn Store>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    on_postgres_database(|url, _, _| async move {
        // Two nodes starting together: migrations must not trip each other.
        let (first, second) = tokio::join!(arbor_store::open(&url), arbor_store::open(&url));
        let first = first.expect("postgres store opens");
        let second = second.expect("postgres store opens twice");
        // Run on its own task so a failing assertion comes back as an error
        // here and the database is still dropped.
        let result = tokio::spawn(story(first, second)).await;
        let again = arbor_store::open(&url).await.expect("postgres store reopens");
        again.count_users().await.expect("reopened store answers");
        result
    })
    .await;
}

/// Runs `story` with the URL and the name of a fresh PostgreSQL database
/// and a pool on the server's `postgres` database (to administer it), when
/// a server is configured; drops the database afterwards and re-raises the
/// story's panic, if any.
async fn on_postgres_database<F, Fut>(story: F)
where
    F: FnOnce(String, String, sqlx::PgPool) -> Fut,
    Fut: Future<Output = Result<(), tokio::task::JoinError>>,
{
    let Ok(server_url) = std::env::var("ARBOR_TEST_POSTGRES_URL") else {
        eprintln!("ARBOR_TEST_POSTGRES_URL is not set; skipping the postgres run");
        return;
    };
    let database = format!("arbor_test_{}", uuid::Uuid::now_v7().simple());
    // Administer through the `postgres` database, which every server has,
    // so the URL's own database need not exist.
    let admin = sqlx::PgPool::connect(&with_database(&server_url, "postgres"))
        .await
        .expect("connect to the server of ARBOR_TEST_POSTGRES_URL");
    // The name is made above from a uuid, not from user input.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .expect("create the test database");
    let outcome = story(with_database(&server_url, &database), database.clone(), admin.clone()).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)")))
        .execute(&admin)
        .await
        .expect("drop the test database");
    if let Err(error) = outcome {
        std::panic::resume_unwind(error.into_panic());
    }
}

/// `server_url` with its database name replaced by `database`.
fn with_database(server_url: &str, database: &str) -> String {
    let (base, query) = match server_url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (server_url, None),
    };
    let scheme_end = base.find("://").map_or(0, |index| index + 3);
    let base = match base[scheme_end..].find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{base}/{database}?{query}"),
        None => format!("{base}/{database}"),
    }
}

/// One test per story and backend: `sqlite::story_x`,
/// `sqlite_exclusive::story_x` and `postgres::story_x`.
macro_rules! stories {
    ($($story:ident),+ $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $story() {
                    super::on_sqlite(super::$story).await;
                }
            )+
        }
        mod sqlite_exclusive {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $story() {
                    super::on_sqlite_exclusive(super::$story).await;
                }
            )+
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $story() {
                    super::on_postgres(super::$story).await;
                }
            )+
        }
    };
}

/// The same for stories that run on two stores sharing one database (two
/// processes on SQLite, two nodes on PostgreSQL).
macro_rules! pair_stories {
    ($($story:ident),+ $(,)?) => {
        mod sqlite_pair {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $story() {
                    super::on_sqlite_pair(super::$story).await;
                }
            )+
        }
        mod postgres_pair {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $story() {
                    super::on_postgres_pair(super::$story).await;
                }
            )+
        }
    };
}

pair_stories!(
    story_concurrent_reservations_never_overspend,
    story_running_turn_is_unique_across_nodes,
    story_one_node_takes_over_an_expired_turn,
    story_both_nodes_see_every_write,
    story_numbered_events_have_no_gaps,
    story_a_deletion_racing_event_batches_is_clean,
);

/// Notices cross processes only through PostgreSQL; SQLite's stay in the
/// process that sent them (one SQLite database serves one node).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_notices_cross_nodes() {
    on_postgres_pair(story_notices_cross_nodes).await;
}

/// When PostgreSQL drops every connection of the pool (a restart, a
/// fail-over, an administrator), the next calls still succeed: the pool
/// tests a connection before handing it out and replaces a dead one, so no
/// turn pays for the connections that died while idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_pool_replaces_connections_killed_while_idle() {
    // The story runs on its own task, so a failing assertion comes back as
    // an error and the database is still dropped.
    on_postgres_database(|url, database, admin| {
        tokio::spawn(async move {
            let store = arbor_store::open(&url).await.expect("postgres store opens");
            // Enough calls side by side that the pool holds several connections.
            let mut warm = tokio::task::JoinSet::new();
            for _ in 0..8 {
                let store = store.clone();
                warm.spawn(async move { store.count_users().await });
            }
            while let Some(counted) = warm.join_next().await {
                counted.expect("the call ran").expect("the store answers");
            }
            let killed: Vec<bool> = sqlx::query_scalar(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            )
            .bind(&database)
            .fetch_all(&admin)
            .await
            .expect("terminate the store's connections");
            assert!(!killed.is_empty(), "the store held no connection to kill");
            // Termination is a signal: wait until the server has let them go.
            for _ in 0..100 {
                let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = $1")
                    .bind(&database)
                    .fetch_one(&admin)
                    .await
                    .expect("count the connections left");
                if left == 0 {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            store.create_user(&user("after-the-kill", None)).await.expect("a write after the kill succeeds");
            for _ in 0..16 {
                assert_eq!(store.count_users().await.expect("a read after the kill succeeds"), 1);
            }
        })
    })
    .await;
}

/// A batch of events the database numbers wakes the other nodes, and not
/// the node that stored it (its event writer has the batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_numbered_events_wake_the_other_node() {
    on_postgres_pair(story_numbered_events_wake_the_other_node).await;
}

stories!(
    story_notices_reach_listeners,
    story_reservations_hold_and_settle,
    story_turn_leases,
    story_users_and_keys,
    story_conversations_page_newest_first,
    story_owners_see_only_their_conversations,
    story_conversation_update_and_delete_cascade,
    story_messages_keep_tree_and_order,
    story_append_is_all_or_nothing,
    story_head_moves_with_optimistic_version,
    story_one_running_turn_per_conversation,
    story_concurrent_turn_claims_admit_one,
    story_record_call_charges_atomically,
    story_concurrent_charges_add_up,
    story_events_replay_in_order,
    story_events_numbered_by_the_store,
    story_a_large_tree_loads_whole,
    story_queued_turns_keep_their_messages,
    story_finish_turn_writes_everything_at_once,
    story_finish_turn_of_an_unlimited_user,
    story_finish_turn_of_a_missing_turn_keeps_nothing,
    story_start_turn_is_all_or_nothing,
    story_start_turn_reserves_credits,
);

// --------------------------------------------------------------- fixtures

fn user(id: &str, balance: Option<i64>) -> User {
    User { id: id.into(), name: format!("name-{id}"), is_admin: false, balance_credits: balance, created_at: 1_000 }
}

fn conversation(owner: &str, id: &str, created_at: i64) -> Conversation {
    Conversation {
        title: Some(format!("title {id}")),
        created_at,
        updated_at: created_at,
        ..arbor_store::testing::conversation(owner, id)
    }
}

fn node(conversation: &str, id: &str, parent: Option<&str>, message: Message) -> Node {
    Node::new(id, conversation, parent.map(Into::into), message, 2_000)
}

fn turn(conversation: &str, id: &str, status: TurnStatus, created_at: i64) -> Turn {
    Turn {
        id: id.into(),
        conversation_id: conversation.into(),
        user_id: "alice".into(),
        user_message_id: "u1".into(),
        status,
        model: "demo".into(),
        iterations: 0,
        usage: Usage::default(),
        cost_micro_usd: 0,
        reply_message_id: None,
        error_code: None,
        error_message: None,
        created_at,
        started_at: None,
        finished_at: None,
        pending_messages: Vec::new(),
    }
}

fn call(id: &str, user: &str, conversation: &str, turn: &str, cost: u64) -> ApiCall {
    ApiCall {
        id: id.into(),
        turn_id: Some(turn.into()),
        conversation_id: Some(conversation.into()),
        user_id: user.into(),
        kind: "chat".into(),
        provider: "demo".into(),
        model: "demo".into(),
        usage: Usage {
            input_tokens: 1200,
            output_tokens: 350,
            thinking_tokens: 10,
            cached_tokens: 800,
            cache_write_tokens: 5,
        },
        latency_ms: 420,
        ttft_ms: Some(90),
        status: "ok".into(),
        error_code: None,
        cost_micro_usd: cost,
        created_at: 3_000,
    }
}

fn event(conversation: &str, seq: i64, data: &str) -> Event {
    Event {
        seq,
        conversation_id: Arc::from(conversation),
        turn_id: Some(Arc::from("t1")),
        name: EventName::Delta,
        data: Arc::from(data),
        created_at: 4_000 + seq,
    }
}

/// A user `alice` with one conversation `c1`, the setting of most stories.
async fn alice_with_conversation(store: &dyn Store, balance: Option<i64>) {
    store.create_user(&user("alice", balance)).await.expect("create alice");
    store.create_conversation(&conversation("alice", "c1", 10)).await.expect("create c1");
}

/// An assistant message with every field a provider can fill, to check the
/// JSON columns come back exactly.
fn rich_assistant() -> Message {
    Message {
        role: Role::Assistant,
        content: None,
        parts: vec![
            Part::Thinking {
                text: "let me add".into(),
                signature: Some(ProviderOpaque { provider: "anthropic".into(), data: "EqQBCkYI==".into() }),
            },
            Part::Image { media_id: Some("m1".into()), url: None, data: None, mime_type: Some("image/png".into()) },
        ],
        tool_calls: vec![ToolCall {
            id: "call_1".into(),
            name: "add".into(),
            arguments: json!({"b": 2, "a": [1, {"z": null}]}),
            signature: Some(ProviderOpaque { provider: "gemini".into(), data: "sig".into() }),
        }],
        tool_call_id: None,
        tool_name: None,
        tool_status: None,
    }
}

// ---------------------------------------------------------------- stories

async fn story_users_and_keys(store: Arc<dyn Store>) {
    assert_eq!(store.count_users().await.expect("count"), 0);
    let mut admin = user("u-admin", None);
    admin.is_admin = true;
    store.create_user(&admin).await.expect("create admin");
    store.create_user(&user("u-bob", Some(500))).await.expect("create bob");
    assert_eq!(store.count_users().await.expect("count"), 2);

    let mut same_name = user("u-other", None);
    same_name.name = admin.name.clone();
    assert!(matches!(store.create_user(&same_name).await, Err(StoreError::Conflict(_))));
    assert_eq!(store.count_users().await.expect("count"), 2);

    assert_eq!(store.user_by_name(&admin.name).await.expect("by name"), Some(admin.clone()));
    assert_eq!(store.user("u-bob").await.expect("by id"), Some(user("u-bob", Some(500))));
    assert_eq!(store.user("nobody").await.expect("by id"), None);
    assert_eq!(store.user_by_name("nobody").await.expect("by name"), None);

    let key = ApiKey {
        id: "k1".into(),
        user_id: "u-admin".into(),
        key_hash: "ab".repeat(32),
        prefix: "arb_1234".into(),
        created_at: 5,
    };
    store.create_api_key(&key).await.expect("create key");
    assert_eq!(store.user_by_key_hash(&key.key_hash).await.expect("lookup"), Some(admin));
    assert_eq!(store.user_by_key_hash(&"cd".repeat(32)).await.expect("lookup"), None);

    let same_hash = ApiKey { id: "k2".into(), user_id: "u-bob".into(), ..key.clone() };
    assert!(matches!(store.create_api_key(&same_hash).await, Err(StoreError::Conflict(_))));
    let orphan = ApiKey { id: "k3".into(), user_id: "nobody".into(), key_hash: "ef".repeat(32), ..key };
    assert!(matches!(store.create_api_key(&orphan).await, Err(StoreError::NotFound)));
}

async fn story_conversations_page_newest_first(store: Arc<dyn Store>) {
    store.create_user(&user("alice", None)).await.expect("alice");
    // Two pairs share a created_at: the id breaks the tie, descending.
    let stamps = [("a", 10), ("b", 20), ("c", 20), ("d", 30), ("e", 40), ("f", 40)];
    for (id, created_at) in stamps {
        store.create_conversation(&conversation("alice", id, created_at)).await.expect("create");
    }
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = store.list_conversations("alice", cursor.as_ref(), 4).await.expect("page");
        assert!(page.len() <= 4);
        let Some(last) = page.last() else { break };
        cursor = Some(ConversationCursor { created_at: last.created_at, id: last.id.clone() });
        seen.extend(page.iter().map(|c| c.id.clone()));
    }
    assert_eq!(seen, ["f", "e", "d", "c", "b", "a"]);

    let first = store.list_conversations("alice", None, 2).await.expect("first page");
    assert_eq!(first[0], conversation("alice", "f", 40));
    let after_tie = store
        .list_conversations("alice", Some(&ConversationCursor { created_at: 20, id: "c".into() }), 10)
        .await
        .expect("page after c");
    let ids: Vec<_> = after_tie.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["b", "a"]);
}

async fn story_owners_see_only_their_conversations(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, None).await;
    store.create_user(&user("bob", None)).await.expect("bob");

    assert_eq!(store.conversation("bob", "c1").await.expect("read"), None);
    assert_eq!(store.conversation_for_turn("bob", "c1").await.expect("read"), None);
    // Read with its owner's credits: alice is unlimited.
    let for_turn = store.conversation_for_turn("alice", "c1").await.expect("read");
    assert_eq!(for_turn, Some((conversation("alice", "c1", 10), None)));
    assert!(store.list_conversations("bob", None, 10).await.expect("list").is_empty());
    let update = ConversationUpdate { title: Some("mine now".into()), updated_at: 99, ..ConversationUpdate::default() };
    assert!(matches!(store.update_conversation("bob", "c1", &update).await, Err(StoreError::NotFound)));
    assert!(matches!(store.delete_conversation("bob", "c1").await, Err(StoreError::NotFound)));
    // Alice's conversation is untouched by bob's attempts.
    assert_eq!(store.conversation("alice", "c1").await.expect("read"), Some(conversation("alice", "c1", 10)));
    // A turn is only found through its own conversation.
    store.create_conversation(&conversation("bob", "c2", 11)).await.expect("bob's conversation");
    store.insert_turn(&turn("c1", "t1", TurnStatus::Queued, 1)).await.expect("turn");
    assert_eq!(store.turn("c2", "t1").await.expect("read"), None);
    assert!(store.turn("c1", "t1").await.expect("read").is_some());
}

async fn story_conversation_update_and_delete_cascade(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, Some(1_000)).await;
    let update = ConversationUpdate {
        title: Some("renamed".into()),
        system_prompt: Some("be brief".into()),
        model: None,
        updated_at: 77,
    };
    let updated = store.update_conversation("alice", "c1", &update).await.expect("update");
    let mut expected = conversation("alice", "c1", 10);
    expected.title = Some("renamed".into());
    expected.system_prompt = Some("be brief".into());
    expected.updated_at = 77;
    assert_eq!(updated, expected);
    assert_eq!(store.conversation("alice", "c1").await.expect("read"), Some(expected));

    store
        .append_messages(
            &[node("c1", "u1", None, Message::user("hi")), node("c1", "a1", Some("u1"), Message::assistant("hello"))],
            20,
        )
        .await
        .expect("append");
    store.insert_turn(&turn("c1", "t1", TurnStatus::Running, 1)).await.expect("turn");
    store.append_events(&[event("c1", 1, "{}"), event("c1", 2, "{}")]).await.expect("events");
    store.record_call(&call("call1", "alice", "c1", "t1", 100), None).await.expect("call");

    store.delete_conversation("alice", "c1").await.expect("delete");
    assert_eq!(store.conversation("alice", "c1").await.expect("read"), None);
    assert!(store.messages("c1").await.expect("messages").is_empty());
    assert_eq!(store.message("c1", "u1").await.expect("message"), None);
    assert_eq!(store.turn("c1", "t1").await.expect("turn"), None);
    assert!(store.turns_with_status(&[TurnStatus::Running]).await.expect("turns").is_empty());
    assert!(store.events_after("c1", 0, 10).await.expect("events").is_empty());
    assert_eq!(store.last_event_seq("c1").await.expect("seq"), 0);
    // Billing history outlives the conversation.
    assert_eq!(store.api_calls("t1").await.expect("calls").len(), 1);
    assert_eq!(store.ledger("alice", 10).await.expect("ledger").len(), 1);
    assert!(matches!(store.delete_conversation("alice", "c1").await, Err(StoreError::NotFound)));
    // The id is free again.
    store.create_conversation(&conversation("alice", "c1", 12)).await.expect("recreate");
    assert!(store.messages("c1").await.expect("messages").is_empty());
}

async fn story_messages_keep_tree_and_order(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, None).await;
    // Ids that do not sort in creation order, so order must come from the
    // store's own sequence.
    let user_message = node("c1", "zz", None, Message::user("add 1 and 2"));
    let mut assistant = node("c1", "mm", Some("zz"), rich_assistant());
    assistant.model = Some("claude".into());
    assistant.provider = Some("anthropic".into());
    assistant.turn_id = Some("t1".into());
    let tool =
        node("c1", "aa", Some("mm"), Message::tool_result(&rich_assistant().tool_calls[0], ToolStatus::Success, "3"));
    let version = store.append_messages(&[user_message.clone(), assistant.clone()], 50).await.expect("append");
    assert_eq!(version, 1);
    let version = store.append_messages(std::slice::from_ref(&tool), 60).await.expect("append");
    assert_eq!(version, 2);

    let conversation = store.conversation("alice", "c1").await.expect("read").expect("exists");
    assert_eq!(conversation.head_id.as_deref(), Some("aa"));
    assert_eq!(conversation.head_version, 2);
    assert_eq!(conversation.updated_at, 60);

    let all = store.messages("c1").await.expect("messages");
    assert_eq!(all, vec![user_message.clone(), assistant.clone(), tool]);
    assert_eq!(store.message("c1", "mm").await.expect("message"), Some(assistant.clone()));
    assert_eq!(store.message("c1", "nope").await.expect("message"), None);

    // A sibling branch: the same parent, a new reply.
    let sibling = node("c1", "b2", Some("zz"), Message::assistant("another"));
    store.append_messages(std::slice::from_ref(&sibling), 70).await.expect("branch");
    assert_eq!(store.messages("c1").await.expect("messages").len(), 4);

    // The same id in another conversation is another message.
    store.create_conversation(&conversation_for("alice", "c2")).await.expect("c2");
    store.append_messages(&[node("c2", "zz", None, Message::user("other"))], 80).await.expect("same id elsewhere");
    assert_eq!(store.message("c2", "zz").await.expect("message").and_then(|n| n.message.content), Some("other".into()));

    // Keeping an interrupted reply: content and status change in place.
    let mut interrupted = assistant;
    interrupted.message.content = Some("partial".into());
    interrupted.message.tool_calls.clear();
    interrupted.status = NodeStatus::Interrupted;
    store.update_message(&interrupted).await.expect("update message");
    assert_eq!(store.message("c1", "mm").await.expect("message"), Some(interrupted.clone()));
    let order: Vec<_> = store.messages("c1").await.expect("messages").into_iter().map(|n| n.id).collect();
    assert_eq!(order, ["zz", "mm", "aa", "b2"], "updates keep the order");
    let mut missing = interrupted;
    missing.id = "never".into();
    assert!(matches!(store.update_message(&missing).await, Err(StoreError::NotFound)));
}

fn conversation_for(owner: &str, id: &str) -> Conversation {
    conversation(owner, id, 20)
}

async fn story_append_is_all_or_nothing(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, None).await;
    store.append_messages(&[node("c1", "u1", None, Message::user("hi"))], 10).await.expect("append");

    // A batch whose second node reuses an id: nothing of it is written.
    let result = store
        .append_messages(
            &[
                node("c1", "a1", Some("u1"), Message::assistant("new")),
                node("c1", "u1", Some("a1"), Message::user("again")),
            ],
            20,
        )
        .await;
    assert!(matches!(result, Err(StoreError::Conflict(_))), "{result:?}");
    // A batch repeating an id within itself.
    let result = store
        .append_messages(
            &[node("c1", "x", Some("u1"), Message::user("one")), node("c1", "x", Some("u1"), Message::user("two"))],
            20,
        )
        .await;
    assert!(matches!(result, Err(StoreError::Conflict(_))), "{result:?}");
    // A parent that is not in the conversation.
    let result = store.append_messages(&[node("c1", "y", Some("ghost"), Message::user("orphan"))], 20).await;
    assert!(matches!(result, Err(StoreError::NotFound)), "{result:?}");
    // A conversation that does not exist.
    let result = store.append_messages(&[node("c404", "y", None, Message::user("lost"))], 20).await;
    assert!(matches!(result, Err(StoreError::NotFound)), "{result:?}");

    let all = store.messages("c1").await.expect("messages");
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].message.content.as_deref(), Some("hi"));
    let conversation = store.conversation("alice", "c1").await.expect("read").expect("exists");
    assert_eq!(conversation.head_id.as_deref(), Some("u1"));
    assert_eq!(conversation.head_version, 1, "failed appends move nothing");
    assert_eq!(conversation.updated_at, 10);
}

async fn story_head_moves_with_optimistic_version(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, None).await;
    let version = store
        .append_messages(
            &[node("c1", "u1", None, Message::user("hi")), node("c1", "a1", Some("u1"), Message::assistant("hello"))],
            10,
        )
        .await
        .expect("append");
    assert_eq!(version, 1);

    let result = store.set_head("c1", Some("u1"), Some(0), 20).await;
    assert!(matches!(result, Err(StoreError::HeadVersionMismatch { current: 1 })), "{result:?}");
    let head = store.conversation("alice", "c1").await.expect("read").expect("exists");
    assert_eq!(head.head_id.as_deref(), Some("a1"), "a mismatch moves nothing");
    assert_eq!(head.head_version, 1);

    assert_eq!(store.set_head("c1", Some("u1"), Some(1), 30).await.expect("move"), 2);
    assert_eq!(store.set_head("c1", None, None, 40).await.expect("clear"), 3);
    let head = store.conversation("alice", "c1").await.expect("read").expect("exists");
    assert_eq!((head.head_id, head.head_version, head.updated_at), (None, 3, 40));

    assert!(matches!(store.set_head("c1", Some("ghost"), None, 50).await, Err(StoreError::NotFound)));
    assert!(matches!(store.set_head("c404", None, None, 50).await, Err(StoreError::NotFound)));
    assert_eq!(store.conversation("alice", "c1").await.expect("read").expect("exists").head_version, 3);
}

async fn story_one_running_turn_per_conversation(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, None).await;
    store.create_conversation(&conversation("alice", "c2", 11)).await.expect("c2");
    let mut first = turn("c1", "t1", TurnStatus::Running, 1);
    first.started_at = Some(2);
    store.insert_turn(&first).await.expect("first runs");

    let result = store.insert_turn(&turn("c1", "t2", TurnStatus::Running, 3)).await;
    assert!(matches!(result, Err(StoreError::Conflict(_))), "{result:?}");
    assert_eq!(store.turn("c1", "t2").await.expect("read"), None);

    // Queued beside it is fine, and so is running in another conversation.
    store.insert_turn(&turn("c1", "t3", TurnStatus::Queued, 4)).await.expect("queued");
    store.insert_turn(&turn("c1", "t4", TurnStatus::Queued, 5)).await.expect("queued");
    store.insert_turn(&turn("c2", "t5", TurnStatus::Running, 6)).await.expect("another conversation");
    assert!(matches!(store.insert_turn(&turn("c404", "t6", TurnStatus::Queued, 7)).await, Err(StoreError::NotFound)));

    // Promoting a queued turn while the first runs is refused too.
    let mut next = turn("c1", "t3", TurnStatus::Running, 4);
    let result = store.update_turn(&next).await;
    assert!(matches!(result, Err(StoreError::Conflict(_))), "{result:?}");
    assert_eq!(store.turn("c1", "t3").await.expect("read").map(|t| t.status), Some(TurnStatus::Queued));

    // Queue order is creation order.
    let queued: Vec<_> =
        store.turns_with_status(&[TurnStatus::Queued]).await.expect("queued").into_iter().map(|t| t.id).collect();
    assert_eq!(queued, ["t3", "t4"]);

    // Finishing the first frees the slot; its totals are kept.
    first.status = TurnStatus::Succeeded;
    first.iterations = 3;
    first.usage =
        Usage { input_tokens: 10, output_tokens: 20, thinking_tokens: 3, cached_tokens: 4, cache_write_tokens: 5 };
    first.cost_micro_usd = 1234;
    first.reply_message_id = Some("a1".into());
    first.finished_at = Some(9);
    store.update_turn(&first).await.expect("finish");
    assert_eq!(store.turn("c1", "t1").await.expect("read"), Some(first));
    next.started_at = Some(10);
    store.update_turn(&next).await.expect("next runs");
    assert_eq!(store.turn("c1", "t3").await.expect("read"), Some(next));

    let running: Vec<_> = store
        .turns_with_status(&[TurnStatus::Running, TurnStatus::Succeeded])
        .await
        .expect("running")
        .into_iter()
        .map(|t| t.id)
        .collect();
    assert_eq!(running, ["t1", "t3", "t5"]);
    assert!(store.turns_with_status(&[]).await.expect("none asked").is_empty());
    assert!(matches!(store.update_turn(&turn("c1", "ghost", TurnStatus::Failed, 1)).await, Err(StoreError::NotFound)));
}

async fn story_concurrent_turn_claims_admit_one(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, None).await;
    let claims: Vec<_> = (0..12)
        .map(|index| {
            let store = store.clone();
            tokio::spawn(async move {
                store.insert_turn(&turn("c1", &format!("t{index}"), TurnStatus::Running, index)).await
            })
        })
        .collect();
    let mut admitted = 0;
    for claim in claims {
        match claim.await.expect("task") {
            Ok(()) => admitted += 1,
            Err(StoreError::Conflict(_)) => {}
            Err(other) => panic!("unexpected error {other:?}"),
        }
    }
    assert_eq!(admitted, 1);
    assert_eq!(store.turns_with_status(&[TurnStatus::Running]).await.expect("running").len(), 1);
}

async fn story_record_call_charges_atomically(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, Some(10_000)).await;
    store.append_messages(&[node("c1", "u1", None, Message::user("hi"))], 10).await.expect("user message");

    let mut reply = node("c1", "a1", Some("u1"), Message::assistant("hello"));
    reply.turn_id = Some("t1".into());
    let first = call("call1", "alice", "c1", "t1", 2_500);
    let entry = store.record_call(&first, Some(&reply)).await.expect("record");
    assert_eq!(
        entry,
        LedgerEntry {
            id: "call1".into(),
            user_id: "alice".into(),
            api_call_id: "call1".into(),
            credits: 2_500,
            balance_after: Some(7_500),
            created_at: 3_000,
        }
    );
    assert_eq!(store.message("c1", "a1").await.expect("read"), Some(reply.clone()));
    assert_eq!(store.user("alice").await.expect("read").and_then(|u| u.balance_credits), Some(7_500));

    // A second call updates the same message in place (the reply grew).
    reply.message.content = Some("hello there".into());
    reply.message.tool_calls = rich_assistant().tool_calls;
    let mut second = call("call2", "alice", "c1", "t1", 8_000);
    second.created_at = 3_001;
    let entry = store.record_call(&second, Some(&reply)).await.expect("record");
    // Recorded spend is real spend: the balance may go below zero.
    assert_eq!(entry.balance_after, Some(-500));
    assert_eq!(store.message("c1", "a1").await.expect("read"), Some(reply));
    assert_eq!(store.messages("c1").await.expect("messages").len(), 2);

    // A failing call (its id is taken) writes nothing: no message, no charge.
    let mut third = call("call1", "alice", "c1", "t1", 1_000);
    third.created_at = 3_002;
    let ghost = node("c1", "a2", Some("u1"), Message::assistant("ghost"));
    assert!(matches!(store.record_call(&third, Some(&ghost)).await, Err(StoreError::Conflict(_))));
    assert_eq!(store.message("c1", "a2").await.expect("read"), None);
    assert_eq!(store.user("alice").await.expect("read").and_then(|u| u.balance_credits), Some(-500));

    let calls = store.api_calls("t1").await.expect("calls");
    assert_eq!(calls, vec![first, second]);
    let ledger = store.ledger("alice", 10).await.expect("ledger");
    let ids: Vec<_> = ledger.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["call2", "call1"], "newest first");
    assert_eq!(store.ledger("alice", 1).await.expect("ledger").len(), 1);

    // Unlimited users are charged on the ledger, with no balance.
    store.create_user(&user("bob", None)).await.expect("bob");
    let entry = store.record_call(&call("call3", "bob", "c1", "t9", 700), None).await.expect("record");
    assert_eq!((entry.credits, entry.balance_after), (700, None));

    store.set_balance("bob", Some(42)).await.expect("set balance");
    assert_eq!(store.user("bob").await.expect("read").and_then(|u| u.balance_credits), Some(42));
    store.set_balance("bob", None).await.expect("unlimited");
    assert_eq!(store.user("bob").await.expect("read").and_then(|u| u.balance_credits), None);
    assert!(matches!(store.set_balance("nobody", Some(1)).await, Err(StoreError::NotFound)));
    assert!(matches!(
        store.record_call(&call("call4", "nobody", "c1", "t9", 1), None).await,
        Err(StoreError::NotFound)
    ));
}

async fn story_concurrent_charges_add_up(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, Some(100_000)).await;
    let tasks: Vec<_> = (0..24u64)
        .map(|index| {
            let store = store.clone();
            tokio::spawn(async move {
                let charge = call(&format!("call{index}"), "alice", "c1", "t1", 100 + index);
                store.record_call(&charge, None).await
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task").expect("record");
    }
    let spent: i64 = (0..24).map(|index| 100 + index).sum();
    assert_eq!(store.user("alice").await.expect("read").and_then(|u| u.balance_credits), Some(100_000 - spent));
    let ledger = store.ledger("alice", 100).await.expect("ledger");
    assert_eq!(ledger.len(), 24);
    let lowest = ledger.iter().filter_map(|entry| entry.balance_after).min().expect("balances");
    assert_eq!(lowest, 100_000 - spent, "each charge saw the previous ones");
}

async fn story_events_replay_in_order(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, None).await;
    store.create_conversation(&conversation("alice", "c2", 11)).await.expect("c2");
    assert_eq!(store.last_event_seq("c1").await.expect("seq"), 0);

    // Payload bytes come back exactly as written (spacing, key order).
    let payloads = [r#"{"text": "Hel"}"#, r#"{"text":"lo"}"#, r#"{"z":1,"a":2}"#, "{\"text\":\"é\\n\"}", "{}"];
    let events: Vec<_> = payloads.iter().zip(1..).map(|(data, seq)| event("c1", seq, data)).collect();
    store.append_events(&events[..3]).await.expect("first batch");
    store.append_events(&events[3..]).await.expect("second batch");
    store.append_events(&[event("c2", 1, "{}")]).await.expect("other conversation");
    store.append_events(&[]).await.expect("empty batch");

    assert_eq!(store.events_after("c1", 0, 100).await.expect("all"), events);
    assert_eq!(store.events_after("c1", 2, 2).await.expect("page"), events[2..4].to_vec());
    assert!(store.events_after("c1", 5, 10).await.expect("none").is_empty());
    assert_eq!(store.last_event_seq("c1").await.expect("seq"), 5);
    assert_eq!(store.last_event_seq("c2").await.expect("seq"), 1);

    // A reused seq is a conflict, and the batch holding it writes nothing.
    let result = store.append_events(&[event("c1", 6, "{}"), event("c1", 3, r#"{"other":true}"#)]).await;
    assert!(matches!(result, Err(StoreError::Conflict(_))), "{result:?}");
    for reused in [1, 2, 4] {
        let result = store.append_events(&[event("c1", reused, "{}")]).await;
        assert!(matches!(result, Err(StoreError::Conflict(_))), "{reused}: {result:?}");
    }
    assert_eq!(store.last_event_seq("c1").await.expect("seq"), 5);
    assert_eq!(store.events_after("c1", 2, 1).await.expect("page")[0].data.as_ref(), payloads[2]);
    // Events of a conversation that is gone are dropped, and the rest of
    // their batch is stored.
    store.append_events(&[event("c404", 1, "{}")]).await.expect("nothing to store");
    assert!(store.events_after("c404", 0, 10).await.expect("none").is_empty());
    store.delete_conversation("alice", "c2").await.expect("deleted");
    store
        .append_events(&[event("c2", 2, r#"{"late":true}"#), event("c404", 2, "{}")])
        .await
        .expect("only events of missing conversations");
    let mut kept = event("c1", 6, r#"{"kept":true}"#);
    kept.turn_id = None;
    let mixed = [event("c2", 3, "{}"), kept.clone(), event("c404", 3, "{}")];
    store.append_events(&mixed).await.expect("the others are stored");
    assert_eq!(store.events_after("c1", 5, 10).await.expect("tail"), vec![kept]);
    assert!(store.events_after("c2", 0, 10).await.expect("gone").is_empty());

    let mut untagged = event("c1", 7, r#"{"turn_id":null}"#);
    untagged.turn_id = None;
    untagged.name = EventName::HeadMoved;
    store.append_events(std::slice::from_ref(&untagged)).await.expect("no turn");
    assert_eq!(store.events_after("c1", 6, 10).await.expect("tail"), vec![untagged]);
}

// ------------------------------------------- several nodes: notices, quota, leases

async fn next_notice(receiver: &mut tokio::sync::broadcast::Receiver<Notice>) -> Notice {
    tokio::time::timeout(std::time::Duration::from_secs(10), receiver.recv())
        .await
        .expect("a notice within 10 s")
        .expect("the notice channel is open")
}

fn sample_notices() -> Vec<Notice> {
    vec![
        Notice::Events { conversation_id: "c1".into(), seq: 41 },
        Notice::CancelTurn { conversation_id: "c1".into(), turn_id: "t1".into() },
        Notice::HeadMoved { conversation_id: "c1".into(), head_id: None, head_version: 7 },
        Notice::TurnFinished { conversation_id: "c1".into(), turn_id: "t1".into() },
    ]
}

async fn story_notices_reach_listeners(store: Arc<dyn Store>) {
    // Sending with nobody listening is fine.
    store.notify(&sample_notices()[0]).await.expect("notify nobody");
    let mut first = store.listen().await.expect("listen");
    let mut second = store.listen().await.expect("listen again");
    for notice in sample_notices() {
        store.notify(&notice).await.expect("notify");
    }
    for notice in sample_notices() {
        assert_eq!(next_notice(&mut first).await, notice);
        assert_eq!(next_notice(&mut second).await, notice);
    }
}

async fn story_notices_cross_nodes(node_a: Arc<dyn Store>, node_b: Arc<dyn Store>) {
    let mut on_b = node_b.listen().await.expect("listen on b");
    let mut on_a = node_a.listen().await.expect("listen on a");
    for notice in sample_notices() {
        node_a.notify(&notice).await.expect("notify from a");
    }
    for notice in sample_notices() {
        assert_eq!(next_notice(&mut on_b).await, notice, "b hears a");
        assert_eq!(next_notice(&mut on_a).await, notice, "a hears itself");
    }
}

async fn story_numbered_events_wake_the_other_node(node_a: Arc<dyn Store>, node_b: Arc<dyn Store>) {
    alice_with_conversation(&*node_a, None).await;
    let mut on_a = node_a.listen().await.expect("listen on a");
    let mut on_b = node_b.listen().await.expect("listen on b");
    let batch = [event("c1", 0, "{}"), event("c1", 0, r#"{"b":1}"#)];
    node_a.append_events_numbered(&batch).await.expect("numbered on a");
    assert_eq!(next_notice(&mut on_b).await, Notice::Events { conversation_id: "c1".into(), seq: 2 }, "b hears a");
    // Notices arrive in commit order: had the batch's reached a, it would
    // come before this one.
    let marker = Notice::TurnFinished { conversation_id: "c1".into(), turn_id: "marker".into() };
    node_a.notify(&marker).await.expect("notify from a");
    assert_eq!(next_notice(&mut on_a).await, marker, "a's own batch does not wake a");
    assert_eq!(next_notice(&mut on_b).await, marker);
}

fn reservation(id: &str, user: &str, credits: i64, expires_at: i64) -> Reservation {
    Reservation { id: id.into(), user_id: user.into(), credits, created_at: 100, expires_at }
}

async fn balance(store: &dyn Store, user_id: &str) -> Option<i64> {
    store.user(user_id).await.expect("read user").expect("user exists").balance_credits
}

async fn story_reservations_hold_and_settle(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, Some(1_000)).await;
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(1_000));
    assert_eq!(
        store.reserve_credits(&reservation("r1", "alice", 600, 10_000)).await.expect("reserve"),
        ReserveOutcome::Reserved { available_after: Some(400) }
    );
    assert_eq!(
        store.reserve_credits(&reservation("r2", "alice", 500, 10_000)).await.expect("reserve"),
        ReserveOutcome::Insufficient { available: 400 }
    );
    // A refused reservation holds nothing, and the balance is untouched.
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(400));
    let (_, available) = store.conversation_for_turn("alice", "c1").await.expect("read").expect("c1");
    assert_eq!(available, Some(400), "read with the conversation, the hold counts too");
    assert_eq!(balance(&*store, "alice").await, Some(1_000));

    // Settling gives the hold back and charges the real cost, atomically.
    let mut reply = node("c1", "a1", None, Message::assistant("hi"));
    reply.turn_id = Some("t1".into());
    let entry =
        store.settle_reservation("r1", &call("call1", "alice", "c1", "t1", 550), Some(&reply)).await.expect("settle");
    assert_eq!((entry.credits, entry.balance_after), (550, Some(450)));
    assert_eq!(balance(&*store, "alice").await, Some(450));
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(450));
    assert_eq!(store.message("c1", "a1").await.expect("read"), Some(reply));
    // A failed settle (the call id is taken) keeps the hold and charges nothing.
    store.reserve_credits(&reservation("r3", "alice", 100, 10_000)).await.expect("reserve");
    assert!(matches!(
        store.settle_reservation("r3", &call("call1", "alice", "c1", "t1", 10), None).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(350));
    assert!(store.release_reservation("r3").await.expect("release"));
    assert!(!store.release_reservation("r3").await.expect("released twice"));
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(450));

    // A reused reservation id holds nothing more.
    store.reserve_credits(&reservation("r4", "alice", 200, 150)).await.expect("reserve");
    assert!(matches!(store.reserve_credits(&reservation("r4", "alice", 50, 150)).await, Err(StoreError::Conflict(_))));
    store.reserve_credits(&reservation("r5", "alice", 100, 500)).await.expect("reserve");
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(150));
    // Reservations a dead node left behind come back when they expire.
    assert_eq!(store.release_expired_reservations(200).await.expect("expire"), 1);
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(350));
    // Settling a reservation that already expired still charges the call.
    assert_eq!(store.release_expired_reservations(1_000).await.expect("expire"), 1);
    let entry =
        store.settle_reservation("r5", &call("call2", "alice", "c1", "t1", 50), None).await.expect("settle expired");
    assert_eq!(entry.balance_after, Some(400));
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(400));

    // Unlimited users always get their reservation.
    store.create_user(&user("bob", None)).await.expect("bob");
    assert_eq!(
        store.reserve_credits(&reservation("r6", "bob", i64::from(u32::MAX), 10_000)).await.expect("reserve"),
        ReserveOutcome::Reserved { available_after: None }
    );
    assert_eq!(store.available_credits("bob").await.expect("available"), None);
    assert!(matches!(store.reserve_credits(&reservation("r7", "nobody", 1, 10_000)).await, Err(StoreError::NotFound)));
    assert!(matches!(store.available_credits("nobody").await, Err(StoreError::NotFound)));
}

async fn story_concurrent_reservations_never_overspend(node_a: Arc<dyn Store>, node_b: Arc<dyn Store>) {
    alice_with_conversation(&*node_a, Some(1_000)).await;
    // Fifty calls of one user, spread over both nodes, each wanting 30.
    let attempts: Vec<_> = (0..50)
        .map(|index| {
            let store = if index % 2 == 0 { node_a.clone() } else { node_b.clone() };
            tokio::spawn(async move {
                let id = format!("r{index}");
                let outcome = store.reserve_credits(&reservation(&id, "alice", 30, 10_000)).await.expect("reserve");
                (store, id, outcome)
            })
        })
        .collect();
    let mut granted = Vec::new();
    for attempt in attempts {
        let (store, id, outcome) = attempt.await.expect("task");
        match outcome {
            ReserveOutcome::Reserved { available_after } => {
                assert!(available_after.expect("limited user") >= 0);
                granted.push((store, id));
            }
            ReserveOutcome::Insufficient { available } => assert!(available < 30),
        }
    }
    assert_eq!(granted.len(), 33, "1000 credits hold 33 calls of 30");
    assert_eq!(node_b.available_credits("alice").await.expect("available"), Some(10));

    // Every granted call settles at its reserved cost, concurrently.
    let settles: Vec<_> = granted
        .into_iter()
        .map(|(store, id)| {
            tokio::spawn(async move {
                let charge = call(&format!("call-{id}"), "alice", "c1", "t1", 30);
                store.settle_reservation(&id, &charge, None).await
            })
        })
        .collect();
    for settle in settles {
        settle.await.expect("task").expect("settle");
    }
    assert_eq!(balance(&*node_a, "alice").await, Some(10));
    assert_eq!(node_a.available_credits("alice").await.expect("available"), Some(10));
    assert_eq!(node_b.ledger("alice", 100).await.expect("ledger").len(), 33);
}

async fn story_turn_leases(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, None).await;
    store.create_conversation(&conversation("alice", "c2", 11)).await.expect("c2");
    store.insert_turn(&turn("c1", "t1", TurnStatus::Running, 1)).await.expect("running");
    store.insert_turn(&turn("c1", "t2", TurnStatus::Queued, 2)).await.expect("queued");
    store.insert_turn(&turn("c2", "t3", TurnStatus::Running, 3)).await.expect("running without a lease");

    assert_eq!(store.turn_lease("t1").await.expect("lease"), None);
    assert!(store.renew_lease("t1", "node-a", 100).await.expect("claim"));
    assert!(store.renew_lease("t1", "node-a", 200).await.expect("renew"));
    assert!(
        !store.renew_lease("t1", "node-b", 300).await.expect("steal"),
        "a lease held by another node is not renewed"
    );
    assert!(!store.renew_lease("t2", "node-a", 300).await.expect("queued"), "only running turns carry leases");
    assert_eq!(store.turn_lease("t1").await.expect("lease"), Some(("node-a".into(), 200)));

    assert!(
        store.expired_running_turns(200).await.expect("expired").iter().any(|t| t.id == "t1"),
        "a lease that ends at `now` has expired"
    );
    assert!(store.expired_running_turns(199).await.expect("expired").is_empty());
    assert!(!store.take_over_turn("t1", "node-b", 150, 400).await.expect("early"), "a live lease cannot be taken over");
    assert!(store.take_over_turn("t1", "node-b", 250, 400).await.expect("take over"));
    assert!(!store.take_over_turn("t1", "node-c", 250, 400).await.expect("late"), "only one node takes a turn over");
    assert!(!store.renew_lease("t1", "node-a", 500).await.expect("old owner"), "the old owner learns it lost the turn");
    assert_eq!(store.turn_lease("t1").await.expect("lease"), Some(("node-b".into(), 400)));

    // The new owner ends the turn; finished turns are never expired.
    let mut interrupted = turn("c1", "t1", TurnStatus::Interrupted, 1);
    interrupted.finished_at = Some(260);
    store.update_turn(&interrupted).await.expect("interrupt");
    assert!(
        store.expired_running_turns(10_000).await.expect("expired").is_empty(),
        "neither finished turns nor turns without a lease are listed"
    );
    assert!(!store.take_over_turn("t1", "node-c", 10_000, 20_000).await.expect("finished"));
}

async fn story_one_node_takes_over_an_expired_turn(node_a: Arc<dyn Store>, node_b: Arc<dyn Store>) {
    alice_with_conversation(&*node_a, None).await;
    node_a.insert_turn(&turn("c1", "t1", TurnStatus::Running, 1)).await.expect("running");
    assert!(node_a.renew_lease("t1", "node-a", 100).await.expect("lease"));
    let expired = node_b.expired_running_turns(1_000).await.expect("expired");
    assert_eq!(expired.len(), 1);
    let races: Vec<_> = (0..16)
        .map(|index| {
            let store = if index % 2 == 0 { node_a.clone() } else { node_b.clone() };
            tokio::spawn(async move {
                store.take_over_turn("t1", &format!("node-{index}"), 1_000, 5_000).await.expect("take over")
            })
        })
        .collect();
    let mut winners = 0;
    for race in races {
        if race.await.expect("task") {
            winners += 1;
        }
    }
    assert_eq!(winners, 1);
}

async fn story_running_turn_is_unique_across_nodes(node_a: Arc<dyn Store>, node_b: Arc<dyn Store>) {
    alice_with_conversation(&*node_a, None).await;
    let claims: Vec<_> = (0..16)
        .map(|index| {
            let store = if index % 2 == 0 { node_a.clone() } else { node_b.clone() };
            tokio::spawn(async move {
                store.insert_turn(&turn("c1", &format!("t{index}"), TurnStatus::Running, index)).await
            })
        })
        .collect();
    let mut admitted = 0;
    for claim in claims {
        match claim.await.expect("task") {
            Ok(()) => admitted += 1,
            Err(StoreError::Conflict(_)) => {}
            Err(other) => panic!("unexpected error {other:?}"),
        }
    }
    assert_eq!(admitted, 1);
}

async fn story_both_nodes_see_every_write(node_a: Arc<dyn Store>, node_b: Arc<dyn Store>) {
    alice_with_conversation(&*node_a, None).await;
    node_a.append_messages(&[node("c1", "u1", None, Message::user("hi"))], 10).await.expect("append on a");
    node_b
        .append_messages(&[node("c1", "a1", Some("u1"), Message::assistant("hello"))], 20)
        .await
        .expect("append on b");
    // The same id from the other node is still a conflict.
    assert!(matches!(
        node_b.append_messages(&[node("c1", "u1", None, Message::user("again"))], 30).await,
        Err(StoreError::Conflict(_))
    ));
    node_a.append_events(&[event("c1", 1, "{}")]).await.expect("events on a");
    assert!(matches!(node_b.append_events(&[event("c1", 1, "{}")]).await, Err(StoreError::Conflict(_))));
    node_b.append_events(&[event("c1", 2, "{}")]).await.expect("events on b");
    assert_eq!(node_a.last_event_seq("c1").await.expect("seq"), 2);
    let ids: Vec<_> = node_a.messages("c1").await.expect("messages").into_iter().map(|n| n.id).collect();
    assert_eq!(ids, ["u1", "a1"]);
    assert_eq!(node_a.conversation("alice", "c1").await.expect("read").expect("exists").head_version, 2);
    // A head move on one node is checked against the version the other made.
    assert!(matches!(
        node_a.set_head("c1", Some("u1"), Some(1), 40).await,
        Err(StoreError::HeadVersionMismatch { current: 2 })
    ));
}

async fn story_a_large_tree_loads_whole(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, None).await;
    // 10,000 nodes in batches of 500: one long branch with a side reply
    // every tenth node, appended as a busy conversation would grow.
    let mut expected = Vec::with_capacity(10_000);
    let mut parent: Option<String> = None;
    for index in 0..10_000 {
        let id = format!("n{:05}", 10_000 - index);
        let sibling = index % 10 == 9;
        let message = if index % 2 == 0 {
            Message::user(format!("question {index}"))
        } else {
            Message::assistant(format!("answer {index}"))
        };
        expected.push(node("c1", &id, parent.as_deref(), message));
        if !sibling {
            parent = Some(id);
        }
    }
    for batch in expected.chunks(500) {
        store.append_messages(batch, 99).await.expect("append batch");
    }
    let loaded = store.messages("c1").await.expect("load");
    assert_eq!(loaded.len(), 10_000);
    assert!(loaded == expected, "the tree comes back whole, in creation order");
    let head = store.conversation("alice", "c1").await.expect("read").expect("exists");
    assert_eq!(head.head_version, 20);
    assert_eq!(head.head_id.as_deref(), Some("n00001"));
}

async fn story_events_numbered_by_the_store(store: Arc<dyn Store>) {
    alice_with_conversation(&*store, None).await;
    // The seq given is ignored; the store numbers from the last one.
    let stored =
        store.append_events_numbered(&[event("c1", 0, "{}"), event("c1", 0, r#"{"b":1}"#)]).await.expect("numbered");
    let seqs: Vec<_> = stored.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, [1, 2]);
    store.append_events(&[event("c1", 3, "{}")]).await.expect("pre-numbered");
    let stored = store.append_events_numbered(&[event("c1", 99, "{}")]).await.expect("numbered");
    assert_eq!(stored[0].seq, 4);
    assert_eq!(&*stored[0].conversation_id, "c1");
    assert_eq!(store.events_after("c1", 0, 10).await.expect("read").len(), 4);
    assert_eq!(store.events_after("c1", 3, 10).await.expect("read"), stored);
    assert!(store.append_events_numbered(&[]).await.expect("empty").is_empty());
    assert!(store.append_events_numbered(&[event("c404", 0, "{}")]).await.expect("gone").is_empty());

    // Several conversations in one batch: each numbered on its own, in the
    // order given; one that is gone costs the others nothing.
    store.create_conversation(&conversation("alice", "c2", 11)).await.expect("create c2");
    let batch = [
        event("c2", 0, r#"{"c2":1}"#),
        event("c1", 0, r#"{"c1":5}"#),
        event("c404", 0, "{}"),
        event("c2", 0, r#"{"c2":2}"#),
        event("c1", 0, r#"{"c1":6}"#),
    ];
    let stored = store.append_events_numbered(&batch).await.expect("numbered");
    let numbers: Vec<_> = stored.iter().map(|e| (&*e.conversation_id, e.seq, &*e.data)).collect();
    assert_eq!(
        numbers,
        [("c2", 1, r#"{"c2":1}"#), ("c1", 5, r#"{"c1":5}"#), ("c2", 2, r#"{"c2":2}"#), ("c1", 6, r#"{"c1":6}"#)]
    );
    assert_eq!(store.events_after("c1", 4, 10).await.expect("read"), [stored[1].clone(), stored[3].clone()]);
    assert_eq!(store.events_after("c2", 0, 10).await.expect("read"), [stored[0].clone(), stored[2].clone()]);
    assert!(store.events_after("c404", 0, 10).await.expect("read").is_empty());
}

/// A conversation deleted on one node while the other stores its events
/// (its first batch, or a later one): the deletion succeeds and the batch
/// either leaves the conversation out or fails as `NotFound` (the event
/// writer then retries without it), never a deadlock or another error;
/// another conversation in the batch keeps its events.
async fn story_a_deletion_racing_event_batches_is_clean(node_a: Arc<dyn Store>, node_b: Arc<dyn Store>) {
    alice_with_conversation(&*node_a, None).await;
    for round in 0..40 {
        let id = format!("gone{round}");
        node_a.create_conversation(&conversation("alice", &id, 100 + round)).await.expect("create");
        if round % 2 == 1 {
            node_a.append_events_numbered(&[event(&id, 0, "{}")]).await.expect("first batch");
        }
        let batch = [event(&id, 0, "{}"), event("c1", 0, "{}"), event(&id, 0, "{}")];
        let (deleted, stored) =
            tokio::join!(node_a.delete_conversation("alice", &id), node_b.append_events_numbered(&batch));
        deleted.expect("the deletion succeeds");
        match stored {
            Ok(stored) => assert!(stored.iter().any(|e| &*e.conversation_id == "c1"), "c1's event was left out"),
            Err(StoreError::NotFound) => {}
            Err(error) => panic!("round {round}: the batch failed with {error}"),
        }
        assert!(node_b.events_after(&id, 0, 10).await.expect("read").is_empty(), "events outlived their conversation");
    }
}

async fn story_numbered_events_have_no_gaps(node_a: Arc<dyn Store>, node_b: Arc<dyn Store>) {
    alice_with_conversation(&*node_a, None).await;
    node_a.create_conversation(&conversation("alice", "c2", 11)).await.expect("create c2");
    const WRITERS: usize = 30;
    const PER_WRITE: usize = 3;
    let total = (WRITERS * PER_WRITE) as i64;

    // Clients tailing both streams from the other node, as resuming clients
    // would: every read must continue exactly where the last one ended.
    let readers: Vec<_> = ["c1", "c2"]
        .into_iter()
        .map(|conversation| {
            let store = node_b.clone();
            tokio::spawn(async move {
                let mut after = 0;
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                while after < total {
                    assert!(std::time::Instant::now() < deadline, "the tail of {conversation} stalled");
                    let page = store.events_after(conversation, after, 1_000).await.expect("tail");
                    for event in page {
                        assert_eq!(event.seq, after + 1, "a resuming client of {conversation} saw a hole");
                        after = event.seq;
                    }
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    // Every batch holds both conversations, half of them c1 first and half
    // c2 first, from both nodes at once: batches that locked the two in the
    // order given would deadlock.
    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| {
            let store = if writer % 2 == 0 { node_a.clone() } else { node_b.clone() };
            let order = if writer % 4 < 2 { ["c1", "c2"] } else { ["c2", "c1"] };
            tokio::spawn(async move {
                let batch: Vec<_> = order
                    .into_iter()
                    .flat_map(|conversation| {
                        (0..PER_WRITE)
                            .map(move |part| event(conversation, 0, &format!(r#"{{"writer":{writer},"part":{part}}}"#)))
                    })
                    .collect();
                store.append_events_numbered(&batch).await.expect("append")
            })
        })
        .collect();
    for writer in writers {
        let stored = writer.await.expect("task");
        assert_eq!(stored.len(), 2 * PER_WRITE);
        // Each conversation's part of a batch is numbered in one run, in
        // its own order.
        for part in stored.chunks(PER_WRITE) {
            for pair in part.windows(2) {
                assert_eq!(pair[1].conversation_id, pair[0].conversation_id);
                assert_eq!(pair[1].seq, pair[0].seq + 1);
            }
        }
    }
    for reader in readers {
        reader.await.expect("reader");
    }
    assert_eq!(node_a.last_event_seq("c1").await.expect("seq"), total);
    assert_eq!(node_b.last_event_seq("c2").await.expect("seq"), total);
}

/// A queued turn's messages are durable in its row until it starts, and
/// come back exactly, by status as crash recovery reads them.
async fn story_queued_turns_keep_their_messages(store: Arc<dyn Store>) {
    alice_with_conversation(store.as_ref(), None).await;
    let mut queued = turn("c1", "t1", TurnStatus::Queued, 5_000);
    queued.pending_messages =
        vec![node("c1", "q1", None, rich_assistant()), node("c1", "q2", Some("q1"), Message::user("later"))];
    store.insert_turn(&queued).await.expect("queued turn stored");
    let read = store.turn("c1", "t1").await.expect("read").expect("turn");
    assert_eq!(read.pending_messages, queued.pending_messages);
    let waiting = store.turns_with_status(&[TurnStatus::Queued]).await.expect("by status");
    assert_eq!(waiting.len(), 1);
    assert_eq!(waiting[0].pending_messages, queued.pending_messages);

    // Once started, the messages live in the tree and the row lets go of them.
    queued.status = TurnStatus::Running;
    queued.pending_messages.clear();
    store.update_turn(&queued).await.expect("started");
    let read = store.turn("c1", "t1").await.expect("read").expect("turn");
    assert!(read.pending_messages.is_empty());
}

/// The end of a turn in one transaction: the reservation goes back, the
/// reply, call and charge are stored, the head moves, the turn is finished.
async fn story_finish_turn_writes_everything_at_once(store: Arc<dyn Store>) {
    alice_with_conversation(store.as_ref(), Some(1_000)).await;
    store.append_messages(&[node("c1", "u1", None, Message::user("hi"))], 20).await.expect("user message");
    let mut running = turn("c1", "t1", TurnStatus::Running, 30);
    store.insert_turn(&running).await.expect("running");
    let held = store.reserve_credits(&reservation("r1", "alice", 600, 10_000)).await.expect("reserve");
    assert!(matches!(held, ReserveOutcome::Reserved { .. }));
    assert_eq!(store.available_credits("alice").await.expect("read"), Some(400));

    running.status = TurnStatus::Succeeded;
    running.reply_message_id = Some("a1".into());
    running.finished_at = Some(50);
    let reply = Arc::new(node("c1", "a1", Some("u1"), Message::assistant("hello")));
    let before = store.conversation("alice", "c1").await.expect("read").expect("c1").head_version;
    let mut listener = store.listen().await.expect("listen");
    let (entry, head_version) = store
        .finish_turn(&Arc::new(running), call("k1", "alice", "c1", "t1", 250), Some(&reply), Some("r1"), 60)
        .await
        .expect("finished");
    // Announced with the commit, without a `notify` of its own.
    let announced = Notice::TurnFinished { conversation_id: "c1".into(), turn_id: "t1".into() };
    assert_eq!(next_notice(&mut listener).await, announced);
    assert_eq!(entry.credits, 250);
    assert_eq!(entry.balance_after, Some(750));
    assert_eq!(head_version, Some(before + 1));
    let conversation = store.conversation("alice", "c1").await.expect("read").expect("c1");
    assert_eq!(conversation.head_id.as_deref(), Some("a1"));
    assert_eq!(conversation.head_version, before + 1);
    assert!(store.message("c1", "a1").await.expect("read").is_some());
    assert_eq!(store.api_calls("t1").await.expect("read").len(), 1);
    let finished = store.turn("c1", "t1").await.expect("read").expect("turn");
    assert_eq!(finished.status, TurnStatus::Succeeded);
    assert_eq!(finished.reply_message_id.as_deref(), Some("a1"));
    assert_eq!(store.available_credits("alice").await.expect("read"), Some(750), "the hold is gone, the charge made");

    let ledger = store.ledger("alice", 10).await.expect("ledger");
    assert_eq!(ledger, vec![entry.clone()], "the ledger row is the entry returned");
    assert_eq!((entry.id.as_str(), entry.api_call_id.as_str(), entry.user_id.as_str()), ("k1", "k1", "alice"));

    // A second running turn may start now: the slot was freed in the same commit.
    store.insert_turn(&turn("c1", "t2", TurnStatus::Running, 70)).await.expect("slot free");
}

/// An unlimited user's turn is charged in the ledger (no balance after),
/// and their balance stays unlimited; a hold taken while they were limited
/// is still given back.
async fn story_finish_turn_of_an_unlimited_user(store: Arc<dyn Store>) {
    alice_with_conversation(store.as_ref(), None).await;
    store.append_messages(&[node("c1", "u1", None, Message::user("hi"))], 20).await.expect("user message");
    let mut running = turn("c1", "t1", TurnStatus::Running, 30);
    store.insert_turn(&running).await.expect("running");
    running.status = TurnStatus::Succeeded;
    running.reply_message_id = Some("a1".into());
    running.finished_at = Some(50);
    let reply = Arc::new(node("c1", "a1", Some("u1"), Message::assistant("hello")));
    let (entry, head_version) = store
        .finish_turn(&Arc::new(running), call("k1", "alice", "c1", "t1", 250), Some(&reply), None, 60)
        .await
        .expect("finished");
    assert_eq!((entry.credits, entry.balance_after), (250, None));
    assert!(head_version.is_some());
    assert_eq!(store.ledger("alice", 10).await.expect("ledger"), vec![entry]);
    assert_eq!(balance(&*store, "alice").await, None);
    assert_eq!(store.available_credits("alice").await.expect("read"), None);

    // Limited when the hold was taken, unlimited when the turn ends.
    store.set_balance("alice", Some(1_000)).await.expect("limit");
    store.append_messages(&[node("c1", "u2", Some("a1"), Message::user("again"))], 70).await.expect("message");
    let mut second = turn("c1", "t2", TurnStatus::Running, 80);
    store.insert_turn(&second).await.expect("running");
    store.reserve_credits(&reservation("r2", "alice", 600, 10_000)).await.expect("reserve");
    store.set_balance("alice", None).await.expect("unlimit");
    second.status = TurnStatus::Succeeded;
    second.finished_at = Some(90);
    let (entry, _) = store
        .finish_turn(&Arc::new(second), call("k2", "alice", "c1", "t2", 100), None, Some("r2"), 95)
        .await
        .expect("finished");
    assert_eq!(entry.balance_after, None);
    store.set_balance("alice", Some(1_000)).await.expect("limit again");
    assert_eq!(store.available_credits("alice").await.expect("read"), Some(1_000), "the hold was not given back");
}

/// Finishing a turn the store does not have fails whole: no reply, call,
/// charge, ledger row or head move is kept, and the hold stays.
async fn story_finish_turn_of_a_missing_turn_keeps_nothing(store: Arc<dyn Store>) {
    alice_with_conversation(store.as_ref(), Some(1_000)).await;
    store.append_messages(&[node("c1", "u1", None, Message::user("hi"))], 20).await.expect("user message");
    store.reserve_credits(&reservation("r1", "alice", 600, 10_000)).await.expect("reserve");
    let before = store.conversation("alice", "c1").await.expect("read").expect("c1");
    let mut ghost = turn("c1", "t9", TurnStatus::Succeeded, 30);
    ghost.reply_message_id = Some("a1".into());
    let reply = Arc::new(node("c1", "a1", Some("u1"), Message::assistant("hello")));
    let mut listener = store.listen().await.expect("listen");
    let finished =
        store.finish_turn(&Arc::new(ghost), call("k1", "alice", "c1", "t9", 250), Some(&reply), Some("r1"), 60).await;
    assert!(matches!(finished, Err(StoreError::NotFound)), "{finished:?}");
    // Nothing announced: a notice sent after it is the first to arrive.
    let marker = Notice::CancelTurn { conversation_id: "c1".into(), turn_id: "marker".into() };
    store.notify(&marker).await.expect("notify");
    assert_eq!(next_notice(&mut listener).await, marker, "a failed finish announced the turn's end");
    assert!(store.message("c1", "a1").await.expect("read").is_none(), "the reply was kept");
    assert!(store.api_calls("t9").await.expect("read").is_empty(), "the call was kept");
    assert!(store.ledger("alice", 10).await.expect("read").is_empty(), "the charge was kept");
    assert_eq!(balance(&*store, "alice").await, Some(1_000));
    assert_eq!(store.available_credits("alice").await.expect("read"), Some(400), "the hold was given back");
    let after = store.conversation("alice", "c1").await.expect("read").expect("c1");
    assert_eq!((after.head_id, after.head_version), (before.head_id, before.head_version));
}

/// Starting a turn writes the running turn and its messages together, or
/// nothing at all.
async fn story_start_turn_is_all_or_nothing(store: Arc<dyn Store>) {
    alice_with_conversation(store.as_ref(), None).await;
    let before = store.conversation("alice", "c1").await.expect("read").expect("c1").head_version;
    let first = Arc::new(turn("c1", "t1", TurnStatus::Running, 30));
    let started = store
        .start_turn(
            &first,
            &[node("c1", "u1", None, Message::user("hi")).into()],
            false,
            40,
            None,
            Some(("node-a", 500)),
        )
        .await
        .expect("started");
    assert_eq!(started, TurnStarted { head_version: before + 1, reserved: None });
    // Started holding its lease: a node that dies now leaves it to the others.
    assert_eq!(store.turn_lease("t1").await.expect("lease"), Some(("node-a".into(), 500)));
    assert!(store.expired_running_turns(500).await.expect("expired").iter().any(|t| t.id == "t1"));
    let version = started.head_version;
    assert_eq!(store.turn("c1", "t1").await.expect("read").expect("t1").status, TurnStatus::Running);
    assert!(store.message("c1", "u1").await.expect("read").is_some());

    // A second running turn: refused, and its message is not written.
    let second = Arc::new(turn("c1", "t2", TurnStatus::Running, 50));
    let refused = store
        .start_turn(&second, &[node("c1", "u2", Some("u1"), Message::user("no")).into()], false, 60, None, None)
        .await;
    assert!(matches!(refused, Err(StoreError::Conflict(_))), "{refused:?}");
    assert!(store.message("c1", "u2").await.expect("read").is_none());
    assert!(store.turn("c1", "t2").await.expect("read").is_none());

    // A message id already used: refused, and the turn is not written.
    let mut done = Turn::clone(&first);
    done.status = TurnStatus::Succeeded;
    store.update_turn(&done).await.expect("finished");
    let reused = store
        .start_turn(&second, &[node("c1", "u1", None, Message::user("again")).into()], false, 70, None, None)
        .await;
    assert!(matches!(reused, Err(StoreError::Conflict(_))), "{reused:?}");
    assert!(store.turn("c1", "t2").await.expect("read").is_none());

    // A queued row becomes the running turn; no messages keeps the head.
    let mut queued = turn("c1", "t3", TurnStatus::Queued, 80);
    store.insert_turn(&queued).await.expect("queued");
    queued.status = TurnStatus::Running;
    let same = store
        .start_turn(&Arc::new(queued), &[], true, 90, None, Some(("node-b", 900)))
        .await
        .expect("started from the queue");
    assert_eq!(store.turn_lease("t3").await.expect("lease"), Some(("node-b".into(), 900)));
    assert_eq!(same.head_version, version);
    assert_eq!(store.turn("c1", "t3").await.expect("read").expect("t3").status, TurnStatus::Running);

    // A conversation that is gone: nothing is written.
    let lost = Arc::new(turn("c404", "t4", TurnStatus::Running, 100));
    let gone = store
        .start_turn(&lost, &[node("c404", "u4", None, Message::user("anyone?")).into()], false, 110, None, None)
        .await;
    assert!(matches!(gone, Err(StoreError::NotFound)), "{gone:?}");
    assert!(store.turn("c404", "t4").await.expect("read").is_none());
}

/// A limited user's turn holds its first call's credits in the commit that
/// starts it; credits that do not cover the call still record the turn and
/// the user's message, and hold nothing.
async fn story_start_turn_reserves_credits(store: Arc<dyn Store>) {
    alice_with_conversation(store.as_ref(), Some(1_000)).await;
    let first = Arc::new(turn("c1", "t1", TurnStatus::Running, 30));
    let started = store
        .start_turn(
            &first,
            &[node("c1", "u1", None, Message::user("hi")).into()],
            false,
            40,
            Some(&reservation("r1", "alice", 600, 10_000)),
            Some(("node-a", 700)),
        )
        .await
        .expect("started");
    assert_eq!(store.turn_lease("t1").await.expect("lease"), Some(("node-a".into(), 700)));
    assert_eq!(started.reserved, Some(ReserveOutcome::Reserved { available_after: Some(400) }));
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(400));
    assert_eq!(balance(&*store, "alice").await, Some(1_000), "a hold is not a charge");

    // Finishing gives the hold back and charges the real cost.
    let mut done = Turn::clone(&first);
    done.status = TurnStatus::Succeeded;
    store
        .finish_turn(&Arc::new(done), call("call1", "alice", "c1", "t1", 100), None, Some("r1"), 50)
        .await
        .expect("finish");
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(900));

    // Not enough left: the turn and its message are written, nothing held.
    let second = Arc::new(turn("c1", "t2", TurnStatus::Running, 60));
    let started = store
        .start_turn(
            &second,
            &[node("c1", "u2", Some("u1"), Message::user("more")).into()],
            false,
            70,
            Some(&reservation("r2", "alice", 901, 10_000)),
            None,
        )
        .await
        .expect("started");
    assert_eq!(started.reserved, Some(ReserveOutcome::Insufficient { available: 900 }));
    assert!(store.message("c1", "u2").await.expect("read").is_some());
    assert_eq!(store.turn("c1", "t2").await.expect("read").expect("t2").status, TurnStatus::Running);
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(900));
    assert!(!store.release_reservation("r2").await.expect("release"), "nothing was held");

    // A start refused by a conflict holds nothing either.
    let third = Arc::new(turn("c1", "t3", TurnStatus::Running, 80));
    let refused = store
        .start_turn(
            &third,
            &[node("c1", "u3", Some("u2"), Message::user("no")).into()],
            false,
            90,
            Some(&reservation("r3", "alice", 10, 10_000)),
            None,
        )
        .await;
    assert!(matches!(refused, Err(StoreError::Conflict(_))), "{refused:?}");
    assert_eq!(store.available_credits("alice").await.expect("available"), Some(900));
}
