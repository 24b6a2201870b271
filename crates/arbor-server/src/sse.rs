//! Writing a conversation's events as Server-Sent Events: `id:` is the
//! event's seq, `event:` its name, `data:` the JSON stored with it. The
//! stream ends at shutdown so that a stopping server is not held open by
//! viewers.

use std::convert::Infallible;
use std::time::Duration;

use arbor_core::event::Visibility;
use arbor_engine::EventStream;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;

pub fn respond(
    events: EventStream,
    visibility: Visibility,
    shutdown: CancellationToken,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let stream = events
        .filter(move |event| std::future::ready(visibility.shows(event.name)))
        .map(|event| Ok(SseEvent::default().id(event.seq.to_string()).event(event.name.as_str()).data(&*event.data)))
        .take_until(shutdown.cancelled_owned());
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
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
