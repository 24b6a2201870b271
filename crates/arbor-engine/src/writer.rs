//! The batched event writer. Emitting an event on the hot path is an
//! in-memory append and a channel send; this task writes what accumulated to
//! the store in one transaction per batch. A batch gathers for [`GATHER`]
//! after its first event, and under load also takes everything that
//! arrived while the last write ran.
//!
//! Events the database numbers (several nodes) are the exception: each
//! batch of them is a statement and a commit on the shared database, and
//! nobody sees them until they are stored. So while nobody watches a
//! conversation on this node, its events are held here (up to
//! [`HOLD_UNWATCHED`]) and go with the next batch that someone waits for: a
//! turn's end, an event of a watched conversation, a new viewer, a flush.
//! A JSON turn's events are then one statement instead of three or four.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use arbor_core::Event;
use arbor_store::{Store, StoreError, StoreResult};
use tokio_util::sync::CancellationToken;

use crate::hub::Hub;
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

enum Message {
    /// An event, and the hub's "flushed up to" mark to advance once stored.
    Event(Event, Arc<AtomicI64>),
    /// An event for the database to number (several nodes), and the hub to
    /// publish it to once stored.
    Unnumbered(Event, Weak<Hub>),
    /// Stores the held events now (a viewer arrived).
    Release,
    Flush(oneshot::Sender<()>),
}

/// How long events the database numbers may wait here while nobody on this
/// node watches their conversation. Viewers on other nodes see them this
/// much later at most (a turn's end and its answer are never held).
pub(crate) const HOLD_UNWATCHED: Duration = Duration::from_millis(50);

/// How long events this node numbers gather before they are stored
/// together (a turn's first events with its last, a stream's pieces a few
/// at a time). Each batch is rows for the store's deferred write, which
/// rides in the next commit someone waits for; stored one batch per
/// commit, a streamed turn made a row of one event for each of its pieces,
/// and a row in the events' index by conversation. Viewers never wait for
/// this: they are served from the hub's memory, which keeps every event
/// until it is stored. It adds to what a crash of Arbor itself can lose
/// (on SQLite the store's own deferral adds up to 50 ms).
pub(crate) const GATHER: Duration = Duration::from_millis(20);

#[derive(Clone)]
pub(crate) struct EventWriter {
    sender: mpsc::UnboundedSender<Message>,
}

impl EventWriter {
    /// Starts the writer task on the current runtime. Once `closing` is
    /// cancelled (the engine shuts down), a batch the store keeps refusing
    /// is given up after a few attempts instead of [`RETRY_FOR`].
    pub(crate) fn start(
        store: Arc<dyn Store>,
        closing: CancellationToken,
    ) -> (EventWriter, tokio::task::JoinHandle<()>) {
        EventWriter::waiting(store, closing, HOLD_UNWATCHED, GATHER)
    }

    /// [`EventWriter::start`] with other waits (tests): `hold` for
    /// unwatched events the database numbers, `gather` for a batch.
    pub(crate) fn waiting(
        store: Arc<dyn Store>,
        closing: CancellationToken,
        hold: Duration,
        gather: Duration,
    ) -> (EventWriter, tokio::task::JoinHandle<()>) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(store, receiver, closing, hold, gather));
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

    /// Stores the events held for unwatched conversations now.
    pub(crate) fn release(&self) {
        let _ = self.sender.send(Message::Release);
    }

    /// A writer to an in-memory SQLite store (tests).
    #[cfg(test)]
    pub(crate) async fn in_memory() -> EventWriter {
        let store = arbor_store::sqlite::SqliteStore::open("sqlite::memory:").await.expect("opens");
        EventWriter::start(Arc::new(store), CancellationToken::new()).0
    }

    /// Waits until everything sent before this call is stored.
    pub(crate) async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        if self.sender.send(Message::Flush(done)).is_ok() {
            let _ = wait.await;
        }
    }
}

