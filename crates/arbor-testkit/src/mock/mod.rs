//! Loopback mock provider servers, one per wire protocol (OpenAI Chat
//! Completions, Anthropic Messages, Gemini generateContent), that Arbor's
//! adapters can be pointed at through their `base_url`.
//!
//! A [`MockServer`] binds `127.0.0.1:0`, serves scripted [`Reply`]s first in,
//! first out (then a default reply), encodes each in the protocol's exact
//! wire format (byte-shaped like the recordings in
//! `shared/fixtures/providers/`), can replay a recording byte-for-byte,
//! injects [`Fault`]s for real over the socket (statuses, hangs, stalls,
//! resets, malformed chunks, slow drips, in-stream errors), and keeps every
//! request it received so tests can assert what Arbor sent.
//!
//! ```no_run
//! # async fn example() {
//! use arbor_testkit::mock::{Fault, MockServer, Protocol, Reply};
//! let server = MockServer::start(Protocol::Anthropic).await;
//! server.push(Reply::thinking("Paris is the capital.", "c2ln").then_text("Paris."));
//! server.push(Reply::fault(Fault::overloaded()));
//! // point the adapter at server.base_url(), run the turn, then:
//! assert_eq!(server.call_count(), 2);
//! assert_eq!(server.calls()[0].body["model"], "claude-sonnet-4-5");
//! # }
//! ```

mod anthropic;
mod gemini;
mod openai;
mod pace;
mod reply;
mod wire;

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt;
use bytes::Bytes;
use futures_util::Stream;
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use reply::{Block, Fault, MockToolCall, Reply, StopReason, provider_fixtures_dir};
pub use wire::{Framing, Rendered, RequestInfo};

use reply::Content;
use wire::CannedError;

/// How long a reset waits for the chunks before it to leave the socket.
const FLUSH_BEFORE_RESET: Duration = Duration::from_millis(20);

/// Request bodies up to this size are accepted (base64 images are large).
const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;

/// Which provider's wire protocol a mock speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// OpenAI Chat Completions (and OpenAI-compatible servers).
    OpenAi,
    /// Anthropic Messages.
    Anthropic,
    /// Google Gemini `generateContent` / `streamGenerateContent`.
    Gemini,
}

impl Protocol {
    pub const ALL: [Protocol; 3] = [Protocol::OpenAi, Protocol::Anthropic, Protocol::Gemini];

