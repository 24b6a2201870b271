//! What the tests that run `arbor serve` as a process share: starting a
//! node (and catching the admin key it prints once), a config with a mock
//! model, and JSON requests.
// Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub const DEADLINE: Duration = Duration::from_secs(30);

pub struct Node {
    pub child: Child,
    pub base_url: String,
}

pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("address").port()
}

/// Starts `arbor serve`; returns the node and, on a first start, the admin key.
pub async fn start_node(config: &Path, data_dir: &Path) -> (Node, Option<String>) {
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--config")
        .arg(config)
        .arg("--data-dir")
        .arg(data_dir)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("arbor starts");
    let stdout = child.stdout.take().expect("stdout");
    let base_url = format!("http://127.0.0.1:{port}");
    let client = client();
    let mut key = None;
    let mut lines = BufReader::new(stdout).lines();
    let started = tokio::time::Instant::now();
    loop {
        assert!(started.elapsed() < DEADLINE, "node did not become ready");
        if client.get(format!("{base_url}/healthz")).send().await.is_ok_and(|response| response.status() == 200) {
            // The key, if any, was printed before the server listened.
            while key.is_none() {
                match tokio::time::timeout(Duration::from_millis(300), lines.next_line()).await {
                    Ok(Ok(Some(line))) => {
                        key = line
                            .split_whitespace()
                            .find(|word| word.starts_with("arb_"))
                            .map(|found| found.trim_matches('\'').to_string())
                    }
                    _ => break,
                }
            }
            break;
        }
        if let Ok(Ok(Some(line))) = tokio::time::timeout(Duration::from_millis(100), lines.next_line()).await
            && let Some(found) = line.split_whitespace().find(|word| word.starts_with("arb_"))
        {
            key = Some(found.trim_matches('\'').to_string());
        }
    }
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (Node { child, base_url }, key)
}

pub fn client() -> reqwest::Client {
    arbor_providers::http::build_client(&arbor_providers::http::HttpTimeouts {
        connect: Duration::from_secs(5),
        read_idle: Duration::from_secs(30),
    })
    .expect("client")
}

pub async fn post(node: &Node, key: &str, path: &str, body: Value) -> (u16, Value) {
    let response =
        client().post(format!("{}{path}", node.base_url)).bearer_auth(key).json(&body).send().await.expect("sent");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

pub async fn get(node: &Node, key: &str, path: &str) -> Value {
    let response = client().get(format!("{}{path}", node.base_url)).bearer_auth(key).send().await.expect("sent");
    response.json().await.unwrap_or(Value::Null)
}

/// Writes `dir/arbor.toml`: the database at `database_url` and the model
/// `mock-model` (the default) served by the mock at `mock`.
pub fn write_config(dir: &Path, database_url: &str, mock: &str) -> PathBuf {
    let path = dir.join("arbor.toml");
    let config = format!(
        r#"default_model = "mock-model"
[server]
turn_lease_secs = 2
shutdown_grace_secs = 1
[storage]
database_url = "{database_url}"
[providers.mock]
kind = "openai"
base_url = "{mock}"
read_timeout_secs = 10
[models."mock-model"]
provider = "mock"
context_window = 128000
max_output = 1000
prices = {{ input = 1000000, output = 1000000 }}
"#
    );
    std::fs::write(&path, config).expect("config written");
    path
}
