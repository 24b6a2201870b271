//! The threads that own the SQLite connections.
//!
//! SQLite's API is blocking. A connection lives on a thread of its own and
//! the async side hands it whole jobs — a closure that runs every statement
//! of one store call — and awaits one reply. A turn's write is then one
//! hand-off each way, however many statements it holds; with a connection
//! that crosses threads per statement (as sqlx's does) the same write was a
//! dozen, and those switches were most of Arbor's time in the benchmark's
//! profile (bench/REPORT.md).
//!
//! Writes are also committed in groups. Each commit appends every page it
//! changed to the WAL and takes and drops the file locks, so at a few
//! thousand small transactions a second the writer spent its time in the
//! kernel writing the same hot pages (the newest rows of each table, the
//! user's balance) again and again. The writer thread takes every write
//! waiting when it is free, runs them in one transaction and commits once:
//! a write that fails is rolled back alone, and no write is answered before
//! the commit that holds it is durable. The writes run without savepoints
//! (a savepoint copies every page it changes into the statement journal
//! first); when one fails, the transaction is rolled back, that write is
//! answered with its error, and the others run again, each in a savepoint
//! ([`commit_group`]). So a write's body may run more than once (it is
//! `FnMut`), and is answered with what its last run returned.
//! When writes arrive one at a time, each is its own group. When they pile
//! up (a commit held [`GATHER_FROM`] or more someone waited on), the next
//! durable commit waits up to [`GATHER`] after the last one for more to
//! join it: fewer, larger commits at the rates where the core is short.
//!
//! Some writes nobody waits on: a conversation's events are already with
//! its viewers (the hub keeps them until stored), and the event writer
//! only needs to hear when they are. Those are *deferred*: the writer holds
//! them until another write comes, or for at most [`DEFERRED_WAIT`], and
//! commits them with it. A turn's events then ride in some turn's own
//! commit instead of one of their own: at 500 turns/s the writer's commits
//! per turn fell from about 4 to under 2 (bench/REPORT.md). A deferred
//! write does not even wake the writer when it sleeps with a deadline
//! (deferred writes already held, or within [`DEFERRED_WAIT`] of its last
//! commit): it is taken when the writer wakes for the next write or for
//! that deadline.
//!
//! A write someone waits on is durable when answered: with `sync_full` set
//! the group that holds one commits with `synchronous = FULL` (the WAL is
//! fsynced before the commit returns). A group of deferred writes alone
//! commits without the fsync; the WAL is written in order, so the next
//! waited-on commit's fsync (or the next checkpoint's) makes it durable
//! too. Events are what is lost to a power loss then, and only those since
//! the last durable commit.
//!
//! The writer also keeps the WAL from growing without end. A background
//! thread copies committed pages into the database file (see `mod.rs`), but
//! SQLite starts the WAL over only when a write transaction begins while
//! every frame in it has been copied — and under steady load the writer
//! commits and begins again within microseconds, so that moment never came
//! and the WAL grew by gigabytes (and every commit paid for the kernel
//! allocating fresh file pages). So once the WAL passes a limit, the writer
//! itself checkpoints right after a commit (its callers already answered),
//! the first commit after the background thread's next copy (see
//! `restart_now`): that thread has then copied nearly everything and
//! synced the database file, the rest is little, and the next transaction
//! starts the WAL over.

use std::cell::Cell;
use std::ffi::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rusqlite::Connection;
use tokio::sync::oneshot;

use super::handoff::{self, Next};
use super::session::{Session, Statements};
use crate::{StoreError, StoreResult};

/// Writes committed together at most.
const MAX_GROUP: usize = 64;

/// How long after the end of a durable commit the next one waits for more
/// writes to join it, when the last one held at least [`GATHER_FROM`]
/// writes someone waited on: the writer is behind, writes pile up during
/// each commit's fsync, and fewer, larger commits cost less CPU a write
/// (each commit writes the b-trees' shared pages once, and syncs once).
/// A server below that load never waits.
///
/// Measured (bench/analysis.md, "Gathering durable commits under load"):
/// S1 at 3,000 turns/s, alternated with the wait off, kept up in 10 of 12
/// runs (p50 2.5–4.7 ms) where the plain writer did in 3 of 15, at
/// 291–303 µs of CPU a turn against 299–399; at 2,000/s, where commits
/// hold fewer than six waited-on writes, nothing changed. Waiting from
/// three writes on also helped at 3,000/s but cost up to 1.5 ms of median
/// at 2,000/s in one of two pairs.
pub(super) const GATHER: Duration = Duration::from_micros(300);
const GATHER_FROM: usize = 6;

/// Until when a durable commit due now waits for more writes, given when
/// the last durable commit ended and how many writes someone waited on it
/// held: see [`GATHER`]. `None`: it commits at once.
fn gathering_until(last_durable: Option<(Instant, usize)>, gather: Duration) -> Option<Instant> {
    let (ended, waited) = last_durable?;
    let until = ended + gather;
    (waited >= GATHER_FROM && Instant::now() < until).then_some(until)
}

/// How long a deferred write waits at most for another one to ride with.
///
/// Long enough for the next turn's writes to come along at the rates where
/// turns are tens of milliseconds apart: at 5 ms, from ~20 to a few
/// hundred turns a second each turn's events were a commit of their own
/// (one more wake-up of the writer, one more transaction); at 50 ms they
/// ride in the next turn's commit, and at 100 turns/s the writer's CPU per
/// turn fell by ~10% (`bench/threadstat.sh`, bench/analysis.md). Nothing
/// waits on these writes, and they were never fsynced on their own (a
/// power loss loses what came after the last durable commit either way),
/// so what grows is what a crash of Arbor itself can lose: up to 50 ms of
/// a running turn's events. Readers are not affected: the hub keeps every
/// event until it is stored and serves it from memory meanwhile.
pub(super) const DEFERRED_WAIT: Duration = Duration::from_millis(50);

