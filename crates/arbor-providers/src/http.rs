//! HTTP plumbing shared by the adapters: the client (rustls, a connect
//! timeout and a per-read idle timeout, so a provider that hangs before its
//! headers or stalls mid-stream ends in `timeout` rather than a turn that
//! never finishes), `retry-after` parsing, and the generic mapping of HTTP
//! statuses and transport failures onto [`ErrorCode`]. Each adapter refines
//! the generic code from its provider's error body.
//!
//! The client is hyper's pooled client over rustls, used directly: every
//! request through reqwest also went through its redirect and retry layers
//! (which copy the headers, print the URI and parse it back as a URL) and
//! its proxy matcher, ~6% of a JSON turn's instructions and ~33 µs of the
//! first token's path at low rates (bench/analysis.md). A proxy set in the
//! environment (`HTTPS_PROXY` and the like) is the one thing reqwest does
//! that hyper does not, so with one set requests go through reqwest, which
//! honours it as before.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use arbor_core::{ErrorCode, ProviderError};
use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use http_body_util::{BodyDataStream, Full};
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, USER_AGENT};
use hyper::{Method, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde::{Deserialize, Serialize};
use tokio::time::Sleep;

/// How long to wait on a provider. There is deliberately no total deadline:
/// a long answer that keeps streaming is healthy; silence is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpTimeouts {
    /// Establishing the TCP and TLS connection.
    #[serde(with = "secs")]
    pub connect: Duration,
    /// The longest silence allowed on a read: waiting for the response
    /// headers, or between two pieces of the body. Generous by default
    /// because reasoning models can think for minutes before the first
    /// token (and a non-streamed call sends nothing until it is done).
    #[serde(with = "secs")]
    pub read_idle: Duration,
}

impl Default for HttpTimeouts {
    fn default() -> HttpTimeouts {
        HttpTimeouts { connect: Duration::from_secs(10), read_idle: Duration::from_secs(300) }
    }
}

mod secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_f64(value.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let seconds = f64::deserialize(deserializer)?;
        Duration::try_from_secs_f64(seconds).map_err(serde::de::Error::custom)
    }
}

const USER_AGENT_VALUE: &str = concat!("arbor/", env!("CARGO_PKG_VERSION"));
const POOL_IDLE: Duration = Duration::from_secs(90);
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

/// The environment variables through which a proxy is set (reqwest reads
/// the same, and `NO_PROXY` for the exceptions).
const PROXY_VARIABLES: [&str; 6] = ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"];

/// Whether `variable` (the environment) sets a proxy.
fn proxy_set(variable: impl Fn(&str) -> Option<std::ffi::OsString>) -> bool {
    PROXY_VARIABLES.iter().any(|name| variable(name).is_some_and(|value| !value.is_empty()))
}

/// The HTTP client every adapter uses. It pools connections, so an adapter
/// builds one and keeps it; clones share the pool.
#[derive(Clone)]
pub struct HttpClient {
    transport: Transport,
    read_idle: Duration,
}

#[derive(Clone)]
enum Transport {
    /// hyper's client over rustls: HTTP/1.1, or h2 where TLS agrees on it.
    Direct(Box<Client<Bounded<HttpsConnector<HttpConnector>>, Full<Bytes>>>),
    /// reqwest, when the environment sets a proxy.
    Proxied(reqwest::Client),
}

impl fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let transport = match self.transport {
            Transport::Direct(_) => "direct",
            Transport::Proxied(_) => "through the environment's proxy",
        };
        f.debug_struct("HttpClient").field("transport", &transport).field("read_idle", &self.read_idle).finish()
    }
}

/// A reqwest client with these timeouts: what [`HttpClient`] sends through
/// when the environment sets a proxy, and a general client for tests and
/// tools (it follows redirects and takes any method).
pub fn build_client(timeouts: &HttpTimeouts) -> Result<reqwest::Client, ProviderError> {
    reqwest_client(timeouts, reqwest::redirect::Policy::default())
}