async fn run(
    store: Arc<dyn Store>,
    mut receiver: mpsc::UnboundedReceiver<Message>,
    closing: CancellationToken,
    hold: Duration,
    gather: Duration,
) {
    let mut batch: Vec<Event> = Vec::with_capacity(256);
    let mut marks: Vec<(Arc<AtomicI64>, i64)> = Vec::new();
    // When `batch` is due to be stored, while it gathers.
    let mut gather_until: Option<tokio::time::Instant> = None;
    let mut unnumbered: Vec<(Event, Weak<Hub>)> = Vec::new();
    // When the oldest of `unnumbered` came, while they are held.
    let mut held_since: Option<tokio::time::Instant> = None;
    let mut waiters: Vec<oneshot::Sender<()>> = Vec::new();
    loop {
        let held_until = held_since.map(|since| since + hold);
        let deadline = gather_until.into_iter().chain(held_until).min();
        let first = match deadline {
            None => receiver.recv().await.map_or(Wake::Closed, Wake::Message),
            Some(deadline) => tokio::select! {
                message = receiver.recv() => message.map_or(Wake::Closed, Wake::Message),
                () = tokio::time::sleep_until(deadline) => Wake::Due,
            },
        };
        // Gone once the engine is: what is held is stored before the end.
        let closed = matches!(first, Wake::Closed);
        let mut release = closed;
        let mut store_now = closed;
        let mut next = match first {
            Wake::Message(message) => Some(message),
            Wake::Due | Wake::Closed => None,
        };
        while let Some(message) = next.take() {
            match message {
                Message::Event(event, mark) => {
                    if batch.is_empty() {
                        gather_until = Some(tokio::time::Instant::now() + gather);
                    }
                    marks.push((mark, event.seq));
                    batch.push(event);
                }
                Message::Unnumbered(event, hub) => {
                    release = release || event.name.ends_turn() || hub.upgrade().is_some_and(|hub| hub.watched());
                    unnumbered.push((event, hub));
                }
                Message::Release => release = true,
                Message::Flush(waiter) => {
                    release = true;
                    store_now = true;
                    waiters.push(waiter);
                }
            }
            if batch.len() + unnumbered.len() < MAX_BATCH {
                next = receiver.try_recv().ok();
            } else {
                release = true;
                store_now = true;
            }
        }
        let now = tokio::time::Instant::now();
        release = release || held_until.is_some_and(|until| now >= until);
        store_now = store_now || gather_until.is_some_and(|until| now >= until);
        if !batch.is_empty() && store_now {
            gather_until = None;
            write_with_retries(store.as_ref(), &batch, &closing).await;
            for (mark, seq) in marks.drain(..) {
                mark.fetch_max(seq, Ordering::AcqRel);
            }
            batch.clear();
        }
        if !unnumbered.is_empty() {
            if release {
                held_since = None;
                number_and_publish(store.as_ref(), &closing, std::mem::take(&mut unnumbered)).await;
            } else {
                held_since.get_or_insert(now);
            }
        }
        for waiter in waiters.drain(..) {
            let _ = waiter.send(());
        }
        if closed {
            return;
        }
    }
}

/// What ended the writer's wait.
enum Wake {
    Message(Message),
    /// A batch's gathering or a hold ran out.
    Due,
    /// The engine is gone.
    Closed,
}

/// Stores a batch, retrying while the store fails. The batch's events stay
/// in their hubs' memory meanwhile (they are marked stored only after this
/// returns), so viewers and replays still get them.
///
/// A batch is retried for up to [`RETRY_FOR`], long enough to ride out a
/// database restart or a failover; it used to be five attempts over ~0.6 s,
/// after which its events were marked stored though they were not, and a
/// later replay missed them. A conflict (an event number already stored) is
/// not retried: the batch is split by conversation so that only the
/// conversation whose numbers collide loses its events, not every
/// conversation that shared the batch.
async fn write_with_retries(store: &dyn Store, batch: &[Event], closing: &CancellationToken) {
    let error = match append_retrying(store, batch, closing).await {
        Ok(()) => return,
        Err(StoreError::Conflict(_)) if batch.iter().any(|event| event.conversation_id != batch[0].conversation_id) => {
            let mut conversations: Vec<&str> = batch.iter().map(|event| &*event.conversation_id).collect();
            conversations.sort_unstable();
            conversations.dedup();
            for conversation in conversations {
                let group: Vec<Event> =
                    batch.iter().filter(|event| &*event.conversation_id == conversation).cloned().collect();
                if let Err(error) = append_retrying(store, &group, closing).await {
                    tracing::error!(%error, events = group.len(), conversation, "storing events failed for good; a replay will miss them");
                }
            }
            return;
        }
        Err(error) => error,
    };
    tracing::error!(%error, events = batch.len(), "storing events failed for good; a replay will miss them");
}

