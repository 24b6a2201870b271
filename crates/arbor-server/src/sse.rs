//! Writing a conversation's events as Server-Sent Events: `id:` is the
//! event's seq, `event:` its name, `data:` the JSON stored with it. The
//! stream ends at shutdown so that a stopping server is not held open by
//! viewers.
//!
//! Each event is written straight into one buffer of its size, which
//! becomes the body's frame. axum's `Sse` built each event in a buffer that
//! grew field by field (five reservations an event, ~250 instructions
//! each) and reset its keep-alive timer after every event: 24k
//! instructions of a streamed turn of the benchmark, 4.2%, against 11k
//! here (callgrind, bench/analysis.md "Since the fiftieth run"). Here the
//! keep-alive timer is not touched per event: it is checked every half
//! interval, and a comment is sent when nothing was sent since the last
//! check, so that a quiet stream carries something at least every
//! [`KEEP_ALIVE`].

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use arbor_core::event::{Event, Visibility};
use arbor_engine::EventStream;
use axum::body::{Body, Bytes};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

/// The longest a viewer's stream stays silent: idle connections are cut by
/// proxies and load balancers (commonly after 30–60 s).
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// How often a quiet stream is checked: a check that finds nothing sent
/// since the last one pings, so silences last at most two of these.
const CHECK_EVERY: Duration = Duration::from_millis(KEEP_ALIVE.as_millis() as u64 / 2);

/// What a quiet stream sends: an SSE comment, which clients ignore.
const PING: &[u8] = b":\n\n";

pub fn respond(events: EventStream, visibility: Visibility, shutdown: CancellationToken) -> Response {
    let frames = events
        .filter(move |event| std::future::ready(visibility.shows(event.name)))
        .map(|event| Ok(frame(&event)))
        .take_until(shutdown.cancelled_owned());
    let body = Body::from_stream(KeepAlive::new(frames));
    ([(CONTENT_TYPE, "text/event-stream"), (CACHE_CONTROL, "no-cache")], body).into_response()
}

/// One event as its SSE frame. The data is JSON, which has no line breaks;
/// should it hold one, each line goes in a `data:` line of its own, which
/// the client joins with `\n` (so a CR or CRLF arrives as LF, the most the
/// format can carry).
fn frame(event: &Event) -> Bytes {
    let mut seq = itoa::Buffer::new();
    let (seq, name, data) = (seq.format(event.seq), event.name.as_str(), event.data.as_bytes());
    let fields = "id: \nevent: \ndata: \n\n".len();
    let mut frame = Vec::with_capacity(fields + seq.len() + name.len() + data.len());
    frame.extend_from_slice(b"id: ");
    frame.extend_from_slice(seq.as_bytes());
    frame.extend_from_slice(b"\nevent: ");
    frame.extend_from_slice(name.as_bytes());
    frame.extend_from_slice(b"\ndata: ");
    let mut rest = data;
    while let Some(end) = memchr::memchr2(b'\n', b'\r', rest) {
        frame.extend_from_slice(&rest[..end]);
        frame.extend_from_slice(b"\ndata: ");
        let crlf = rest[end] == b'\r' && rest.get(end + 1) == Some(&b'\n');
        rest = &rest[end + if crlf { 2 } else { 1 }..];
    }
    frame.extend_from_slice(rest);
    frame.extend_from_slice(b"\n\n");
    Bytes::from(frame)
}

/// The frames, with a [`PING`] whenever nothing was sent for a while.
struct KeepAlive<S> {
    frames: Pin<Box<S>>,
    /// The next check. Not reset when a frame goes out (that would be a
    /// timer update per event); `sent` records it instead.
    check: Pin<Box<Sleep>>,
    sent: bool,
}

impl<S> KeepAlive<S> {
    fn new(frames: S) -> KeepAlive<S> {
        KeepAlive { frames: Box::pin(frames), check: Box::pin(tokio::time::sleep(CHECK_EVERY)), sent: false }
    }
}

impl<S> Stream for KeepAlive<S>
where
    S: Stream<Item = Result<Bytes, Infallible>>,
{
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = this.frames.as_mut().poll_next(context) {
            this.sent = true;
            return Poll::Ready(frame);
        }
        loop {
            ready!(this.check.as_mut().poll(context));
            let next = Instant::now() + CHECK_EVERY;
            this.check.as_mut().reset(next);
            if !std::mem::take(&mut this.sent) {
                return Poll::Ready(Some(Ok(Bytes::from_static(PING))));
            }
        }
    }
}