fn reqwest_client(
    timeouts: &HttpTimeouts,
    redirects: reqwest::redirect::Policy,
) -> Result<reqwest::Client, ProviderError> {
    ensure_crypto_provider();
    reqwest::Client::builder()
        .connect_timeout(timeouts.connect)
        .read_timeout(timeouts.read_idle)
        .pool_idle_timeout(POOL_IDLE)
        .tcp_keepalive(TCP_KEEPALIVE)
        .user_agent(USER_AGENT_VALUE)
        .redirect(redirects)
        .build()
        .map_err(|error| ProviderError::new(ErrorCode::Internal, format!("could not build the HTTP client: {error}")))
}

impl HttpClient {
    /// A client with these timeouts, going through the environment's proxy
    /// when one is set.
    pub fn new(timeouts: &HttpTimeouts) -> Result<HttpClient, ProviderError> {
        HttpClient::with_transport(timeouts, proxy_set(|name| std::env::var_os(name)))
    }

    fn with_transport(timeouts: &HttpTimeouts, proxied: bool) -> Result<HttpClient, ProviderError> {
        ensure_crypto_provider();
        let cannot = |error: &dyn fmt::Display| {
            ProviderError::new(ErrorCode::Internal, format!("could not build the HTTP client: {error}"))
        };
        let transport = if proxied {
            // Redirects are not followed either way (see `fallback_message`).
            Transport::Proxied(reqwest_client(timeouts, reqwest::redirect::Policy::none())?)
        } else {
            let mut http = HttpConnector::new();
            http.enforce_http(false);
            http.set_nodelay(true);
            http.set_keepalive(Some(TCP_KEEPALIVE));
            // Certificates are checked as reqwest checks them: the system's
            // roots, through rustls' platform verifier.
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let tls = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|error| cannot(&error))?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(
                    rustls_platform_verifier::Verifier::new(provider).map_err(|error| cannot(&error))?,
                ))
                .with_no_client_auth();
            let connector = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls)
                .https_or_http()
                .enable_http1()
                .enable_http2()
                .wrap_connector(http);
            let connector = Bounded { inner: connector, limit: timeouts.connect };
            let client = Client::builder(TokioExecutor::new())
                .pool_idle_timeout(POOL_IDLE)
                .pool_timer(TokioTimer::new())
                .timer(TokioTimer::new())
                .build(connector);
            Transport::Direct(Box::new(client))
        };
        Ok(HttpClient { transport, read_idle: timeouts.read_idle })
    }

    /// Sends `request` and returns the response, whatever its status, once
    /// its headers are in; its body is read as it comes. Silence longer than
    /// the read idle timeout, waiting for the headers or between two pieces
    /// of the body, ends it in `timeout`.
    pub async fn send(&self, request: HttpRequest) -> Result<HttpResponse, ProviderError> {
        let HttpRequest { uri, mut headers, body } = request;
        if !headers.contains_key(USER_AGENT) {
            headers.insert(USER_AGENT, HeaderValue::from_static(USER_AGENT_VALUE));
        }
        match &self.transport {
            Transport::Direct(client) => {
                let mut request = hyper::Request::new(Full::new(body));
                *request.method_mut() = Method::POST;
                *request.uri_mut() = uri;
                *request.headers_mut() = headers;
                let response = tokio::time::timeout(self.read_idle, client.request(request))
                    .await
                    .map_err(|_| silent(self.read_idle, "before its response headers"))?
                    .map_err(|error| transport_error(hyper_code(&error), &error))?;
                let (parts, body) = response.into_parts();
                Ok(HttpResponse {
                    status: parts.status.as_u16(),
                    headers: parts.headers,
                    body: Box::pin(IdleLimited::new(BodyDataStream::new(body), self.read_idle)),
                })
            }
            Transport::Proxied(client) => {
                let url = reqwest::Url::parse(&uri.to_string()).map_err(|error| {
                    ProviderError::new(ErrorCode::InvalidRequest, format!("{uri} is not a valid URL: {error}"))
                })?;
                let mut response = client
                    .post(url)
                    .headers(headers)
                    .body(body)
                    .send()
                    .await
                    .map_err(|error| transport_error(reqwest_code(&error), &error))?;
                let headers = std::mem::take(response.headers_mut());
                Ok(HttpResponse {
                    status: response.status().as_u16(),
                    headers,
                    body: Box::pin(
                        response
                            .bytes_stream()
                            .map(|piece| piece.map_err(|error| body_error(error.is_timeout(), &error))),
                    ),
                })
            }
        }
    }
}

