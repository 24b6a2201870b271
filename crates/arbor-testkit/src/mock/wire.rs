//! What the three protocol encoders share: the request facts they need
//! ([`RequestInfo`]), the response they produce ([`Rendered`]: status,
//! headers and the body cut into chunks), and the helpers that shape bytes
//! like the real services do (Gemini's `": "` JSON spacing, a truncated
//! "malformed" chunk).

use bytes::Bytes;
use serde::Serialize;

/// How the body of a response is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Framing {
    /// One JSON document (non-streaming call).
    Json,
    /// `text/event-stream`.
    Sse,
    /// Gemini `streamGenerateContent` without `alt=sse`: one JSON array whose
    /// elements arrive one by one.
    JsonArray,
}

/// The facts of a request that change how a reply is encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestInfo {
    /// Echoed back as the response's model, like the providers do.
    pub model: String,
    pub framing: Framing,
    /// OpenAI `stream_options.include_usage`: only then does a stream end
    /// with a usage chunk.
    pub include_usage: bool,
    /// Makes response ids unique per request (`chatcmpl-mock3`, `msg_mock3`).
    pub number: u64,
}

/// An encoded response: concatenated, `chunks` is the body.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// One SSE event (or JSON-array element) per chunk for streams; a single
    /// chunk for JSON bodies.
    pub chunks: Vec<Bytes>,
    /// How many chunks at the end close the stream (OpenAI `[DONE]`,
    /// Anthropic `message_stop`, Gemini's last chunk): "reset after k chunks"
    /// never sends these.
    pub terminal_chunks: usize,
}

impl Rendered {
    pub(crate) fn json(status: u16, content_type: &str, body: Vec<u8>) -> Self {
        Rendered {
            status,
            headers: vec![("content-type".to_owned(), content_type.to_owned())],
            chunks: vec![Bytes::from(body)],
            terminal_chunks: 1,
        }
    }

    pub(crate) fn with_header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    /// The whole body in one buffer.
    pub fn body(&self) -> Bytes {
        match self.chunks.as_slice() {
            [only] => only.clone(),
            chunks => Bytes::from(chunks.concat()),
        }
    }
}

/// The canned errors every protocol can produce in its own shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CannedError {
    RateLimited {
        retry_after_secs: u64,
    },
    ServerError,
    Unavailable,
    Overloaded,
    ContextLength,
    /// A request the mock cannot serve (bad JSON, unknown route).
    BadRequest,
    NotFound,
}

/// Compact JSON; serialising plain structs and `Value`s into a `Vec` only
/// fails on non-string map keys, which these wire types never have.
pub(crate) fn compact<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

/// Pretty JSON with the given indent (OpenAI errors use four spaces, its
/// responses and Google's use two).
pub(crate) fn pretty<T: Serialize>(value: &T, indent: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(indent);
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
    if value.serialize(&mut serializer).is_err() {
        return Vec::new();
    }
    out
}

/// Google's streaming JSON: compact, but with a space after each colon
/// (`{"text": "The"}`), exactly as the recordings show.
pub(crate) fn google_compact<T: Serialize>(value: &T) -> Vec<u8> {
    struct GoogleFormatter;
    impl serde_json::ser::Formatter for GoogleFormatter {
        fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
            writer.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, GoogleFormatter);
    if value.serialize(&mut serializer).is_err() {
        return Vec::new();
    }
    out
}

/// Makes a chunk invalid JSON the way a broken proxy or a provider bug
/// would: the `data:` payload (or, without SSE framing, the chunk itself) is
/// cut in half while the event framing stays intact.
pub(crate) fn malformed(chunk: &Bytes) -> Bytes {
    let text = String::from_utf8_lossy(chunk);
    if let Some(data_at) = text.find("data:") {
        let payload_start = data_at + "data:".len();
        let payload_end = text[payload_start..].find(['\r', '\n']).map_or(text.len(), |end| payload_start + end);
        let payload = &text[payload_start..payload_end];
        let cut = half(payload);
        let mut broken = String::with_capacity(text.len());
        broken.push_str(&text[..payload_start]);
        broken.push_str(&payload[..cut]);
        broken.push_str(&text[payload_end..]);
        return Bytes::from(broken);
    }
    // A piece of a JSON body (a non-streamed reply, an array element): cut
    // it, and close a string and the object early, so that the result is
    // invalid wherever the cut falls (a cut inside a string alone could leave
    // valid JSON with garbled text).
    let cut = half(&text);
    Bytes::from(format!("{}\"}}{{", &text[..cut]))
}

/// The middle of a string, on a character boundary, never 0 for a string of
/// two characters or more (so the result is a proper, non-empty prefix).
fn half(text: &str) -> usize {
    let mut cut = text.len() / 2;
    while cut > 0 && !text.is_char_boundary(cut) {
        cut -= 1;
    }
    if cut == 0 {
        cut = text.chars().next().map_or(0, char::len_utf8).min(text.len());
    }
    cut
}

/// Seconds since the Unix epoch, for OpenAI's `created`.
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_keeps_framing_and_breaks_json() {
        let chunk = Bytes::from_static(b"event: x\ndata: {\"a\":\"b\",\"c\":1}\n\n");
        let broken = malformed(&chunk);
        let text = std::str::from_utf8(&broken).unwrap();
        assert!(text.starts_with("event: x\ndata: "));
        assert!(text.ends_with("\n\n"));
        let payload = text.trim_start_matches("event: x\ndata: ").trim_end();
        assert!(serde_json::from_str::<serde_json::Value>(payload).is_err());
        let array_element = Bytes::from_static(b"[{\"a\": 1}");
        assert_eq!(&malformed(&array_element)[..], b"[{\"a\"}{");
        let inside_a_string = Bytes::from_static(b"{\"text\":\"One two three\"}");
        let broken = malformed(&inside_a_string);
        assert!(serde_json::from_slice::<serde_json::Value>(&broken).is_err(), "{broken:?}");
    }

    #[test]
    fn google_formatting_puts_a_space_after_colons_only() {
        let value = serde_json::json!({"parts": [{"text": "The"}], "role": "model"});
        assert_eq!(google_compact(&value), br#"{"parts": [{"text": "The"}],"role": "model"}"#.to_vec());
    }
}