    pub fn name(self) -> &'static str {
        match self {
            Protocol::OpenAi => "openai",
            Protocol::Anthropic => "anthropic",
            Protocol::Gemini => "gemini",
        }
    }

    /// The path an adapter's `base_url` ends with for this provider.
    pub fn base_path(self) -> &'static str {
        match self {
            Protocol::OpenAi => "/v1",
            Protocol::Anthropic => "",
            Protocol::Gemini => "/v1beta",
        }
    }

    /// Reads what matters about a request, or `None` when the method and path
    /// are not this protocol's chat call. OpenAI: `POST /v1/chat/completions`
    /// (or `/chat/completions`); Anthropic: `POST /v1/messages`; Gemini:
    /// `POST /v1beta/models/{model}:generateContent` or
    /// `:streamGenerateContent` (`alt=sse` for SSE, else a JSON array).
    pub fn request_info(
        self,
        method: &Method,
        path: &str,
        query: Option<&str>,
        body: &Value,
        number: u64,
    ) -> Option<RequestInfo> {
        if method != Method::POST {
            return None;
        }
        let model_in_body = || body.get("model").and_then(Value::as_str).unwrap_or("mock-model").to_owned();
        let streams = || body.get("stream").and_then(Value::as_bool).unwrap_or(false);
        match self {
            Protocol::OpenAi if path == "/v1/chat/completions" || path == "/chat/completions" => {
                let include_usage =
                    body.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
                let framing = if streams() { Framing::Sse } else { Framing::Json };
                Some(RequestInfo { model: model_in_body(), framing, include_usage, number })
            }
            Protocol::Anthropic if path == "/v1/messages" => {
                let framing = if streams() { Framing::Sse } else { Framing::Json };
                Some(RequestInfo { model: model_in_body(), framing, include_usage: false, number })
            }
            Protocol::Gemini => {
                let (model, action) = path.strip_prefix("/v1beta/models/")?.rsplit_once(':')?;
                let sse = query.is_some_and(|q| q.split('&').any(|pair| pair == "alt=sse"));
                let framing = match action {
                    "generateContent" => Framing::Json,
                    "streamGenerateContent" if sse => Framing::Sse,
                    "streamGenerateContent" => Framing::JsonArray,
                    _ => return None,
                };
                Some(RequestInfo { model: model.to_owned(), framing, include_usage: false, number })
            }
            _ => None,
        }
    }

    /// Encodes a reply's content (faults aside) for a request: a scripted
    /// reply in this protocol's format, a fixture exactly as recorded.
    pub fn render(self, reply: &Reply, request: &RequestInfo) -> Rendered {
        match &reply.content {
            Content::Fixture(fixture) => Rendered {
                status: fixture.status,
                headers: fixture.headers.clone(),
                chunks: fixture.chunks.clone(),
                terminal_chunks: 1,
            },
            Content::Script(_) => match self {
                Protocol::OpenAi => openai::render(reply, request),
                Protocol::Anthropic => anthropic::render(reply, request),
                Protocol::Gemini => gemini::render(reply, request),
            },
        }
    }

    /// A canned error answering a chat call. Gemini's JSON-array stream
    /// wraps even its errors in an array, so that framing is kept.
    fn fault_error(self, kind: CannedError, framing: Framing) -> Rendered {
        let mut rendered = self.canned_error(kind, "");
        if self == Protocol::Gemini && framing == Framing::JsonArray {
            let body = rendered.body();
            let mut wrapped = b"[".to_vec();
            wrapped.extend_from_slice(body.trim_ascii_end());
            wrapped.extend_from_slice(b"\n]");
            rendered.chunks = vec![Bytes::from(wrapped)];
        }
        rendered
    }

    fn canned_error(self, kind: CannedError, detail: &str) -> Rendered {
        match self {
            Protocol::OpenAi => openai::error(kind, detail),
            Protocol::Anthropic => anthropic::error(kind, detail),
            Protocol::Gemini => gemini::error(kind, detail),
        }
    }

    fn in_stream_error(self, framing: Framing, first: bool) -> Bytes {
        match self {
            Protocol::OpenAi => openai::in_stream_error(),
            Protocol::Anthropic => anthropic::in_stream_error(),
            Protocol::Gemini => gemini::in_stream_error(framing, first),
        }
    }
}

impl FromStr for Protocol {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Protocol::ALL
            .into_iter()
            .find(|protocol| protocol.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| format!("unknown protocol {name:?}; expected openai, anthropic or gemini"))
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.name())
    }
}

/// One request the mock received, kept for assertions.
#[derive(Debug, Clone)]
pub struct RecordedCall {
    pub method: Method,
    /// The path without the query (`/v1beta/models/gemini-2.5-flash:streamGenerateContent`).
    pub path: String,
    pub query: Option<String>,
    pub headers: HeaderMap,
    /// The body as JSON; a string when it was not JSON, null when empty.
    pub body: Value,
}

impl RecordedCall {
    /// A header's value, if present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }
}

/// State shared by the server task and the test's handle.
struct Shared {
    protocol: Protocol,
    queue: Mutex<VecDeque<Reply>>,
    default_reply: Mutex<Reply>,
    calls: Mutex<Vec<RecordedCall>>,
    /// Counts calls so tests can wait for one without polling.
    call_count: watch::Sender<usize>,
    /// Numbers requests, for unique response ids.
    next_number: AtomicU64,
    /// Cancelled when the server stops; ends hangs and stalls so the
    /// graceful shutdown never waits on a connection held open on purpose.
    shutdown: CancellationToken,
}

/// A lock that survives a panicking test thread: the data here stays
/// consistent between statements, so a poisoned lock is still usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A running mock provider server on `127.0.0.1`. Dropping it stops it.
pub struct MockServer {
    address: SocketAddr,
    shared: Arc<Shared>,
    task: Option<JoinHandle<()>>,
}