type ReadJob = Box<dyn FnOnce(&Session<'_, '_>) + Send>;

/// A queue of reads served by one or more threads, each with its own
/// connection. Cloning shares the queue; the threads stop (closing their
/// connections) once every clone is gone and the queue is drained.
#[derive(Clone, Debug)]
pub(super) struct Readers {
    jobs: handoff::Sender<ReadJob>,
}

impl Readers {
    /// Starts one thread per connection, all taking jobs from one queue in
    /// arrival order.
    pub fn start(name: &str, connections: Vec<Connection>) -> std::io::Result<Readers> {
        let (jobs, queue) = handoff::Sender::<ReadJob>::new();
        for (index, connection) in connections.into_iter().enumerate() {
            let queue = queue.clone();
            std::thread::Builder::new().name(format!("{name}-{index}")).spawn(move || {
                let statements = Statements::default();
                let session = Session::new(&connection, &statements);
                while let Next::Item(job) = queue.next(None) {
                    // A panicking job (a bug) loses its own reply, which its
                    // caller sees as an error; the thread serves on.
                    let _ = catch_unwind(AssertUnwindSafe(|| job(&session)));
                }
            })?;
        }
        Ok(Readers { jobs })
    }

    /// Runs `job` on one of the threads and returns its result.
    pub async fn run<T, F>(&self, job: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Session<'_, '_>) -> StoreResult<T> + Send + 'static,
    {
        let (reply, result) = oneshot::channel();
        self.jobs.send(Box::new(move |connection: &Session<'_, '_>| {
            // The caller may have stopped waiting (a cancelled request):
            // the work is done all the same, only the answer is dropped.
            let _ = reply.send(job(connection));
        }));
        result.await.map_err(|_| no_answer())?
    }
}

/// Connections for point reads (one row by its key), run right on the
/// caller's thread.
///
/// A reader thread costs each read two thread switches: the job's hand-off
/// and the answer's wake-up. A point read itself takes a few microseconds,
/// less than those switches (with Arbor on one core, every hand-off is one),
/// and a turn makes two of them (its conversation and the user's credits).
/// So a point read borrows an idle connection and runs where it was asked;
/// with none idle (every connection busy on another worker thread) it goes
/// to the reader threads as before. Reads that may take long (a whole tree,
/// a listing, a stream's events) always go to the reader threads, which
/// never hold up an async worker. In WAL mode a read never waits for the
/// writer; it can wait only for another process's checkpoint to finish
/// resetting the WAL (`SQLITE_BUSY` retried under the busy timeout), which
/// is rare and short.
#[derive(Debug, Default)]
pub(super) struct PointReaders {
    idle: Mutex<Vec<Connection>>,
}

impl PointReaders {
    pub fn new(connections: Vec<Connection>) -> PointReaders {
        PointReaders { idle: Mutex::new(connections) }
    }

    /// Runs `job` on an idle connection, or gives it back when none is.
    pub fn try_run<T, F>(&self, job: F) -> Result<StoreResult<T>, F>
    where
        F: FnOnce(&Session<'_, '_>) -> StoreResult<T>,
    {
        let Some(connection) = self.idle.lock().ok().and_then(|mut idle| idle.pop()) else { return Err(job) };
        // Given back even when `job` panics (a bug): the connection holds no
        // open transaction once a statement is done or dropped.
        let borrowed = Borrowed { pool: self, connection: Some(connection) };
        Ok(job(&Session::borrowed(borrowed.connection.as_ref().expect("held until dropped"))))
    }
}

/// A connection taken from a [`PointReaders`], given back when dropped.
struct Borrowed<'a> {
    pool: &'a PointReaders,
    connection: Option<Connection>,
}

impl Drop for Borrowed<'_> {
    fn drop(&mut self) {
        if let (Some(connection), Ok(mut idle)) = (self.connection.take(), self.pool.idle.lock()) {
            idle.push(connection);
        }
    }
}

/// A write waiting in a group: run inside the group's transaction (again
/// when another write of the group failed), then answered once.
trait Write: Send {
    /// Runs the write, keeping what it returned; `false` when it failed.
    fn run(&mut self, connection: &Session<'_, '_>) -> bool;
    /// Answers the caller: its last run's error, if it failed; else its
    /// value when `committed`, or the reason the commit did not happen.
    fn answer(self: Box<Self>, committed: Result<(), &str>);
}

type WriteBody = Box<dyn Write>;

struct Pending<T, F> {
    body: F,
    outcome: Option<StoreResult<T>>,
    reply: oneshot::Sender<StoreResult<T>>,
}

impl<T, F> Write for Pending<T, F>
where
    T: Send,
    F: FnMut(&Session<'_, '_>) -> StoreResult<T> + Send,
{
    fn run(&mut self, connection: &Session<'_, '_>) -> bool {
        let outcome = (self.body)(connection);
        let ran = outcome.is_ok();
        self.outcome = Some(outcome);
        ran
    }

    fn answer(self: Box<Self>, committed: Result<(), &str>) {
        let answer = match (self.outcome, committed) {
            (Some(Err(error)), _) => Err(error),
            (_, Err(reason)) => Err(StoreError::Database(reason.to_string())),
            (Some(Ok(value)), Ok(())) => Ok(value),
            (None, Ok(())) => Err(no_answer()),
        };
        let _ = self.reply.send(answer);
    }
}

