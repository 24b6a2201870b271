//! Server-sent events from a provider's response body. The framing (lines,
//! `field: value` pairs, `data:` continuation, CR/LF variants, split UTF-8)
//! is done here by hand rather than by a crate: it sits on the hot path of
//! every streamed reply, and the crate we used before (`eventsource-stream`,
//! built on nom) cost about a sixth of Arbor's CPU in a profile; among other
//! things it copied the rest of its buffer after every line. This decoder
//! scans each byte once, decodes complete lines straight out of the body's
//! chunks, and copies only a line that a chunk boundary cuts in two. An
//! event's data is handed on as bytes: usually a slice of the chunk it came
//! in, neither copied nor checked here. Its reader checks that it is UTF-8
//! ([`SseEvent::text`]), once, a block at a time (`simdutf8`: a chunk of a
//! streamed reply, ~240 bytes, in about half of `std::str::from_utf8`'s
//! instructions); before, each line was checked here and each event's data
//! copied into a string of its own.
//!
//! The framing follows the WHATWG server-sent events rules: lines end with
//! CRLF, LF or CR (a CR that ends one chunk and an LF that starts the next are
//! one line end); a leading byte order mark is dropped; `:` starts a comment;
//! one space after a field's colon is dropped; `event` names the event
//! (`message` when unnamed), `data` lines are joined with `\n`, a blank line
//! dispatches, and an event without `data` is not dispatched. `id`, `retry`
//! and unknown fields are ignored: no adapter reconnects with a last event id.
//! Failures become [`ProviderError`]s, so that every adapter reads the same,
//! already-classified events; data that is not UTF-8 is one, from
//! [`SseEvent::text`].
//!
//! The in-memory helpers ([`byte_chunks`], [`decode_chunked`]) feed the same
//! decoder from a byte slice cut at chosen offsets, which is how the adapters'
//! tests check that chunk boundaries never change a parsed reply.

use std::borrow::Cow;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use arbor_core::{ErrorCode, ProviderError};
use bytes::{Buf, Bytes};
use futures_util::{FutureExt, Stream, StreamExt, stream};

/// One server-sent event. `event` is `message` when the server named none
/// (borrowed then: OpenAI names no event, and one string less per event is
/// one allocation less per chunk of every streamed reply).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub event: Cow<'static, str>,
    /// The `data` lines, joined with `\n`, as the server sent them: read
    /// them with [`SseEvent::text`].
    pub data: Bytes,
}

impl SseEvent {
    /// The event's data as text, or the error that ends a stream that is
    /// not UTF-8.
    pub fn text(&self) -> Result<&str, ProviderError> {
        utf8(&self.data)
    }
}

/// `bytes` as text, or the error that ends a stream that is not UTF-8.
fn utf8(bytes: &[u8]) -> Result<&str, ProviderError> {
    simdutf8::basic::from_utf8(bytes).map_err(|_| not_utf8(bytes))
}

/// Says where the text stops being UTF-8 (the fast check only says that
/// it does).
#[cold]
fn not_utf8(bytes: &[u8]) -> ProviderError {
    let detail = match std::str::from_utf8(bytes) {
        Err(error) => error.to_string(),
        Ok(_) => "an invalid sequence".to_owned(),
    };
    ProviderError::new(ErrorCode::StreamInterrupted, format!("the provider's stream is not valid UTF-8: {detail}"))
}

/// A failure of the byte stream under the events, classified for Arbor.
pub trait BodyError {
    fn into_provider_error(self) -> ProviderError;
}

impl BodyError for reqwest::Error {
    fn into_provider_error(self) -> ProviderError {
        crate::http::body_error(self.is_timeout(), &self)
    }
}