impl MockServer {
    /// Starts a mock on a free loopback port.
    ///
    /// # Panics
    /// When no loopback port can be bound: a test cannot go on without its
    /// mock, and a panic names the cause where the test fails. Use
    /// [`MockServer::try_start`] to handle the error instead.
    pub async fn start(protocol: Protocol) -> MockServer {
        match MockServer::try_start(protocol).await {
            Ok(server) => server,
            Err(error) => panic!("cannot start the {protocol} mock server on 127.0.0.1: {error}"),
        }
    }

    pub async fn try_start(protocol: Protocol) -> std::io::Result<MockServer> {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let address = listener.local_addr()?;
        let shared = Arc::new(Shared {
            protocol,
            queue: Mutex::new(VecDeque::new()),
            default_reply: Mutex::new(Reply::default()),
            calls: Mutex::new(Vec::new()),
            call_count: watch::Sender::new(0),
            next_number: AtomicU64::new(1),
            shutdown: CancellationToken::new(),
        });
        let router = Router::new().fallback(handle).with_state(Arc::clone(&shared));
        let stop = shared.shutdown.clone();
        let task = tokio::spawn(async move {
            // Streamed chunks leave at once, as from a real provider.
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let server = axum::serve(listener, router).with_graceful_shutdown(stop.cancelled_owned());
            if let Err(error) = server.await {
                tracing::warn!(%error, %protocol, "mock provider server stopped with an error");
            }
        });
        Ok(MockServer { address, shared, task: Some(task) })
    }

    pub fn protocol(&self) -> Protocol {
        self.shared.protocol
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// What an adapter's `base_url` should be: `http://127.0.0.1:PORT/v1`
    /// (OpenAI), `http://127.0.0.1:PORT` (Anthropic),
    /// `http://127.0.0.1:PORT/v1beta` (Gemini).
    pub fn base_url(&self) -> String {
        format!("http://{}{}", self.address, self.protocol().base_path())
    }

    /// An absolute URL on this server, e.g. `url("/v1/messages")`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.address, path)
    }

    /// Queues a reply; replies are served first in, first out.
    pub fn push(&self, reply: Reply) -> &Self {
        lock(&self.shared.queue).push_back(reply);
        self
    }

    /// The reply served whenever the queue is empty (initially
    /// `Reply::text("mock reply")`).
    pub fn set_default(&self, reply: Reply) {
        *lock(&self.shared.default_reply) = reply;
    }

    /// Queued replies not served yet.
    pub fn pending_replies(&self) -> usize {
        lock(&self.shared.queue).len()
    }

    /// Every request received so far, oldest first (also unroutable ones).
    pub fn calls(&self) -> Vec<RecordedCall> {
        lock(&self.shared.calls).clone()
    }

    pub fn call_count(&self) -> usize {
        lock(&self.shared.calls).len()
    }

    pub fn last_call(&self) -> Option<RecordedCall> {
        lock(&self.shared.calls).last().cloned()
    }

    /// Waits until at least `count` requests have arrived; false on timeout.
    pub async fn wait_for_calls(&self, count: usize, timeout: Duration) -> bool {
        let mut receiver = self.shared.call_count.subscribe();
        matches!(tokio::time::timeout(timeout, receiver.wait_for(|seen| *seen >= count)).await, Ok(Ok(_)))
    }

    /// Stops accepting, ends held-open connections, and waits for the
    /// server task to finish.
    pub async fn shutdown(mut self) {
        self.shared.shutdown.cancel();
        if let Some(task) = self.task.take()
            && let Err(error) = task.await
        {
            tracing::warn!(%error, "mock provider server task failed");
        }
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        // Drop cannot wait: signal the server, which then finishes on its own
        // once in-flight responses (with hangs and stalls cut) are done.
        self.shared.shutdown.cancel();
    }
}