/// An endpoint's URL as the client takes it, from text checked and
/// normalised as a URL (an international host name in its ASCII form).
/// Adapters make theirs once: the text is not parsed again per request.
pub fn endpoint(text: &str) -> Result<Uri, String> {
    let url = reqwest::Url::parse(text).map_err(|error| error.to_string())?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("the scheme must be http or https, not {}", url.scheme()));
    }
    Uri::try_from(url.as_str()).map_err(|error| error.to_string())
}

/// The headers an adapter sends with every request, made once: `headers`
/// (its own or the configured ones), the JSON content type, and the API
/// key, if any, under its header name.
pub fn request_headers(mut headers: HeaderMap, key: Option<(HeaderName, &str)>) -> Result<HeaderMap, ProviderError> {
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some((name, value)) = key {
        headers.insert(name, secret_header(value)?);
    }
    Ok(headers)
}

/// A request that could not be written as JSON (a map with keys that are
/// not strings, say): Arbor's fault, not the caller's.
pub fn not_encoded(error: serde_json::Error) -> ProviderError {
    ProviderError::new(ErrorCode::Internal, format!("could not encode the request: {error}"))
}

/// A header value holding a secret (an API key): invalid text is refused,
/// and the value is marked sensitive (left out of debug output).
fn secret_header(value: &str) -> Result<HeaderValue, ProviderError> {
    let mut header = HeaderValue::from_str(value).map_err(|_| {
        ProviderError::new(ErrorCode::InvalidRequest, "the API key holds characters that are not valid in HTTP")
    })?;
    header.set_sensitive(true);
    Ok(header)
}

/// A connector whose connections, TCP and the TLS handshake both, are made
/// within `limit`, or fail as timed out (the HTTP connector's own timeout
/// would cover TCP alone, and a server that takes the connection but never
/// answers the handshake would hold a turn for the whole read idle time).
#[derive(Clone)]
struct Bounded<C> {
    inner: C,
    limit: Duration,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> tower_service::Service<Uri> for Bounded<C>
where
    C: tower_service::Service<Uri>,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, context: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(context).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let limit = self.limit;
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            match tokio::time::timeout(limit, connecting).await {
                Ok(connected) => connected.map_err(Into::into),
                Err(_) => Err(Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no connection within {limit:?}"),
                )) as BoxError),
            }
        })
    }
}

/// A request for [`HttpClient::send`]: a `POST` of `body` to `uri`.
#[derive(Debug, Clone)]
pub struct HttpRequest {
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl HttpRequest {
    pub fn post(uri: Uri, body: impl Into<Bytes>) -> HttpRequest {
        HttpRequest { uri, headers: HeaderMap::new(), body: body.into() }
    }

    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> HttpRequest {
        self.headers.insert(name, value);
        self
    }
}

/// A response body: its pieces as they arrive, or why it broke off.
pub type BodyStream = Pin<Box<dyn Stream<Item = Result<Bytes, ProviderError>> + Send>>;

/// A response whose headers are in.
pub struct HttpResponse {
    status: u16,
    headers: HeaderMap,
    body: BodyStream,
}

impl fmt::Debug for HttpResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpResponse").field("status", &self.status).field("headers", &self.headers).finish()
    }
}

impl HttpResponse {
    pub fn status(&self) -> u16 {
        self.status
    }

    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The `content-type`, when there is one in plain text.
    pub fn content_type(&self) -> Option<&str> {
        self.headers.get(CONTENT_TYPE).and_then(|value| value.to_str().ok())
    }

    /// Whether the body is JSON, by its `content-type`.
    pub fn is_json(&self) -> bool {
        self.content_type().is_some_and(|value| value.starts_with("application/json"))
    }

