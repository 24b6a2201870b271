//! The batched event writer. Emitting an event on the hot path is an
//! in-memory append and a channel send; this task writes what accumulated to
//! the store in one transaction per batch. Under load batches grow by
//! themselves (everything that arrived while the last write ran goes in the
//! next one); when idle each event is written as soon as it comes.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use arbor_core::Event;
use arbor_store::Store;
use tokio::sync::{mpsc, oneshot};

/// Largest number of events written in one transaction.
const MAX_BATCH: usize = 512;

enum Message {
    /// An event, and the hub's "flushed up to" mark to advance once stored.
    Event(Event, Arc<AtomicI64>),
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

    /// Waits until everything sent before this call is stored.
    pub(crate) async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        if self.sender.send(Message::Flush(done)).is_ok() {
            let _ = wait.await;
        }
    }
}

async fn run(store: Arc<dyn Store>, mut receiver: mpsc::UnboundedReceiver<Message>) {
    let mut batch: Vec<Event> = Vec::with_capacity(MAX_BATCH);
    let mut marks: Vec<(Arc<AtomicI64>, i64)> = Vec::new();
    let mut waiters: Vec<oneshot::Sender<()>> = Vec::new();
    while let Some(first) = receiver.recv().await {
        let mut next = Some(first);
        while let Some(message) = next.take() {
            match message {
                Message::Event(event, mark) => {
                    marks.push((mark, event.seq));
                    batch.push(event);
                }
                Message::Flush(waiter) => waiters.push(waiter),
            }
            if batch.len() < MAX_BATCH {
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