impl std::fmt::Debug for MockServer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("MockServer")
            .field("protocol", &self.protocol())
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let protocol = shared.protocol;
    let (parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_REQUEST_BYTES).await {
        Ok(bytes) => bytes,
        Err(error) => {
            let detail = format!("the mock could not read the request body: {error}");
            return respond_plain(protocol.canned_error(CannedError::BadRequest, &detail));
        }
    };
    let json = serde_json::from_slice::<Value>(&bytes).ok();
    let recorded_body = match &json {
        Some(value) => value.clone(),
        None if bytes.is_empty() => Value::Null,
        None => Value::String(String::from_utf8_lossy(&bytes).into_owned()),
    };
    let path = parts.uri.path().to_owned();
    let query = parts.uri.query().map(str::to_owned);
    lock(&shared.calls).push(RecordedCall {
        method: parts.method.clone(),
        path: path.clone(),
        query: query.clone(),
        headers: parts.headers,
        body: recorded_body,
    });
    shared.call_count.send_modify(|count| *count += 1);

    let number = shared.next_number.fetch_add(1, Ordering::Relaxed);
    let body_or_null = json.as_ref().unwrap_or(&Value::Null);
    let Some(info) = protocol.request_info(&parts.method, &path, query.as_deref(), body_or_null, number) else {
        let detail = format!(
            "mock {protocol} server: no route for {} {path}; its chat call is under {}",
            parts.method,
            protocol.base_path()
        );
        return respond_plain(protocol.canned_error(CannedError::NotFound, &detail));
    };
    if json.is_none() {
        let detail = "mock server: the request body is not valid JSON";
        return respond_plain(protocol.canned_error(CannedError::BadRequest, detail));
    }
    let reply = {
        let queued = lock(&shared.queue).pop_front();
        queued.unwrap_or_else(|| lock(&shared.default_reply).clone())
    };
    serve(protocol, reply, &info, shared.shutdown.clone()).await
}

/// Serves one reply for one request, faults included.
async fn serve(protocol: Protocol, reply: Reply, info: &RequestInfo, shutdown: CancellationToken) -> Response {
    if !reply.header_delay.is_zero() && pause(reply.header_delay, &shutdown).await.is_err() {
        return shutting_down();
    }
    let rendered = match &reply.fault {
        Some(Fault::HangBeforeHeaders) => {
            shutdown.cancelled().await;
            return shutting_down();
        }
        Some(Fault::Status { status, body, headers }) => {
            let mut headers = headers.clone();
            if !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("content-type")) {
                headers.push(("content-type".to_owned(), "application/json".to_owned()));
            }
            Rendered {
                status: *status,
                headers,
                chunks: vec![Bytes::from(body.clone().into_bytes())],
                terminal_chunks: 1,
            }
        }
        Some(Fault::RateLimited { retry_after_secs }) => {
            protocol.fault_error(CannedError::RateLimited { retry_after_secs: *retry_after_secs }, info.framing)
        }
        Some(Fault::ServerError) => protocol.fault_error(CannedError::ServerError, info.framing),
        Some(Fault::Unavailable) => protocol.fault_error(CannedError::Unavailable, info.framing),
        Some(Fault::Overloaded) => protocol.fault_error(CannedError::Overloaded, info.framing),
        Some(Fault::ContextLength) => protocol.fault_error(CannedError::ContextLength, info.framing),
        Some(Fault::InStreamError { .. }) if info.framing == Framing::Json => {
            protocol.fault_error(CannedError::Overloaded, info.framing)
        }
        _ => protocol.render(&reply, info),
    };
    // Extra headers ride on every answer, errors included.
    let mut rendered = rendered;
    rendered.headers.extend(reply.headers.iter().cloned());
    let steps = plan(protocol, rendered.chunks, rendered.terminal_chunks, &reply, info.framing);
    build_response(rendered.status, &rendered.headers, steps, shutdown)
}

/// One thing the response body does next.
enum Step {
    /// Wait, then write these bytes.
    Send(Duration, Bytes),
    /// Go silent with the connection open until the server stops.
    Stall,
    /// Abort the connection mid-body.
    Reset,
}

