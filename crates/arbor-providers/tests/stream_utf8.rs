//! A provider's stream whose text is not UTF-8 ends as `stream_interrupted`,
//! in every adapter. The SSE framing hands an event's data on as bytes, not
//! checked; each adapter checks it once (`SseEvent::text`), so this is where
//! a missing check would show.

use arbor_core::ErrorCode;
use arbor_providers::sse::byte_chunks;
use arbor_providers::{ChunkStream, Collected, anthropic, gemini, openai};
use futures_util::{FutureExt, StreamExt};

const RECORDED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/providers");

/// An adapter's stream decoder, fed a body cut at the given offsets.
type Decoder = fn(&[u8], &[usize]) -> ChunkStream;

#[test]
fn text_that_is_not_utf8_ends_each_adapters_stream_at_every_cut() {
    // A recorded text stream, a word of its text, and the text before it.
    let cases: [(&str, &str, &str, Decoder); 3] = [
        ("openai/stream-text-usage.response.sse", "City", "The capital of Mexico is Mexico", |body, cuts| {
            openai::decode_stream(byte_chunks(body, cuts))
        }),
        ("anthropic/stream-text.response.sse", "Hello", "", |body, cuts| {
            anthropic::decode_body(byte_chunks(body, cuts))
        }),
        ("gemini/stream-text-sse.response.sse", "Paris", "The capital of France", |body, cuts| {
            gemini::decode_body(byte_chunks(body, cuts))
        }),
    ];
    for (fixture, word, before, decode) in cases {
        let mut body = std::fs::read(format!("{RECORDED}/{fixture}")).expect("fixture exists");
        let at =
            body.windows(word.len()).position(|window| window == word.as_bytes()).expect("the word is in the body");
        // A byte that never occurs in UTF-8.
        body[at] = 0xff;
        for cut in 0..=body.len() {
            let items =
                decode(&body, &[cut]).collect::<Vec<_>>().now_or_never().expect("an in-memory body never waits");
            let (last, chunks) = items.split_last().expect("the stream says something");
            let Err(error) = last else { panic!("{fixture}, cut at {cut}: the stream ends without an error") };
            assert_eq!(error.code, ErrorCode::StreamInterrupted, "{fixture}, cut at {cut}");
            assert!(error.message.contains("not valid UTF-8"), "{fixture}: {}", error.message);
            let mut collected = Collected::default();
            for chunk in chunks {
                collected.push(chunk.as_ref().expect("only the last item is an error"));
            }
            assert_eq!(collected.finish().text, before, "{fixture}, cut at {cut}");
        }
    }
}