impl BodyError for std::io::Error {
    fn into_provider_error(self) -> ProviderError {
        crate::http::body_error(self.kind() == std::io::ErrorKind::TimedOut, &self)
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
    EventStream { body: Some(Box::pin(body)), chunk: Bytes::new(), decoder: Decoder::default() }
}

/// The stream behind [`sse_events`]: pulls chunks from the body and hands
/// them to the [`Decoder`] until it completes an event.
struct EventStream<S> {
    /// `None` once the body has ended or failed: nothing more is read from it.
    /// Boxed so that this stream is `Unpin` whatever the body is.
    body: Option<Pin<Box<S>>>,
    /// What is left of the latest chunk. A chunk can hold several events and
    /// the stream yields one at a time, so the rest waits here.
    chunk: Bytes,
    decoder: Decoder,
}

impl<S> EventStream<S> {
    /// Ends the stream after an error: what follows a gap or a bad byte
    /// cannot be trusted.
    fn stop(&mut self) {
        self.body = None;
        self.chunk.clear();
    }
}

impl<S, E> Stream for EventStream<S>
where
    S: Stream<Item = Result<Bytes, E>>,
    E: BodyError,
{
    type Item = Result<SseEvent, ProviderError>;

    fn poll_next(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            // Events already in the buffered chunk come before anything the
            // body says next, including its error.
            if let Some(item) = this.decoder.decode(&mut this.chunk) {
                if item.is_err() {
                    this.stop();
                }
                return Poll::Ready(Some(item));
            }
            let Some(body) = this.body.as_mut() else {
                return Poll::Ready(None);
            };
            match ready!(body.as_mut().poll_next(context)) {
                Some(Ok(chunk)) => this.chunk = chunk,
                Some(Err(error)) => {
                    this.stop();
                    return Poll::Ready(Some(Err(error.into_provider_error())));
                }
                None => {
                    this.body = None;
                    return Poll::Ready(this.decoder.finish());
                }
            }
        }
    }
}

const BYTE_ORDER_MARK: &[u8] = "\u{feff}".as_bytes();

/// The framing state carried from one chunk to the next.
#[derive(Default)]
struct Decoder {
    /// The start of a line whose end has not arrived yet. Only new bytes are
    /// scanned for the line end, so a long line cut into many chunks is still
    /// scanned once; the buffer keeps its capacity from line to line.
    partial_line: Vec<u8>,
    /// The last line ended with a CR, so an LF right after it belongs to the
    /// same line end, even when it comes first in the next chunk.
    after_cr: bool,
    /// A line has been read, so a byte order mark is no longer stripped.
    started: bool,
    /// The `event` field of the event being read; empty means `message`.
    event_type: String,
    /// The `data` lines of the event being read.
    data: Data,
    /// The data of an event with more than one `data` line, or whose line
    /// came in pieces, joined with `\n`; it keeps its capacity from event to
    /// event.
    joined: Vec<u8>,
}

/// The `data` read so far of the event being read.
#[derive(Default)]
enum Data {
    /// No `data` line: the event is not dispatched at all (a `data` line
    /// with nothing on it gives an event with empty data).
    #[default]
    None,
    /// One line, which came whole in one chunk: a slice of that chunk.
    Slice(Bytes),
    /// In `joined`.
    Joined,
}

impl Decoder {
    /// Reads lines from the front of `input`, consuming them, until one
    /// completes an event or fails. Returns `None` once `input` is used up,
    /// with an unfinished last line kept for the next chunk.
    fn decode(&mut self, input: &mut Bytes) -> Option<Result<SseEvent, ProviderError>> {
        while !input.is_empty() {
            if std::mem::take(&mut self.after_cr) && input[0] == b'\n' {
                input.advance(1);
                continue;
            }
            let Some(end) = memchr::memchr2(b'\n', b'\r', input) else {
                self.partial_line.extend_from_slice(input);
                input.clear();
                return None;
            };
            self.after_cr = input[end] == b'\r';
            let outcome = if self.partial_line.is_empty() {
                self.line(&input[..end], Some(&*input))
            } else {
                let mut line = std::mem::take(&mut self.partial_line);
                line.extend_from_slice(&input[..end]);
                let outcome = self.line(&line, None);
                line.clear();
                self.partial_line = line;
                outcome
            };
            input.advance(end + 1);
            if outcome.is_some() {
                return outcome;
            }
        }
        None
    }