/// Turns encoded chunks into body steps, applying the reply's delays and
/// chunk-level fault.
fn plan(protocol: Protocol, mut chunks: Vec<Bytes>, mut terminal: usize, reply: &Reply, framing: Framing) -> Vec<Step> {
    let fault = reply.fault.as_ref();
    let cuts_chunks = matches!(
        fault,
        Some(Fault::StallAfterChunks(_) | Fault::ResetAfterChunks(_) | Fault::MalformedChunk(_) | Fault::SlowDrip(_))
    );
    if cuts_chunks && chunks.len() == 1 {
        // A JSON body is one chunk: quarter it so a fault has places to cut.
        chunks = quarters(&chunks[0]);
        terminal = 1;
    }
    let before_terminal = |count: usize, total: usize| count.min(total.saturating_sub(terminal));
    let delay = reply.chunk_delay;
    let paced = |chunks: Vec<Bytes>| -> Vec<Step> {
        chunks
            .into_iter()
            .enumerate()
            .map(|(index, chunk)| Step::Send(if index == 0 { Duration::ZERO } else { delay }, chunk))
            .collect()
    };
    match fault {
        Some(Fault::StallAfterChunks(count)) => {
            let keep = before_terminal(*count, chunks.len());
            chunks.truncate(keep);
            let mut steps = paced(chunks);
            steps.push(Step::Stall);
            steps
        }
        Some(Fault::ResetAfterChunks(count)) => {
            let keep = before_terminal(*count, chunks.len());
            chunks.truncate(keep);
            let mut steps = paced(chunks);
            steps.push(Step::Reset);
            steps
        }
        Some(Fault::MalformedChunk(index)) => {
            if let Some(last) = chunks.len().checked_sub(1) {
                let index = (*index).min(last);
                chunks[index] = wire::malformed(&chunks[index]);
            }
            paced(chunks)
        }
        Some(Fault::SlowDrip(drip)) => chunks
            .into_iter()
            .flat_map(|chunk| {
                let middle = chunk.len() / 2;
                [chunk.slice(..middle), chunk.slice(middle..)]
            })
            .filter(|piece| !piece.is_empty())
            .map(|piece| Step::Send(*drip, piece))
            .collect(),
        Some(Fault::InStreamError { after_chunks }) => {
            let keep = before_terminal(*after_chunks, chunks.len());
            chunks.truncate(keep);
            chunks.push(protocol.in_stream_error(framing, keep == 0));
            paced(chunks)
        }
        _ => paced(chunks),
    }
}

/// Cuts a body in (up to) four byte ranges.
fn quarters(body: &Bytes) -> Vec<Bytes> {
    let length = body.len();
    (0..4).map(|part| body.slice(part * length / 4..(part + 1) * length / 4)).filter(|p| !p.is_empty()).collect()
}

/// Sleeps unless the server stops first.
async fn pause(duration: Duration, shutdown: &CancellationToken) -> Result<(), ()> {
    tokio::select! {
        () = pace::sleep(duration) => Ok(()),
        () = shutdown.cancelled() => Err(()),
    }
}

fn shutting_down() -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, "mock server shutting down").into_response()
}

/// A response with no pauses or faults in its body.
fn respond_plain(rendered: Rendered) -> Response {
    let steps = rendered.chunks.into_iter().map(|chunk| Step::Send(Duration::ZERO, chunk)).collect();
    build_response(rendered.status, &rendered.headers, steps, CancellationToken::new())
}

fn build_response(
    status: u16,
    headers: &[(String, String)],
    steps: Vec<Step>,
    shutdown: CancellationToken,
) -> Response {
    let mut builder = Response::builder().status(status);
    for (name, value) in headers {
        builder = builder.header(name.as_str(), value.as_str());
    }
    // Without pauses or faults, send the body in one piece with a
    // content-length, as cheaply as possible (benchmarks serve this path).
    let immediate = steps.iter().all(|step| matches!(step, Step::Send(delay, _) if delay.is_zero()));
    let body = if immediate {
        let mut pieces: Vec<Bytes> = steps
            .into_iter()
            .filter_map(|step| match step {
                Step::Send(_, bytes) => Some(bytes),
                Step::Stall | Step::Reset => None,
            })
            .collect();
        if pieces.len() == 1 { Body::from(pieces.remove(0)) } else { Body::from(pieces.concat()) }
    } else {
        Body::from_stream(body_stream(steps, shutdown))
    };
    builder.body(body).unwrap_or_else(|error| {
        let message = format!("mock server: cannot build the scripted response: {error}");
        (StatusCode::INTERNAL_SERVER_ERROR, message).into_response()
    })
}

