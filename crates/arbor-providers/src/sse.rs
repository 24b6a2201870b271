//! Server-sent events from a provider's response body. Framing (lines,
//! `data:` continuation, CR/LF variants, split UTF-8) is the
//! `eventsource-stream` crate's business; this module only turns its output
//! into [`SseEvent`]s and its failures into [`ProviderError`]s, so that every
//! adapter reads the same, already-classified events.
//!
//! The in-memory helpers ([`byte_chunks`], [`decode_chunked`]) feed the same
//! decoder from a byte slice cut at chosen offsets, which is how the adapters'
//! tests check that chunk boundaries never change a parsed reply.

use std::convert::Infallible;

use arbor_core::{ErrorCode, ProviderError};
use bytes::Bytes;
use eventsource_stream::{EventStreamError, Eventsource};
use futures_util::{FutureExt, Stream, StreamExt, stream};

/// One server-sent event. `event` is `message` when the server named none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
}

/// A failure of the byte stream under the events, classified for Arbor.
pub trait BodyError {
    fn into_provider_error(self) -> ProviderError;
}

impl BodyError for reqwest::Error {
    fn into_provider_error(self) -> ProviderError {
        crate::http::body_error(&self)
    }
}

impl BodyError for std::io::Error {
    fn into_provider_error(self) -> ProviderError {
        let code =
            if self.kind() == std::io::ErrorKind::TimedOut { ErrorCode::Timeout } else { ErrorCode::StreamInterrupted };
        ProviderError::new(code, format!("the provider's stream broke off: {self}"))
    }
}

impl BodyError for ProviderError {
    fn into_provider_error(self) -> ProviderError {
        self
    }
}

impl BodyError for Infallible {
    fn into_provider_error(self) -> ProviderError {
        match self {}
    }
}

/// Decodes a response body into events. The stream ends after the first
/// error: a broken body cannot be resynchronised, and an adapter must not
/// build a reply from what follows a gap.
///
/// A final event the server did not close with a blank line is still
/// delivered when the body ends cleanly (some OpenAI-compatible servers end
/// with `data: [DONE]\n`); a body cut mid-line then yields an unreadable
/// event, which the adapter reports, rather than silently losing it.
pub fn sse_events<S, E>(body: S) -> impl Stream<Item = Result<SseEvent, ProviderError>> + Send
where
    S: Stream<Item = Result<Bytes, E>> + Send,
    E: BodyError + Send,
{
    let closing = stream::once(async { Ok(Bytes::from_static(b"\n\n")) });
    body.chain(closing)
        .eventsource()
        .map(|item| match item {
            Ok(event) => Ok(SseEvent { event: event.event, data: event.data }),
            Err(EventStreamError::Transport(error)) => Err(error.into_provider_error()),
            Err(EventStreamError::Utf8(error)) => Err(ProviderError::new(
                ErrorCode::StreamInterrupted,
                format!("the provider's stream is not valid UTF-8: {error}"),
            )),
            Err(EventStreamError::Parser(error)) => Err(ProviderError::new(
                ErrorCode::StreamInterrupted,
                format!("the provider's stream is not valid server-sent events: {error}"),
            )),
        })
        .scan(false, |failed, item| {
            if *failed {
                return std::future::ready(None);
            }
            *failed = item.is_err();
            std::future::ready(Some(item))
        })
}

/// `bytes` as a body stream, cut at each offset in `cuts` (offsets out of
/// range or out of order are clamped, so any list of numbers is a valid cut).
pub fn byte_chunks(bytes: &[u8], cuts: &[usize]) -> impl Stream<Item = Result<Bytes, Infallible>> + Send + 'static {
    let mut pieces = Vec::with_capacity(cuts.len() + 1);
    let mut start = 0;
    let mut sorted: Vec<usize> = cuts.iter().map(|cut| (*cut).min(bytes.len())).collect();
    sorted.sort_unstable();
    for cut in sorted {
        pieces.push(Ok(Bytes::copy_from_slice(&bytes[start..cut])));
        start = cut;
    }
    pieces.push(Ok(Bytes::copy_from_slice(&bytes[start..])));
    stream::iter(pieces)
}

/// Decodes an in-memory body cut at `cuts`, synchronously.
pub fn decode_chunked(bytes: &[u8], cuts: &[usize]) -> Vec<Result<SseEvent, ProviderError>> {
    sse_events(byte_chunks(bytes, cuts))
        .collect::<Vec<_>>()
        .now_or_never()
        // An in-memory stream is always ready, so this never waits.
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(name: &str, data: &str) -> SseEvent {
        SseEvent { event: name.into(), data: data.into() }
    }

    #[test]
    fn decodes_named_and_unnamed_events_with_multiline_data() {
        let body = b": comment\ndata: {\"a\":1}\n\nevent: error\ndata: line one\ndata: line two\n\ndata: [DONE]\n\n";
        let events: Vec<_> = decode_chunked(body, &[]).into_iter().map(|item| item.expect("valid")).collect();
        assert_eq!(
            events,
            vec![event("message", "{\"a\":1}"), event("error", "line one\nline two"), event("message", "[DONE]"),]
        );
    }

    #[test]
    fn crlf_and_split_utf8_give_the_same_events_at_every_cut() {
        let body = "data: h\u{e9}llo \u{1F44D}\r\n\r\nevent: x\r\ndata: 2\r\n\r\n".as_bytes();
        let whole = decode_chunked(body, &[]);
        assert_eq!(whole.len(), 2);
        for cut in 0..=body.len() {
            assert_eq!(decode_chunked(body, &[cut]), whole, "cut at {cut}");
            for second in cut..=body.len() {
                assert_eq!(decode_chunked(body, &[cut, second]), whole);
            }
        }
    }

    #[test]
    fn last_event_without_blank_line_is_delivered() {
        let events = decode_chunked(b"data: 1\n\ndata: [DONE]\n", &[]);
        assert_eq!(events, vec![Ok(event("message", "1")), Ok(event("message", "[DONE]"))]);
    }

    #[test]
    fn transport_error_ends_the_stream_with_its_code() {
        let body = stream::iter(vec![
            Ok(Bytes::from_static(b"data: 1\n\n")),
            Err(ProviderError::new(ErrorCode::Timeout, "idle")),
            Ok(Bytes::from_static(b"data: 2\n\n")),
        ]);
        let items = sse_events(body).collect::<Vec<_>>().now_or_never().expect("ready");
        assert_eq!(items.len(), 2);
        assert_eq!(items[0], Ok(event("message", "1")));
        assert_eq!(items[1].as_ref().map_err(|e| e.code), Err(ErrorCode::Timeout));
    }

    #[test]
    fn invalid_utf8_is_a_stream_interruption() {
        let items = decode_chunked(b"data: \xff\xfe\n\n", &[]);
        let last = items.last().expect("an item");
        assert_eq!(last.as_ref().map_err(|e| e.code), Err(ErrorCode::StreamInterrupted));
    }

    #[test]
    fn io_errors_map_timeouts_apart_from_breaks() {
        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "slow");
        assert_eq!(timed_out.into_provider_error().code, ErrorCode::Timeout);
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(reset.into_provider_error().code, ErrorCode::StreamInterrupted);
    }
}
