//! The scripted loopback server the Anthropic and Gemini HTTP tests share.
//! It answers each request, whatever its path, with the next scripted reply,
//! sends the body in several pieces as a network would (so that the client
//! really decodes a stream), and keeps what it received for the test to
//! check. The tests choose the replies; nothing here knows a provider.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::Response;
use serde_json::Value;

pub fn read(dir: &str, name: &str) -> Vec<u8> {
    std::fs::read(format!("{dir}/{name}")).expect("fixture exists")
}

/// One scripted answer.
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn new(status: u16, content_type: &str, body: Vec<u8>) -> Reply {
        Reply { status, headers: vec![("content-type", content_type.into())], body }
    }
}

/// What the server received.
pub struct Received {
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Value,
}

#[derive(Clone)]
pub struct Mock {
    replies: Arc<Mutex<VecDeque<Reply>>>,
    pub received: Arc<Mutex<Vec<Received>>>,
    /// How many pieces each body is cut into.
    pieces: usize,
}

/// Starts a server on a loopback port that answers with `replies` in
/// order, each body cut into `pieces` pieces.
pub async fn serve(replies: Vec<Reply>, pieces: usize) -> (Mock, SocketAddr) {
    let mock = Mock { replies: Arc::new(Mutex::new(replies.into())), received: Arc::default(), pieces };
    let router = axum::Router::new().fallback(answer).with_state(mock.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move {
        axum::serve(listener, router).await.expect("serve");
    });
    (mock, address)
}

async fn answer(State(mock): State<Mock>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    mock.received.lock().expect("lock").push(Received {
        uri,
        headers,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    });
    let reply = mock.replies.lock().expect("lock").pop_front();
    let Some(reply) = reply else {
        return Response::builder()
            .status(StatusCode::INTERNAL_SERVER_ERROR)
            .body(Body::from("no scripted reply left"))
            .expect("response");
    };
    let piece_length = reply.body.len().div_ceil(mock.pieces).max(1);
    let pieces: Vec<Result<Bytes, std::io::Error>> =
        reply.body.chunks(piece_length).map(|piece| Ok(Bytes::copy_from_slice(piece))).collect();
    let mut response = Response::builder().status(reply.status);
    for (name, value) in reply.headers {
        response = response.header(name, value);
    }
    response.body(Body::from_stream(futures_util::stream::iter(pieces))).expect("response")
}

/// Every case must end on its own; a hang is a failure, not a stuck CI.
pub async fn within<T>(future: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), future).await.expect("finished within its deadline")
}