    /// The next piece of the body; `None` at its end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, ProviderError> {
        self.body.next().await.transpose()
    }

    /// The whole body.
    pub async fn bytes(mut self) -> Result<Bytes, ProviderError> {
        let Some(first) = self.chunk().await? else { return Ok(Bytes::new()) };
        let Some(second) = self.chunk().await? else { return Ok(first) };
        let mut whole = BytesMut::with_capacity(first.len() + second.len());
        whole.extend_from_slice(&first);
        whole.extend_from_slice(&second);
        while let Some(piece) = self.chunk().await? {
            whole.extend_from_slice(&piece);
        }
        Ok(whole.freeze())
    }

    /// The body as a stream of its pieces.
    pub fn into_stream(self) -> BodyStream {
        self.body
    }
}

/// A body whose pieces may be at most `idle` apart: past that, it ends in a
/// `timeout` error. A body that breaks off ends in `stream_interrupted`.
struct IdleLimited {
    body: BodyDataStream<Incoming>,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    ended: bool,
}

impl IdleLimited {
    fn new(body: BodyDataStream<Incoming>, idle: Duration) -> IdleLimited {
        IdleLimited { body, idle, deadline: Box::pin(tokio::time::sleep(idle)), ended: false }
    }
}

impl Stream for IdleLimited {
    type Item = Result<Bytes, ProviderError>;

