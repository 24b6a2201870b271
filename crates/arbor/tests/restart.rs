//! A server killed outright (SIGKILL, as by the OOM killer or a power cut
//! of the process) keeps every turn it answered: restarted on the same
//! SQLite file, in either locking mode, it serves them all. Under
//! `locking=exclusive` the WAL index lived in the dead process's memory, so
//! the restart rebuilds it from the WAL file alone.

mod common;

use arbor_testkit::mock::{MockServer, Protocol, Reply};
use common::{get, post, start_node, write_config};
use serde_json::json;

#[tokio::test]
async fn a_killed_sqlite_server_keeps_every_answered_turn_in_both_locking_modes() {
    let mock = MockServer::start(Protocol::OpenAi).await;
    mock.set_default(Reply::text("noted"));
    for query in ["", "?locking=exclusive"] {
        let dir = tempfile::tempdir().expect("temp dir");
        let database_url = format!("sqlite://{}{query}", dir.path().join("arbor.db").display());
        let config = write_config(dir.path(), &database_url, &mock.base_url());
        let (mut node, key) = start_node(&config, dir.path()).await;
        let key = key.expect("the first start prints the admin key");
        let (_, created) = post(&node, &key, "/v1/conversations", json!({})).await;
        let conversation = created["id"].as_str().expect("id").to_string();
        let path = format!("/v1/conversations/{conversation}/messages");
        for index in 0..5 {
            let (status, answer) = post(&node, &key, &path, json!({"content": format!("message {index}")})).await;
            assert_eq!(status, 200, "{query:?}: {answer}");
        }
        node.child.start_kill().expect("SIGKILL");
        let _ = node.child.wait().await;
        // The mode under test: only shared locking maps a `-shm` file.
        assert_eq!(dir.path().join("arbor.db-shm").exists(), query.is_empty(), "{query:?}");

        let (node, printed) = start_node(&config, dir.path()).await;
        assert!(printed.is_none(), "{query:?}: the admin is still there, no new key");
        let tree = get(&node, &key, &format!("/v1/conversations/{conversation}")).await;
        let messages = tree["messages"].as_array().unwrap_or_else(|| panic!("{query:?}: {tree}"));
        let contents = |role: &str| -> Vec<String> {
            messages
                .iter()
                .filter(|message| message["role"] == role)
                .map(|message| message["content"].as_str().unwrap_or_default().to_string())
                .collect()
        };
        let sent: Vec<String> = (0..5).map(|index| format!("message {index}")).collect();
        assert_eq!(contents("user"), sent, "{query:?}");
        assert_eq!(contents("assistant"), vec!["noted"; 5], "{query:?}");
    }
}
