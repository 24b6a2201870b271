//! Event streams for viewers: what a viewer missed (from the store, then from
//! the hub's recent buffer) followed by live events, in seq order, with no gap
//! and no duplicate — also when a slow viewer falls behind the live channel.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arbor_core::Event;
use arbor_store::Store;
use futures_util::Stream;
use tokio::sync::{broadcast, mpsc};

use crate::hub::{Hub, Subscription};

/// Store reads are paged so a long history does not arrive as one query.
const STORE_PAGE: u32 = 500;
/// Events buffered between the follower task and the viewer.
const VIEWER_BUFFER: usize = 256;

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
    receiver: mpsc::Receiver<Event>,
}

impl Stream for EventStream {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Event>> {
        self.receiver.poll_recv(context)
    }
}

/// A turn's event stream before anyone asked for it: a JSON turn's caller
/// only waits for the outcome, so it costs no subscription, no channel and
/// no follower task, and its conversation stays unwatched (its events may
/// wait to be stored together). The stream, when asked for, starts from the
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
pub(crate) fn follow(
    store: Arc<dyn Store>,
    hub: Arc<Hub>,
    subscription: Subscription,
    after: i64,
    until: Until,
) -> EventStream {
    let (sender, receiver) = mpsc::channel(VIEWER_BUFFER);
    tokio::spawn(async move {
        let mut follower = Follower { store, hub, sender, last: after, until };
        follower.run(subscription).await;
    });
    EventStream { receiver }
}

struct Follower {
    store: Arc<dyn Store>,
    hub: Arc<Hub>,
    sender: mpsc::Sender<Event>,
    /// The last seq delivered.
    last: i64,
    until: Until,
}

/// Why following stopped.
enum Stop {
    Finished,
    ViewerGone,
}

impl Follower {
    async fn run(&mut self, mut subscription: Subscription) {
        loop {
            if self.catch_up(&subscription).await.is_err() {
                return;
            }
            match self.live(&mut subscription.receiver).await {
                // Fell behind the live channel: catch up again from here.
                None => subscription = self.hub.subscribe(self.last),
                Some(_) => return,
            }
        }
    }

    /// Delivers the store's events before the hub's memory, then the backlog.
    async fn catch_up(&mut self, subscription: &Subscription) -> Result<(), Stop> {
        while self.last + 1 < subscription.memory_from {
            let page = match self.store.events_after(&self.hub.conversation_id, self.last, STORE_PAGE).await {
                Ok(page) => page,
                Err(error) => {
                    tracing::error!(%error, "reading events to replay failed");
                    return Err(Stop::ViewerGone);
                }
            };
            let before = self.last;
            for event in page.into_iter().filter(|event| event.seq < subscription.memory_from) {
                self.deliver(event).await?;
            }
            if self.last == before {
                // Nothing more stored below the memory window.
                break;
            }
        }
        for event in &subscription.backlog {
            self.deliver(event.clone()).await?;
        }
        Ok(())
    }

    /// Forwards live events; `None` when the viewer lagged behind.
    async fn live(&mut self, receiver: &mut broadcast::Receiver<Event>) -> Option<Stop> {
        loop {
            // A viewer that went away (a JSON turn's caller drops the stream
            // at once) stops counting as one now, not at the next event: an
            // unwatched conversation's events may wait to be stored together.
            let received = tokio::select! {
                received = receiver.recv() => received,
                () = self.sender.closed() => return Some(Stop::ViewerGone),
            };
            match received {
                Ok(event) => {
                    if let Err(stop) = self.deliver(event).await {
                        return Some(stop);
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => return None,
                Err(broadcast::error::RecvError::Closed) => return Some(Stop::Finished),
            }
        }
    }

    async fn deliver(&mut self, event: Event) -> Result<(), Stop> {
        if event.seq <= self.last {
            return Ok(());
        }
        self.last = event.seq;
        // A turn's own stream carries that turn's events (and turn-less ones
        // such as head moves), never another turn's: a queued turn's viewer
        // must not mistake the running turn's deltas for its own answer.
        if let Until::TurnEnds(turn_id) = &self.until
            && event.turn_id.as_deref().is_some_and(|owner| owner != &**turn_id)
        {
            return Ok(());
        }
        let ends = match &self.until {
            Until::TurnEnds(turn_id) => event.name.ends_turn() && event.turn_id.as_deref() == Some(&**turn_id),
            Until::Forever => false,
        };
        if self.sender.send(event).await.is_err() {
            return Err(Stop::ViewerGone);
        }
        if ends { Err(Stop::Finished) } else { Ok(()) }
    }
}
