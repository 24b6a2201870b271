//! The batched event writer. Emitting an event on the hot path is an
//! in-memory append and a channel send; this task writes what accumulated to
//! the store in one transaction per batch. Under load batches grow by
//! themselves (everything that arrived while the last write ran goes in the
//! next one); when idle each event is written as soon as it comes.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arbor_core::Event;
use arbor_store::{Notice, Store};

use crate::hub::Hub;
use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot};

/// Largest number of events written in one transaction. One batch is
/// stored at a time, so this bounds how fast events can be stored: at 512,
/// past what the core could keep up with (S2 at 3,000 turns/s, ~9 events a
/// turn), the batches fell seconds behind, and every conversation with
/// events not yet stored had to stay in memory (conversations loaded 2,592,
/// of them 1,671 waiting for their events; RSS 180 MB after 10 s). At 4,096
/// the writer catches up with what accumulated during one commit (123-296
/// waiting, 133 MB). Below saturation batches are small either way.
const MAX_BATCH: usize = 4096;

/// Conversations whose events the database numbers at the same time (each
/// holds a pooled connection meanwhile; the pool has 16).
const CONCURRENT_GROUPS: usize = 4;

enum Message {
    /// An event, and the hub's "flushed up to" mark to advance once stored.
    Event(Event, Arc<AtomicI64>),
    /// An event for the database to number (several nodes), and the hub to
    /// publish it to once stored.
    Unnumbered(Event, Weak<Hub>),
    Flush(oneshot::Sender<()>),
}

#[derive(Clone)]
pub(crate) struct EventWriter {
    sender: mpsc::UnboundedSender<Message>,
}

impl EventWriter {
    /// Starts the writer task on the current runtime.
    pub(crate) fn start(store: Arc<dyn Store>) -> (EventWriter, tokio::task::JoinHandle<()>) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(store, receiver));
        (EventWriter { sender }, task)
    }

    pub(crate) fn write(&self, event: Event, flushed: Arc<AtomicI64>) {
        // The receiver lives as long as the engine; a send can only fail
        // during teardown, when there is nobody left to write for.
        let _ = self.sender.send(Message::Event(event, flushed));
    }

    pub(crate) fn write_unnumbered(&self, event: Event, hub: Weak<Hub>) {
        let _ = self.sender.send(Message::Unnumbered(event, hub));
    }

    /// A writer to an in-memory SQLite store (tests).
    #[cfg(test)]
    pub(crate) async fn in_memory() -> EventWriter {
        let store = arbor_store::sqlite::SqliteStore::open("sqlite::memory:").await.expect("opens");
        EventWriter::start(Arc::new(store)).0
    }

    /// Waits until everything sent before this call is stored.
    pub(crate) async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        if self.sender.send(Message::Flush(done)).is_ok() {
            let _ = wait.await;
        }
    }
}

async fn run(store: Arc<dyn Store>, mut receiver: mpsc::UnboundedReceiver<Message>) {
    let mut batch: Vec<Event> = Vec::with_capacity(256);
    let mut marks: Vec<(Arc<AtomicI64>, i64)> = Vec::new();
    let mut unnumbered: Vec<(Event, Weak<Hub>)> = Vec::new();
    let mut waiters: Vec<oneshot::Sender<()>> = Vec::new();
    while let Some(first) = receiver.recv().await {
        let mut next = Some(first);
        while let Some(message) = next.take() {
            match message {
                Message::Event(event, mark) => {
                    marks.push((mark, event.seq));
                    batch.push(event);
                }
                Message::Unnumbered(event, hub) => unnumbered.push((event, hub)),
                Message::Flush(waiter) => waiters.push(waiter),
            }
            if batch.len() + unnumbered.len() < MAX_BATCH {
                next = receiver.try_recv().ok();
            }
        }
        if !batch.is_empty() {
            write_with_retries(store.as_ref(), &batch).await;
            for (mark, seq) in marks.drain(..) {
                mark.fetch_max(seq, Ordering::AcqRel);
            }
            batch.clear();
        }
        if !unnumbered.is_empty() {
            number_and_publish(store.as_ref(), std::mem::take(&mut unnumbered)).await;
        }
        for waiter in waiters.drain(..) {
            let _ = waiter.send(());
        }
    }
}

async fn write_with_retries(store: &dyn Store, batch: &[Event]) {
    let mut delay = Duration::from_millis(20);
    for attempt in 1..=5 {
        match store.append_events(batch).await {
            Ok(()) => return,
            Err(error) => {
                tracing::warn!(%error, attempt, events = batch.len(), "storing events failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
        }
    }
    tracing::error!(events = batch.len(), "storing events failed five times; these events are only in memory");
}

/// Stores events the database numbers, one conversation at a time (in the
/// order they were emitted), publishes them to their hubs and wakes the
/// other nodes.
async fn number_and_publish(store: &dyn Store, events: Vec<(Event, Weak<Hub>)>) {
    let mut groups: Vec<(Arc<str>, Weak<Hub>, Vec<Event>)> = Vec::new();
    for (event, hub) in events {
        match groups.iter_mut().find(|(conversation, _, _)| *conversation == event.conversation_id) {
            Some((_, _, group)) => group.push(event),
            None => groups.push((event.conversation_id.clone(), hub, vec![event])),
        }
    }
    // Conversations are numbered independently, so their groups are stored
    // side by side (each batch holds one group per conversation, and the
    // next batch waits for this one: a conversation's events stay in order).
    futures_util::stream::iter(groups)
        .for_each_concurrent(CONCURRENT_GROUPS, |(conversation_id, hub, group)| {
            store_numbered_group(store, conversation_id, hub, group)
        })
        .await;
}

/// Numbers and stores one conversation's events, then publishes them.
async fn store_numbered_group(store: &dyn Store, conversation_id: Arc<str>, hub: Weak<Hub>, group: Vec<Event>) {
    let mut delay = Duration::from_millis(20);
    let mut numbered = None;
    for attempt in 1..=5 {
        match store.append_events_numbered(&conversation_id, &group).await {
            Ok(stored) => {
                numbered = Some(stored);
                break;
            }
            Err(error) => {
                tracing::warn!(%error, attempt, events = group.len(), "storing events failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
        }
    }
    let Some(numbered) = numbered else {
        tracing::error!(events = group.len(), %conversation_id, "storing events failed five times; they are lost");
        if let Some(hub) = hub.upgrade() {
            hub.publish(&[], group.len());
        }
        return;
    };
    if let Some(hub) = hub.upgrade() {
        hub.publish(&numbered, group.len());
    }
    if let Some(last) = numbered.last() {
        let notice = Notice::Events { conversation_id: conversation_id.to_string(), seq: last.seq };
        if let Err(error) = store.notify(&notice).await {
            tracing::warn!(%error, "announcing events to the other nodes failed; they will see them on their next read");
        }
    }
}