struct WriteJob {
    body: WriteBody,
    /// When it may wait for company until (see the module's
    /// documentation); `None` for a write someone waits on.
    due: Option<Instant>,
}

thread_local! {
    /// Pages in the WAL after the last commit on this thread's connection.
    static WAL_PAGES: Cell<c_int> = const { Cell::new(0) };
}

/// How long the WAL is, as the writer last saw it: the frames in it after
/// its last commit (it starts from 0 when the WAL starts over). Shared with
/// the thread that checkpoints, which copies frames only once enough have
/// piled up (see `mod.rs`), and which sleeps here while nothing is written:
/// the writer wakes it when the length changes, so an idle store's threads
/// do not wake at all.
#[derive(Clone, Debug, Default)]
pub(super) struct WalLength(Arc<WalShared>);

#[derive(Debug, Default)]
struct WalShared {
    frames: AtomicI32,
    /// Set by the watcher before it sleeps, so that the writer takes the
    /// lock and wakes it only then (most commits find it unset).
    asleep: AtomicBool,
    /// The writer is gone: the watcher stops waiting.
    closed: AtomicBool,
    /// Checkpoints the watcher finished with the database file synced.
    passes: AtomicU32,
    /// Durable commits that held [`GATHER_FROM`] or more writes someone
    /// waited on: the writer is behind (see [`WalLength::gathered`]).
    gathered: AtomicU32,
    lock: Mutex<()>,
    wake: Condvar,
}

impl WalLength {
    pub fn frames(&self) -> c_int {
        self.0.frames.load(Ordering::SeqCst)
    }

    /// Records the length after a commit (the writer) and wakes a watcher
    /// asleep in [`WalLength::wait_for_change`] if it changed.
    pub fn set(&self, frames: c_int) {
        if self.0.frames.swap(frames, Ordering::SeqCst) != frames {
            self.wake();
        }
    }

    /// The writer has stopped: wakes the watcher for good.
    pub fn close(&self) {
        self.0.closed.store(true, Ordering::SeqCst);
        self.wake();
    }

    pub fn is_closed(&self) -> bool {
        self.0.closed.load(Ordering::SeqCst)
    }

    /// The watcher has copied frames into the database file and synced it.
    pub fn note_pass(&self) {
        self.0.passes.fetch_add(1, Ordering::SeqCst);
    }

    /// How many times [`WalLength::note_pass`] was called.
    pub fn passes(&self) -> u32 {
        self.0.passes.load(Ordering::SeqCst)
    }

    /// The writer's durable commit held [`GATHER_FROM`] or more writes
    /// someone waited on: it is behind, and the next one gathers.
    fn note_gathered(&self) {
        self.0.gathered.fetch_add(1, Ordering::Relaxed);
    }

    /// How many durable commits so far held [`GATHER_FROM`] or more
    /// waited-on writes: when it moves fast enough between two looks, the
    /// core is short and the checkpointing thread looks less often
    /// (`writer_behind` in `mod.rs`).
    pub fn gathered(&self) -> u32 {
        self.0.gathered.load(Ordering::Relaxed)
    }

    fn wake(&self) {
        if self.0.asleep.load(Ordering::SeqCst) {
            let _guard = self.0.lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            self.0.wake.notify_all();
        }
    }

    /// Sleeps until the length is no longer `seen`, the writer closes, or
    /// `timeout` (if any) passes. The flag is raised before the length is
    /// looked at again, and the writer changes the length before it looks
    /// at the flag (both sequentially consistent), so either the watcher
    /// sees the new length or the writer sees the flag and wakes it.
    pub fn wait_for_change(&self, seen: c_int, timeout: Option<Duration>) {
        let shared = &self.0;
        shared.asleep.store(true, Ordering::SeqCst);
        let guard = shared.lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if self.frames() == seen && !self.is_closed() {
            let _guard = match timeout {
                Some(timeout) => {
                    shared.wake.wait_timeout(guard, timeout).unwrap_or_else(|poisoned| poisoned.into_inner()).0
                }
                None => shared.wake.wait(guard).unwrap_or_else(|poisoned| poisoned.into_inner()),
            };
        }
        shared.asleep.store(false, Ordering::SeqCst);
    }
}

/// SQLite calls this after each commit in WAL mode, on the committing
/// thread.
fn note_wal_pages(_: &rusqlite::hooks::Wal, pages: c_int) -> rusqlite::Result<()> {
    WAL_PAGES.set(pages);
    Ok(())
}

/// The one thread that writes, with its connection.
#[derive(Clone, Debug)]
pub(super) struct Writer {
    jobs: handoff::Sender<WriteJob>,
}

