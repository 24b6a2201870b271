//! Event streams for viewers: what a viewer missed (from the store, then from
//! the hub's recent buffer) followed by live events, in seq order, with no gap
//! and no duplicate — also when a slow viewer falls behind the live channel.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arbor_core::Event;
use arbor_store::Store;
use futures_util::Stream;
use tokio::sync::broadcast;

use crate::hub::{Hub, Subscription};

/// Store reads are paged so a long history does not arrive as one query.
const STORE_PAGE: u32 = 500;

/// When a viewer's stream ends.
#[derive(Debug, Clone)]
pub enum Until {
    /// Follow the conversation until the viewer goes away.
    Forever,
    /// Only this turn's events (and turn-less ones, like head moves), ending
    /// after its `done` or `error`.
    TurnEnds(Arc<str>),
}

/// A viewer's stream of events.
pub struct EventStream {
    events: Pin<Box<dyn Stream<Item = Event> + Send>>,
}

impl Stream for EventStream {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Event>> {
        self.events.as_mut().poll_next(context)
    }
}

/// A turn's event stream before anyone asked for it: a JSON turn's caller
/// only waits for the outcome, so it costs no subscription, and its
/// conversation stays unwatched (its events may wait to be stored
/// together). The stream, when asked for, starts from the
/// seq the turn started after: what came before the subscription is
/// replayed from the hub's memory or the store, as for any viewer.
pub(crate) struct PendingEvents {
    store: Arc<dyn Store>,
    hub: Arc<Hub>,
    /// Taken when the turn was queued (under the hub's lock, with its place
    /// in the queue); a started turn subscribes when asked.
    subscription: Option<Subscription>,
    after: i64,
    until: Until,
}

impl PendingEvents {
    pub(crate) fn new(
        store: Arc<dyn Store>,
        hub: Arc<Hub>,
        subscription: Option<Subscription>,
        after: i64,
        until: Until,
    ) -> PendingEvents {
        PendingEvents { store, hub, subscription, after, until }
    }

    pub(crate) fn start(self) -> EventStream {
        let PendingEvents { store, hub, subscription, after, until } = self;
        let subscription = subscription.unwrap_or_else(|| hub.subscribe(after));
        follow(store, hub, subscription, after, until)
    }
}

/// Starts following `hub` for a viewer that has seen everything up to `after`.
///
/// The stream is polled by whoever reads it (a response body): no task of
/// its own, no channel between. Live events wait in the hub's broadcast
/// channel until read; a viewer that falls further behind than it holds
/// catches up from the hub's memory and the store, as a new viewer does.
pub(crate) fn follow(
    store: Arc<dyn Store>,
    hub: Arc<Hub>,
    subscription: Subscription,
    after: i64,
    until: Until,
) -> EventStream {
    let follower =
        Follower { store, hub, subscription, last: after, until, stage: Stage::Stored, ready: VecDeque::new() };
    let events = futures_util::stream::unfold(follower, |mut follower| async move {
        let event = follower.next().await?;
        Some((event, follower))
    });
    EventStream { events: Box::pin(events) }
}

/// Where a follower reads next.
enum Stage {
    /// The store's events below the subscription's memory window.
    Stored,
    /// The subscription's backlog from the hub's memory.
    Backlog,
    /// The live channel.
    Live,
    /// The viewer's last event was delivered (or the stream cannot go on).
    Ended,
}

struct Follower {
    store: Arc<dyn Store>,
    hub: Arc<Hub>,
    subscription: Subscription,
    /// The last seq delivered.
    last: i64,
    until: Until,
    stage: Stage,
    /// Events read (a page from the store, the backlog, a live one) and not
    /// yet delivered.
    ready: VecDeque<Event>,
}

impl Follower {
    /// The viewer's next event; `None` once the stream has ended.
    async fn next(&mut self) -> Option<Event> {
        loop {
            match self.stage {
                Stage::Ended => return None,
                _ if !self.ready.is_empty() => {
                    let event = self.ready.pop_front().and_then(|event| self.accept(event));
                    if event.is_some() {
                        return event;
                    }
                }
                Stage::Stored => self.read_stored().await,
                Stage::Backlog => {
                    self.ready = std::mem::take(&mut self.subscription.backlog).into();
                    self.stage = Stage::Live;
                }
                Stage::Live => match self.subscription.receiver.recv().await {
                    Ok(event) => self.ready.push_back(event),
                    // Fell behind the live channel: catch up again from here.
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        self.subscription = self.hub.subscribe(self.last);
                        self.stage = Stage::Stored;
                    }
                    Err(broadcast::error::RecvError::Closed) => self.stage = Stage::Ended,
                },
            }
        }
    }

    /// Reads the next page of stored events below the memory window, or
    /// moves on to the backlog when there is none.
    async fn read_stored(&mut self) {
        let memory_from = self.subscription.memory_from;
        if self.last + 1 >= memory_from {
            self.stage = Stage::Backlog;
            return;
        }
        match self.store.events_after(&self.hub.conversation_id, self.last, STORE_PAGE).await {
            Ok(page) => {
                self.ready = page.into_iter().filter(|event| event.seq < memory_from).collect();
                if self.ready.is_empty() {
                    // Nothing more stored below the memory window.
                    self.stage = Stage::Backlog;
                }
            }
            Err(error) => {
                tracing::error!(%error, "reading events to replay failed");
                self.stage = Stage::Ended;
            }
        }
    }

    /// The event if the viewer gets it: each seq once, in order, and on a
    /// turn's own stream only that turn's events (and turn-less ones such
    /// as head moves), never another turn's: a queued turn's viewer must
    /// not mistake the running turn's deltas for its own answer.
    fn accept(&mut self, event: Event) -> Option<Event> {
        if event.seq <= self.last {
            return None;
        }
        self.last = event.seq;
        if let Until::TurnEnds(turn_id) = &self.until {
            if event.turn_id.as_deref().is_some_and(|owner| owner != &**turn_id) {
                return None;
            }
            if event.name.ends_turn() && event.turn_id.as_deref() == Some(&**turn_id) {
                self.stage = Stage::Ended;
            }
        }
        Some(event)
    }
}
