//! Test support shared by every crate's tests: an in-process Arbor on a
//! random loopback port with a temporary SQLite database ([`spawn_app`]),
//! loopback mock provider servers ([`mock`]), and an SSE reader for the
//! client side of a stream. Tests use these instead of copying helpers.

pub mod mock;
pub mod sse;

use std::time::Duration;

use arbor_engine::Engine;
use arbor_server::config::{Config, Overrides};
use reqwest::header::{ACCEPT, AUTHORIZATION};
use serde_json::Value;
use tokio::sync::oneshot;

pub use sse::{SseEvent, SseReader, parse_sse};

/// A running Arbor for one test.
pub struct TestApp {
    /// `http://127.0.0.1:PORT`
    pub base_url: String,
    pub client: reqwest::Client,
    /// The first admin's key.
    pub admin_key: String,
    pub engine: Engine,
    pub config: Config,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// The database lives here; removed when the app is dropped.
    data_dir: Option<tempfile::TempDir>,
}

/// Options for [`spawn_app_with`].
#[derive(Default)]
pub struct AppOptions {
    /// Extra config TOML (providers, models, limits, …).
    pub config_toml: String,
    /// Environment variables the config may name (`api_key_env`).
    pub env: Vec<(String, String)>,
}

/// Starts Arbor with the default (demo-only) configuration.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(AppOptions::default()).await
}

pub async fn spawn_app_with(options: AppOptions) -> TestApp {
    let data_dir = tempfile::tempdir().expect("temporary data dir");
    let env = options.env;
    let lookup = move |name: &str| env.iter().find(|(key, _)| key == name).map(|(_, value)| value.clone());
    let overrides = Overrides { listen: Some("127.0.0.1:0".into()), data_dir: Some(data_dir.path().to_path_buf()) };
    let config = Config::from_toml(&options.config_toml, &overrides, &lookup).expect("test config is valid");
    start(config, data_dir).await
}

/// Starts Arbor on an existing data dir (a restart after a crash).
pub async fn restart_app(data_dir: tempfile::TempDir, config_toml: &str) -> TestApp {
    let overrides = Overrides { listen: Some("127.0.0.1:0".into()), data_dir: Some(data_dir.path().to_path_buf()) };
    let config = Config::from_toml(config_toml, &overrides, &|_| None).expect("test config is valid");
    start(config, data_dir).await
}

async fn start(config: Config, data_dir: tempfile::TempDir) -> TestApp {
    let app = arbor_server::setup::build(config.clone(), true).await.expect("arbor starts");
    let admin_key = app.first_admin.as_ref().map(|admin| admin.key.clone()).unwrap_or_default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
    let base_url = format!("http://{}", listener.local_addr().expect("bound address"));
    let (stop, stopped) = oneshot::channel::<()>();
    let engine = app.state.engine.clone();
    let server = tokio::spawn(arbor_server::serve(
        listener,
        app.state,
        config.max_body_bytes,
        Duration::from_secs(5),
        async move {
            let _ = stopped.await;
        },
    ));
    let client = arbor_providers::http::build_client(&arbor_providers::http::HttpTimeouts {
        connect: Duration::from_secs(5),
        read_idle: Duration::from_secs(30),
    })
    .expect("http client");
    TestApp {
        base_url,
        client,
        admin_key,
        engine,
        config,
        stop: Some(stop),
        server: Some(server),
        data_dir: Some(data_dir),
    }
}

/// A response's status and JSON body.
#[derive(Debug)]
pub struct JsonResponse {
    pub status: u16,
    pub body: Value,
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base_url, path)
    }

    /// Creates a user and returns their key.
    pub async fn new_user(&self, name: &str) -> String {
        self.engine.create_user(name, false).await.expect("user created").1
    }

    pub async fn get(&self, key: &str, path: &str) -> JsonResponse {
        let response = self
            .client
            .get(self.url(path))
            .header(AUTHORIZATION, format!("Bearer {key}"))
            .send()
            .await
            .expect("request sent");
        read_json(response).await
    }

    pub async fn post(&self, key: &str, path: &str, body: &Value) -> JsonResponse {
        self.send_raw(key, reqwest::Method::POST, path, body.to_string()).await
    }

    /// Sends a raw body with `content-type: application/json`.
    pub async fn send_raw(&self, key: &str, method: reqwest::Method, path: &str, body: String) -> JsonResponse {
        let response = self
            .client
            .request(method, self.url(path))
            .header(AUTHORIZATION, format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("request sent");
        read_json(response).await
    }

    /// The user a key belongs to.
    pub async fn user(&self, key: &str) -> arbor_store::User {
        self.engine.authenticate(key).await.expect("authenticated").expect("a user for this key")
    }

    /// Starts a turn on `content` through the engine (returns once the turn
    /// holds the conversation's slot), for tests that act while it runs.
    pub async fn begin_turn(&self, key: &str, conversation: &str, content: &str) -> arbor_engine::TurnHandle {
        let user = self.user(key).await;
        let submitted = self.engine.submit(&user, conversation, arbor_engine::Submit::message(content)).await;
        submitted.expect("submitted").into_turn().expect("a turn started")
    }

    /// Creates a conversation and returns its id.
    pub async fn new_conversation(&self, key: &str, body: Value) -> String {
        let response = self.post(key, "/v1/conversations", &body).await;
        assert_eq!(response.status, 201, "conversation created: {:?}", response.body);
        response.body["id"].as_str().expect("conversation id").to_string()
    }

    /// Posts with `Accept: text/event-stream` and reads the whole stream
    /// (bounded by `deadline`).
    pub async fn stream(&self, key: &str, path: &str, body: &Value, deadline: Duration) -> (u16, Vec<SseEvent>) {
        let response = self
            .client
            .post(self.url(path))
            .header(AUTHORIZATION, format!("Bearer {key}"))
            .header(ACCEPT, "text/event-stream")
            .json(body)
            .send()
            .await
            .expect("request sent");
        let status = response.status().as_u16();
        let text =
            tokio::time::timeout(deadline, response.text()).await.expect("stream ended in time").unwrap_or_default();
        (status, parse_sse(&text))
    }

    /// Opens an SSE request (`GET` when `body` is `None`) with extra headers.
    pub async fn open_stream(
        &self,
        key: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> SseReader {
        let mut request = match body {
            Some(body) => self.client.post(self.url(path)).json(body),
            None => self.client.get(self.url(path)),
        };
        request = request.header(AUTHORIZATION, format!("Bearer {key}")).header(ACCEPT, "text/event-stream");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        SseReader::new(request.send().await.expect("request sent"))
    }

    /// Stops the server gracefully and waits for it.
    pub async fn stop(mut self) -> tempfile::TempDir {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
        // Leave the data dir to the caller, e.g. to restart on it.
        self.data_dir.take().expect("the data dir is only taken here")
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(server) = &self.server {
            server.abort();
        }
    }
}

async fn read_json(response: reqwest::Response) -> JsonResponse {
    let status = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    JsonResponse { status, body }
}