    fn poll_next(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.body.poll_next_unpin(context) {
            Poll::Ready(Some(Ok(piece))) => {
                let next = tokio::time::Instant::now() + self.idle;
                self.deadline.as_mut().reset(next);
                Poll::Ready(Some(Ok(piece)))
            }
            Poll::Ready(Some(Err(error))) => {
                self.ended = true;
                Poll::Ready(Some(Err(body_error(error.is_timeout(), &error))))
            }
            Poll::Ready(None) => {
                self.ended = true;
                Poll::Ready(None)
            }
            Poll::Pending => match self.deadline.as_mut().poll(context) {
                Poll::Ready(()) => {
                    self.ended = true;
                    let idle = self.idle;
                    Poll::Ready(Some(Err(silent(idle, "in the middle of its answer"))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

/// The error for a provider that sent nothing for `idle`.
fn silent(idle: Duration, when: &str) -> ProviderError {
    ProviderError::new(ErrorCode::Timeout, format!("the provider sent nothing for {idle:?} {when}"))
}

/// reqwest is built without a default rustls crypto provider and panics
/// when none is installed. The binary installs ring at start-up; doing it
/// here too (a no-op when one is already installed) keeps tests and other
/// embedders of this crate from tripping over that.
fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing the race to another thread installing one is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// How long the provider asked us to wait, from `retry-after-ms` (OpenAI,
/// milliseconds) or `retry-after` (seconds, or an HTTP date).
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    retry_after_at(headers, SystemTime::now())
}

/// [`retry_after`] with an explicit clock, for HTTP dates.
pub fn retry_after_at(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let header = |name: &str| headers.get(name).and_then(|value| value.to_str().ok()).map(str::trim);
    if let Some(millis) = header("retry-after-ms").and_then(|text| text.parse::<f64>().ok())
        && let Ok(duration) = Duration::try_from_secs_f64(millis / 1000.0)
    {
        return Some(duration);
    }
    let value = header("retry-after")?;
    if let Ok(seconds) = value.parse::<f64>() {
        return Duration::try_from_secs_f64(seconds).ok();
    }
    let date = httpdate::parse_http_date(value).ok()?;
    // A date already past means "now".
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The generic meaning of an HTTP error status. Adapters refine it from the
/// body (a 400 that says the prompt is too long, a 403 that is a content
/// filter, a 503 that says "overloaded").
pub fn status_code(status: u16) -> ErrorCode {
    match status {
        400 | 409 | 415 | 422 => ErrorCode::InvalidRequest,
        401 => ErrorCode::Authentication,
        // 402: the provider account cannot pay; retrying will not help.
        402 | 403 => ErrorCode::Permission,
        404 => ErrorCode::NotFound,
        408 | 504 => ErrorCode::Timeout,
        413 => ErrorCode::ContextLengthExceeded,
        429 => ErrorCode::RateLimit,
        529 => ErrorCode::Overloaded,
        500..=599 => ErrorCode::ProviderUnavailable,
        _ => ErrorCode::InvalidRequest,
    }
}

/// Whether a provider's error message says the input is too long for the
/// model. Providers put this in a plain 400, so only the words tell.
pub fn mentions_context_length(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    [
        "context length",
        "context_length",
        "context window",
        "maximum context",
        "prompt is too long",
        "too many tokens",
        "input is too long",
        "exceeds the maximum number of tokens",
        "reduce the length of the messages",
    ]
    .iter()
    .any(|needle| message.contains(needle))
}

/// A failed HTTP exchange, read far enough for an adapter to classify it.
#[derive(Debug, Clone)]
pub struct ErrorResponse {
    pub status: u16,
    pub headers: HeaderMap,
    /// The body as text, cut at [`ErrorResponse::BODY_LIMIT`] bytes.
    pub body: String,
}

impl ErrorResponse {
    /// Error bodies are small; a server that sends megabytes with a 500
    /// must not make us hold them.
    pub const BODY_LIMIT: usize = 64 * 1024;

    /// Reads the status, headers and (the start of) the body. A body that
    /// cannot be read leaves `body` empty: the status still says enough.
    pub async fn read(mut response: HttpResponse) -> ErrorResponse {
        let status = response.status;
        let headers = std::mem::take(&mut response.headers);
        let mut bytes = Vec::new();
        while bytes.len() < Self::BODY_LIMIT {
            match response.chunk().await {
                Ok(Some(chunk)) => bytes.extend_from_slice(&chunk),
                Ok(None) | Err(_) => break,
            }
        }
        bytes.truncate(Self::BODY_LIMIT);
        ErrorResponse { status, headers, body: String::from_utf8_lossy(&bytes).into_owned() }
    }

    /// The generic error: code from the status, `retry_after` from the
    /// headers, and `message` (the provider's, when the adapter found one).
    pub fn to_error(&self, code: ErrorCode, message: impl Into<String>) -> ProviderError {
        ProviderError::new(code, message).with_status(self.status).with_retry_after(retry_after(&self.headers))
    }

    /// A message for a body the adapter could not read: the status and a
    /// short prefix of the body.
    pub fn fallback_message(&self) -> String {
        let body = self.body.trim();
        // Redirects are not followed (a model call is a POST with a key in
        // it): the answer says where the endpoint moved.
        if (300..400).contains(&self.status)
            && let Some(location) = self.headers.get(hyper::header::LOCATION).and_then(|value| value.to_str().ok())
        {
            return format!(
                "the provider answered HTTP {} (redirected to {location}): set the provider's base_url to the address it moved to",
                self.status
            );
        }
        if body.is_empty() {
            format!("the provider answered HTTP {}", self.status)
        } else {
            let prefix: String = body.chars().take(500).collect();
            format!("the provider answered HTTP {}: {prefix}", self.status)
        }
    }
}

/// Sends a request; a success status passes the response on, any other
/// becomes the adapter's error (`to_error` reads the provider's error body).
pub async fn send(
    client: &HttpClient,
    request: HttpRequest,
    to_error: fn(&ErrorResponse) -> ProviderError,
) -> Result<HttpResponse, ProviderError> {
    let response = client.send(request).await?;
    if (200..300).contains(&response.status) {
        Ok(response)
    } else {
        Err(to_error(&ErrorResponse::read(response).await))
    }
}

/// A failure to send the request or to receive the response headers, as
/// `code` ([`reqwest_code`] or [`hyper_code`] says which); its message names
/// the causes.
fn transport_error(code: ErrorCode, error: &(dyn std::error::Error + 'static)) -> ProviderError {
    ProviderError::new(code, describe(error))
}

fn reqwest_code(error: &reqwest::Error) -> ErrorCode {
    if error.is_timeout() {
        ErrorCode::Timeout
    } else if error.is_body() || error.is_decode() {
        ErrorCode::StreamInterrupted
    } else if error.is_builder() {
        ErrorCode::InvalidRequest
    } else {
        // Connection refused, DNS, TLS, a reset before the headers.
        ErrorCode::ProviderUnavailable
    }
}

/// hyper's client: a timeout where the connect limit's `TimedOut` is
/// somewhere in the error's chain, else the provider is unavailable.
fn hyper_code(error: &(dyn std::error::Error + 'static)) -> ErrorCode {
    let mut source = Some(error);
    while let Some(cause) = source {
        if cause.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut) {
            return ErrorCode::Timeout;
        }
        source = cause.source();
    }
    ErrorCode::ProviderUnavailable
}

/// A failure while reading a response body that had started, whichever
/// transport or reader met it: a timeout stays a timeout (the provider went
/// silent), anything else means the stream broke off.
pub(crate) fn body_error(timed_out: bool, cause: &dyn std::error::Error) -> ProviderError {
    let code = if timed_out { ErrorCode::Timeout } else { ErrorCode::StreamInterrupted };
    ProviderError::new(code, format!("the provider's stream broke off: {}", describe(cause)))
}

/// The clients' displays hide the cause ("error sending request", "client
/// error (Connect)"); the chain says what actually happened ("connection
/// refused").
fn describe(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_str(value).expect("valid header"));
        }
        map
    }

    #[test]
    fn retry_after_reads_milliseconds_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777);
        assert_eq!(retry_after_at(&headers(&[("retry-after", "7")]), now), Some(Duration::from_secs(7)));
        assert_eq!(retry_after_at(&headers(&[("retry-after", "1.5")]), now), Some(Duration::from_millis(1500)));
        // The millisecond header is more precise and wins.
        assert_eq!(
            retry_after_at(&headers(&[("retry-after-ms", "250"), ("retry-after", "1")]), now),
            Some(Duration::from_millis(250))
        );
        // 784111777 is Sun, 06 Nov 1994 08:49:37 GMT.
        assert_eq!(
            retry_after_at(&headers(&[("retry-after", "Sun, 06 Nov 1994 08:50:07 GMT")]), now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            retry_after_at(&headers(&[("retry-after", "Sun, 06 Nov 1994 08:00:00 GMT")]), now),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after_at(&headers(&[]), now), None);
        assert_eq!(retry_after_at(&headers(&[("retry-after", "soon")]), now), None);
        assert_eq!(retry_after_at(&headers(&[("retry-after", "-3")]), now), None);
    }

    #[test]
    fn statuses_map_to_codes() {
        let cases = [
            (400, ErrorCode::InvalidRequest),
            (401, ErrorCode::Authentication),
            (403, ErrorCode::Permission),
            (404, ErrorCode::NotFound),
            (408, ErrorCode::Timeout),
            (413, ErrorCode::ContextLengthExceeded),
            (429, ErrorCode::RateLimit),
            (500, ErrorCode::ProviderUnavailable),
            (502, ErrorCode::ProviderUnavailable),
            (503, ErrorCode::ProviderUnavailable),
            (504, ErrorCode::Timeout),
            (529, ErrorCode::Overloaded),
        ];
        for (status, code) in cases {
            assert_eq!(status_code(status), code, "HTTP {status}");
        }
    }

    #[test]
    fn context_length_messages_are_recognised() {
        assert!(mentions_context_length(
            "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens."
        ));
        assert!(mentions_context_length("prompt is too long: 210000 tokens > 200000 maximum"));
        assert!(mentions_context_length(
            "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576)."
        ));
        assert!(!mentions_context_length("Invalid API key provided"));
    }

    #[test]
    fn error_response_keeps_status_and_retry_after() {
        let response = ErrorResponse { status: 429, headers: headers(&[("retry-after", "7")]), body: String::new() };
        let error = response.to_error(ErrorCode::RateLimit, "slow down");
        assert_eq!(error.status, Some(429));
        assert_eq!(error.retry_after, Some(Duration::from_secs(7)));
        assert_eq!(response.fallback_message(), "the provider answered HTTP 429");
    }

    /// Neither transport follows a redirect: the 3xx comes back as the
    /// answer, to become the adapter's error.
    #[tokio::test]
    async fn neither_transport_follows_a_redirect() {
        const MOVED: &str = "HTTP/1.1 308 Permanent Redirect\r\nlocation: http://127.0.0.1:9/elsewhere\r\n\
                             content-length: 0\r\n\r\n";
        for proxied in [false, true] {
            let (uri, server) = answering_once(MOVED).await;
            let client = HttpClient::with_transport(&HttpTimeouts::default(), proxied).expect("client");
            let response = client.send(HttpRequest::post(uri, Vec::new())).await.expect("answered");
            assert_eq!(response.status(), 308, "proxied: {proxied}");
            server.await.expect("served");
        }
    }

    #[test]
    fn a_redirect_is_not_followed_and_says_where_to() {
        let moved = ErrorResponse {
            status: 308,
            headers: headers(&[("location", "https://api.example.com/v1/chat/completions")]),
            body: String::new(),
        };
        let message = moved.fallback_message();
        assert!(
            message.contains("HTTP 308") && message.contains("https://api.example.com/v1/chat/completions"),
            "{message}"
        );
        assert_eq!(status_code(308), ErrorCode::InvalidRequest);
    }

    #[test]
    fn timeouts_read_from_toml_seconds() {
        let timeouts: HttpTimeouts = toml::from_str("connect = 2\nread_idle = 0.5").expect("valid");
        assert_eq!(timeouts.connect, Duration::from_secs(2));
        assert_eq!(timeouts.read_idle, Duration::from_millis(500));
    }

    /// A server on loopback that reads one request and answers `response`
    /// (raw HTTP/1.1), then closes; returns its URI and what it was sent.
    async fn answering_once(response: &'static str) -> (Uri, tokio::task::JoinHandle<String>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let uri = format!("http://{}/v1/chat", listener.local_addr().expect("address")).parse().expect("uri");
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("accept");
            let mut request = Vec::new();
            let mut buffer = [0u8; 4096];
            // The headers, then the body of the length they give.
            loop {
                let read = socket.read(&mut buffer).await.expect("read");
                request.extend_from_slice(&buffer[..read]);
                let text = String::from_utf8_lossy(&request).to_string();
                if let Some(end) = text.find("\r\n\r\n") {
                    let length = text
                        .lines()
                        .find_map(|line| line.to_ascii_lowercase().strip_prefix("content-length:").map(str::to_string))
                        .and_then(|value| value.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if request.len() >= end + 4 + length || read == 0 {
                        break;
                    }
                }
            }
            socket.write_all(response.as_bytes()).await.expect("write");
            socket.shutdown().await.ok();
            String::from_utf8_lossy(&request).to_string()
        });
        (uri, server)
    }

    /// Both transports (direct, and reqwest for a proxy) send the same
    /// request and read a response of any status whole: its status, its
    /// headers and its body, however it was cut into chunks.
    #[tokio::test]
    async fn both_transports_post_and_read_a_response_whole() {
        const ANSWER: &str = "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n\
                              retry-after: 7\r\ntransfer-encoding: chunked\r\n\r\n\
                              5\r\n{\"a\":\r\n4\r\n 12}\r\n0\r\n\r\n";
        for proxied in [false, true] {
            let (uri, server) = answering_once(ANSWER).await;
            let client = HttpClient::with_transport(&HttpTimeouts::default(), proxied).expect("client");
            let request = HttpRequest::post(uri, b"{\"q\":1}".to_vec())
                .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
                .header(HeaderName::from_static("x-api-key"), secret_header("k-1").expect("valid"));
            let response = client.send(request).await.expect("answered");
            assert_eq!(response.status(), 429, "proxied: {proxied}");
            assert!(response.is_json());
            assert_eq!(retry_after(response.headers()), Some(Duration::from_secs(7)));
            assert_eq!(&response.bytes().await.expect("body")[..], b"{\"a\": 12}", "proxied: {proxied}");
            let sent = server.await.expect("served").to_ascii_lowercase();
            assert!(sent.starts_with("post /v1/chat http/1.1\r\n"), "{sent}");
            assert!(sent.contains("x-api-key: k-1\r\n") && sent.contains("user-agent: arbor/"), "{sent}");
            assert!(sent.ends_with("\r\n\r\n{\"q\":1}"), "{sent}");
        }
    }

    #[test]
    fn a_proxy_in_the_environment_is_seen_in_any_of_its_spellings() {
        let only = |set: &'static str, value: &'static str| {
            move |name: &str| (name == set).then(|| std::ffi::OsString::from(value))
        };
        for name in PROXY_VARIABLES {
            assert!(proxy_set(only(name, "http://proxy:3128")), "{name}");
            assert!(!proxy_set(only(name, "")), "{name} set empty");
        }
        assert!(!proxy_set(only("NO_PROXY", "localhost")), "NO_PROXY alone sets no proxy");
    }

    /// An `https` endpoint is reached over TLS: the client's hello names
    /// the host (SNI) and offers h2 and HTTP/1.1 (ALPN), and a server that
    /// does not answer in TLS is `provider_unavailable`, its cause named.
    #[tokio::test]
    async fn https_goes_over_tls_offering_h2_and_http1() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("accept");
            let mut hello = vec![0u8; 4096];
            let read = socket.read(&mut hello).await.expect("read");
            hello.truncate(read);
            socket.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n").await.ok();
            hello
        });
        let uri: Uri = format!("https://localhost:{port}/v1/chat/completions").parse().expect("uri");
        let client = HttpClient::with_transport(&HttpTimeouts::default(), false).expect("client");
        let error = client.send(HttpRequest::post(uri, Vec::new())).await.expect_err("not TLS");
        assert_eq!(error.code, ErrorCode::ProviderUnavailable, "{error}");
        let hello = server.await.expect("served");
        let contains = |needle: &[u8]| hello.windows(needle.len()).any(|window| window == needle);
        assert_eq!(hello.first(), Some(&0x16), "a TLS handshake record");
        assert!(contains(b"localhost"), "SNI names the host");
        assert!(contains(b"\x02h2") && contains(b"\x08http/1.1"), "ALPN offers h2 and http/1.1");
    }