/// The body as a stream that really waits, stalls and fails on the socket:
/// an `Err` item makes hyper abort the connection, which is how a reset
/// reaches the client.
fn body_stream(steps: Vec<Step>, shutdown: CancellationToken) -> impl Stream<Item = std::io::Result<Bytes>> + Send {
    futures_util::stream::unfold((steps.into_iter(), shutdown), |(mut steps, shutdown)| async move {
        let item = match steps.next()? {
            Step::Send(delay, bytes) => {
                if !delay.is_zero() && pause(delay, &shutdown).await.is_err() {
                    Err(std::io::Error::other("mock server shut down mid-stream"))
                } else {
                    Ok(bytes)
                }
            }
            Step::Stall => {
                shutdown.cancelled().await;
                Err(std::io::Error::other("mock server shut down during a stall"))
            }
            Step::Reset => {
                // hyper buffers what it writes and drops the buffer when
                // the body fails; going idle first lets it flush the
                // chunks sent so far, so the client really receives k
                // chunks, then an abrupt end.
                let _ = pause(FLUSH_BEFORE_RESET, &shutdown).await;
                Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "mock fault: connection reset"))
            }
        };
        // After an error hyper stops polling; dropping the rest keeps the
        // stream from yielding anything after it in any case.
        if item.is_err() {
            steps = Vec::new().into_iter();
        }
        Some((item, (steps, shutdown)))
    })
}

/// Prebuilt encodings of one reply for every framing a protocol supports,
/// so a benchmark server answers without encoding anything per request.
#[derive(Debug, Clone)]
pub struct Prebuilt {
    protocol: Protocol,
    responses: Vec<PrebuiltResponse>,
}

/// One prebuilt response: its chunks (for paced streaming) and the whole
/// body (served by reference count, without copying, when there is no pace).
#[derive(Debug, Clone)]
pub struct PrebuiltResponse {
    framing: Framing,
    include_usage: bool,
    rendered: Rendered,
    whole: Bytes,
}

impl Prebuilt {
    /// Encodes `reply` (content only; faults are ignored) once per framing.
    pub fn new(protocol: Protocol, reply: &Reply) -> Prebuilt {
        let mut responses = Vec::new();
        for framing in [Framing::Json, Framing::Sse, Framing::JsonArray] {
            for include_usage in [false, true] {
                let info = RequestInfo { model: "mock-model".to_owned(), framing, include_usage, number: 1 };
                let rendered = protocol.render(reply, &info);
                let whole = rendered.body();
                responses.push(PrebuiltResponse { framing, include_usage, rendered, whole });
            }
        }
        Prebuilt { protocol, responses }
    }

    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// The prebuilt response for a request, if it is a chat call.
    pub fn lookup(&self, method: &Method, path: &str, query: Option<&str>, body: &Value) -> Option<&PrebuiltResponse> {
        let info = self.protocol.request_info(method, path, query, body, 0)?;
        self.responses
            .iter()
            .find(|response| response.framing == info.framing && response.include_usage == info.include_usage)
    }

    /// A 404 in this protocol's shape for a request that is not a chat call.
    pub fn not_found(&self, method: &Method, path: &str) -> Response {
        let detail = format!("mock {} server: no route for {method} {path}", self.protocol);
        respond_plain(self.protocol.canned_error(CannedError::NotFound, &detail))
    }

    /// A 400 in this protocol's shape for a body that is not JSON.
    pub fn bad_request(&self) -> Response {
        let detail = "mock server: the request body is not valid JSON";
        respond_plain(self.protocol.canned_error(CannedError::BadRequest, detail))
    }
}

impl PrebuiltResponse {
    pub fn rendered(&self) -> &Rendered {
        &self.rendered
    }

    /// Serves the response, pausing `chunk_delay` between chunks; the pause
    /// ends early (and the connection is cut) when `shutdown` is cancelled.
    pub fn respond(&self, chunk_delay: Duration, shutdown: CancellationToken) -> Response {
        if chunk_delay.is_zero() {
            let steps = vec![Step::Send(Duration::ZERO, self.whole.clone())];
            return build_response(self.rendered.status, &self.rendered.headers, steps, shutdown);
        }
        let steps = self
            .rendered
            .chunks
            .iter()
            .enumerate()
            .map(|(index, chunk)| Step::Send(if index == 0 { Duration::ZERO } else { chunk_delay }, chunk.clone()))
            .collect();
        build_response(self.rendered.status, &self.rendered.headers, steps, shutdown)
    }
}