impl Writer {
    /// Starts the writer. With `wal_limit` (pages; a database file in WAL
    /// mode), the writer checkpoints after a commit that leaves the WAL
    /// longer, and keeps `wal_length` up to date. With `sync_full` set,
    /// commits that hold a waited-on write fsync (see the module's
    /// documentation), and under load each such commit waits up to the
    /// duration it holds for company (see [`GATHER`]; zero never waits).
    pub fn start(
        name: &str,
        connection: Connection,
        wal_limit: Option<c_int>,
        wal_length: WalLength,
        sync_full: Option<Duration>,
    ) -> std::io::Result<Writer> {
        let (jobs, queue) = handoff::Sender::<WriteJob>::new();
        if wal_limit.is_some() {
            connection.wal_hook(Some(note_wal_pages));
        }
        std::thread::Builder::new().name(name.to_string()).spawn(move || {
            // Should the thread stop (a panic outside a write), writes
            // queued and to come are answered with an error, not awaited
            // forever.
            let _abandon = Abandon(&queue);
            let statements = Statements::default();
            let session = Session::new(&connection, &statements);
            let mut group = Group::default();
            let mut open = true;
            let mut synced = false;
            // Until when the writer sleeps with a deadline after a commit.
            let mut lingering: Option<Instant> = None;
            // The background checkpoints counted when the WAL passed its
            // limit (see `restart_now`).
            let mut passed_limit: Option<u32> = None;
            // When the last durable commit ended, and how many writes
            // someone waited on it held (see `GATHER`).
            let mut last_durable: Option<(Instant, usize)> = None;
            while open || !group.bodies.is_empty() {
                while group.bodies.len() < MAX_GROUP
                    && let Some(job) = queue.try_next()
                {
                    group.take(job);
                }
                if open && !group.is_due() {
                    // Nothing waited on is queued: sleep until a write comes
                    // or the deferred ones are due. Sleeping with a deadline,
                    // the writer is not woken for a deferred write (it goes
                    // with the others when they are due), and it sleeps so
                    // for `DEFERRED_WAIT` after each commit too: while turns
                    // come, their events ride in their commits without a
                    // wake-up of their own, and an idle writer stops waking.
                    match queue.next(group.due.or(lingering)) {
                        Next::Item(job) => group.take(job),
                        Next::TimedOut => lingering = None,
                        Next::Closed => open = false,
                    }
                    continue;
                }
                // A group with a write someone waits on syncs, and may gather.
                let durable = sync_full.filter(|_| group.waited > 0);
                let sync = durable.is_some();
                if let Some(gather) = durable
                    && open
                    && group.bodies.len() < MAX_GROUP
                    && let Some(until) = gathering_until(last_durable, gather)
                {
                    match queue.next(Some(until)) {
                        Next::Item(job) => group.take(job),
                        Next::TimedOut => {}
                        Next::Closed => open = false,
                    }
                    continue;
                }
                if sync != synced {
                    let level = if sync { "full" } else { "normal" };
                    match connection.pragma_update(None, "synchronous", level) {
                        Ok(()) => synced = sync,
                        Err(error) => tracing::error!(%error, "setting SQLite's synchronous level failed"),
                    }
                }
                let waited = group.waited;
                group.commit(&session);
                let now = Instant::now();
                lingering = Some(now + DEFERRED_WAIT);
                if sync {
                    last_durable = Some((now, waited));
                    if waited >= GATHER_FROM {
                        wal_length.note_gathered();
                    }
                }
                if let Some(limit) = wal_limit
                    && restart_now(WAL_PAGES.get(), limit, &mut passed_limit, wal_length.passes())
                {
                    WAL_PAGES.set(0);
                    if let Err(error) = connection.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                        tracing::warn!(%error, "checkpointing the SQLite write-ahead log failed");
                    }
                }
                // After the writer's own checkpoint too: the WAL it leaves
                // starts over with the next commit, and the background
                // thread should not take it for one near the limit.
                wal_length.set(WAL_PAGES.get());
            }
            wal_length.close();
        })?;
        Ok(Writer { jobs })
    }

    /// Runs `body` in a write transaction (committed with whatever other
    /// writes were waiting) and returns its result once that transaction
    /// is committed. When `body` fails, nothing it did is kept. `body` may
    /// run more than once (when another write of its group fails); only its
    /// last run is kept.
    pub async fn write<T, F>(&self, body: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnMut(&Session<'_, '_>) -> StoreResult<T> + Send + 'static,
    {
        self.submit(body, false).await
    }

    /// Like [`Writer::write`], for a write that may wait up to
    /// [`DEFERRED_WAIT`] to be committed with another.
    pub async fn write_deferred<T, F>(&self, body: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnMut(&Session<'_, '_>) -> StoreResult<T> + Send + 'static,
    {
        self.submit(body, true).await
    }

    async fn submit<T, F>(&self, body: F, deferred: bool) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnMut(&Session<'_, '_>) -> StoreResult<T> + Send + 'static,
    {
        let (reply, result) = oneshot::channel::<StoreResult<T>>();
        let body: WriteBody = Box::new(Pending { body, outcome: None, reply });
        if deferred {
            self.jobs.send_quiet(WriteJob { body, due: Some(Instant::now() + DEFERRED_WAIT) });
        } else {
            self.jobs.send(WriteJob { body, due: None });
        }
        result.await.map_err(|_| no_answer())?
    }
}

/// Abandons the writer's queue when dropped: when its thread stops.
struct Abandon<'a>(&'a handoff::Handoff<WriteJob>);

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        self.0.abandon();
    }
}

/// The writes the writer thread has taken and not yet committed.
#[derive(Default)]
struct Group {
    bodies: Vec<WriteBody>,
    /// How many of them someone waits on (they come first in `bodies`).
    waited: usize,
    /// When the oldest deferred write among them is due.
    due: Option<Instant>,
}

impl Group {
    /// Adds a write: a deferred one at the end, one someone waits on after
    /// the others waited on. Should one of them fail, the rest run again in
    /// savepoints, where the first write opens the transaction without one;
    /// a turn's write (its messages, turn, head, charge: ~10 pages) is then
    /// the one that opens, and a batch of events (2-3 pages) one that pays
    /// for a savepoint's copies. Writes in a group are independent (a
    /// caller's next write comes after its last was answered), so their
    /// order in the transaction, and running them again, changes nothing
    /// they see.
    fn take(&mut self, job: WriteJob) {
        if let Some(due) = job.due {
            self.due = Some(self.due.map_or(due, |earlier| earlier.min(due)));
            self.bodies.push(job.body);
        } else {
            self.bodies.insert(self.waited, job.body);
            self.waited += 1;
        }
    }

