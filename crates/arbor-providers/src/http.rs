//! HTTP plumbing shared by the adapters: one way to build the client (rustls,
//! a connect timeout and a per-read idle timeout, so a provider that hangs
//! before its headers or stalls mid-stream ends in `timeout` rather than a
//! turn that never finishes), `retry-after` parsing, and the generic mapping
//! of HTTP statuses and transport failures onto [`ErrorCode`]. Each adapter
//! refines the generic code from its provider's error body.

use std::time::{Duration, SystemTime};

use arbor_core::{ErrorCode, ProviderError};
use reqwest::header::HeaderMap;
use serde::{Deserialize, Serialize};

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

/// The `reqwest::Client` every adapter uses. Clients pool connections, so
/// an adapter builds one and keeps it.
pub fn build_client(timeouts: &HttpTimeouts) -> Result<reqwest::Client, ProviderError> {
    ensure_crypto_provider();
    reqwest::Client::builder()
        .connect_timeout(timeouts.connect)
        .read_timeout(timeouts.read_idle)
        .pool_idle_timeout(Duration::from_secs(90))
        .tcp_keepalive(Duration::from_secs(30))
        .user_agent(concat!("arbor/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|error| ProviderError::new(ErrorCode::Internal, format!("could not build the HTTP client: {error}")))
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
    pub async fn read(mut response: reqwest::Response) -> ErrorResponse {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
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
    request: reqwest::RequestBuilder,
    to_error: fn(&ErrorResponse) -> ProviderError,
) -> Result<reqwest::Response, ProviderError> {
    let response = request.send().await.map_err(|error| transport_error(&error))?;
    if response.status().is_success() { Ok(response) } else { Err(to_error(&ErrorResponse::read(response).await)) }
}

/// A failure to send the request or to receive the response headers.
pub fn transport_error(error: &reqwest::Error) -> ProviderError {
    let code = if error.is_timeout() {
        ErrorCode::Timeout
    } else if error.is_body() || error.is_decode() {
        ErrorCode::StreamInterrupted
    } else if error.is_builder() {
        ErrorCode::InvalidRequest
    } else {
        // Connection refused, DNS, TLS, a reset before the headers.
        ErrorCode::ProviderUnavailable
    };
    ProviderError::new(code, describe(error))
}

/// A failure while reading a response body that had started: a timeout
/// stays a timeout (the provider went silent), anything else means the
/// stream broke off.
pub fn body_error(error: &reqwest::Error) -> ProviderError {
    let code = if error.is_timeout() { ErrorCode::Timeout } else { ErrorCode::StreamInterrupted };
    ProviderError::new(code, describe(error))
}

/// reqwest's display hides the cause ("error sending request"); the chain
/// says what actually happened ("connection refused").
fn describe(error: &reqwest::Error) -> String {
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
    use reqwest::header::HeaderValue;

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

    #[test]
    fn timeouts_read_from_toml_seconds() {
        let timeouts: HttpTimeouts = toml::from_str("connect = 2\nread_idle = 0.5").expect("valid");
        assert_eq!(timeouts.connect, Duration::from_secs(2));
        assert_eq!(timeouts.read_idle, Duration::from_millis(500));
    }

    #[tokio::test]
    async fn a_refused_connection_is_provider_unavailable() {
        // Bind then drop a listener so the port is very likely closed.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        drop(listener);
        let client = build_client(&HttpTimeouts::default()).expect("client");
        let error = client.get(format!("http://{address}/")).send().await.expect_err("nothing listens");
        assert_eq!(transport_error(&error).code, ErrorCode::ProviderUnavailable);
    }
}