    /// A server that takes the connection but never answers the TLS
    /// handshake is given the connect timeout, not the read idle one.
    #[tokio::test]
    async fn a_handshake_that_never_comes_is_a_connect_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        tokio::spawn(async move {
            let (_socket, _) = listener.accept().await.expect("accept");
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        let uri: Uri = format!("https://localhost:{port}/").parse().expect("uri");
        let timeouts = HttpTimeouts { connect: Duration::from_millis(300), read_idle: Duration::from_secs(30) };
        let client = HttpClient::with_transport(&timeouts, false).expect("client");
        let started = std::time::Instant::now();
        let error = client.send(HttpRequest::post(uri, Vec::new())).await.expect_err("no handshake");
        assert_eq!(error.code, ErrorCode::Timeout, "{error}");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    }

    /// A response whose body stops coming ends in `timeout` after the read
    /// idle time, not in a turn that waits forever.
    #[tokio::test]
    async fn a_body_that_stops_coming_times_out() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let uri: Uri = format!("http://{}/", listener.local_addr().expect("address")).parse().expect("uri");
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("accept");
            let mut buffer = [0u8; 4096];
            let _ = socket.read(&mut buffer).await;
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            socket.write_all(head.as_bytes()).await.expect("head");
            socket.write_all(b"6\r\ndata: \r\n").await.expect("piece");
            // Then silence, with the connection open.
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        let timeouts = HttpTimeouts { connect: Duration::from_secs(2), read_idle: Duration::from_millis(200) };
        let client = HttpClient::with_transport(&timeouts, false).expect("client");
        let mut response = client.send(HttpRequest::post(uri, Vec::new())).await.expect("headers");
        assert_eq!(response.chunk().await.expect("first piece").as_deref(), Some(&b"data: "[..]));
        let started = std::time::Instant::now();
        let error = response.chunk().await.expect_err("silence");
        assert_eq!(error.code, ErrorCode::Timeout, "{error}");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        assert_eq!(response.chunk().await.expect("ended").as_deref(), None, "nothing after the timeout");
    }

    #[tokio::test]
    async fn a_refused_connection_is_provider_unavailable() {
        // Bind then drop a listener so the port is very likely closed.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        drop(listener);
        let uri: Uri = format!("http://{address}/").parse().expect("uri");
        for proxied in [false, true] {
            let client = HttpClient::with_transport(&HttpTimeouts::default(), proxied).expect("client");
            let error = client.send(HttpRequest::post(uri.clone(), Vec::new())).await.expect_err("nothing listens");
            assert_eq!(error.code, ErrorCode::ProviderUnavailable, "proxied: {proxied}: {error}");
            assert!(error.message.contains("refused"), "the cause is named: {error}");
        }
    }
}