    /// Whether to commit now rather than wait for more.
    fn is_due(&self) -> bool {
        self.waited > 0 || self.bodies.len() >= MAX_GROUP || self.due.is_some_and(|due| Instant::now() >= due)
    }

    /// Commits the writes taken ([`commit_group`]) and starts over, keeping
    /// the buffer for the next group.
    fn commit(&mut self, connection: &Session<'_, '_>) {
        (self.waited, self.due) = (0, None);
        commit_group(connection, &mut self.bodies);
    }
}

/// Whether the writer checkpoints now, after a commit that left `pages`
/// frames in the WAL, so that the next transaction starts it over.
///
/// Not as soon as the WAL passes its limit: the frames the background
/// thread has not copied yet are copied by this checkpoint, and its fsync
/// of the database file writes every page the background thread copied
/// since the file was last synced, all while writes wait. At 2,000 turns/s
/// that was 70–190 pages and a 2–9 ms fsync, 5–15 ms without a commit
/// every 0.8 s (`perf trace`, bench/analysis.md): the p99 of the turns
/// queued behind it. So the writer waits for the background thread's next
/// checkpoint, which ends with the database file synced
/// ([`WalLength::note_pass`]); right after it, little is left to copy or
/// to sync. Should no such checkpoint come (a reader holding old frames), it
/// checkpoints anyway a quarter past the limit.
///
/// `passed_limit` holds the count of those checkpoints when the WAL passed
/// its limit (`passes` now), and is cleared when the writer checkpoints or
/// the WAL started over by itself.
fn restart_now(pages: c_int, limit: c_int, passed_limit: &mut Option<u32>, passes: u32) -> bool {
    if pages <= limit {
        *passed_limit = None;
        return false;
    }
    let at_limit = *passed_limit.get_or_insert(passes);
    let restart = passes != at_limit || pages > limit.saturating_add(limit / 4);
    if restart {
        *passed_limit = None;
    }
    restart
}

/// Runs a group of writes in one transaction, commits, and answers them,
/// leaving `group` empty.
///
/// The writes run one after another without savepoints, which is what a
/// group without a failing write needs. When one fails (or takes the whole
/// transaction down with it, as a full disk does), the transaction is rolled
/// back, that write is answered with its error, and the others run (again,
/// for those before it) in [`commit_in_savepoints`], where each can fail
/// alone.
fn commit_group(connection: &Session<'_, '_>, group: &mut Vec<WriteBody>) {
    if let Err(error) = execute(connection, "BEGIN IMMEDIATE") {
        let reason = format!("cannot begin a write: {error}");
        group.drain(..).for_each(|write| write.answer(Err(&reason)));
        return;
    }
    let failed =
        group.iter_mut().enumerate().find_map(|(index, write)| run(connection, write).err().map(|why| (index, why)));
    let Some((index, why)) = failed else {
        commit(connection, group);
        return;
    };
    // Undone whole: the writes before it run again, those after it for the
    // first time.
    let _ = execute(connection, "ROLLBACK");
    answer_failed(group.remove(index), why);
    commit_in_savepoints(connection, group);
}

/// Why a write's run failed.
enum Failure {
    /// It returned an error.
    Returned,
    /// SQLite rolled the whole transaction back (a full disk, an I/O
    /// error): the writes before it in the group are gone with it.
    TookTransaction,
    /// It panicked (a bug): its caller gets no answer.
    Panicked,
}

fn run(connection: &Session<'_, '_>, write: &mut WriteBody) -> Result<(), Failure> {
    match catch_unwind(AssertUnwindSafe(|| write.run(connection))) {
        Err(_) => Err(Failure::Panicked),
        Ok(_) if connection.is_autocommit() => Err(Failure::TookTransaction),
        Ok(true) => Ok(()),
        Ok(false) => Err(Failure::Returned),
    }
}

/// Answers a write whose run failed, its changes undone: with the error it
/// returned, else (it succeeded, but SQLite rolled its transaction back)
/// with that.
fn answer_failed(write: WriteBody, why: Failure) {
    match why {
        Failure::Panicked => {}
        Failure::TookTransaction => write.answer(Err("it was rolled back with its transaction")),
        // Answered with its own error; the commit does not concern it.
        Failure::Returned => write.answer(Ok(())),
    }
}

/// Commits the open transaction and answers the writes in it.
fn commit(connection: &Session<'_, '_>, writes: &mut Vec<WriteBody>) {
    match execute(connection, "COMMIT") {
        Ok(()) => writes.drain(..).for_each(|write| write.answer(Ok(()))),
        Err(error) => abandon(connection, writes, &format!("the commit failed: {error}")),
    }
}

