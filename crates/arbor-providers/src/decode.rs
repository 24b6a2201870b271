//! The loop every streaming adapter runs. A response body arrives as framed
//! pieces (SSE events, the texts of streamed responses, runs of bytes); each
//! piece goes into a decoder, and what the decoder gives back comes out as a
//! stream, in order, until the body ends or an error ends it first. The
//! decoders own the translation; this module owns only the order of things,
//! so that every adapter keeps the same rules: nothing after an error may
//! pass for more of the reply, and a body that ends is always told to its
//! decoder, which decides whether the reply was complete.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use arbor_core::ProviderError;
use futures_util::Stream;

/// Where a decoder puts what one step gives, in order. An error ends the
/// stream: it is delivered, and nothing after it is. The driver's own queue,
/// so that a step (one per SSE event of every streamed reply) allocates no
/// list of its own.
pub(crate) type Decoded<T> = VecDeque<Result<T, ProviderError>>;

/// A decoder as [`drive`] runs it: pieces of a body in, items out.
pub(crate) trait Decode: Send + 'static {
    /// One framed piece of the body.
    type Piece: Send + 'static;
    /// What comes out: reply chunks, or, for a framing step, the pieces the
    /// next decoder reads.
    type Item: Send + 'static;

    /// What one piece carries, added to `out`.
    fn feed(&mut self, piece: Self::Piece, out: &mut Decoded<Self::Item>);

    /// The body ended: what closes the output, or the error saying that the
    /// body was cut off, added to `out`.
    fn end(self, out: &mut Decoded<Self::Item>);

    /// Whether the last piece ended the output on its own (OpenAI's
    /// `[DONE]`). The rest of the body is then neither read nor waited for,
    /// and [`Decode::end`] is not called.
    fn is_done(&self) -> bool {
        false
    }
}

/// Adds a decoder's usual answer, its items or the error, to `out`.
pub(crate) fn items<T>(result: Result<Vec<T>, ProviderError>, out: &mut Decoded<T>) {
    match result {
        Ok(items) => out.extend(items.into_iter().map(Ok)),
        Err(error) => out.push_back(Err(error)),
    }
}

/// Feeds `pieces` to `decoder` and streams what it gives. An error in
/// `pieces` (a broken body) ends the stream like a decoder's error does.
pub(crate) fn drive<S, D>(pieces: S, decoder: D) -> Drive<S, D>
where
    S: Stream<Item = Result<D::Piece, ProviderError>> + Send + 'static,
    D: Decode,
{
    Drive { pieces: Box::pin(pieces), decoder: Some(decoder), ready: VecDeque::new() }
}

/// The stream [`drive`] gives. Written out rather than made with
/// `stream::unfold`: that moves its state (the decoder, the queue) into a
/// new future and back out with each item, several copies a chunk of every
/// streamed reply (bench/analysis.md).
pub(crate) struct Drive<S, D: Decode> {
    pieces: Pin<Box<S>>,
    /// `None` once the output is complete: after an error, after the
    /// decoder said it was done, or after the end of the body.
    decoder: Option<D>,
    ready: Decoded<D::Item>,
}

// Nothing in it is pinned in place: the body is boxed.
impl<S, D: Decode> Unpin for Drive<S, D> {}

impl<S, D> Stream for Drive<S, D>
where
    S: Stream<Item = Result<D::Piece, ProviderError>>,
    D: Decode,
{
    type Item = Result<D::Item, ProviderError>;

    fn poll_next(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(item) = this.ready.pop_front() {
                if item.is_err() {
                    // Nothing after an error may pass for more of the reply.
                    this.decoder = None;
                    this.ready.clear();
                }
                return Poll::Ready(Some(item));
            }
            let Some(decoder) = this.decoder.as_mut() else {
                return Poll::Ready(None);
            };
            match ready!(this.pieces.as_mut().poll_next(context)) {
                Some(Ok(piece)) => {
                    decoder.feed(piece, &mut this.ready);
                    if decoder.is_done() {
                        this.decoder = None;
                    }
                }
                Some(Err(error)) => this.ready.push_back(Err(error)),
                None => {
                    if let Some(decoder) = this.decoder.take() {
                        decoder.end(&mut this.ready);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use arbor_core::ErrorCode;
    use futures_util::{FutureExt, StreamExt, stream};

    use super::*;

    /// Echoes each piece; `"fail"` gives an item, an error and an item,
    /// `"stop"` ends the output, and the end of the body adds `"end"`.
    #[derive(Default)]
    struct Echo {
        stopped: bool,
    }

    impl Decode for Echo {
        type Piece = &'static str;
        type Item = &'static str;

        fn feed(&mut self, piece: &'static str, out: &mut Decoded<&'static str>) {
            match piece {
                "fail" => out.extend([Ok("before"), Err(ProviderError::new(ErrorCode::Internal, "bad")), Ok("after")]),
                piece => {
                    self.stopped = piece == "stop";
                    out.push_back(Ok(piece));
                }
            }
        }

        fn end(self, out: &mut Decoded<&'static str>) {
            out.push_back(Ok("end"));
        }

        fn is_done(&self) -> bool {
            self.stopped
        }
    }

    /// Drives `pieces`. Unless `ends`, the body then stays open, so that a
    /// driver that reads past the end of its output gives `None` instead of
    /// hanging the test.
    fn run(
        pieces: Vec<Result<&'static str, ProviderError>>,
        ends: bool,
    ) -> Option<Vec<Result<&'static str, ErrorCode>>> {
        let body = stream::iter(pieces);
        let body = if ends { body.boxed() } else { body.chain(stream::pending()).boxed() };
        drive(body, Echo::default()).map(|item| item.map_err(|error| error.code)).collect::<Vec<_>>().now_or_never()
    }

    #[test]
    fn the_end_of_the_body_is_told_to_the_decoder() {
        assert_eq!(run(vec![Ok("a"), Ok("b")], true), Some(vec![Ok("a"), Ok("b"), Ok("end")]));
    }

    #[test]
    fn nothing_follows_an_error_of_the_decoder_or_of_the_body() {
        assert_eq!(
            run(vec![Ok("a"), Ok("fail"), Ok("b")], false),
            Some(vec![Ok("a"), Ok("before"), Err(ErrorCode::Internal)])
        );
        let broken = ProviderError::new(ErrorCode::StreamInterrupted, "cut");
        assert_eq!(
            run(vec![Ok("a"), Err(broken), Ok("b")], false),
            Some(vec![Ok("a"), Err(ErrorCode::StreamInterrupted)])
        );
    }

    #[test]
    fn a_decoder_that_is_done_stops_reading_the_body() {
        assert_eq!(run(vec![Ok("a"), Ok("stop"), Ok("b")], false), Some(vec![Ok("a"), Ok("stop")]));
    }
}