    /// Ends the body as if it had closed its last line and event: some
    /// servers end with `data: [DONE]\n`, and a body cut mid-line yields an
    /// unreadable event, which the adapter reports, rather than losing it.
    fn finish(&mut self) -> Option<Result<SseEvent, ProviderError>> {
        if !self.partial_line.is_empty() {
            let line = std::mem::take(&mut self.partial_line);
            // A line with something on it never dispatches, so this can only
            // be an error.
            if let Some(error) = self.line(&line, None) {
                return Some(error);
            }
        }
        self.dispatch().map(Ok)
    }

    /// Applies one line (without its line end) to the event being read.
    /// `chunk` is the chunk the line lies in, when it came whole in one.
    fn line(&mut self, line: &[u8], chunk: Option<&Bytes>) -> Option<Result<SseEvent, ProviderError>> {
        let line = if std::mem::replace(&mut self.started, true) {
            line
        } else {
            line.strip_prefix(BYTE_ORDER_MARK).unwrap_or(line)
        };
        if line.is_empty() {
            return self.dispatch().map(Ok);
        }
        // The field name is short (`data`, `event`): a plain scan finds its
        // colon sooner than a searcher is set up (`split_once` was ~130
        // instructions a line).
        let (field, value) = match line.iter().position(|byte| *byte == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &[][..]),
        };
        match field {
            b"event" => {
                // CR and LF never occur inside a multi-byte character, so a
                // complete line holds whole characters, however the chunks
                // were cut.
                let name = match utf8(value) {
                    Ok(name) => name,
                    Err(error) => return Some(Err(error)),
                };
                self.event_type.clear();
                self.event_type.push_str(name);
            }
            b"data" => match (&self.data, chunk) {
                (Data::None, Some(chunk)) => self.data = Data::Slice(chunk.slice_ref(value)),
                (Data::None, None) => {
                    self.joined.clear();
                    self.joined.extend_from_slice(value);
                    self.data = Data::Joined;
                }
                (Data::Slice(first), _) => {
                    self.joined.clear();
                    self.joined.extend_from_slice(first);
                    self.joined.push(b'\n');
                    self.joined.extend_from_slice(value);
                    self.data = Data::Joined;
                }
                (Data::Joined, _) => {
                    self.joined.push(b'\n');
                    self.joined.extend_from_slice(value);
                }
            },
            // A comment (empty field name), `id`, `retry` or a field we do
            // not know: ignored, whatever its bytes.
            _ => {}
        }
        None
    }

    /// Ends the event being read: it is returned if it has data, and the
    /// next one starts empty either way.
    fn dispatch(&mut self) -> Option<SseEvent> {
        let event_type = std::mem::take(&mut self.event_type);
        let data = match std::mem::take(&mut self.data) {
            Data::None => return None,
            Data::Slice(data) => data,
            Data::Joined => Bytes::copy_from_slice(&self.joined),
        };
        let event = if event_type.is_empty() { Cow::Borrowed("message") } else { Cow::Owned(event_type) };
        Some(SseEvent { event, data })
    }
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
        SseEvent { event: name.to_owned().into(), data: Bytes::copy_from_slice(data.as_bytes()) }
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
        assert_eq!(whole, vec![Ok(event("message", "h\u{e9}llo \u{1F44D}")), Ok(event("x", "2"))]);
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
    fn data_that_is_not_utf8_reads_as_a_stream_interruption() {
        let items = events(b"data: ok\n\ndata: \xff\xfe\n\n", &[]);
        assert_eq!(items[0].text(), Ok("ok"));
        let error = items[1].text().expect_err("not UTF-8");
        assert_eq!(error.code, ErrorCode::StreamInterrupted);
        // Where it stops being UTF-8 is said, though the fast check alone
        // cannot tell.
        assert!(error.message.contains("not valid UTF-8") && error.message.contains("index 0"), "{}", error.message);
    }

    #[test]
    fn an_event_name_that_is_not_utf8_ends_the_stream() {
        let items = decode_chunked(b"event: \xff\ndata: 1\n\ndata: 2\n\n", &[]);
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].as_ref().map_err(|e| e.code), Err(ErrorCode::StreamInterrupted));
    }

    #[test]
    fn lines_that_are_ignored_are_ignored_whatever_their_bytes() {
        let body = b": \xff comment\nid: \xfe\n\xff: x\ndata: 1\n\n";
        assert_eq!(events(body, &[]), vec![event("message", "1")]);
    }

    #[test]
    fn io_errors_map_timeouts_apart_from_breaks() {
        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "slow");
        assert_eq!(timed_out.into_provider_error().code, ErrorCode::Timeout);
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(reset.into_provider_error().code, ErrorCode::StreamInterrupted);
    }

    fn events(body: &[u8], cuts: &[usize]) -> Vec<SseEvent> {
        decode_chunked(body, cuts).into_iter().map(|item| item.expect("valid")).collect()
    }

    #[test]
    fn cr_alone_ends_lines() {
        let body = b"event: a\rdata: 1\rdata: 2\r\rdata: 3\r\r";
        assert_eq!(events(body, &[]), vec![event("a", "1\n2"), event("message", "3")]);
    }

    #[test]
    fn cr_and_lf_in_different_chunks_are_one_line_end_at_every_cut() {
        // Were the CR and the LF two line ends, the blank line they would make
        // would split the first event in two.
        let body = b"data: 1\r\ndata: 2\r\n\r\nevent: x\r\ndata: 3\r\n\r\n";
        let expected = vec![event("message", "1\n2"), event("x", "3")];
        for cut in 0..=body.len() {
            assert_eq!(events(body, &[cut]), expected, "cut at {cut}");
            for second in cut..=body.len() {
                assert_eq!(events(body, &[cut, second]), expected, "cuts at {cut} and {second}");
            }
        }
    }

    #[test]
    fn leading_byte_order_mark_is_dropped_at_every_cut() {
        let body = "\u{feff}data: 1\n\n".as_bytes();
        for cut in 0..=body.len() {
            assert_eq!(events(body, &[cut]), vec![event("message", "1")], "cut at {cut}");
        }
        // Only at the start: later, it is part of a field name we don't know.
        assert_eq!(events("data: 1\n\n\u{feff}data: 2\n\n".as_bytes(), &[]), vec![event("message", "1")]);
    }

    #[test]
    fn comments_alone_give_no_events() {
        assert_eq!(decode_chunked(b": ping\n\n:\n\n: ping\r\n", &[]), vec![]);
    }

    #[test]
    fn field_without_colon_has_an_empty_value() {
        let body = b"data\n\ndata\ndata\n\nevent\ndata: x\n\nevent: lost\n\n";
        assert_eq!(events(body, &[]), vec![event("message", ""), event("message", "\n"), event("message", "x")]);
    }

    #[test]
    fn only_one_space_after_the_colon_is_dropped() {
        let body = b"data:1\n\ndata:  2\n\nevent:named\ndata:\n\n";
        assert_eq!(events(body, &[]), vec![event("message", "1"), event("message", " 2"), event("named", "")]);
    }

    #[test]
    fn id_retry_and_unknown_fields_are_ignored() {
        let body = b"id: 7\nretry: 10\nfoo: bar\ndata: 1\n\nid: 8\n\n";
        assert_eq!(events(body, &[]), vec![event("message", "1")]);
    }

    #[test]
    fn a_long_line_in_one_byte_chunks() {
        let data: String = "ab\u{e9}\u{1F44D}".repeat(2_000);
        let body = format!("event: long\ndata: {data}\n\n");
        let every_byte: Vec<usize> = (1..body.len()).collect();
        assert_eq!(events(body.as_bytes(), &every_byte), vec![event("long", &data)]);
    }

    #[test]
    fn a_cut_character_is_not_utf8_at_every_cut() {
        let body = b"data: 1\n\ndata: \xe2\x82\n\ndata: 2\n\n";
        for cut in 0..=body.len() {
            let items = events(body, &[cut]);
            assert_eq!(items.len(), 3, "cut at {cut}");
            assert_eq!(items[0].text(), Ok("1"));
            assert_eq!(&items[1].data[..], b"\xe2\x82");
            assert_eq!(items[1].text().map_err(|e| e.code), Err(ErrorCode::StreamInterrupted));
        }
        // A body that breaks off inside a character.
        let items = events(b"data: \xe2\x82", &[]);
        assert_eq!(
            items.iter().map(|item| item.text().map_err(|e| e.code)).collect::<Vec<_>>(),
            vec![Err(ErrorCode::StreamInterrupted)]
        );
    }

    #[test]
    fn events_before_a_transport_error_in_the_same_chunk_come_first() {
        let body = stream::iter(vec![
            Ok(Bytes::from_static(b"data: 1\n\ndata: 2\n\ndata: 3")),
            Err(ProviderError::new(ErrorCode::StreamInterrupted, "reset")),
        ]);
        let items = sse_events(body).collect::<Vec<_>>().now_or_never().expect("ready");
        let codes: Vec<_> = items.iter().map(|item| item.as_ref().map(|e| &e.data[..]).map_err(|e| e.code)).collect();
        // The cut-off third event is not delivered: the body did not end cleanly.
        assert_eq!(codes, vec![Ok(&b"1"[..]), Ok(b"2"), Err(ErrorCode::StreamInterrupted)]);
    }

    /// One event of a generated body, and what it should decode to.
    #[derive(Debug, Clone)]
    struct GeneratedEvent {
        name: Option<String>,
        data: Vec<String>,
        comment: Option<String>,
        ignored_field: bool,
    }

    fn generated_event() -> impl proptest::strategy::Strategy<Value = GeneratedEvent> {
        use proptest::prelude::*;
        let text = "[^\r\n]{0,12}";
        (
            proptest::option::of("[a-z_]{1,8}"),
            proptest::collection::vec(text, 0..4),
            proptest::option::of(text),
            any::<bool>(),
        )
            .prop_map(|(name, data, comment, ignored_field)| GeneratedEvent {
                name,
                data,
                comment,
                ignored_field,
            })
    }

    /// Renders events with the given line ends (cycled), leaving the last
    /// event unclosed when `close_last` is false.
    fn render(generated: &[GeneratedEvent], line_ends: &[&str], close_last: bool) -> Vec<u8> {
        let mut lines = Vec::new();
        for (index, event) in generated.iter().enumerate() {
            if let Some(comment) = &event.comment {
                lines.push(format!(":{comment}"));
            }
            if let Some(name) = &event.name {
                lines.push(format!("event: {name}"));
            }
            if event.ignored_field {
                lines.push("id: 42".to_owned());
            }
            lines.extend(event.data.iter().map(|data| format!("data: {data}")));
            if close_last || index + 1 < generated.len() {
                lines.push(String::new());
            }
        }
        let mut body = String::new();
        let mut previous_end = "";
        for (line, end) in lines.iter().zip(line_ends.iter().cycle()) {
            // After a lone CR, a blank line ended by LF would read as CRLF.
            let end = if line.is_empty() && previous_end == "\r" && *end == "\n" { "\r\n" } else { end };
            body.push_str(line);
            body.push_str(end);
            previous_end = end;
        }
        body.into_bytes()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        #[test]
        fn any_cutting_gives_the_events_of_the_whole_body(
            generated in proptest::collection::vec(generated_event(), 0..6),
            line_ends in proptest::collection::vec(proptest::sample::select(vec!["\n", "\r\n", "\r"]), 1..4),
            close_last: bool,
            bom: bool,
            cuts in proptest::collection::vec(proptest::prelude::any::<proptest::sample::Index>(), 0..30),
        ) {
            let mut body = if bom { "\u{feff}".as_bytes().to_vec() } else { Vec::new() };
            body.extend(render(&generated, &line_ends, close_last));
            let cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(body.len() + 1)).collect();
            let expected: Vec<_> = generated
                .iter()
                .filter(|generated| !generated.data.is_empty())
                .map(|generated| Ok(SseEvent {
                    event: generated.name.clone().map_or(Cow::Borrowed("message"), Cow::Owned),
                    data: Bytes::from(generated.data.join("\n")),
                }))
                .collect();
            proptest::prop_assert_eq!(&decode_chunked(&body, &[]), &expected);
            proptest::prop_assert_eq!(&decode_chunked(&body, &cuts), &expected);
        }
    }
}