/// Runs a group of writes in one transaction, each that joins it in a
/// savepoint, commits, and answers them: a write that fails is undone alone.
fn commit_in_savepoints(connection: &Session<'_, '_>, group: &mut Vec<WriteBody>) {
    let mut kept: Vec<WriteBody> = Vec::with_capacity(group.len());
    for mut write in group.drain(..) {
        // A write that opens the transaction needs no savepoint: if it
        // fails, rolling the transaction back undoes it and nothing else.
        let opens = connection.is_autocommit();
        let began = if opens { execute(connection, "BEGIN IMMEDIATE") } else { execute(connection, "SAVEPOINT write") };
        if let Err(error) = began {
            write.answer(Err(&format!("cannot begin a write: {error}")));
            continue;
        }
        let unwound = match run(connection, &mut write) {
            Ok(()) => {
                kept.push(write);
                if opens { Ok(()) } else { execute(connection, "RELEASE write") }
            }
            Err(Failure::TookTransaction) => {
                answer_failed(write, Failure::TookTransaction);
                abandon(connection, &mut kept, "it was rolled back with a failed write of the same commit");
                continue;
            }
            Err(why) => {
                answer_failed(write, why);
                if opens {
                    execute(connection, "ROLLBACK")
                } else {
                    execute(connection, "ROLLBACK TO write").and_then(|()| execute(connection, "RELEASE write"))
                }
            }
        };
        if let Err(error) = unwound {
            tracing::error!(%error, "closing a SQLite savepoint failed");
            abandon(connection, &mut kept, &format!("closing its savepoint failed: {error}"));
        }
    }
    if connection.is_autocommit() {
        // Abandoned, or every write failed: nothing is left to commit.
        return;
    }
    commit(connection, &mut kept);
}

/// Rolls the group's transaction back and answers each write in it.
fn abandon(connection: &Session<'_, '_>, writes: &mut Vec<WriteBody>, reason: &str) {
    // Already rolled back when SQLite did it itself; nothing to undo then.
    let _ = execute(connection, "ROLLBACK");
    for write in writes.drain(..) {
        write.answer(Err(reason));
    }
}

fn execute(connection: &Session<'_, '_>, statement: &'static str) -> rusqlite::Result<()> {
    connection.cached(statement)?.execute([])?;
    Ok(())
}