/// Parses `?visibility=`.
pub fn visibility(text: Option<&str>) -> Result<Visibility, crate::error::ApiError> {
    match text {
        None => Ok(Visibility::Full),
        Some(text) => Visibility::parse(text).ok_or_else(|| {
            crate::error::ApiError::bad_request(format!("visibility {text:?} is not one of minimal, compact, full"))
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arbor_core::event::EventName;
    use futures_util::stream;

    use super::*;

    fn event(seq: i64, data: &str) -> Event {
        Event {
            seq,
            conversation_id: Arc::from("c"),
            turn_id: None,
            name: EventName::Delta,
            data: Arc::from(data),
            created_at: 0,
        }
    }

    /// What a client reads from `frame`: (id, event, data) of each event.
    fn read(frame: &[u8]) -> Vec<(Option<i64>, String, String)> {
        arbor_testkit::parse_sse(std::str::from_utf8(frame).expect("UTF-8"))
            .into_iter()
            .map(|event| (event.id, event.event, event.data.to_string()))
            .collect()
    }

    #[test]
    fn an_event_is_one_frame_of_id_name_and_data() {
        let frame = frame(&event(42, r#"{"text":"hi"}"#));
        assert_eq!(&frame[..], b"id: 42\nevent: delta\ndata: {\"text\":\"hi\"}\n\n");
    }

    #[test]
    fn line_breaks_in_data_become_data_lines_the_client_joins() {
        for (data, joined) in [("a\nb", "a\nb"), ("a\r\nb", "a\nb"), ("a\rb\n\nc", "a\nb\n\nc"), ("end\n", "end\n")] {
            let frame = frame(&event(7, data));
            let text = std::str::from_utf8(&frame).expect("UTF-8");
            // Every line of the frame is a field: no bare line break leaks out.
            assert!(text.lines().take_while(|line| !line.is_empty()).all(|line| line.contains(": ")), "{text:?}");
            assert!(text.ends_with("\n\n") && !text.contains('\r'), "{text:?}");
            let lines: Vec<&str> = text.lines().filter_map(|line| line.strip_prefix("data: ")).collect();
            assert_eq!(lines.join("\n"), joined, "{data:?}");
        }
        assert_eq!(read(&frame(&event(1, "{}"))), vec![(Some(1), "delta".into(), "{}".into())]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_stream_pings_within_the_keep_alive_and_a_busy_one_does_not() {
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel::<Result<Bytes, Infallible>>();
        let mut stream = KeepAlive::new(tokio_stream::wrappers::UnboundedReceiverStream::new(receiver));
        let ping = Some(Ok(Bytes::from_static(PING)));
        let frame = Some(Ok(Bytes::from_static(b"frame")));
        // Silent from the start: a ping within the limit.
        let first = tokio::time::timeout(KEEP_ALIVE, stream.next()).await.expect("a ping within the keep-alive");
        assert_eq!(first, ping);
        // A frame every 3 s for 30 s, read as they come: no ping among them.
        let feeder = tokio::spawn(async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_secs(3)).await;
                sender.send(Ok(Bytes::from_static(b"frame"))).expect("open");
            }
            sender
        });
        for _ in 0..10 {
            assert_eq!(stream.next().await, frame);
        }
        let sender = feeder.await.expect("fed");
        // Then silence again: a ping within the limit of the last frame.
        let next = tokio::time::timeout(KEEP_ALIVE, stream.next()).await.expect("a ping within the keep-alive");
        assert_eq!(next, ping);
        drop(sender);
        assert_eq!(stream.next().await, None);
    }

    #[tokio::test]
    async fn the_stream_ends_with_its_events() {
        let frames = stream::iter([Ok(Bytes::from_static(b"a")), Ok(Bytes::from_static(b"b"))]);
        let all: Vec<_> = KeepAlive::new(frames).collect().await;
        assert_eq!(all, vec![Ok(Bytes::from_static(b"a")), Ok(Bytes::from_static(b"b"))]);
    }
}