/// How long a batch the store refuses is retried before it is given up.
const RETRY_FOR: Duration = Duration::from_secs(300);
/// The longest wait between two attempts.
const RETRY_DELAY_MAX: Duration = Duration::from_secs(5);
/// Attempts at a batch once the engine is shutting down, and the longest
/// wait between them.
const CLOSING_ATTEMPTS: u32 = 5;
const CLOSING_DELAY_MAX: Duration = Duration::from_millis(320);

async fn append_retrying(store: &dyn Store, events: &[Event], closing: &CancellationToken) -> StoreResult<()> {
    retrying(closing, events.len(), || store.append_events(events)).await
}

/// Runs `attempt` until it succeeds, fails with a conflict (which another
/// attempt would not change), or has failed for [`RETRY_FOR`] — or for
/// [`CLOSING_ATTEMPTS`] attempts once the engine is shutting down, so that
/// a shutdown with the store down ends. Waits double from 20 ms up to
/// [`RETRY_DELAY_MAX`] between attempts.
async fn retrying<T, F, Fut>(closing: &CancellationToken, events: usize, mut attempt: F) -> StoreResult<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = StoreResult<T>>,
{
    let started = Instant::now();
    let mut delay = Duration::from_millis(20);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let error = match attempt().await {
            Ok(value) => return Ok(value),
            Err(error @ StoreError::Conflict(_)) => return Err(error),
            Err(error) => error,
        };
        if started.elapsed() >= RETRY_FOR || (closing.is_cancelled() && attempts >= CLOSING_ATTEMPTS) {
            return Err(error);
        }
        tracing::warn!(%error, attempt = attempts, events, "storing events failed; retrying");
        let wait = if closing.is_cancelled() { delay.min(CLOSING_DELAY_MAX) } else { delay };
        // A shutdown that starts during a long wait ends the wait.
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = closing.cancelled(), if !closing.is_cancelled() => {}
        }
        delay = (delay * 2).min(RETRY_DELAY_MAX);
    }
}