fn no_answer() -> StoreError {
    StoreError::Database("the SQLite connection thread did not answer".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Runs `wait_for_change(seen, timeout)` on a thread of its own.
    fn watcher(wal: &WalLength, seen: c_int, timeout: Option<Duration>) -> std::thread::JoinHandle<()> {
        let wal = wal.clone();
        std::thread::spawn(move || wal.wait_for_change(seen, timeout))
    }

    fn finishes_within(handle: &std::thread::JoinHandle<()>, limit: Duration) -> bool {
        let start = Instant::now();
        while !handle.is_finished() && start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(2));
        }
        handle.is_finished()
    }

    #[test]
    fn past_its_limit_the_wal_starts_over_after_the_next_background_checkpoint() {
        let mut passed = None;
        assert!(!restart_now(90, 100, &mut passed, 7), "under the limit");
        assert_eq!(passed, None);
        // Past it: not before the background thread's next checkpoint.
        assert!(!restart_now(110, 100, &mut passed, 7));
        assert!(!restart_now(120, 100, &mut passed, 7));
        assert_eq!(passed, Some(7));
        assert!(restart_now(121, 100, &mut passed, 8), "right after the next one");
        assert_eq!(passed, None, "cleared once it checkpoints");
        // Without one, a quarter past the limit.
        assert!(!restart_now(110, 100, &mut passed, 8));
        assert!(!restart_now(125, 100, &mut passed, 8));
        assert!(restart_now(126, 100, &mut passed, 8));
        // A WAL that started over by itself starts the wait afresh.
        assert!(!restart_now(110, 100, &mut passed, 8));
        assert!(!restart_now(5, 100, &mut passed, 9));
        assert!(!restart_now(110, 100, &mut passed, 9), "a checkpoint before this pass does not count");
        assert!(restart_now(111, 100, &mut passed, 10));
    }

    #[test]
    fn a_watcher_sleeps_until_the_wal_changes() {
        let wal = WalLength::default();
        wal.set(3);
        let asleep = watcher(&wal, 3, None);
        assert!(!finishes_within(&asleep, Duration::from_millis(100)), "woke with nothing written");
        wal.set(3);
        assert!(!finishes_within(&asleep, Duration::from_millis(50)), "the same length woke it");
        wal.set(40);
        assert!(finishes_within(&asleep, Duration::from_secs(5)), "a commit did not wake it");
        // A length it has not seen yet does not put it to sleep at all.
        assert!(finishes_within(&watcher(&wal, 3, None), Duration::from_secs(5)));
    }

    #[test]
    fn a_watcher_wakes_when_its_time_passes_or_the_writer_stops() {
        let wal = WalLength::default();
        let timed = watcher(&wal, 0, Some(Duration::from_millis(20)));
        assert!(finishes_within(&timed, Duration::from_secs(5)), "the timeout did not end the wait");
        let asleep = watcher(&wal, 0, None);
        assert!(!finishes_within(&asleep, Duration::from_millis(50)));
        wal.close();
        assert!(finishes_within(&asleep, Duration::from_secs(5)), "closing did not wake it");
        assert!(wal.is_closed());
    }

    /// Keeps the writer busy for `time` with a write of its own (one
    /// commit), so that writes sent meanwhile queue up; returns after
    /// giving the writer 20 ms to take it.
    async fn hold(writer: &Writer, time: Duration) -> tokio::task::JoinHandle<StoreResult<()>> {
        let busy = tokio::spawn({
            let writer = writer.clone();
            async move {
                writer
                    .write(move |_| {
                        std::thread::sleep(time);
                        Ok(())
                    })
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        busy
    }

    /// A writer on a fresh in-memory database with one table, and a count
    /// of the commits it makes.
    fn writer() -> (Writer, Arc<AtomicUsize>) {
        let (writer, commits, _) = writer_committing(None);
        (writer, commits)
    }

    /// [`writer`], syncing the commits that hold a waited-on write when
    /// `sync_full` is set, and gathering under load for the duration it holds.
    fn writer_committing(sync_full: Option<Duration>) -> (Writer, Arc<AtomicUsize>, WalLength) {
        let connection = Connection::open_in_memory().expect("opens");
        connection.execute_batch("CREATE TABLE t (v INTEGER)").expect("table");
        let commits = Arc::new(AtomicUsize::new(0));
        let counted = commits.clone();
        connection
            .commit_hook(Some(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                false
            }))
            .expect("hook");
        let wal = WalLength::default();
        (Writer::start("test-writer", connection, None, wal.clone(), sync_full).expect("starts"), commits, wal)
    }

    fn insert(value: i64) -> impl FnMut(&Session<'_, '_>) -> StoreResult<usize> + Send + 'static {
        move |connection| Ok(connection.execute("INSERT INTO t VALUES (?)", [value])?)
    }

    #[test]
    fn a_point_read_borrows_an_idle_connection_or_gives_the_job_back() {
        let open = || {
            let connection = Connection::open_in_memory().expect("opens");
            connection.execute_batch("CREATE TABLE t (v INTEGER)").expect("table");
            connection
        };
        let point = PointReaders::new(vec![open(), open()]);
        let count =
            |c: &Session<'_, '_>| -> StoreResult<i64> { Ok(c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0))?) };
        // Two connections: two nested reads get one each, a third none.
        let nested = point.try_run(|_| {
            let inner = point.try_run(|_| Ok(point.try_run(count).is_err()));
            Ok(matches!(inner, Ok(Ok(true))))
        });
        assert!(matches!(nested, Ok(Ok(true))), "the third read was given back");
        // Both went back, also after a read that panicked.
        let panicked = catch_unwind(AssertUnwindSafe(|| point.try_run(|_| -> StoreResult<()> { panic!("a bug") })));
        assert!(panicked.is_err());
        let both = point.try_run(|_| Ok(matches!(point.try_run(count), Ok(Ok(0)))));
        assert!(matches!(both, Ok(Ok(true))), "two connections idle again");
    }

    #[tokio::test]
    async fn a_deferred_write_rides_in_the_next_commit_or_goes_alone_when_due() {
        let (writer, commits) = writer();
        // Alone, it is committed once its wait is over.
        let started = Instant::now();
        writer.write_deferred(insert(1)).await.expect("stored");
        assert!(started.elapsed() >= DEFERRED_WAIT, "it waited for company");
        assert_eq!(commits.load(Ordering::SeqCst), 1);

        // With a write someone waits on beside it, both go in one commit. (A
        // busy writer lets both queue first, however slow this machine is.)
        let busy = hold(&writer, Duration::from_millis(300)).await;
        let deferred = tokio::spawn({
            let writer = writer.clone();
            async move { writer.write_deferred(insert(2)).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        writer.write(insert(3)).await.expect("stored");
        deferred.await.expect("joins").expect("stored");
        busy.await.expect("joins").expect("busy write");
        assert_eq!(commits.load(Ordering::SeqCst), 3, "the busy write's commit, then one commit for both");
        let rows: i64 =
            writer.write(|c| Ok(c.query_row("SELECT COUNT(*) FROM t", [], |row| row.get(0))?)).await.unwrap();
        assert_eq!(rows, 3);
    }

    #[tokio::test]
    async fn after_a_commit_a_deferred_write_waits_its_turn_and_a_waited_one_does_not() {
        let (writer, commits) = writer();
        writer.write(insert(1)).await.expect("stored");
        // Right after a commit the writer sleeps with a deadline; a deferred
        // write does not wake it, and is committed alone when due.
        let sent = Instant::now();
        writer.write_deferred(insert(2)).await.expect("stored");
        assert!(sent.elapsed() >= DEFERRED_WAIT, "it waited for company");
        assert_eq!(commits.load(Ordering::SeqCst), 2);
        // A write someone waits on wakes it at once, lingering or not.
        for value in [3, 4] {
            let sent = Instant::now();
            writer.write(insert(value)).await.expect("stored");
            assert!(sent.elapsed() < DEFERRED_WAIT / 2, "a waited-on write was held {:?}", sent.elapsed());
        }
        assert_eq!(commits.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn under_load_a_durable_commit_waits_for_company_and_a_quiet_one_does_not() {
        // A window far longer than any pause of a loaded test machine.
        let window = Duration::from_millis(400);
        let (writer, commits, wal) = writer_committing(Some(window));
        // Quiet: each write is its own commit, sent at once.
        for value in [1, 2] {
            let sent = Instant::now();
            writer.write(insert(value)).await.expect("stored");
            assert!(sent.elapsed() < window / 2, "a write on a quiet writer was held {:?}", sent.elapsed());
        }
        assert_eq!(commits.load(Ordering::SeqCst), 2);

        // Behind: enough writes queue behind a busy one to commit together...
        let busy = hold(&writer, Duration::from_millis(100)).await;
        let piled: Vec<_> = (0..GATHER_FROM as i64)
            .map(|value| {
                let writer = writer.clone();
                tokio::spawn(async move { writer.write(insert(10 + value)).await })
            })
            .collect();
        for write in piled {
            write.await.expect("joins").expect("stored");
        }
        busy.await.expect("joins").expect("held");
        assert_eq!(commits.load(Ordering::SeqCst), 4, "the hold, then one commit for the pile");
        assert_eq!(wal.gathered(), 1, "the pile's commit says the writer is behind");

        // ...so the next durable commit waits out the window after it, and a
        // write sent meanwhile goes in the same commit.
        let first = tokio::spawn({
            let writer = writer.clone();
            async move { writer.write(insert(100)).await }
        });
        tokio::time::sleep(window / 4).await;
        writer.write(insert(101)).await.expect("stored");
        first.await.expect("joins").expect("stored");
        assert_eq!(commits.load(Ordering::SeqCst), 5, "both writes in one commit");

        // That commit held two: the next write is not held again.
        let sent = Instant::now();
        writer.write(insert(102)).await.expect("stored");
        assert!(sent.elapsed() < window / 2, "held {:?} after a commit of two", sent.elapsed());
        assert_eq!(commits.load(Ordering::SeqCst), 6);
        assert_eq!(wal.gathered(), 1, "no commit since held enough to gather");
    }

    #[tokio::test]
    async fn in_a_group_the_writes_waited_on_run_first_in_arrival_order() {
        let (writer, commits) = writer();
        let busy = hold(&writer, Duration::from_millis(150)).await;
        let mut queued = Vec::new();
        for (value, deferred) in [(10, true), (20, false), (11, true), (21, false)] {
            let writer = writer.clone();
            queued.push(tokio::spawn(async move {
                if deferred { writer.write_deferred(insert(value)).await } else { writer.write(insert(value)).await }
            }));
            // Sent one after another, so they queue in this order.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for write in queued {
            write.await.expect("joins").expect("stored");
        }
        busy.await.expect("joins").expect("held");
        assert_eq!(commits.load(Ordering::SeqCst), 2, "the hold, then one commit for the four");
        let order: Vec<i64> = writer
            .write(|c| {
                let mut statement = c.prepare("SELECT v FROM t ORDER BY rowid")?;
                let values = statement.query_map([], |row| row.get(0))?.collect::<Result<_, _>>()?;
                Ok(values)
            })
            .await
            .expect("reads");
        assert_eq!(order, [20, 21, 10, 11]);
    }

    #[tokio::test]
    async fn in_a_group_a_failed_write_is_undone_alone_whether_first_or_later() {
        let (writer, commits) = writer();
        // Hold the writer so the next writes queue up and go as one group.
        let busy = hold(&writer, Duration::from_millis(100)).await;
        let failing = |value: i64| {
            move |connection: &Session<'_, '_>| -> StoreResult<usize> {
                connection.execute("INSERT INTO t VALUES (?)", [value])?;
                Err(StoreError::Conflict("refused after writing".into()))
            }
        };
        let (first, second, third, fourth) = tokio::join!(
            writer.write(failing(1)),
            writer.write(insert(2)),
            writer.write(failing(3)),
            writer.write(insert(4)),
        );
        busy.await.expect("joins").expect("held");
        assert!(first.is_err() && third.is_err());
        assert!(second.is_ok() && fourth.is_ok());
        assert_eq!(commits.load(Ordering::SeqCst), 2, "the hold, then one commit for the four");
        let kept: Vec<i64> = writer
            .write(|c| {
                let mut statement = c.prepare("SELECT v FROM t ORDER BY v")?;
                let values = statement.query_map([], |row| row.get(0))?.collect::<Result<_, _>>()?;
                Ok(values)
            })
            .await
            .expect("reads");
        assert_eq!(kept, [2, 4]);
    }

    #[tokio::test]
    async fn a_write_that_ran_before_a_failed_one_runs_again_and_answers_with_its_last_run() {
        let (writer, commits) = writer();
        let counting = |runs: &Arc<AtomicUsize>| {
            let runs = runs.clone();
            move |connection: &Session<'_, '_>| -> StoreResult<usize> {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                connection.execute("INSERT INTO t VALUES (?)", [run as i64 * 10])?;
                Ok(run)
            }
        };
        let values = |writer: Writer| async move {
            writer
                .write(|c| {
                    let mut statement = c.prepare("SELECT v FROM t ORDER BY v")?;
                    let values: Vec<i64> = statement.query_map([], |row| row.get(0))?.collect::<Result<_, _>>()?;
                    Ok(values)
                })
                .await
                .expect("reads")
        };
        // A group without a failure: each write runs once.
        let (alone, company) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let busy = hold(&writer, Duration::from_millis(100)).await;
        let (first, second) = tokio::join!(writer.write(counting(&alone)), writer.write(counting(&company)));
        busy.await.expect("joins").expect("held");
        assert_eq!((first.expect("stored"), second.expect("stored")), (1, 1));
        assert_eq!(values(writer.clone()).await, [10, 10]);
        // A write after it fails: it is undone with the transaction and runs
        // again; its answer and its row are its second run's, and only that.
        let again = Arc::new(AtomicUsize::new(0));
        let busy = hold(&writer, Duration::from_millis(100)).await;
        let (ran_twice, failed) = tokio::join!(
            writer.write(counting(&again)),
            writer.write(|connection: &Session<'_, '_>| -> StoreResult<usize> {
                connection.execute("INSERT INTO t VALUES (99)", [])?;
                Err(StoreError::Conflict("refused after writing".into()))
            }),
        );
        busy.await.expect("joins").expect("held");
        assert!(matches!(failed, Err(StoreError::Conflict(_))), "{failed:?}");
        assert_eq!(ran_twice.expect("stored"), 2);
        assert_eq!(values(writer.clone()).await, [10, 10, 20]);
        assert_eq!(commits.load(Ordering::SeqCst), 6, "hold, group, read, hold, group, read");
    }
}