/// Stores events the database numbers, all of a batch's conversations in
/// one transaction (each conversation's in the order they were emitted),
/// and publishes each conversation's to its hub (the store wakes the other
/// nodes). The next batch waits for this one, so a conversation's events
/// stay in order.
async fn number_and_publish(store: &dyn Store, closing: &CancellationToken, events: Vec<(Event, Weak<Hub>)>) {
    // Found by key: a batch may hold MAX_BATCH events of hundreds of
    // conversations.
    let mut groups: Vec<(Arc<str>, Weak<Hub>, Vec<Event>)> = Vec::new();
    let mut group_of: HashMap<Arc<str>, usize> = HashMap::new();
    for (event, hub) in events {
        let index = *group_of.entry(event.conversation_id.clone()).or_insert_with(|| {
            groups.push((event.conversation_id.clone(), hub, Vec::new()));
            groups.len() - 1
        });
        groups[index].2.push(event);
    }
    // Each conversation's events side by side, so that what comes back (in
    // the order sent, a conversation that is gone left out) is a run per
    // hub.
    let batch: Vec<Event> = groups.iter().flat_map(|(_, _, group)| group.iter().cloned()).collect();
    let stored = match retrying(closing, batch.len(), || store.append_events_numbered(&batch)).await {
        Ok(stored) => stored,
        Err(error) => {
            tracing::error!(%error, events = batch.len(), "storing events failed; they are lost");
            Vec::new()
        }
    };
    let mut stored = stored.as_slice();
    for (conversation_id, hub, group) in groups {
        let run = stored.iter().take_while(|event| event.conversation_id == conversation_id).count();
        let (numbered, rest) = stored.split_at(run);
        stored = rest;
        // The store announced them to the other nodes with its commit.
        if let Some(hub) = hub.upgrade() {
            hub.publish(numbered, group.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_core::EventName;
    use arbor_store::sqlite::SqliteStore;
    use arbor_store::testing;

    fn event(conversation: &str, seq: i64) -> Event {
        Event {
            seq,
            conversation_id: Arc::from(conversation),
            turn_id: Some(Arc::from("t1")),
            name: EventName::Delta,
            data: Arc::from(format!(r#"{{"text":"{conversation} {seq}"}}"#)),
            created_at: 1_000 + seq,
        }
    }

    /// A file store with a user and the conversations `ids`.
    async fn store_with(folder: &std::path::Path, ids: &[&str]) -> SqliteStore {
        let url = format!("sqlite://{}", folder.join("arbor.db").display());
        let store = SqliteStore::open(&url).await.expect("opens");
        store.create_user(&testing::user("u")).await.expect("user");
        for id in ids {
            store.create_conversation(&testing::conversation("u", id)).await.expect("conversation");
        }
        store
    }

    /// Events the database numbers, of several conversations emitted in
    /// turn, go in one batch: each hub gets its own, numbered from 1 in the
    /// order emitted, and a conversation that is gone costs the others
    /// nothing.
    #[tokio::test]
    async fn numbered_events_of_several_conversations_reach_their_hubs() {
        use crate::hub::{Hub, Numbering};
        let folder = tempfile::tempdir().expect("temp dir");
        let store: Arc<dyn Store> = Arc::new(store_with(folder.path(), &["c1", "c2"]).await);
        let (writer, _task) = EventWriter::start(store.clone(), CancellationToken::new());
        let hubs: Vec<Arc<Hub>> = ["c1", "c2", "gone"]
            .iter()
            .map(|id| Hub::new(id, 0, writer.clone(), Numbering::Database, Default::default()))
            .collect();
        let mut viewers: Vec<_> = hubs.iter().map(|hub| hub.subscribe(hub.last_published()).receiver).collect();
        // Emitted without yielding, so the writer takes them as one batch.
        for round in 0..3 {
            for hub in &hubs {
                hub.emit(None, EventName::Delta, &serde_json::json!({ "round": round }));
            }
        }
        writer.flush().await;
        for (hub, viewer) in hubs.iter().zip(&mut viewers).take(2) {
            for round in 0..3 {
                let event = viewer.try_recv().expect("published");
                assert_eq!(event.seq, round + 1);
                assert_eq!(&*event.conversation_id, &*hub.conversation_id);
                assert_eq!(&*event.data, format!(r#"{{"round":{round}}}"#));
            }
            assert_eq!(store.last_event_seq(&hub.conversation_id).await.expect("read"), 3);
        }
        let mut gone = viewers.pop().expect("third viewer");
        assert!(gone.try_recv().is_err(), "nothing published for a conversation that is gone");
        drop(gone);
        // Its hub no longer waits for them, so it can leave memory.
        assert!(hubs[2].idle_since().is_some(), "the hub of a conversation that is gone still waits for its events");
    }

    /// A writer holding unwatched events for `hold`, hubs numbered by the
    /// database for `ids`, and the store.
    async fn writer_holding(
        folder: &std::path::Path,
        ids: &[&str],
        hold: Duration,
    ) -> (EventWriter, Vec<Arc<crate::hub::Hub>>, Arc<dyn Store>) {
        use crate::hub::{Hub, Numbering};
        let store: Arc<dyn Store> = Arc::new(store_with(folder, ids).await);
        let (writer, _task) = EventWriter::waiting(store.clone(), CancellationToken::new(), hold, GATHER);
        let hubs =
            ids.iter().map(|id| Hub::new(id, 0, writer.clone(), Numbering::Database, Default::default())).collect();
        (writer, hubs, store)
    }

    /// Waits (up to 5 s) until the store has `count` events of `conversation`.
    async fn stored(store: &dyn Store, conversation: &str, count: i64) -> Duration {
        let started = Instant::now();
        while store.last_event_seq(conversation).await.expect("reads") < count {
            assert!(started.elapsed() < Duration::from_secs(5), "{conversation}'s events were not stored");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        started.elapsed()
    }

    /// Nobody watches: a turn's events wait, and go with its end, in order.
    #[tokio::test]
    async fn unwatched_events_wait_for_the_end_of_their_turn() {
        let folder = tempfile::tempdir().expect("temp dir");
        let (_writer, hubs, store) = writer_holding(folder.path(), &["c1"], Duration::from_secs(60)).await;
        let turn: Arc<str> = Arc::from("t1");
        hubs[0].emit(Some(&turn), EventName::TurnStarted, &serde_json::json!({"n": 1}));
        hubs[0].emit(Some(&turn), EventName::Delta, &serde_json::json!({"n": 2}));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(store.last_event_seq("c1").await.expect("reads"), 0, "stored before the turn ended");
        hubs[0].emit(Some(&turn), EventName::Done, &serde_json::json!({"n": 3}));
        stored(&*store, "c1", 3).await;
        let events = store.events_after("c1", 0, 10).await.expect("reads");
        let order: Vec<_> = events.iter().map(|event| (event.seq, event.name, &*event.data)).collect();
        assert_eq!(
            order,
            [
                (1, EventName::TurnStarted, r#"{"n":1}"#),
                (2, EventName::Delta, r#"{"n":2}"#),
                (3, EventName::Done, r#"{"n":3}"#)
            ]
        );
        // The writer publishes right after the store answers, so the rows
        // can be read a moment before the hub has them.
        let started = Instant::now();
        while hubs[0].last_published() < 3 && started.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(hubs[0].last_published(), 3, "published once stored");
    }

    /// A watched conversation's events are stored (and so seen) at once;
    /// a viewer that arrives releases what was held.
    #[tokio::test]
    async fn watched_events_are_stored_at_once() {
        let folder = tempfile::tempdir().expect("temp dir");
        let (_writer, hubs, store) = writer_holding(folder.path(), &["c1", "c2"], Duration::from_secs(60)).await;
        let mut viewer = hubs[0].subscribe(0).receiver;
        hubs[0].emit(None, EventName::Delta, &serde_json::json!({"n": 1}));
        let seen = tokio::time::timeout(Duration::from_secs(5), viewer.recv()).await.expect("in time").expect("event");
        assert_eq!((seen.seq, &*seen.data), (1, r#"{"n":1}"#));

        hubs[1].emit(None, EventName::Delta, &serde_json::json!({"n": 1}));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(store.last_event_seq("c2").await.expect("reads"), 0, "stored though nobody watched");
        let mut late = hubs[1].subscribe(0).receiver;
        let seen = tokio::time::timeout(Duration::from_secs(5), late.recv()).await.expect("in time").expect("event");
        assert_eq!((seen.seq, &*seen.conversation_id), (1, "c2"));
    }

    /// Held events are stored after the hold at the latest, and at once on
    /// a flush (the engine's shutdown).
    #[tokio::test]
    async fn held_events_are_stored_after_the_hold_or_a_flush() {
        let folder = tempfile::tempdir().expect("temp dir");
        let hold = Duration::from_millis(150);
        let (writer, hubs, store) = writer_holding(folder.path(), &["c1"], hold).await;
        hubs[0].emit(None, EventName::Delta, &serde_json::json!({"n": 1}));
        let took = stored(&*store, "c1", 1).await;
        assert!(took >= hold - Duration::from_millis(10), "stored after {took:?}, within the hold");

        drop(writer);
        let folder = tempfile::tempdir().expect("temp dir");
        let (writer_long, hubs, store) = writer_holding(folder.path(), &["c1"], Duration::from_secs(60)).await;
        hubs[0].emit(None, EventName::Delta, &serde_json::json!({"n": 2}));
        writer_long.flush().await;
        assert_eq!(store.last_event_seq("c1").await.expect("reads"), 1, "a flush left events held");
    }

    /// A JSON turn's caller drops its event stream at once: from then on
    /// the conversation counts as unwatched (its events may be held), not
    /// only after the next event finds the viewer gone.
    #[tokio::test]
    async fn a_dropped_stream_stops_watching_at_once() {
        let folder = tempfile::tempdir().expect("temp dir");
        let (_writer, hubs, store) = writer_holding(folder.path(), &["c1"], Duration::from_secs(60)).await;
        let stream = crate::stream::follow(
            store.clone(),
            hubs[0].clone(),
            hubs[0].subscribe(0),
            0,
            crate::stream::Until::Forever,
        );
        assert!(hubs[0].watched());
        drop(stream);
        let started = Instant::now();
        while hubs[0].watched() {
            assert!(started.elapsed() < Duration::from_secs(5), "still watched by a dropped stream");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// A connection of its own to the database `store_with` made in `folder`.
    fn outside_connection(folder: &std::path::Path) -> rusqlite::Connection {
        rusqlite::Connection::open(folder.join("arbor.db")).expect("opens")
    }

    /// Makes every insert into the store's events fail until the trigger
    /// `outage` is dropped; returns the connection that made it.
    fn start_outage(folder: &std::path::Path) -> rusqlite::Connection {
        let outside = outside_connection(folder);
        outside
            .execute_batch(
                "CREATE TRIGGER outage BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'disk trouble'); END;",
            )
            .expect("trigger");
        outside
    }

    #[tokio::test]
    async fn a_batch_is_stored_after_an_outage_longer_than_a_second() {
        let folder = tempfile::tempdir().expect("temp dir");
        let store = store_with(folder.path(), &["c1"]).await;
        let outside = start_outage(folder.path());
        let batch = [event("c1", 1), event("c1", 2)];
        assert!(store.append_events(&batch).await.is_err(), "the store is down");

        let mended = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            outside.execute_batch("DROP TRIGGER outage;").expect("mends");
        });
        write_with_retries(&store, &batch, &CancellationToken::new()).await;
        mended.join().expect("mended");
        assert_eq!(store.events_after("c1", 0, 10).await.expect("reads"), batch);
    }

    #[tokio::test]
    async fn a_shutdown_with_the_store_down_gives_up_in_moments() {
        let folder = tempfile::tempdir().expect("temp dir");
        let store = store_with(folder.path(), &["c1"]).await;
        start_outage(folder.path());
        let closing = CancellationToken::new();
        let started = Instant::now();
        let shutdown = closing.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            shutdown.cancel();
        });
        write_with_retries(&store, &[event("c1", 1)], &closing).await;
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "gave up after {took:?}");
    }

    #[tokio::test]
    async fn a_conflict_costs_only_its_own_conversation_the_batch() {
        let folder = tempfile::tempdir().expect("temp dir");
        let store = store_with(folder.path(), &["c1", "c2"]).await;
        store.append_events(&[event("c1", 1)]).await.expect("first");
        // c1's number 1 is taken; c2's events share the batch.
        let batch = [event("c2", 1), event("c1", 1), event("c2", 2)];
        write_with_retries(&store, &batch, &CancellationToken::new()).await;
        assert_eq!(store.events_after("c2", 0, 10).await.expect("reads"), [event("c2", 1), event("c2", 2)]);
        assert_eq!(store.events_after("c1", 0, 10).await.expect("reads"), [event("c1", 1)]);
    }

    /// Rows in the SQLite file's events table (a run of a conversation's
    /// events in a batch is one row).
    fn event_rows(folder: &std::path::Path) -> i64 {
        outside_connection(folder).query_row("SELECT count(*) FROM events", [], |row| row.get(0)).expect("counts")
    }

    /// A stream's pieces, emitted a few milliseconds apart, are stored
    /// together once the batch has gathered: one row, not one a piece. A
    /// flush stores what is gathering at once. (A long gathering here, so
    /// that a slow machine's sleeps cannot split the pieces.)
    #[tokio::test]
    async fn events_gather_before_they_are_stored() {
        use crate::hub::{Hub, Numbering};
        let gather = Duration::from_millis(400);
        let folder = tempfile::tempdir().expect("temp dir");
        let store: Arc<dyn Store> = Arc::new(store_with(folder.path(), &["c1"]).await);
        let (writer, _task) = EventWriter::waiting(store.clone(), CancellationToken::new(), HOLD_UNWATCHED, gather);
        let hub = Hub::new("c1", 0, writer.clone(), Numbering::Local, Default::default());
        let started = Instant::now();
        for piece in 0..3 {
            hub.emit(None, EventName::Delta, &serde_json::json!({ "piece": piece }));
            // Long enough for the writer to take each piece on its own.
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        stored(&*store, "c1", 3).await;
        let took = started.elapsed();
        assert!(took >= gather, "stored {took:?} after the first piece, before the batch gathered");
        assert_eq!(event_rows(folder.path()), 1, "the pieces were stored in more than one batch");

        hub.emit(None, EventName::Delta, &serde_json::json!({ "piece": 3 }));
        writer.flush().await;
        assert_eq!(store.last_event_seq("c1").await.expect("reads"), 4, "a flush left events gathering");
    }
}
