//! The SQLite store: Arbor's embedded default, one file on the local disk and
//! no service to run.
//!
//! SQLite allows one writer at a time. Rather than let several connections
//! race for the write lock (and fail with `SQLITE_BUSY` when a read
//! transaction tries to upgrade), every write of this process runs on one
//! connection, owned by one thread, and starts with `BEGIN IMMEDIATE`; reads
//! run on a few other connections, each on a thread of its own, and thanks
//! to WAL never wait for the writer. A store call is one job for one of
//! those threads (see [`worker`]). The busy timeout still covers other
//! processes (`arbor users add` while the server runs). Because all writes
//! of this process are serialized, each invariant the engine relies on (one
//! running turn, quota, unique message ids) also holds by the database's own
//! constraints, exactly as on PostgreSQL.

mod handoff;
mod packed;
mod session;
#[allow(unsafe_code)]
mod vfs;
mod worker;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arbor_core::ids::Millis;
use arbor_core::{Event, Node};
use async_trait::async_trait;
use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior, ffi, params};
use tokio::sync::broadcast;

use self::session::Session;
use self::worker::{PointReaders, Readers, WalLength, Writer};
use crate::codec::{self, ColumnPlaces, NodeColumns, SqliteRow, to_i64};
use crate::*;

/// How long a statement waits for another process's write lock before
/// failing with "database is locked".
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long opening a database under `locking=exclusive` waits for a lock
/// held elsewhere before it says the file is in use.
const EXCLUSIVE_OPEN_WAIT: Duration = Duration::from_secs(1);

/// Notices a slow listener may fall behind by before it is told it lagged.
const NOTICE_BUFFER: usize = 1024;

/// WAL pages (4 KiB each, so 64 MiB) past which the writer checkpoints
/// after a commit and the WAL starts over (see [`worker`]). Each such
/// checkpoint pauses writes for a few milliseconds; at a benchmark's write
/// rate (~130 MB of WAL a second) 64 MiB kept the pauses out of the 99th
/// percentile, where 16 MiB did not (bench/REPORT.md).
const WAL_RESTART_PAGES: std::ffi::c_int = 16384;

/// The WAL file is cut back to this many bytes when it starts over after
/// having grown past it (a burst of writes).
const WAL_SIZE_LIMIT: i64 = 128 * 1024 * 1024;

/// Prepared statements each connection keeps (every statement of this
/// module fits, so none is ever prepared twice).
const STATEMENT_CACHE: usize = 64;

/// The schema, embedded in the binary so `arbor serve` needs no files beside
/// it. Versions are the file name prefixes; a landed file is never edited.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "initial", include_str!("../../migrations/sqlite/0001_initial.sql")),
    (2, "turn pending messages", include_str!("../../migrations/sqlite/0002_turn_pending_messages.sql")),
    (3, "lighter turn writes", include_str!("../../migrations/sqlite/0003_lighter_turn_writes.sql")),
    (4, "ledger index ascending", include_str!("../../migrations/sqlite/0004_ledger_index_ascending.sql")),
    (5, "events in arrival order", include_str!("../../migrations/sqlite/0005_events_in_arrival_order.sql")),
    (6, "turns, calls and charges by key", include_str!("../../migrations/sqlite/0006_turns_calls_charges_by_key.sql")),
    (7, "running turns indexed once", include_str!("../../migrations/sqlite/0007_running_turns_indexed_once.sql")),
    (8, "ledger by user", include_str!("../../migrations/sqlite/0008_ledger_by_user.sql")),
    (9, "checks without IN lists", include_str!("../../migrations/sqlite/0009_checks_without_in_lists.sql")),
    (10, "events in runs", include_str!("../../migrations/sqlite/0010_events_in_runs.sql")),
];

impl From<rusqlite::Error> for StoreError {
    fn from(error: rusqlite::Error) -> StoreError {
        let rusqlite::Error::SqliteFailure(failure, message) = &error else {
            return match error {
                rusqlite::Error::QueryReturnedNoRows => StoreError::NotFound,
                error => StoreError::Database(error.to_string()),
            };
        };
        match failure.extended_code {
            ffi::SQLITE_CONSTRAINT_UNIQUE | ffi::SQLITE_CONSTRAINT_PRIMARYKEY => {
                let message = message.clone().unwrap_or_else(|| error.to_string());
                // The partial unique index that allows one running turn per
                // conversation names just that column.
                if message.ends_with("turns.conversation_id") {
                    StoreError::Conflict("the conversation already has a running turn".into())
                } else {
                    StoreError::Conflict(message)
                }
            }
            // A row that points at a missing one: the conversation, user or
            // parent message named does not exist.
            ffi::SQLITE_CONSTRAINT_FOREIGNKEY => StoreError::NotFound,
            _ => StoreError::Database(error.to_string()),
        }
    }
}

/// Where a `sqlite:` URL points.
#[derive(Debug, PartialEq, Eq)]
enum Location {
    File(PathBuf, Durability, Locking),
    /// `sqlite::memory:`: a private database that lives as long as the store
    /// (tests and throwaway runs).
    Memory,
}

/// When a commit reaches the disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Durability {
    /// `?synchronous=normal`: a commit is in the WAL (the operating
    /// system's cache) when it returns, and the WAL is fsynced at each
    /// checkpoint. A crash of Arbor loses nothing; a power loss or a kernel
    /// crash can lose the commits since the last checkpoint (never corrupt
    /// the file).
    Normal,
    /// The default (`?synchronous=full`): a commit that holds a write
    /// someone waits on (a user's message, a finished turn, a charge)
    /// fsyncs the WAL before it is answered, so it survives a power loss
    /// too. Commits of events alone skip the fsync (see [`worker`]).
    #[default]
    Full,
}

/// Whether other processes may open the database while this one has it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum Locking {
    /// The default: any process may open the file beside Arbor (`arbor
    /// users add` while the server runs, the `sqlite3` shell, a backup);
    /// every transaction takes and releases its locks with `fcntl` calls,
    /// on the database's `-shm` file.
    #[default]
    Shared,
    /// `?locking=exclusive`: the first connection takes the file for this
    /// process until the last one closes (SQLite's `unix-excl` VFS, see
    /// [`vfs::register`]); its connections then lock each other in memory,
    /// with no system call, and another process's open fails within a
    /// second with an error that says so. Durability is the same.
    Exclusive,
}

fn parse_url(url: &str) -> StoreResult<Location> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .ok_or_else(|| StoreError::Database(format!("{url:?} is not a sqlite:// url")))?;
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    // Other connection parameters (`?mode=…`) are Arbor's to choose.
    let (mut durability, mut locking) = (Durability::default(), Locking::default());
    for (key, value) in query.split('&').filter_map(|pair| pair.split_once('=')) {
        match key {
            "synchronous" => {
                durability = url_choice(url, key, value, [("normal", Durability::Normal), ("full", Durability::Full)])?;
            }
            "locking" => {
                locking =
                    url_choice(url, key, value, [("shared", Locking::Shared), ("exclusive", Locking::Exclusive)])?;
            }
            _ => {}
        }
    }
    match path {
        "" => Err(StoreError::Database(format!("{url:?} names no file: use sqlite://PATH"))),
        ":memory:" => Ok(Location::Memory),
        path => Ok(Location::File(PathBuf::from(path), durability, locking)),
    }
}

/// The choice a URL parameter's `value` names (case-blind), or an error
/// that lists the choices.
fn url_choice<T: Copy>(url: &str, key: &str, value: &str, choices: [(&str, T); 2]) -> StoreResult<T> {
    let [(first, _), (second, _)] = choices;
    choices
        .into_iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(value))
        .map(|(_, choice)| choice)
        .ok_or_else(|| StoreError::Database(format!("{key}={value:?} in {url:?}: use {key}={first} or {key}={second}")))
}

/// A SQLite database behind the [`Store`] trait.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    /// One connection: every write of this process, serialized.
    writer: Writer,
    /// Several connections for reads, which WAL lets run beside the writer
    /// (`None` for an in-memory database: its one connection does both).
    reader: Option<Readers>,
    /// Connections for point reads on the caller's thread (see
    /// [`PointReaders`]; `None` for an in-memory database).
    point: Option<Arc<PointReaders>>,
    /// Notices stay in this process: a SQLite database serves one node.
    /// (The WAL checkpointing thread stops when the writer does, once the
    /// last clone of the store is gone.)
    notices: broadcast::Sender<Notice>,
    /// No other process can write the database (`locking=exclusive`, or in
    /// memory): see [`Store::sole_writer`].
    sole_writer: bool,
}

impl SqliteStore {
    /// Opens (creating the file and its folder if missing) the database at
    /// `sqlite://PATH`, or a private in-memory one for `sqlite::memory:`,
    /// and applies the migrations it lacks.
    pub async fn open(url: &str) -> StoreResult<SqliteStore> {
        match parse_url(url)? {
            Location::Memory => {
                // Each in-memory connection is its own database, so one
                // connection serves both roles.
                let connection = blocking(|| {
                    let mut connection = Connection::open_in_memory()?;
                    configure(&connection)?;
                    migrate(&mut connection)?;
                    Ok(connection)
                })
                .await?;
                Ok(SqliteStore {
                    writer: Writer::start("arbor-sqlite", connection, None, WalLength::default(), None)
                        .map_err(thread_error)?,
                    reader: None,
                    point: None,
                    notices: broadcast::channel(NOTICE_BUFFER).0,
                    sole_writer: true,
                })
            }
            Location::File(path, durability, locking) => {
                Self::open_file(path, durability, locking, WAL_RESTART_PAGES).await
            }
        }
    }

    async fn open_file(
        path: PathBuf,
        durability: Durability,
        locking: Locking,
        wal_limit: std::ffi::c_int,
    ) -> StoreResult<SqliteStore> {
        if let Some(parent) = path.parent().filter(|parent| !parent.as_os_str().is_empty()) {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|error| StoreError::Database(format!("cannot create {}: {error}", parent.display())))?;
        }
        let readers = std::thread::available_parallelism().map_or(4, |count| count.get()).clamp(2, 4);
        let (writer, reader_connections, point_connections, (checkpointer, database)) = blocking(move || {
            let mut writer = open_connection(&path, locking)?;
            // A checkpoint copies the WAL into the database file and fsyncs
            // both, which takes milliseconds on a real disk. SQLite runs one
            // inside the commit that grows the WAL past 1,000 pages, so that
            // write, and every write queued behind it on the single writer,
            // waits for two fsyncs: that was the benchmark's p99 (see
            // bench/REPORT.md). So the writer never checkpoints; a thread
            // does, on a connection of its own, in PASSIVE mode, which never
            // takes the write lock. Durability is unchanged: a commit is in
            // the WAL either way, and the checkpoint only moves it.
            writer.pragma_update(None, "wal_autocheckpoint", 0)?;
            writer.pragma_update(None, "journal_size_limit", WAL_SIZE_LIMIT)?;
            migrate(&mut writer)?;
            let open_readers =
                || (0..readers).map(|_| open_connection(&path, locking)).collect::<StoreResult<Vec<_>>>();
            // The checkpointing thread syncs the database file through a
            // handle of its own (see `checkpoint_wal`).
            let file = std::fs::File::open(&path)
                .map_err(|error| StoreError::Database(format!("cannot open {}: {error}", path.display())))?;
            Ok((writer, open_readers()?, open_readers()?, (open_connection(&path, locking)?, file)))
        })
        .await?;
        let wal_length = WalLength::default();
        let watched_length = wal_length.clone();
        // The writer first: the checkpointing thread stops when it closes
        // the WAL length, so it must not outlive a writer that never ran.
        let writer = Writer::start(
            "arbor-sqlite-writer",
            writer,
            Some(wal_limit),
            wal_length,
            (durability == Durability::Full).then_some(worker::GATHER),
        )
        .map_err(thread_error)?;
        std::thread::Builder::new()
            .name("arbor-sqlite-checkpoint".into())
            .spawn(move || checkpoint_wal(&checkpointer, &database, &watched_length, wal_limit))
            .map_err(thread_error)?;
        Ok(SqliteStore {
            writer,
            reader: Some(Readers::start("arbor-sqlite-reader", reader_connections).map_err(thread_error)?),
            point: Some(Arc::new(PointReaders::new(point_connections))),
            notices: broadcast::channel(NOTICE_BUFFER).0,
            sole_writer: locking == Locking::Exclusive,
        })
    }

    /// Runs `body` in a write transaction on the writer thread and returns
    /// once that transaction is committed (see [`worker`]: it may be
    /// committed with other writes). The transaction holds the write lock
    /// from its start, so it never has to upgrade (and fail) half way
    /// through; nothing `body` did is kept when it fails.
    async fn write<T, F>(&self, body: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnMut(&Session<'_, '_>) -> StoreResult<T> + Send + 'static,
    {
        self.writer.write(body).await
    }

    /// Runs `body` on a reader thread.
    async fn read<T, F>(&self, body: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnMut(&Session<'_, '_>) -> StoreResult<T> + Send + 'static,
    {
        match &self.reader {
            Some(reader) => reader.run(body).await,
            None => self.writer.write(body).await,
        }
    }

    /// Runs `body`, a point read (one row by its key, a few microseconds),
    /// on this thread when a connection for it is idle, else like
    /// [`SqliteStore::read`] (see [`PointReaders`]).
    async fn read_point<T, F>(&self, body: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnMut(&Session<'_, '_>) -> StoreResult<T> + Send + 'static,
    {
        let body = match &self.point {
            Some(point) => match point.try_run(body) {
                Ok(result) => return result,
                Err(body) => body,
            },
            None => body,
        };
        self.read(body).await
    }
}

/// Runs blocking SQLite work (opening files, migrating) off the async
/// threads.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> StoreResult<T> + Send + 'static) -> StoreResult<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| StoreError::Database(format!("the SQLite task failed: {error}")))?
}

fn thread_error(error: std::io::Error) -> StoreError {
    StoreError::Database(format!("cannot start a SQLite thread: {error}"))
}

/// Opens a connection to a database file in WAL mode.
fn open_connection(path: &Path, locking: Locking) -> StoreResult<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    // Through SQLite's unix VFS with the WAL's writes batched (see `vfs`).
    let connection = match (vfs::register(locking), locking) {
        (Some(vfs), _) => Connection::open_with_flags_and_vfs(path, flags, vfs)?,
        (None, Locking::Shared) => Connection::open_with_flags(path, flags)?,
        (None, Locking::Exclusive) => {
            return Err(StoreError::Database(
                "locking=exclusive needs SQLite's unix-excl VFS, which this build lacks".into(),
            ));
        }
    };
    configure(&connection)?;
    // The file's first lock is taken below. Another process that holds it
    // exclusively holds it until it stops, so the caller hears that after a
    // moment (a closing connection of this process may hold it that long,
    // for its last checkpoint) instead of after the busy timeout.
    if locking == Locking::Exclusive {
        connection.busy_timeout(EXCLUSIVE_OPEN_WAIT)?;
    }
    // WAL: readers never block the writer nor the writer readers.
    let mode: String = match connection.pragma_update_and_check(None, "journal_mode", "wal", |row| row.get(0)) {
        Ok(mode) => mode,
        Err(error)
            if locking == Locking::Exclusive
                && error.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy) =>
        {
            return Err(StoreError::Database(format!(
                "{} is in use by another process, and locking=exclusive lets one process at a time open it \
                 (stop the Arbor server that has it to run this command, or drop locking=exclusive from the database URL)",
                path.display()
            )));
        }
        Err(error) => return Err(error.into()),
    };
    if locking == Locking::Exclusive {
        // The file is this process's now: its own connections may still
        // wait on each other (the checkpointer on the writer, say).
        connection.busy_timeout(BUSY_TIMEOUT)?;
    }
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Database(format!("{} cannot use WAL (journal mode {mode})", path.display())));
    }
    // NORMAL: a connection's commits survive a crash of the application in
    // WAL mode; only a power loss can drop the last ones, never corrupt the
    // file. The writer raises it to FULL for the commits that must survive
    // that too (see `Durability`).
    connection.pragma_update(None, "synchronous", "normal")?;
    Ok(connection)
}

/// Settings every connection needs, file or memory.
fn configure(connection: &Connection) -> StoreResult<()> {
    connection.busy_timeout(BUSY_TIMEOUT)?;
    connection.pragma_update(None, "foreign_keys", true)?;
    // Temporary files stay in memory. The one that matters is the
    // statement journal: when a write of a group fails, the others run
    // again each in a savepoint (see `worker`), and SQLite keeps the
    // original of each page a savepoint changes so it can roll back to it;
    // past 64 KiB it spilled to a temporary file, opened, written page by
    // page and deleted (when every write ran in a savepoint, at 100 turns/s
    // a third of the writer's `pwrite`s, by strace). It is only read to
    // undo a savepoint, never after a crash, so durability is unchanged.
    connection.pragma_update(None, "temp_store", "memory")?;
    connection.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    Ok(())
}

/// Applies the migrations the database lacks, each in its own transaction.
/// The version applied last is the database's `user_version`. A database
/// migrated by an earlier Arbor (which kept sqlx's `_sqlx_migrations`
/// table) starts from the versions recorded there.
fn migrate(connection: &mut Connection) -> StoreResult<()> {
    let mut version: i64 = connection.pragma_query_value(None, "user_version", |row| row.get(0))?;
    if version == 0 {
        let migrated_by_sqlx: bool = connection.query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations')",
            [],
            |row| row.get(0),
        )?;
        if migrated_by_sqlx {
            let earlier: Option<i64> =
                connection
                    .query_row("SELECT MAX(version) FROM _sqlx_migrations WHERE success", [], |row| row.get(0))?;
            version = earlier.unwrap_or(0);
        }
    }
    // Rebuilding a table (SQLite's way to change a column) needs foreign
    // keys off: dropping the old table would otherwise delete, by cascade,
    // the rows just copied. They are checked before each migration commits
    // instead, and switched back on after.
    connection.pragma_update(None, "foreign_keys", false)?;
    let migrated = apply_migrations(connection, version);
    connection.pragma_update(None, "foreign_keys", true)?;
    migrated
}

fn apply_migrations(connection: &mut Connection, version: i64) -> StoreResult<()> {
    for &(number, description, sql) in MIGRATIONS.iter().filter(|(number, ..)| *number > version) {
        let failed =
            |error: String| StoreError::Database(format!("migration {number} ({description}) failed: {error}"));
        let transaction = connection.transaction_with_behavior(TransactionBehavior::Immediate)?;
        transaction.execute_batch(sql).map_err(|error| failed(error.to_string()))?;
        let broken: Option<String> = transaction
            .query_row("SELECT \"table\" FROM pragma_foreign_key_check LIMIT 1", [], |row| row.get(0))
            .optional()?;
        if let Some(table) = broken {
            return Err(failed(format!("it left rows of {table} whose foreign keys point nowhere")));
        }
        transaction.pragma_update(None, "user_version", number)?;
        transaction.commit()?;
    }
    Ok(())
}

/// How many frames the WAL may hold beyond those already copied before the
/// background thread copies them (4 MiB), unless writes come fast.
///
/// Copying everything has a price later: the next commit then starts the
/// WAL over, and starting over writes a new WAL header and fsyncs it (SQLite
/// does that in every synchronous mode but OFF), in that commit, on the
/// turn's path. Checkpointing every 10 ms regardless, as before, meant that
/// at 50 turns/s nearly every other turn waited for that fsync (0.45 fsyncs
/// per turn on the writer, `bench/threadstat.sh`), and the checkpoints' own
/// two fsyncs each came once per turn. A turn writes ~33 frames, so at this
/// threshold the WAL starts over about once per 30 turns.
///
/// Under fast writes ([`CHECKPOINT_FAST`]) that changes: a checkpoint then
/// often finds a commit landing while it runs, so the WAL starts over less
/// often anyway (at 600 turns/s once per 100 turns), and copying thousands
/// of frames at once was measured to hurt the tail: with 4,096 at a time,
/// p99 at 1,000 turns/s rose from ~12 to ~25 ms, and at 500/s from ~5 to
/// ~8 ms. So from ~150 turns/s on, frames are copied at every look, a few
/// hundred at a time. The same goes for the stretch before the writer's own
/// limit, past which the writer copies what is left itself while writes
/// wait.
const CHECKPOINT_FRAMES: std::ffi::c_int = 1024;
/// Frames written within [`CHECKPOINT_WINDOW`] from which writes count as
/// fast (5,000 a second, ~150 turns/s).
const CHECKPOINT_FAST: std::ffi::c_int = 500;
const CHECKPOINT_WINDOW: Duration = Duration::from_millis(100);
/// How often the background thread looks at the WAL's length while
/// commits come. A turn's commits rewrite the same few pages (the b-trees'
/// right edges, the conversation's row), so a longer look copies each of
/// them once for more turns: at 2,000 turns/s, 40 ms rather than 10 copied
/// ~40% fewer pages a turn and halved the checkpointer's CPU. But each look
/// copies its pages in one go on Arbor's one core, which holds the turns'
/// threads back meanwhile: since the copies' database fsync moved to this
/// thread, 20 ms had a lower p99 than 40 at 1,000 and 2,000 turns/s
/// (2.0–2.3 against 2.2–2.6 ms, 3.6–4.1 against 4.1–4.9 ms) for the same
/// CPU a turn, and 10 ms cost ~30 µs more CPU a turn at 1,000/s
/// (bench/analysis.md).
const CHECKPOINT_POLL: Duration = Duration::from_millis(20);
/// How often it looks while the writer is behind ([`writer_behind`]): the
/// core is then short, and the CPU a look saves matters more than how long
/// one copy holds the turns back. A copy then takes more turns' rewrites
/// of the same pages (the b-trees' right edges) at once: at 3,000 turns/s
/// the checkpointer copied 2.1–2.2 pages a turn against 2.4–3.1 at 20 ms,
/// for 16–17 µs of its CPU a turn against 18–28; at 3,500/s all of
/// Arbor's threads took 247–252 µs a turn against 253–257 (three
/// alternated pairs each, bench/analysis.md). Copies of more pages hold
/// the turns back longer, so below that load it stays at
/// [`CHECKPOINT_POLL`].
const CHECKPOINT_POLL_BEHIND: Duration = Duration::from_millis(50);
/// Durable commits that gathered (held enough waited-on writes to wait
/// for more, see `worker::GATHER`) per [`CHECKPOINT_POLL`] from which the
/// writer counts as behind. Measured between looks: 0–0.02 at 1,000
/// turns/s, 0.6–1.5 at 2,000/s, 9.5–13 at 3,000/s.
const BEHIND_FROM: u32 = 4;

/// Whether the writer is behind, from the commits that gathered in the
/// time `since` the last look: [`BEHIND_FROM`] or more per
/// [`CHECKPOINT_POLL`].
fn writer_behind(gathered: u32, since: Duration) -> bool {
    gathered > 0 && u128::from(gathered) * CHECKPOINT_POLL.as_micros() >= u128::from(BEHIND_FROM) * since.as_micros()
}

/// After this long without a commit, whatever is left is copied too, so an
/// idle database's file is up to date.
const CHECKPOINT_IDLE: Duration = Duration::from_secs(2);

/// Checkpoints the WAL until the writer stops (the last clone of the store
/// is gone). PASSIVE copies what no reader still needs and never waits for
/// a lock. The WAL starts over only from the writer (see [`worker`]), which
/// then has little left to copy.
///
/// SQLite syncs the database file after a checkpoint only when no commit
/// came while it copied, which under steady writes is never: the pages it
/// copied stayed in the kernel until the writer's own checkpoint synced
/// them all at once, 2–9 ms at 2,000 turns/s with writes waiting. So after
/// each checkpoint that copied frames this thread syncs `database` (the
/// database file) itself (when SQLite just did, that finds nothing to
/// write), and tells the writer ([`WalLength::note_pass`]), which starts
/// the WAL over right after such a checkpoint. Syncing more often makes
/// nothing durable that was not already: the WAL holds every commit until
/// it starts over.
///
/// While commits come it looks every [`CHECKPOINT_POLL`] (every
/// [`CHECKPOINT_POLL_BEHIND`] while the writer is behind); once a look finds
/// nothing new it sleeps until the writer changes the WAL, or until what
/// is left is due after [`CHECKPOINT_IDLE`]. An idle store's thread so
/// wakes not at all, where it used to wake 100 times a second.
fn checkpoint_wal(connection: &Connection, database: &std::fs::File, wal: &WalLength, wal_limit: std::ffi::c_int) {
    // Frames of the current WAL known to be copied; the length last seen and
    // when it last changed; frames written in the current window, and
    // whether the last window's writes were fast.
    let (mut copied, mut seen, mut changed) = (0, 0, Instant::now());
    let (mut window, mut written, mut fast) = (Instant::now(), 0, false);
    // The writer's count of gathered commits when the last pause began,
    // and when that was.
    let (mut gathered, mut counted) = (wal.gathered(), Instant::now());
    let mut pause = Pause::UntilWritten(None);
    loop {
        match pause {
            Pause::Poll => {
                // Over the last pause and look.
                let now = wal.gathered();
                let behind = writer_behind(now.wrapping_sub(gathered), counted.elapsed());
                (gathered, counted) = (now, Instant::now());
                std::thread::sleep(if behind { CHECKPOINT_POLL_BEHIND } else { CHECKPOINT_POLL });
            }
            Pause::UntilWritten(timeout) => {
                wal.wait_for_change(seen, timeout);
                (gathered, counted) = (wal.gathered(), Instant::now());
            }
        }
        if wal.is_closed() {
            break;
        }
        let frames = wal.frames();
        let quiet = frames == seen;
        if !quiet {
            // A shorter WAL started over, with `frames` new ones.
            written += if frames > seen { frames - seen } else { frames };
            (seen, changed) = (frames, Instant::now());
        }
        if window.elapsed() >= CHECKPOINT_WINDOW {
            (fast, written, window) = (written >= CHECKPOINT_FAST, 0, Instant::now());
        }
        if frames < copied {
            copied = 0;
        }
        let waiting = frames - copied;
        let due = waiting >= CHECKPOINT_FRAMES
            || waiting > 0 && (fast || frames > wal_limit - CHECKPOINT_FRAMES || changed.elapsed() >= CHECKPOINT_IDLE);
        if due {
            // (busy, frames in the WAL, frames copied)
            match connection.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| row.get::<_, std::ffi::c_int>(2)) {
                Ok(done) if done > copied => {
                    copied = done;
                    match database.sync_data() {
                        Ok(()) => wal.note_pass(),
                        Err(error) => tracing::warn!(%error, "syncing the SQLite database file failed"),
                    }
                }
                Ok(done) => copied = done.max(0),
                Err(error) => tracing::warn!(%error, "checkpointing the SQLite write-ahead log failed"),
            }
        }
        let left = frames - copied;
        pause = if !quiet || (due && left > 0) {
            // Writes are coming, or a reader kept frames from this copy.
            Pause::Poll
        } else if left == 0 {
            Pause::UntilWritten(None)
        } else {
            Pause::UntilWritten(Some(CHECKPOINT_IDLE.saturating_sub(changed.elapsed())))
        };
    }
}

/// How the checkpointing thread waits before its next look.
#[derive(Clone, Copy)]
enum Pause {
    Poll,
    /// Until the WAL's length changes, or the time passes.
    UntilWritten(Option<Duration>),
}

const NODE_INSERT: &str =
    concat!("INSERT INTO messages (", node_columns!(), ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)");

/// The same insert, but an existing node with the id is updated in place
/// (its identity and place in the tree stay as they were).
const NODE_UPSERT: &str = concat!(
    "INSERT INTO messages (",
    node_columns!(),
    ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ",
    node_upsert_conflict!()
);

fn insert_node(connection: &Session<'_, '_>, statement: &'static str, node: &Node) -> StoreResult<()> {
    let columns = NodeColumns::new(node)?;
    connection.cached(statement)?.execute(params![
        node.conversation_id,
        node.id,
        node.parent_id,
        node.message.role.as_str(),
        node.message.content,
        columns.parts,
        columns.tool_calls,
        node.message.tool_call_id,
        node.message.tool_name,
        columns.tool_status,
        node.model,
        node.provider,
        node.turn_id,
        node.copied_from,
        node.status.as_str(),
        node.created_at,
    ])?;
    Ok(())
}

// The statements every turn runs on the writer. None of them may make
// SQLite build a temporary b-tree at each run (`RETURNING`, or a CHECK with
// a constant IN list of more than two values, does): a test checks their
// plans.
const EVENT_INSERT: &str = "INSERT INTO events (conversation_id, seq, last_seq, body) VALUES (?, ?, ?, ?)";
/// The first stored run of a conversation that ends at or after a number:
/// the only one a new run starting there could overlap.
const EVENT_OVERLAP: &str =
    "SELECT seq FROM events WHERE conversation_id = ? AND last_seq >= ? ORDER BY last_seq LIMIT 1";
/// A conversation's last event number (0 when none).
const EVENT_LAST: &str = "SELECT COALESCE(MAX(last_seq), 0) FROM events WHERE conversation_id = ?";
const HEAD_MOVE: &str =
    "UPDATE conversations SET head_id = ?, head_version = head_version + 1, updated_at = ? WHERE id = ?";
const CALL_INSERT: &str = concat!(
    "INSERT INTO api_calls (",
    api_call_columns!(),
    ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
);
const BALANCE_CHARGE: &str = "UPDATE users SET balance_credits = balance_credits - ? WHERE id = ?";
const LEDGER_INSERT: &str = concat!("INSERT INTO cost_ledger (", ledger_columns!(), ") VALUES (?, ?, ?, ?, ?, ?)");
const TURN_INSERT: &str = concat!(
    "INSERT INTO turns (",
    turn_columns!(),
    ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
);
const TURN_UPDATE: &str = "UPDATE turns SET status = ?, model = ?, iterations = ?, input_tokens = ?, \
     output_tokens = ?, thinking_tokens = ?, cached_tokens = ?, cache_write_tokens = ?, \
     cost_micro_usd = ?, reply_message_id = ?, error_code = ?, error_message = ?, \
     started_at = ?, finished_at = ?, pending_messages = ? WHERE conversation_id = ? AND id = ?";

/// Inserts events a run to a row (see [`packed`]), each row's statement
/// executed on its own.
///
/// Not one multi-row `INSERT ... VALUES (...), (...)`: SQLite runs a
/// statement that writes several rows and may fail half-way in a
/// statement transaction, copying every page it first touches into an
/// in-memory journal (1 KiB chunks, a `malloc` each) so that it can undo
/// the statement alone. Here that is never needed (a failed write is
/// rolled back whole, by its transaction or savepoint), and it cost more
/// than the statements it saved: 1,117 k → 1,085 k instructions per JSON
/// turn (`bench/profile.sh`), level at 1,000 turns/s.
///
/// A number already stored in the conversation is a conflict (the run
/// overlaps the first row ending at or after its start), and the caller's
/// transaction undoes the batch. A run whose conversation is gone fails
/// alone (SQLite undoes a failed statement by itself) and is skipped: see
/// [`Store::append_events`].
fn insert_events(connection: &Session<'_, '_>, events: &[Event]) -> StoreResult<()> {
    let mut overlap = connection.cached(EVENT_OVERLAP)?;
    let mut insert = connection.cached(EVENT_INSERT)?;
    let mut body = String::new();
    for run in packed::Runs::new(events) {
        let (first, last) = (run[0], run[run.len() - 1]);
        let taken: Option<i64> =
            overlap.query_row(params![&*first.conversation_id, first.seq], |row| row.get(0)).optional()?;
        if taken.is_some_and(|seq| seq <= last.seq) {
            return Err(StoreError::Conflict(format!(
                "event numbers {}..={} of conversation {} are already used",
                first.seq, last.seq, first.conversation_id
            )));
        }
        packed::encode(&run, &mut body);
        match insert.execute(params![&*first.conversation_id, first.seq, last.seq, body]) {
            Ok(_) => {}
            Err(rusqlite::Error::SqliteFailure(error, _))
                if error.extended_code == ffi::SQLITE_CONSTRAINT_FOREIGNKEY => {}
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

/// Sets a conversation's head to `head_id`, returning the new head version;
/// `NotFound` when the conversation does not exist.
///
/// The hot writes here read back what they changed with a second statement
/// rather than `RETURNING`: SQLite gathers a `RETURNING` statement's rows
/// in a temporary b-tree made and dropped at every run, which costs more
/// than looking the row up again inside the same transaction (nothing else
/// writes between the two; there is one writer).
fn advance_head(
    connection: &Session<'_, '_>,
    conversation_id: &str,
    head_id: Option<&str>,
    updated_at: Millis,
) -> StoreResult<i64> {
    changed_one(connection.cached(HEAD_MOVE)?.execute(params![head_id, updated_at, conversation_id])?)?;
    head_version(connection, conversation_id)
}

/// The head version of a conversation; `NotFound` when it does not exist.
fn head_version(connection: &Session<'_, '_>, conversation_id: &str) -> StoreResult<i64> {
    let version = connection
        .cached("SELECT head_version FROM conversations WHERE id = ?")?
        .query_row([conversation_id], |row| row.get(0))
        .optional()?;
    version.ok_or(StoreError::NotFound)
}

/// Stores a model call, its message and its charge, inside the caller's
/// transaction (shared by `record_call`, `settle_reservation` and
/// `finish_turn`).
fn charge_call(connection: &Session<'_, '_>, call: &ApiCall, message: Option<&Node>) -> StoreResult<LedgerEntry> {
    if let Some(node) = message {
        insert_node(connection, NODE_UPSERT, node)?;
    }
    connection.cached(CALL_INSERT)?.execute(params![
        call.id,
        call.turn_id,
        call.conversation_id,
        call.user_id,
        call.kind,
        call.provider,
        call.model,
        to_i64(call.usage.input_tokens),
        to_i64(call.usage.output_tokens),
        to_i64(call.usage.thinking_tokens),
        to_i64(call.usage.cached_tokens),
        to_i64(call.usage.cache_write_tokens),
        to_i64(call.latency_ms),
        call.ttft_ms.map(to_i64),
        call.status,
        call.error_code,
        to_i64(call.cost_micro_usd),
        call.created_at,
    ])?;
    let credits = to_i64(call.cost_micro_usd);
    // The deduction reads and writes the balance in one statement, inside
    // the writer's transaction: concurrent charges add up, none is lost. A
    // NULL (unlimited) balance stays NULL. (Read back without `RETURNING`,
    // see `advance_head`.)
    changed_one(connection.cached(BALANCE_CHARGE)?.execute(params![credits, call.user_id])?)?;
    let balance_after: Option<i64> = connection
        .cached("SELECT balance_credits FROM users WHERE id = ?")?
        .query_row([&call.user_id], |row| row.get(0))?;
    let entry = LedgerEntry::for_call(call, balance_after);
    connection.cached(LEDGER_INSERT)?.execute(params![
        entry.id,
        entry.user_id,
        entry.api_call_id,
        entry.credits,
        entry.balance_after,
        entry.created_at
    ])?;
    Ok(entry)
}

/// Holds a reservation's credits, inside the caller's transaction.
fn reserve(connection: &Session<'_, '_>, reservation: &Reservation) -> StoreResult<ReserveOutcome> {
    // The check and the hold are one statement, so no other
    // reservation or charge can slip between them. (Read back without
    // `RETURNING`, see `advance_head`.)
    let held = connection
        .cached(
            "UPDATE users SET reserved_credits = reserved_credits + ? \
             WHERE id = ? AND (balance_credits IS NULL OR balance_credits - reserved_credits >= ?)",
        )?
        .execute(params![reservation.credits, reservation.user_id, reservation.credits])?;
    let available = available_credits(connection, &reservation.user_id)?;
    if held == 0 {
        return Ok(ReserveOutcome::Insufficient { available: available.unwrap_or(0) });
    }
    connection
        .cached(
            "INSERT INTO credit_reservations (id, user_id, credits, created_at, expires_at) \
             VALUES (?, ?, ?, ?, ?)",
        )?
        .execute(params![
            reservation.id,
            reservation.user_id,
            reservation.credits,
            reservation.created_at,
            reservation.expires_at,
        ])?;
    Ok(ReserveOutcome::Reserved { available_after: available })
}

/// Gives a reservation's credits back, inside the caller's transaction.
/// Returns whether the reservation still existed.
fn release(connection: &Session<'_, '_>, reservation_id: &str) -> StoreResult<bool> {
    // Read, then deleted (rather than `DELETE ... RETURNING`, see
    // `advance_head`).
    let released: Option<(String, i64)> = connection
        .cached("SELECT user_id, credits FROM credit_reservations WHERE id = ?")?
        .query_row([reservation_id], |row| Ok((row.get(0)?, row.get(1)?)))
        .optional()?;
    let Some((user_id, credits)) = released else {
        return Ok(false);
    };
    connection.cached("DELETE FROM credit_reservations WHERE id = ?")?.execute([reservation_id])?;
    connection
        .cached("UPDATE users SET reserved_credits = MAX(reserved_credits - ?, 0) WHERE id = ?")?
        .execute(params![credits, user_id])?;
    Ok(true)
}

fn insert_turn(connection: &Session<'_, '_>, turn: &Turn) -> StoreResult<()> {
    connection.cached(TURN_INSERT)?.execute(params![
        turn.id,
        turn.conversation_id,
        turn.user_id,
        turn.user_message_id,
        turn.status.as_str(),
        turn.model,
        i64::from(turn.iterations),
        to_i64(turn.usage.input_tokens),
        to_i64(turn.usage.output_tokens),
        to_i64(turn.usage.thinking_tokens),
        to_i64(turn.usage.cached_tokens),
        to_i64(turn.usage.cache_write_tokens),
        to_i64(turn.cost_micro_usd),
        turn.reply_message_id,
        turn.error_code,
        turn.error_message,
        turn.created_at,
        turn.started_at,
        turn.finished_at,
        codec::pending_json(turn),
    ])?;
    Ok(())
}

/// Writes a turn's status, totals, error and times.
fn update_turn(connection: &Session<'_, '_>, turn: &Turn) -> StoreResult<()> {
    changed_one(connection.cached(TURN_UPDATE)?.execute(params![
        turn.status.as_str(),
        turn.model,
        i64::from(turn.iterations),
        to_i64(turn.usage.input_tokens),
        to_i64(turn.usage.output_tokens),
        to_i64(turn.usage.thinking_tokens),
        to_i64(turn.usage.cached_tokens),
        to_i64(turn.usage.cache_write_tokens),
        to_i64(turn.cost_micro_usd),
        turn.reply_message_id,
        turn.error_code,
        turn.error_message,
        turn.started_at,
        turn.finished_at,
        codec::pending_json(turn),
        turn.conversation_id,
        turn.id,
    ])?)
}

/// The first row a statement returns, decoded; `None` when it returns none.
fn query_one<T>(
    connection: &Session<'_, '_>,
    sql: &'static str,
    parameters: impl rusqlite::Params,
    decode: impl Fn(&SqliteRow<'_, '_>) -> StoreResult<T>,
) -> StoreResult<Option<T>> {
    let mut statement = connection.cached(sql)?;
    let mut rows = statement.query(parameters)?;
    rows.next()?.map(|row| decode(&SqliteRow::new(row))).transpose()
}

/// Every row a statement returns, decoded.
fn query_all<T>(
    connection: &Session<'_, '_>,
    sql: &'static str,
    parameters: impl rusqlite::Params,
    decode: impl Fn(&SqliteRow<'_, '_>) -> StoreResult<T>,
) -> StoreResult<Vec<T>> {
    let mut statement = connection.cached(sql)?;
    let mut rows = statement.query(parameters)?;
    let (mut decoded, places) = (Vec::new(), ColumnPlaces::default());
    while let Some(row) = rows.next()? {
        decoded.push(decode(&SqliteRow::with_places(row, Some(&places)))?);
    }
    Ok(decoded)
}

/// The statement's rows changed, as a `NotFound` when none.
fn changed_one(changed: usize) -> StoreResult<()> {
    if changed == 0 { Err(StoreError::NotFound) } else { Ok(()) }
}

#[async_trait]
impl Store for SqliteStore {
    fn sole_writer(&self) -> bool {
        self.sole_writer
    }

    async fn create_user(&self, user: &User) -> StoreResult<()> {
        let user = user.clone();
        self.write(move |connection| {
            connection
                .cached("INSERT INTO users (id, name, is_admin, balance_credits, created_at) VALUES (?, ?, ?, ?, ?)")?
                .execute(params![user.id, user.name, user.is_admin, user.balance_credits, user.created_at])?;
            Ok(())
        })
        .await
    }

    async fn user_by_name(&self, name: &str) -> StoreResult<Option<User>> {
        let name = name.to_string();
        self.read_point(move |connection| {
            query_one(connection, concat!("SELECT ", user_columns!(), " FROM users WHERE name = ?"), [&name], |row| {
                codec::user_from_row(row)
            })
        })
        .await
    }

    async fn user(&self, user_id: &str) -> StoreResult<Option<User>> {
        let user_id = user_id.to_string();
        self.read_point(move |connection| {
            query_one(connection, concat!("SELECT ", user_columns!(), " FROM users WHERE id = ?"), [&user_id], |row| {
                codec::user_from_row(row)
            })
        })
        .await
    }

    async fn count_users(&self) -> StoreResult<u64> {
        self.read(|connection| {
            let count: i64 = connection.cached("SELECT COUNT(*) FROM users")?.query_row([], |row| row.get(0))?;
            Ok(codec::to_u64(count))
        })
        .await
    }

    async fn create_api_key(&self, key: &ApiKey) -> StoreResult<()> {
        let key = key.clone();
        self.write(move |connection| {
            connection
                .cached("INSERT INTO api_keys (id, user_id, key_hash, prefix, created_at) VALUES (?, ?, ?, ?, ?)")?
                .execute(params![key.id, key.user_id, key.key_hash, key.prefix, key.created_at])?;
            Ok(())
        })
        .await
    }

    async fn user_by_key_hash(&self, key_hash: &str) -> StoreResult<Option<User>> {
        let key_hash = key_hash.to_string();
        self.read_point(move |connection| {
            query_one(
                connection,
                "SELECT users.id, users.name, users.is_admin, users.balance_credits, \
                 users.created_at FROM api_keys JOIN users ON users.id = api_keys.user_id \
                 WHERE api_keys.key_hash = ? AND api_keys.revoked_at IS NULL",
                [&key_hash],
                |row| codec::user_from_row(row),
            )
        })
        .await
    }

    async fn create_conversation(&self, conversation: &Conversation) -> StoreResult<()> {
        let conversation = conversation.clone();
        self.write(move |connection| {
            connection
                .cached(concat!(
                    "INSERT INTO conversations (",
                    conversation_columns!(),
                    ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                ))?
                .execute(params![
                    conversation.id,
                    conversation.owner_id,
                    conversation.title,
                    conversation.system_prompt,
                    conversation.preset_id,
                    conversation.model,
                    conversation.head_id,
                    conversation.head_version,
                    conversation.summary,
                    conversation.created_at,
                    conversation.updated_at,
                ])?;
            Ok(())
        })
        .await
    }

    async fn conversation(&self, owner_id: &str, conversation_id: &str) -> StoreResult<Option<Conversation>> {
        let (owner_id, conversation_id) = (owner_id.to_string(), conversation_id.to_string());
        self.read_point(move |connection| {
            query_one(
                connection,
                concat!("SELECT ", conversation_columns!(), " FROM conversations WHERE owner_id = ? AND id = ?"),
                [&owner_id, &conversation_id],
                |row| codec::conversation_from_row(row),
            )
        })
        .await
    }

    async fn conversation_for_turn(
        &self,
        owner_id: &str,
        conversation_id: &str,
    ) -> StoreResult<Option<(Conversation, Option<i64>)>> {
        let (owner_id, conversation_id) = (owner_id.to_string(), conversation_id.to_string());
        self.read_point(move |connection| {
            // The owner's row exists while the conversation does (the
            // foreign key cascades), so the subquery always finds it.
            query_one(
                connection,
                concat!(
                    "SELECT ",
                    conversation_columns!(),
                    ", (SELECT balance_credits - reserved_credits FROM users WHERE users.id = ?1) \
                     AS available_credits FROM conversations WHERE owner_id = ?1 AND id = ?2"
                ),
                [&owner_id, &conversation_id],
                |row| {
                    Ok((
                        codec::conversation_from_row(row)?,
                        codec::RowSource::optional_integer(row, "available_credits")?,
                    ))
                },
            )
        })
        .await
    }

    async fn list_conversations(
        &self,
        owner_id: &str,
        cursor: Option<&ConversationCursor>,
        limit: u32,
    ) -> StoreResult<Vec<Conversation>> {
        let owner_id = owner_id.to_string();
        let cursor = cursor.cloned();
        // Keyset pagination on the (owner_id, created_at DESC, id DESC)
        // index: a page costs the same however deep it is.
        self.read(move |connection| match &cursor {
            None => query_all(
                connection,
                concat!(
                    "SELECT ",
                    conversation_columns!(),
                    " FROM conversations WHERE owner_id = ? ORDER BY created_at DESC, id DESC LIMIT ?"
                ),
                params![owner_id, i64::from(limit)],
                |row| codec::conversation_from_row(row),
            ),
            Some(cursor) => query_all(
                connection,
                concat!(
                    "SELECT ",
                    conversation_columns!(),
                    " FROM conversations WHERE owner_id = ? AND (created_at, id) < (?, ?) \
                     ORDER BY created_at DESC, id DESC LIMIT ?"
                ),
                params![owner_id, cursor.created_at, cursor.id, i64::from(limit)],
                |row| codec::conversation_from_row(row),
            ),
        })
        .await
    }

    async fn update_conversation(
        &self,
        owner_id: &str,
        conversation_id: &str,
        update: &ConversationUpdate,
    ) -> StoreResult<Conversation> {
        let (owner_id, conversation_id, update) = (owner_id.to_string(), conversation_id.to_string(), update.clone());
        self.write(move |connection| {
            query_one(
                connection,
                concat!(
                    "UPDATE conversations SET title = COALESCE(?, title), \
                     system_prompt = COALESCE(?, system_prompt), model = COALESCE(?, model), \
                     updated_at = ? WHERE owner_id = ? AND id = ? RETURNING ",
                    conversation_columns!()
                ),
                params![update.title, update.system_prompt, update.model, update.updated_at, owner_id, conversation_id],
                |row| codec::conversation_from_row(row),
            )?
            .ok_or(StoreError::NotFound)
        })
        .await
    }

    async fn delete_conversation(&self, owner_id: &str, conversation_id: &str) -> StoreResult<()> {
        let (owner_id, conversation_id) = (owner_id.to_string(), conversation_id.to_string());
        // Messages, turns and events go with it (ON DELETE CASCADE); api
        // calls and the ledger stay, as billing history.
        self.write(move |connection| {
            changed_one(
                connection
                    .cached("DELETE FROM conversations WHERE owner_id = ? AND id = ?")?
                    .execute([&owner_id, &conversation_id])?,
            )
        })
        .await
    }

    async fn set_head(
        &self,
        conversation_id: &str,
        head_id: Option<&str>,
        expected_version: Option<i64>,
        updated_at: Millis,
    ) -> StoreResult<i64> {
        let (conversation_id, head_id) = (conversation_id.to_string(), head_id.map(str::to_string));
        self.write(move |connection| {
            let current = head_version(connection, &conversation_id)?;
            if let Some(expected) = expected_version
                && expected != current
            {
                return Err(StoreError::HeadVersionMismatch { current });
            }
            if let Some(head_id) = &head_id {
                let exists = connection
                    .cached("SELECT 1 FROM messages WHERE conversation_id = ? AND id = ?")?
                    .exists([&conversation_id, head_id])?;
                if !exists {
                    return Err(StoreError::NotFound);
                }
            }
            advance_head(connection, &conversation_id, head_id.as_deref(), updated_at)
        })
        .await
    }

    async fn append_messages(&self, nodes: &[Node], updated_at: Millis) -> StoreResult<i64> {
        codec::batch_target(nodes)?;
        let nodes = nodes.to_vec();
        self.write(move |connection| {
            let (conversation_id, last_id) = codec::batch_target(&nodes)?;
            for node in &nodes {
                insert_node(connection, NODE_INSERT, node)?;
            }
            advance_head(connection, conversation_id, Some(last_id), updated_at)
        })
        .await
    }

    async fn messages(&self, conversation_id: &str) -> StoreResult<Vec<Node>> {
        let conversation_id = conversation_id.to_string();
        self.read(move |connection| {
            query_all(
                connection,
                concat!("SELECT ", node_columns!(), " FROM messages WHERE conversation_id = ? ORDER BY seq"),
                [&conversation_id],
                |row| codec::node_from_row(row),
            )
        })
        .await
    }

    async fn message(&self, conversation_id: &str, message_id: &str) -> StoreResult<Option<Node>> {
        let (conversation_id, message_id) = (conversation_id.to_string(), message_id.to_string());
        self.read_point(move |connection| {
            query_one(
                connection,
                concat!("SELECT ", node_columns!(), " FROM messages WHERE conversation_id = ? AND id = ?"),
                [&conversation_id, &message_id],
                |row| codec::node_from_row(row),
            )
        })
        .await
    }

    async fn update_message(&self, node: &Node) -> StoreResult<()> {
        let node = node.clone();
        self.write(move |connection| {
            let columns = NodeColumns::new(&node)?;
            changed_one(
                connection
                    .cached(
                        "UPDATE messages SET content = ?, parts = ?, tool_calls = ?, tool_call_id = ?, \
                         tool_name = ?, tool_status = ?, model = ?, provider = ?, status = ? \
                         WHERE conversation_id = ? AND id = ?",
                    )?
                    .execute(params![
                        node.message.content,
                        columns.parts,
                        columns.tool_calls,
                        node.message.tool_call_id,
                        node.message.tool_name,
                        columns.tool_status,
                        node.model,
                        node.provider,
                        node.status.as_str(),
                        node.conversation_id,
                        node.id,
                    ])?,
            )
        })
        .await
    }

    async fn insert_turn(&self, turn: &Turn) -> StoreResult<()> {
        let turn = turn.clone();
        self.write(move |connection| insert_turn(connection, &turn)).await
    }

    async fn update_turn(&self, turn: &Turn) -> StoreResult<()> {
        let turn = turn.clone();
        self.write(move |connection| update_turn(connection, &turn)).await
    }

    async fn start_turn(
        &self,
        turn: &Arc<Turn>,
        nodes: &[Arc<Node>],
        queued_row: bool,
        updated_at: Millis,
        reservation: Option<&Reservation>,
        lease: Option<(&str, Millis)>,
    ) -> StoreResult<TurnStarted> {
        let (turn, nodes, reservation) = (Arc::clone(turn), nodes.to_vec(), reservation.cloned());
        let lease = lease.map(|(owner, expires_at)| (owner.to_string(), expires_at));
        self.write(move |connection| {
            let updated = if queued_row { update_turn(connection, &turn) } else { Err(StoreError::NotFound) };
            match updated {
                Ok(()) => {}
                Err(StoreError::NotFound) => insert_turn(connection, &turn)?,
                Err(error) => return Err(error),
            }
            if let Some((owner, expires_at)) = &lease {
                connection
                    .cached("UPDATE turns SET lease_owner = ?1, lease_expires_at = ?2 WHERE id = ?3")?
                    .execute(params![owner, expires_at, turn.id])?;
            }
            let head_version = if nodes.is_empty() {
                head_version(connection, &turn.conversation_id)?
            } else {
                let (conversation_id, last_id) = codec::batch_target(&nodes)?;
                for node in &nodes {
                    insert_node(connection, NODE_INSERT, node)?;
                }
                advance_head(connection, conversation_id, Some(last_id), updated_at)?
            };
            let reserved = reservation.as_ref().map(|reservation| reserve(connection, reservation)).transpose()?;
            Ok(TurnStarted { head_version, reserved })
        })
        .await
    }

    async fn turn(&self, conversation_id: &str, turn_id: &str) -> StoreResult<Option<Turn>> {
        let (conversation_id, turn_id) = (conversation_id.to_string(), turn_id.to_string());
        self.read_point(move |connection| {
            query_one(
                connection,
                concat!("SELECT ", turn_columns!(), " FROM turns WHERE conversation_id = ? AND id = ?"),
                [&conversation_id, &turn_id],
                |row| codec::turn_from_row(row),
            )
        })
        .await
    }

    async fn turns_with_status(&self, statuses: &[TurnStatus]) -> StoreResult<Vec<Turn>> {
        // SQLite has no array parameters: the statuses travel as one JSON
        // array, unpacked by json_each, so the statement stays static.
        let names: Vec<&str> = statuses.iter().map(|status| status.as_str()).collect();
        let names = arbor_core::json::to_string(&names).map_err(|error| StoreError::Database(error.to_string()))?;
        // Live turns are found through the partial indexes of running and
        // of queued turns, which SQLite uses only for a query that repeats
        // their conditions.
        let sql = if statuses.iter().all(|status| !status.is_finished()) {
            LIVE_TURNS
        } else {
            concat!(
                "SELECT ",
                turn_columns!(),
                " FROM turns WHERE status IN (SELECT value FROM json_each(?)) ORDER BY created_at, id"
            )
        };
        self.read(move |connection| query_all(connection, sql, [&names], |row| codec::turn_from_row(row))).await
    }

    async fn record_call(&self, call: &ApiCall, message: Option<&Node>) -> StoreResult<LedgerEntry> {
        let (call, message) = (call.clone(), message.cloned());
        self.write(move |connection| charge_call(connection, &call, message.as_ref())).await
    }

    async fn finish_turn(
        &self,
        turn: &Arc<Turn>,
        call: ApiCall,
        reply: Option<&Arc<Node>>,
        reservation_id: Option<&str>,
        updated_at: Millis,
    ) -> StoreResult<(LedgerEntry, Option<i64>)> {
        let notice = Notice::TurnFinished { conversation_id: turn.conversation_id.clone(), turn_id: turn.id.clone() };
        let (turn, reply) = (Arc::clone(turn), reply.cloned());
        let reservation_id = reservation_id.map(str::to_string);
        let finished = self
            .write(move |connection| {
                if let Some(reservation_id) = &reservation_id {
                    release(connection, reservation_id)?;
                }
                let entry = charge_call(connection, &call, reply.as_deref())?;
                let head_version = match &reply {
                    Some(node) => Some(advance_head(connection, &node.conversation_id, Some(&node.id), updated_at)?),
                    None => None,
                };
                update_turn(connection, &turn)?;
                Ok((entry, head_version))
            })
            .await?;
        self.notify(&notice).await?;
        Ok(finished)
    }

    async fn api_calls(&self, turn_id: &str) -> StoreResult<Vec<ApiCall>> {
        let turn_id = turn_id.to_string();
        self.read(move |connection| {
            query_all(
                connection,
                concat!("SELECT ", api_call_columns!(), " FROM api_calls WHERE turn_id = ? ORDER BY created_at, id"),
                [&turn_id],
                |row| codec::api_call_from_row(row),
            )
        })
        .await
    }

    async fn ledger(&self, user_id: &str, limit: u32) -> StoreResult<Vec<LedgerEntry>> {
        let user_id = user_id.to_string();
        self.read(move |connection| {
            query_all(
                connection,
                concat!(
                    "SELECT ",
                    ledger_columns!(),
                    " FROM cost_ledger WHERE user_id = ? ORDER BY created_at DESC, id DESC LIMIT ?"
                ),
                params![user_id, i64::from(limit)],
                |row| codec::ledger_from_row(row),
            )
        })
        .await
    }

    async fn set_balance(&self, user_id: &str, balance: Option<i64>) -> StoreResult<()> {
        let user_id = user_id.to_string();
        self.write(move |connection| {
            changed_one(
                connection
                    .cached("UPDATE users SET balance_credits = ? WHERE id = ?")?
                    .execute(params![balance, user_id])?,
            )
        })
        .await
    }

    async fn append_events(&self, events: &[Event]) -> StoreResult<()> {
        if events.is_empty() {
            return Ok(());
        }
        let events = events.to_vec();
        // Their viewers have them already and the hub keeps them until they
        // are stored, so they may wait a moment to ride in another commit.
        self.writer.write_deferred(move |connection| insert_events(connection, &events)).await
    }

    async fn append_events_numbered(&self, events: &[Event]) -> StoreResult<Vec<Event>> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let events = events.to_vec();
        // The write transaction is the lock: no other writer can number
        // events between the read of the last seq and the commit.
        self.write(move |connection| {
            let mut last_before = HashMap::new();
            let mut last = connection.cached(
                "SELECT (SELECT COALESCE(MAX(last_seq), 0) FROM events WHERE conversation_id = ?1) \
                 FROM conversations WHERE id = ?1",
            )?;
            for conversation_id in codec::events_by_conversation(&events).0 {
                if let Some(seq) = last.query_row([conversation_id], |row| row.get(0)).optional()? {
                    last_before.insert(conversation_id.to_string(), seq);
                }
            }
            let numbered = codec::number_events(&events, last_before);
            insert_events(connection, &numbered)?;
            Ok(numbered)
        })
        .await
    }

    async fn events_after(&self, conversation_id: &str, after: i64, limit: u32) -> StoreResult<Vec<Event>> {
        let conversation_id: Arc<str> = Arc::from(conversation_id);
        self.read(move |connection| {
            let mut statement = connection.cached(
                "SELECT seq, last_seq, body FROM events WHERE conversation_id = ? AND last_seq > ? ORDER BY last_seq",
            )?;
            let mut rows = statement.query(params![&*conversation_id, after])?;
            let (limit, mut events) = (limit as usize, Vec::new());
            while events.len() < limit {
                let Some(row) = rows.next()? else { break };
                let body = row.get_ref(2)?.as_str().map_err(|error| StoreError::Database(error.to_string()))?;
                packed::decode(&conversation_id, row.get(0)?, row.get(1)?, body, after, limit, &mut events)?;
            }
            Ok(events)
        })
        .await
    }

    async fn last_event_seq(&self, conversation_id: &str) -> StoreResult<i64> {
        let conversation_id = conversation_id.to_string();
        self.read_point(move |connection| {
            Ok(connection.cached(EVENT_LAST)?.query_row([&conversation_id], |row| row.get(0))?)
        })
        .await
    }

    async fn notify(&self, notice: &Notice) -> StoreResult<()> {
        // No listener is not an error: nobody is waiting for this wake-up.
        let _ = self.notices.send(notice.clone());
        Ok(())
    }

    async fn listen(&self) -> StoreResult<broadcast::Receiver<Notice>> {
        Ok(self.notices.subscribe())
    }

    async fn reserve_credits(&self, reservation: &Reservation) -> StoreResult<ReserveOutcome> {
        let reservation = reservation.clone();
        self.write(move |connection| reserve(connection, &reservation)).await
    }

    async fn settle_reservation(
        &self,
        reservation_id: &str,
        call: &ApiCall,
        message: Option<&Node>,
    ) -> StoreResult<LedgerEntry> {
        let (reservation_id, call, message) = (reservation_id.to_string(), call.clone(), message.cloned());
        self.write(move |connection| {
            release(connection, &reservation_id)?;
            charge_call(connection, &call, message.as_ref())
        })
        .await
    }

    async fn release_reservation(&self, reservation_id: &str) -> StoreResult<bool> {
        let reservation_id = reservation_id.to_string();
        self.write(move |connection| release(connection, &reservation_id)).await
    }

    async fn release_expired_reservations(&self, now: Millis) -> StoreResult<u64> {
        self.write(move |connection| {
            let expired = connection
                .cached("SELECT id FROM credit_reservations WHERE expires_at <= ?")?
                .query_map([now], |row| row.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()?;
            for id in &expired {
                release(connection, id)?;
            }
            Ok(expired.len() as u64)
        })
        .await
    }

    async fn available_credits(&self, user_id: &str) -> StoreResult<Option<i64>> {
        let user_id = user_id.to_string();
        self.read_point(move |connection| available_credits(connection, &user_id)).await
    }

    async fn renew_lease(&self, turn_id: &str, owner: &str, expires_at: Millis) -> StoreResult<bool> {
        let (turn_id, owner) = (turn_id.to_string(), owner.to_string());
        self.write(move |connection| {
            let changed = connection
                .cached(
                    "UPDATE turns SET lease_owner = ?1, lease_expires_at = ?2 \
                     WHERE id = ?3 AND status = 'running' AND (lease_owner IS NULL OR lease_owner = ?1)",
                )?
                .execute(params![owner, expires_at, turn_id])?;
            Ok(changed == 1)
        })
        .await
    }

    async fn expired_running_turns(&self, now: Millis) -> StoreResult<Vec<Turn>> {
        self.read(move |connection| query_all(connection, EXPIRED_TURNS, [now], |row| codec::turn_from_row(row))).await
    }

    async fn take_over_turn(&self, turn_id: &str, owner: &str, now: Millis, expires_at: Millis) -> StoreResult<bool> {
        let (turn_id, owner) = (turn_id.to_string(), owner.to_string());
        // The expiry is re-checked in the update itself: of several nodes
        // racing for the turn, the first one's new lease fails the others.
        self.write(move |connection| {
            let changed = connection
                .cached(
                    "UPDATE turns SET lease_owner = ?, lease_expires_at = ? \
                     WHERE id = ? AND status = 'running' AND lease_expires_at <= ?",
                )?
                .execute(params![owner, expires_at, turn_id, now])?;
            Ok(changed == 1)
        })
        .await
    }

    async fn turn_lease(&self, turn_id: &str) -> StoreResult<Option<(String, Millis)>> {
        let turn_id = turn_id.to_string();
        self.read_point(move |connection| {
            let row: Option<(Option<String>, Option<i64>)> = connection
                .cached("SELECT lease_owner, lease_expires_at FROM turns WHERE id = ?")?
                .query_row([&turn_id], |row| Ok((row.get(0)?, row.get(1)?)))
                .optional()?;
            Ok(match row {
                Some((Some(owner), Some(expires_at))) => Some((owner, expires_at)),
                _ => None,
            })
        })
        .await
    }
}

/// Turns of the statuses in a JSON array, all of them live: the running
/// ones through the unique index of running turns, the queued ones through
/// the index of queued turns. Each half names its status as the index's
/// condition does, which is how SQLite knows the index holds every row the
/// half wants.
const LIVE_TURNS: &str = concat!(
    "SELECT ",
    turn_columns!(),
    " FROM turns WHERE status = 'running' AND 'running' IN (SELECT value FROM json_each(?1)) \
     UNION ALL SELECT ",
    turn_columns!(),
    " FROM turns WHERE status = 'queued' AND 'queued' IN (SELECT value FROM json_each(?1)) \
     ORDER BY created_at, id"
);

/// Running turns whose lease has expired (see [`LIVE_TURNS`]).
const EXPIRED_TURNS: &str = concat!(
    "SELECT ",
    turn_columns!(),
    " FROM turns WHERE status = 'running' AND lease_expires_at <= ? ORDER BY created_at, id"
);

/// Credits a user may still reserve; `NotFound` for an unknown user.
fn available_credits(connection: &Session<'_, '_>, user_id: &str) -> StoreResult<Option<i64>> {
    let available: Option<Option<i64>> = connection
        .cached("SELECT balance_credits - reserved_credits FROM users WHERE id = ?")?
        .query_row([user_id], |row| row.get(0))
        .optional()?;
    available.ok_or(StoreError::NotFound)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checkpointing thread looks less often only at the rates where
    /// the core is short: the gathered commits between looks measured at
    /// 2,000 turns/s (~1.5 a look) leave it at every 20 ms, those at 3,000/s
    /// (~10 a look, ~25 a longer one) do not; and a thread that just woke
    /// from a long sleep is not behind for the few commits that woke it.
    #[test]
    fn the_writer_is_behind_only_when_commits_gather_several_times_a_look() {
        let ms = Duration::from_millis;
        assert!(!writer_behind(0, ms(21)));
        assert!(!writer_behind(0, Duration::ZERO));
        assert!(!writer_behind(1, ms(21)), "2,000 turns/s");
        assert!(!writer_behind(3, ms(51)), "2,000 turns/s, after a longer look");
        assert!(writer_behind(10, ms(21)), "3,000 turns/s");
        assert!(writer_behind(25, ms(52)), "3,000 turns/s, after a longer look");
        assert!(!writer_behind(4, ms(2_000)), "after a long sleep");
    }

    #[test]
    fn urls_name_a_file_or_memory() {
        let file = |path: &str, durability| Some(Location::File(PathBuf::from(path), durability, Locking::Shared));
        assert_eq!(parse_url("sqlite://./data/arbor.db").ok(), file("./data/arbor.db", Durability::Full));
        assert_eq!(parse_url("sqlite:///tmp/a.db?mode=rwc").ok(), file("/tmp/a.db", Durability::Full));
        assert_eq!(parse_url("sqlite:///tmp/a.db?mode=rwc&synchronous=FULL").ok(), file("/tmp/a.db", Durability::Full));
        assert_eq!(parse_url("sqlite:///tmp/a.db?synchronous=normal").ok(), file("/tmp/a.db", Durability::Normal));
        let bad = parse_url("sqlite:///tmp/a.db?synchronous=off").expect_err("refused");
        assert!(bad.to_string().contains("synchronous=normal or synchronous=full"), "{bad}");
        assert_eq!(
            parse_url("sqlite:///tmp/a.db?locking=EXCLUSIVE&synchronous=normal").ok(),
            Some(Location::File(PathBuf::from("/tmp/a.db"), Durability::Normal, Locking::Exclusive))
        );
        assert_eq!(parse_url("sqlite:///tmp/a.db?locking=shared").ok(), file("/tmp/a.db", Durability::Full));
        let bad = parse_url("sqlite:///tmp/a.db?locking=none").expect_err("refused");
        assert!(bad.to_string().contains("locking=shared or locking=exclusive"), "{bad}");
        assert_eq!(parse_url("sqlite::memory:").ok(), Some(Location::Memory));
        assert!(parse_url("sqlite://").is_err());
        assert!(parse_url("postgres://x").is_err());
    }

    /// Runs `sql` (one row, one column) on the writer, every reader thread
    /// and a point-read connection (all opened alike).
    async fn on_every_connection(store: &SqliteStore, sql: &'static str) -> Vec<i64> {
        let mut values = vec![store.write(move |c| Ok(c.query_row(sql, [], |row| row.get(0))?)).await.unwrap()];
        // Readers are interchangeable; enough calls reach each of them.
        for _ in 0..16 {
            values.push(store.read(move |c| Ok(c.query_row(sql, [], |row| row.get(0))?)).await.unwrap());
        }
        values.push(store.read_point(move |c| Ok(c.query_row(sql, [], |row| row.get(0))?)).await.unwrap());
        values
    }

    #[tokio::test]
    async fn point_reads_do_not_wait_behind_long_reads() {
        let folder = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(&format!("sqlite://{}", folder.path().join("a.db").display())).await.unwrap();
        store.create_user(&owner()).await.expect("user");
        // Every reader thread busy with a slow read (a big tree, a listing).
        let slow: Vec<_> = (0..8)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move {
                    store
                        .read(|_| {
                            std::thread::sleep(Duration::from_millis(400));
                            Ok(())
                        })
                        .await
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = std::time::Instant::now();
        assert_eq!(store.user(&owner().id).await.expect("reads"), Some(owner()));
        assert!(started.elapsed() < Duration::from_millis(200), "answered in {:?}", started.elapsed());
        for read in slow {
            read.await.expect("joins").expect("reads");
        }
    }

    #[tokio::test]
    async fn files_open_in_wal_mode_with_foreign_keys() {
        let folder = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", folder.path().join("a.db").display());
        let store = SqliteStore::open(&url).await.expect("opens");
        let modes = store
            .read(|c| Ok(c.query_row("PRAGMA journal_mode", [], |row| row.get::<_, String>(0))?))
            .await
            .expect("journal mode");
        assert_eq!(modes, "wal");
        assert!(on_every_connection(&store, "PRAGMA foreign_keys").await.iter().all(|&on| on == 1));
        // A waited-on write commits with FULL (2); readers stay NORMAL (1).
        let levels = on_every_connection(&store, "PRAGMA synchronous").await;
        assert_eq!(levels[0], 2);
        assert!(levels[1..].iter().all(|&level| level == 1), "{levels:?}");
        // Deferred writes alone (events) commit without the fsync.
        let deferred =
            store.writer.write_deferred(|c| Ok(c.query_row("PRAGMA synchronous", [], |row| row.get::<_, i64>(0))?));
        assert_eq!(deferred.await.expect("deferred"), 1);
    }

    /// `.cargo/config.toml` builds the bundled SQLite without the two
    /// features that take a process-wide mutex in every malloc and every
    /// page-cache fetch (bench/analysis.md); a build that lost those flags
    /// would still work, only slower, so this is where it shows. The options
    /// are the linked library's, so any connection reads them.
    #[test]
    fn sqlite_is_built_without_its_global_mutexes() {
        let connection = Connection::open_in_memory().expect("opens");
        let mut statement = connection.prepare("SELECT compile_options FROM pragma_compile_options").expect("prepares");
        let options: Vec<String> = statement
            .query_map([], |row| row.get(0))
            .expect("compile options")
            .collect::<Result<_, _>>()
            .expect("compile options");
        assert!(options.iter().any(|option| option == "DEFAULT_MEMSTATUS=0"), "{options:?}");
        assert!(!options.iter().any(|option| option == "ENABLE_MEMORY_MANAGEMENT"), "{options:?}");
    }

    #[tokio::test]
    async fn synchronous_normal_leaves_every_commit_to_the_checkpoints() {
        let folder = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}?synchronous=normal", folder.path().join("a.db").display());
        let store = SqliteStore::open(&url).await.expect("opens");
        let levels = on_every_connection(&store, "PRAGMA synchronous").await;
        assert!(levels.iter().all(|&level| level == 1), "{levels:?}");
    }

    /// Under `locking=exclusive` the WAL index is in this process's memory,
    /// not in a `-shm` file other processes could map; the default makes
    /// one, and both keep every row.
    #[tokio::test]
    async fn exclusive_locking_keeps_the_wal_index_in_memory() {
        for (query, shm_file) in [("", true), ("?locking=exclusive", false)] {
            let folder = tempfile::tempdir().expect("temp dir");
            let path = folder.path().join("a.db");
            let store = SqliteStore::open(&format!("sqlite://{}{query}", path.display())).await.expect("opens");
            store.create_user(&owner()).await.expect("written");
            assert_eq!(store.count_users().await.expect("read"), 1);
            assert!(folder.path().join("a.db-wal").exists());
            assert_eq!(folder.path().join("a.db-shm").exists(), shm_file, "{query:?}");
        }
    }

    fn owner() -> User {
        crate::testing::user("u")
    }

    #[tokio::test]
    async fn event_batches_of_any_size_are_stored_whole_and_in_order() {
        let store = SqliteStore::open("sqlite::memory:").await.expect("opens");
        store.create_user(&owner()).await.expect("user");
        store.create_conversation(&crate::testing::conversation("u", "c")).await.expect("conversation");
        let event = |seq: i64| Event {
            seq,
            conversation_id: "c".into(),
            turn_id: (seq % 2 == 0).then(|| "t".into()),
            name: arbor_core::EventName::Delta,
            data: format!("{{\"n\":{seq}}}").into(),
            created_at: seq,
        };
        // 1 + 2 + 64 + 27: single rows, full chunks and a mixed remainder.
        let mut next = 1;
        for size in [1, 2, 64, 27] {
            let batch: Vec<Event> = (next..next + size).map(event).collect();
            store.append_events(&batch).await.expect("appends");
            next += size;
        }
        let stored = store.events_after("c", 0, 1000).await.expect("reads");
        assert_eq!(stored.iter().map(|event| event.seq).collect::<Vec<_>>(), (1..next).collect::<Vec<_>>());
        assert!(stored.iter().all(|stored| *stored == event(stored.seq)), "every column round-trips");

        // A batch with a taken seq is refused whole.
        let clash: Vec<Event> = (next..next + 40).chain([5]).map(event).collect();
        assert!(matches!(store.append_events(&clash).await, Err(StoreError::Conflict(_))));
        assert_eq!(store.last_event_seq("c").await.expect("reads"), next - 1);
    }

    #[tokio::test]
    async fn the_writer_leaves_checkpoints_to_the_background_thread() {
        let folder = tempfile::tempdir().expect("temp dir");
        let path = folder.path().join("a.db");
        let store = SqliteStore::open(&format!("sqlite://{}", path.display())).await.expect("opens");
        let automatic: i64 =
            store.write(|c| Ok(c.query_row("PRAGMA wal_autocheckpoint", [], |row| row.get(0))?)).await.expect("reads");
        assert_eq!(automatic, 0, "the writer never checkpoints in its commits");
        store.create_user(&owner()).await.expect("writes");
        // An immutable connection reads the database file alone, without the
        // WAL: it sees the row only once a checkpoint has copied it there.
        let file_only = format!("file:{}?immutable=1", path.display());
        let mut checkpointed = false;
        // Once the writes stop, it is copied whatever the WAL's length.
        for _ in 0..100 {
            tokio::time::sleep(CHECKPOINT_IDLE / 20).await;
            let connection =
                Connection::open_with_flags(&file_only, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_URI)
                    .expect("opens");
            let users: i64 =
                connection.query_row("SELECT count(*) FROM users WHERE id = 'u'", [], |row| row.get(0)).unwrap_or(0);
            if users == 1 {
                checkpointed = true;
                break;
            }
        }
        assert!(checkpointed, "the background thread copied the commit into the database file");
    }

    /// The writer starts the WAL over right after a background copy is
    /// counted, so by then the database file must hold what was copied.
    #[test]
    fn a_background_copy_is_counted_once_the_database_file_holds_it() {
        let folder = tempfile::tempdir().expect("temp dir");
        let path = folder.path().join("a.db");
        let writer = open_connection(&path, Locking::Shared).expect("opens");
        writer.pragma_update(None, "wal_autocheckpoint", 0).expect("no automatic checkpoints");
        writer.execute_batch("CREATE TABLE t (v INTEGER)").expect("table");
        // The WAL's frames, from its length (a 32-byte header, then frames of
        // a 24-byte header and a 4 KiB page); it only grows here.
        let wal_file = folder.path().join("a.db-wal");
        let frames =
            || (std::fs::metadata(&wal_file).map_or(0, |file| file.len()).saturating_sub(32) / (24 + 4096)) as i32;
        let wal = WalLength::default();
        // A commit each, at least a frame each: more than the thread lets
        // wait, so it copies them at its first look. All of them before the
        // thread starts: a copy made while commits still come stops at the
        // last frame no reader needs and skips the pages written after it,
        // so the file alone is readable only with the WAL (SQLite's
        // checkpoints; CI saw 'malformed' when the two overlapped).
        for value in 0..i64::from(CHECKPOINT_FRAMES) + 100 {
            writer.execute("INSERT INTO t VALUES (?)", [value]).expect("inserts");
            wal.set(frames());
        }
        let checkpointer = {
            let (wal, connection) = (wal.clone(), open_connection(&path, Locking::Shared).expect("opens"));
            let file = std::fs::File::open(&path).expect("opens the file");
            std::thread::spawn(move || checkpoint_wal(&connection, &file, &wal, 1 << 20))
        };
        let waited = Instant::now();
        while wal.passes() == 0 && waited.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(wal.passes() > 0, "no copy was counted");
        // The thread stops before the file is read: a copy it made meanwhile
        // would change pages under a reader that takes the file as fixed.
        wal.close();
        checkpointer.join().expect("the thread stops");
        // An immutable connection reads the database file alone.
        let file_only = Connection::open_with_flags(
            format!("file:{}?immutable=1", path.display()),
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_URI,
        )
        .expect("opens");
        let rows: i64 = file_only.query_row("SELECT count(*) FROM t", [], |row| row.get(0)).expect("reads");
        assert!(rows > 0, "the file holds none of the copied rows");
    }

    /// Starting the WAL over costs the commit that does it an fsync, so a
    /// trickle of writes must not start it over each time.
    #[tokio::test]
    async fn a_trickle_of_writes_keeps_appending_to_one_wal() {
        let folder = tempfile::tempdir().expect("temp dir");
        let path = folder.path().join("a.db");
        let store = SqliteStore::open(&format!("sqlite://{}", path.display())).await.expect("opens");
        store.create_user(&owner()).await.expect("writes");
        // The salts in the WAL header change whenever the WAL starts over.
        let salts = || std::fs::read(folder.path().join("a.db-wal")).expect("a WAL")[16..24].to_vec();
        let first = salts();
        for n in 0..30 {
            store.set_balance(&owner().id, Some(n)).await.expect("writes");
            tokio::time::sleep(CHECKPOINT_POLL * 2).await;
        }
        assert_eq!(salts(), first, "the WAL was started over");
        assert_eq!(store.user(&owner().id).await.expect("reads").and_then(|user| user.balance_credits), Some(29));
    }

    #[tokio::test]
    async fn memory_databases_keep_their_rows_while_open() {
        let store = SqliteStore::open("sqlite::memory:").await.expect("opens");
        let user = User { id: "u".into(), name: "n".into(), is_admin: true, balance_credits: None, created_at: 1 };
        store.create_user(&user).await.expect("create");
        assert_eq!(store.user("u").await.expect("read"), Some(user));
        assert_eq!(store.count_users().await.expect("count"), 1);
    }

    #[tokio::test]
    async fn a_failed_write_rolls_back_everything_it_did() {
        let store = SqliteStore::open("sqlite::memory:").await.expect("opens");
        store.create_user(&owner()).await.expect("user");
        let result: StoreResult<()> = store
            .write(|connection| {
                connection.execute("UPDATE users SET name = 'changed'", [])?;
                Err(StoreError::Conflict("stop".into()))
            })
            .await;
        assert!(result.is_err());
        assert_eq!(store.user("u").await.expect("reads").map(|user| user.name), Some("u".to_string()));
    }

    /// Writes sent together are committed together; one that fails must
    /// take nothing of the others with it, and keep nothing of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_write_among_concurrent_ones_loses_only_itself() {
        let folder = tempfile::tempdir().expect("temp dir");
        let store =
            SqliteStore::open(&format!("sqlite://{}", folder.path().join("a.db").display())).await.expect("opens");
        let writes: Vec<_> = (0..200)
            .map(|n: i64| {
                let store = store.clone();
                tokio::spawn(async move {
                    store
                        .write(move |connection| {
                            connection.execute(
                                "INSERT INTO users (id, name, is_admin, created_at) VALUES (?1, ?1, 0, 1)",
                                [format!("u{n}")],
                            )?;
                            if n % 3 == 0 { Err(StoreError::Conflict(format!("refused {n}"))) } else { Ok(n) }
                        })
                        .await
                })
            })
            .collect();
        for (n, write) in (0..).zip(writes) {
            match write.await.expect("joins") {
                Ok(answer) => assert_eq!(answer, n),
                Err(StoreError::Conflict(reason)) => assert_eq!(reason, format!("refused {n}")),
                Err(error) => panic!("write {n}: {error}"),
            }
        }
        for n in 0..200 {
            let stored = store.user(&format!("u{n}")).await.expect("reads").is_some();
            assert_eq!(stored, n % 3 != 0, "user u{n}");
        }
    }

    /// Under steady writes the WAL starts over once past its limit rather
    /// than growing with everything ever written.
    #[tokio::test]
    async fn the_wal_stays_bounded_under_steady_writes() {
        let folder = tempfile::tempdir().expect("temp dir");
        let path = folder.path().join("a.db");
        // A limit of 64 pages (256 KiB), so a test can pass it many times.
        let store = SqliteStore::open_file(path.clone(), Durability::Normal, Locking::Shared, 64).await.expect("opens");
        store.create_user(&owner()).await.expect("user");
        let content = "x".repeat(8 * 1024);
        // 3,000 writes of 8 KiB: 24 MiB through the WAL.
        for n in 0..3000 {
            let content = content.clone();
            store
                .write(move |connection| {
                    connection.execute("UPDATE users SET name = ?1 WHERE id = 'u'", [format!("{n}{content}")])?;
                    Ok(())
                })
                .await
                .expect("writes");
        }
        // The file keeps the longest the WAL ever got: the limit plus what
        // came while a checkpoint held the lock (its fsyncs take long on a
        // slow disk). Without starting over it would hold all 24 MiB.
        let wal = std::fs::metadata(folder.path().join("a.db-wal")).expect("a WAL").len();
        assert!(wal < 12 * 1024 * 1024, "the WAL is {wal} bytes after 24 MiB of writes");
        assert!(store.user("u").await.expect("reads").is_some_and(|user| user.name.starts_with("2999")));
    }

    /// Writes a database file with the schema of versions 1 and 2 (what an
    /// earlier Arbor made), then `sql`.
    fn schema_two_with(path: &Path, sql: &str) {
        let connection = Connection::open(path).expect("opens");
        for (_, _, migration) in &MIGRATIONS[..2] {
            connection.execute_batch(migration).expect("schema");
        }
        connection.execute_batch(sql).expect("rows");
    }

    #[tokio::test]
    async fn databases_migrated_by_sqlx_are_not_migrated_again() {
        let folder = tempfile::tempdir().expect("temp dir");
        let path = folder.path().join("old.db");
        // The shape an earlier Arbor left: the schema and sqlx's table.
        schema_two_with(
            &path,
            "CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, success BOOLEAN NOT NULL); \
             INSERT INTO _sqlx_migrations VALUES (1, TRUE), (2, TRUE); \
             INSERT INTO users (id, name, is_admin, created_at) VALUES ('u', 'kept', 0, 1);",
        );
        let store = SqliteStore::open(&format!("sqlite://{}", path.display())).await.expect("opens again");
        assert_eq!(store.user("u").await.expect("reads").map(|user| user.name), Some("kept".to_string()));
        let version: i64 =
            store.read(|c| Ok(c.query_row("PRAGMA user_version", [], |row| row.get(0))?)).await.expect("reads");
        assert_eq!(version, latest_version(), "the migrations sqlx never saw were applied");
        drop(store);
        // Opening once more still finds everything in place.
        let store = SqliteStore::open(&format!("sqlite://{}", path.display())).await.expect("opens a third time");
        assert_eq!(store.count_users().await.expect("counts"), 1);
    }

    fn latest_version() -> i64 {
        MIGRATIONS.last().expect("migrations").0
    }

    #[tokio::test]
    async fn the_migrations_keep_every_row_its_order_and_its_foreign_keys() {
        let folder = tempfile::tempdir().expect("temp dir");
        let path = folder.path().join("v2.db");
        // A database as the schema of version 2 left it, with a tree.
        schema_two_with(
            &path,
            "PRAGMA user_version = 2; PRAGMA foreign_keys = ON; \
             INSERT INTO users (id, name, created_at) VALUES ('u', 'ann', 1); \
             INSERT INTO conversations (id, owner_id, model, created_at, updated_at) \
                 VALUES ('c', 'u', 'demo', 1, 1); \
             INSERT INTO messages (conversation_id, id, parent_id, role, content, created_at) VALUES \
                 ('c', 'z-root', NULL, 'user', 'first', 1), \
                 ('c', 'a-reply', 'z-root', 'assistant', 'second', 2), \
                 ('c', 'm-next', 'a-reply', 'user', 'third', 3); \
             INSERT INTO turns (id, conversation_id, user_id, user_message_id, status, model, created_at) VALUES \
                 ('t-done', 'c', 'u', 'z-root', 'succeeded', 'demo', 1), \
                 ('t-waiting', 'c', 'u', 'm-next', 'queued', 'demo', 2); \
             INSERT INTO api_calls (id, turn_id, conversation_id, user_id, kind, provider, model, input_tokens, \
                 output_tokens, thinking_tokens, cached_tokens, cache_write_tokens, latency_ms, status, \
                 cost_micro_usd, created_at) VALUES ('a1', 't-done', 'c', 'u', 'llm', 'demo', 'demo', 10, 20, 0, 0, 0, \
                 5, 'ok', 14, 1); \
             INSERT INTO cost_ledger (id, user_id, api_call_id, credits, balance_after, created_at) VALUES \
                 ('l1', 'u', 'a1', 14, 986, 1), ('l2', 'u', 'a1', 1, 985, 2); \
             INSERT INTO events (conversation_id, seq, turn_id, name, data, created_at) VALUES \
                 ('c', 2, 't-done', 'delta', '{\"text\":\"hé: 1 2\"}', 1), ('c', 1, NULL, 'turn.started', '{}', 1);",
        );
        let store = SqliteStore::open(&format!("sqlite://{}", path.display())).await.expect("migrates");
        let version: i64 =
            store.read(|c| Ok(c.query_row("PRAGMA user_version", [], |row| row.get(0))?)).await.expect("reads");
        assert_eq!(version, latest_version());

        let ids = |nodes: Vec<Node>| nodes.into_iter().map(|node| (node.id, node.parent_id)).collect::<Vec<_>>();
        let kept = ids(store.messages("c").await.expect("reads"));
        assert_eq!(
            kept,
            [
                ("z-root".to_string(), None),
                ("a-reply".to_string(), Some("z-root".to_string())),
                ("m-next".to_string(), Some("a-reply".to_string()))
            ],
            "every node, in the order written, under its parent"
        );
        let schema: String = store
            .read(|c| Ok(c.query_row("SELECT sql FROM sqlite_master WHERE name = 'messages'", [], |row| row.get(0))?))
            .await
            .expect("reads");
        assert!(!schema.contains("AUTOINCREMENT"), "{schema}");
        // Turns, calls and charges are each one b-tree, in key order.
        let keyed: Vec<String> = store
            .read(|c| {
                let sql = "SELECT name FROM sqlite_master WHERE type = 'table' AND sql LIKE '%WITHOUT ROWID' \
                           AND name IN ('turns', 'api_calls', 'cost_ledger') ORDER BY name";
                Ok(c.prepare(sql)?.query_map([], |row| row.get(0))?.collect::<Result<_, _>>()?)
            })
            .await
            .expect("reads");
        assert_eq!(keyed, ["api_calls", "cost_ledger", "turns"]);

        // Turns, calls and charges are all there; the statement still reads
        // newest first, in key order without a sort.
        let queued = store.turns_with_status(&[TurnStatus::Queued]).await.expect("reads");
        assert_eq!(queued.iter().map(|turn| turn.id.as_str()).collect::<Vec<_>>(), ["t-waiting"]);
        let calls = store.api_calls("t-done").await.expect("reads");
        assert_eq!((calls.len(), calls[0].cost_micro_usd), (1, 14));
        let statement = store.ledger("u", 10).await.expect("reads");
        assert_eq!(statement.iter().map(|entry| entry.id.as_str()).collect::<Vec<_>>(), ["l2", "l1"], "newest first");
        let plan: Vec<String> = store
            .read(|c| {
                let sql = "EXPLAIN QUERY PLAN SELECT * FROM cost_ledger WHERE user_id = 'u' \
                           ORDER BY created_at DESC, id DESC LIMIT 10";
                Ok(c.prepare(sql)?.query_map([], |row| row.get(3))?.collect::<Result<_, _>>()?)
            })
            .await
            .expect("plans");
        assert_eq!(plan, ["SEARCH cost_ledger USING PRIMARY KEY (user_id=?)"], "no sort");

        // The events replay in their numbering, from any number on; a
        // number already used is still refused.
        let seqs =
            |events: Vec<Event>| events.into_iter().map(|event| (event.seq, event.name.as_str())).collect::<Vec<_>>();
        assert_eq!(seqs(store.events_after("c", 0, 10).await.expect("reads")), [(1, "turn.started"), (2, "delta")]);
        let delta = store.events_after("c", 1, 10).await.expect("reads");
        assert_eq!(seqs(delta.clone()), [(2, "delta")]);
        assert_eq!((delta[0].turn_id.as_deref(), &*delta[0].data), (Some("t-done"), "{\"text\":\"hé: 1 2\"}"));
        assert_eq!(store.events_after("c", 0, 1).await.expect("reads")[0].turn_id, None);
        assert_eq!(store.last_event_seq("c").await.expect("reads"), 2);
        let again = Event { seq: 2, ..store.events_after("c", 1, 1).await.expect("reads").remove(0) };
        assert!(matches!(store.append_events(&[again]).await, Err(StoreError::Conflict(_))));
        let plan = |sql: &'static str| {
            store.read(move |c| {
                // Its parameters stay unbound: the plan does not need them.
                let mut statement = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))?;
                let (mut rows, mut details) = (statement.raw_query(), Vec::new());
                while let Some(row) = rows.next()? {
                    details.push(row.get::<_, String>(3)?);
                }
                Ok(details)
            })
        };
        let replay = "SELECT seq, last_seq, body FROM events WHERE conversation_id = 'c' AND last_seq > 1 \
                      ORDER BY last_seq";
        assert_eq!(
            plan(replay).await.expect("plans"),
            ["SEARCH events USING INDEX events_by_conversation (conversation_id=? AND last_seq>?)"]
        );
        for sql in [EVENT_OVERLAP, EVENT_LAST] {
            let covered = plan(sql).await.expect("plans");
            assert_eq!(covered.len(), 1, "{covered:?}");
            assert!(covered[0].starts_with("SEARCH events USING COVERING INDEX events_by_conversation"), "{covered:?}");
        }

        // The rebuilt table still refuses a parent that is not there, and
        // foreign keys are back on for every connection.
        assert!(on_every_connection(&store, "PRAGMA foreign_keys").await.iter().all(|&on| on == 1));
        let orphan = Node {
            id: "lost".into(),
            conversation_id: "c".into(),
            parent_id: Some("nowhere".into()),
            message: arbor_core::Message::user("orphan"),
            model: None,
            provider: None,
            turn_id: None,
            copied_from: None,
            status: Default::default(),
            created_at: 4,
        };
        assert!(store.append_messages(std::slice::from_ref(&orphan), 4).await.is_err());
        let child = Node { id: "b-last".into(), parent_id: Some("m-next".into()), ..orphan };
        store.append_messages(std::slice::from_ref(&child), 4).await.expect("a real parent");
        let order: Vec<String> = store.messages("c").await.expect("reads").into_iter().map(|node| node.id).collect();
        assert_eq!(order, ["z-root", "a-reply", "m-next", "b-last"], "a new node comes after the old ones");

        // Deleting the conversation still takes its messages with it.
        store.write(|c| Ok(c.execute("DELETE FROM conversations WHERE id = 'c'", [])?)).await.expect("deletes");
        let left: i64 = store
            .read(|c| Ok(c.query_row("SELECT COUNT(*) FROM messages", [], |row| row.get(0))?))
            .await
            .expect("reads");
        assert_eq!(left, 0);
        assert!(store.events_after("c", 0, 10).await.expect("reads").is_empty(), "its events went with it");
        let turns_left = store.turns_with_status(&[TurnStatus::Queued]).await.expect("reads");
        assert!(turns_left.is_empty(), "its turns went with it");
    }

    /// Every decoder reads its columns in the order the store's statements
    /// select them, so `SqliteRow` finds each where the last one read
    /// suggests: a search by name costs ~1,300 instructions a column, and a
    /// turn on a conversation not in memory decodes its whole path.
    #[tokio::test]
    async fn rows_are_decoded_in_the_order_they_are_selected() {
        let store = SqliteStore::open("sqlite::memory:").await.expect("opens");
        store.create_user(&owner()).await.expect("user");
        store.create_conversation(&crate::testing::conversation("u", "c")).await.expect("conversation");
        let node = Node::new("n", "c", None, arbor_core::Message::user("hi"), 1);
        store.append_messages(std::slice::from_ref(&node), 1).await.expect("message");
        let turn = Turn {
            id: "t".into(),
            conversation_id: "c".into(),
            user_id: "u".into(),
            user_message_id: "n".into(),
            status: TurnStatus::Queued,
            model: "demo".into(),
            iterations: 0,
            usage: arbor_core::Usage::default(),
            cost_micro_usd: 0,
            reply_message_id: None,
            error_code: None,
            error_message: None,
            created_at: 2,
            started_at: None,
            finished_at: None,
            pending_messages: Vec::new(),
        };
        store.insert_turn(&turn).await.expect("turn");
        let call = ApiCall {
            id: "a".into(),
            turn_id: Some("t".into()),
            conversation_id: Some("c".into()),
            user_id: "u".into(),
            kind: "chat".into(),
            provider: "demo".into(),
            model: "demo".into(),
            usage: arbor_core::Usage { input_tokens: 3, output_tokens: 4, ..Default::default() },
            latency_ms: 5,
            ttft_ms: Some(6),
            status: "ok".into(),
            error_code: None,
            cost_micro_usd: 7,
            created_at: 3,
        };
        store.record_call(&call, None).await.expect("call");

        fn searches<T>(
            connection: &Session<'_, '_>,
            sql: &'static str,
            decode: fn(&SqliteRow<'_, '_>) -> StoreResult<T>,
        ) -> StoreResult<(T, u32)> {
            let mut statement = connection.cached(sql)?;
            let mut rows = statement.query([])?;
            let row = SqliteRow::new(rows.next()?.ok_or(StoreError::NotFound)?);
            Ok((decode(&row)?, row.searches()))
        }
        let (expected_turn, expected_call) = (turn.clone(), call.clone());
        let found = store
            .read(move |c| {
                let (user, users) =
                    searches(c, concat!("SELECT ", user_columns!(), " FROM users"), |row| codec::user_from_row(row))?;
                let (_, conversations) =
                    searches(c, concat!("SELECT ", conversation_columns!(), " FROM conversations"), |row| {
                        codec::conversation_from_row(row)
                    })?;
                let (read, messages) = searches(c, concat!("SELECT ", node_columns!(), " FROM messages"), |row| {
                    codec::node_from_row(row)
                })?;
                let (turn, turns) =
                    searches(c, concat!("SELECT ", turn_columns!(), " FROM turns"), |row| codec::turn_from_row(row))?;
                let (call, calls) = searches(c, concat!("SELECT ", api_call_columns!(), " FROM api_calls"), |row| {
                    codec::api_call_from_row(row)
                })?;
                let (_, ledger) = searches(c, concat!("SELECT ", ledger_columns!(), " FROM cost_ledger"), |row| {
                    codec::ledger_from_row(row)
                })?;
                assert_eq!((user.id.as_str(), &read, &turn, &call), ("u", &node, &expected_turn, &expected_call));
                Ok([("users", users), ("conversations", conversations), ("messages", messages), ("turns", turns)]
                    .into_iter()
                    .chain([("api_calls", calls), ("cost_ledger", ledger)])
                    .filter(|&(_, searches)| searches > 0)
                    .collect::<Vec<_>>())
            })
            .await
            .expect("reads");
        assert_eq!(found, [], "columns searched for by name, by table");
    }

    /// A query's later rows take each column from where its first row
    /// found it, without asking SQLite for names; a read in another order
    /// finds its columns again and still gets the right values.
    #[test]
    fn a_querys_later_rows_take_their_columns_from_the_first() {
        use crate::codec::RowSource;
        let connection = Connection::open_in_memory().expect("opens");
        let mut statement = connection
            .prepare("SELECT column1 AS a, column2 AS b FROM (VALUES (1, 'x'), (2, 'y'), (3, 'z'), (4, 'w'))")
            .expect("prepares");
        let mut rows = statement.query([]).expect("runs");
        let places = ColumnPlaces::default();
        macro_rules! next {
            () => {
                SqliteRow::with_places(rows.next().expect("steps").expect("a row"), Some(&places))
            };
        }

        let row = next!();
        assert_eq!((row.integer("a").expect("a"), row.text("b").expect("b")), (1, "x".to_string()));
        assert_eq!(row.named(), 2, "the first row asks");
        let row = next!();
        assert_eq!((row.integer("a").expect("a"), row.text("b").expect("b")), (2, "y".to_string()));
        assert_eq!(row.named(), 0, "a later row takes them from the first");
        let row = next!();
        assert_eq!((row.text("b").expect("b"), row.integer("a").expect("a")), ("z".to_string(), 3));
        assert_eq!(row.named(), 2, "read in another order: found again");
        let row = next!();
        assert_eq!((row.text("b").expect("b"), row.integer("a").expect("a")), ("w".to_string(), 4));
        assert_eq!(row.named(), 0, "and recorded in their new places");
    }

    #[test]
    fn rows_are_read_by_name_in_any_order() {
        use crate::codec::RowSource;
        let connection = Connection::open_in_memory().expect("opens");
        let mut statement = connection.prepare("SELECT 1 AS a, 'x' AS b, 3 AS c, NULL AS d").expect("prepares");
        let mut rows = statement.query([]).expect("runs");
        let row = SqliteRow::new(rows.next().expect("steps").expect("a row"));
        // In order, out of order, again, and by another case.
        assert_eq!(row.integer("a").expect("a"), 1);
        assert_eq!(row.text("b").expect("b"), "x");
        assert_eq!(row.integer("a").expect("a again"), 1);
        assert_eq!(row.integer("c").expect("c"), 3);
        assert_eq!(row.optional_text("d").expect("d"), None);
        assert_eq!(row.text("B").expect("B"), "x");
        let missing = row.integer("e").expect_err("no such column");
        assert!(missing.to_string().contains('e'), "{missing}");
    }

    #[tokio::test]
    async fn a_turns_writes_build_no_temporary_b_trees() {
        let store = SqliteStore::open("sqlite::memory:").await.expect("opens");
        for sql in [
            NODE_INSERT,
            NODE_UPSERT,
            EVENT_INSERT,
            EVENT_OVERLAP,
            HEAD_MOVE,
            CALL_INSERT,
            BALANCE_CHARGE,
            LEDGER_INSERT,
            TURN_INSERT,
            TURN_UPDATE,
        ] {
            let program: Vec<String> = store
                .read(move |c| {
                    // Its parameters stay unbound: the plan does not need them.
                    let mut statement = c.prepare(&format!("EXPLAIN {sql}"))?;
                    let mut rows = statement.raw_query();
                    let mut opcodes = Vec::new();
                    while let Some(row) = rows.next()? {
                        opcodes.push(row.get(1)?);
                    }
                    Ok(opcodes)
                })
                .await
                .expect("explains");
            assert!(!program.iter().any(|opcode| opcode == "OpenEphemeral"), "{sql}");
        }
        // The rules those CHECKs keep still hold.
        let refused = |sql: &'static str| {
            let store = store.clone();
            async move { store.write(move |c| Ok(c.execute_batch(sql)?)).await.is_err() }
        };
        assert!(
            refused(
                "INSERT INTO users (id, name, created_at) VALUES ('u', 'u', 0); \
                 INSERT INTO conversations (id, owner_id, model, created_at, updated_at) VALUES ('c', 'u', 'm', 0, 0); \
                 INSERT INTO messages (conversation_id, id, role, created_at) VALUES ('c', 'm', 'robot', 0);"
            )
            .await
        );
        assert!(
            refused(
                "INSERT INTO users (id, name, created_at) VALUES ('u', 'u', 0); \
                 INSERT INTO conversations (id, owner_id, model, created_at, updated_at) VALUES ('c', 'u', 'm', 0, 0); \
                 INSERT INTO turns (id, conversation_id, user_id, user_message_id, status, model, created_at) \
                 VALUES ('t', 'c', 'u', 'm', 'paused', 'm', 0);"
            )
            .await
        );
        assert!(
            !refused(
                "INSERT INTO users (id, name, created_at) VALUES ('u', 'u', 0); \
                 INSERT INTO conversations (id, owner_id, model, created_at, updated_at) VALUES ('c', 'u', 'm', 0, 0); \
                 INSERT INTO messages (conversation_id, id, role, created_at) VALUES ('c', 'm', 'tool', 0); \
                 INSERT INTO turns (id, conversation_id, user_id, user_message_id, status, model, created_at) \
                 VALUES ('t', 'c', 'u', 'm', 'interrupted', 'm', 0);"
            )
            .await
        );
    }

    #[tokio::test]
    async fn live_turns_are_read_through_the_index_of_live_turns() {
        let store = SqliteStore::open("sqlite::memory:").await.expect("opens");
        let plan = |sql: String| {
            let store = store.clone();
            async move {
                store
                    .read(move |c| {
                        let mut statement = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))?;
                        let details: Vec<String> =
                            statement.query_map(["[\"queued\"]"], |row| row.get(3))?.collect::<Result<_, _>>()?;
                        Ok(details.join("; "))
                    })
                    .await
                    .expect("plans")
            }
        };
        // The statements the store runs for the queue, crash recovery and
        // lease takeovers.
        let live = plan(LIVE_TURNS.to_string()).await;
        assert!(live.contains("USING INDEX turns_one_running_per_conversation (status=?)"), "{live}");
        assert!(live.contains("USING INDEX turns_queued (status=?)"), "{live}");
        let expired = plan(EXPIRED_TURNS.to_string()).await;
        assert!(expired.contains("USING INDEX turns_one_running_per_conversation (status=?)"), "{expired}");
        assert!(store.turns_with_status(&[TurnStatus::Queued, TurnStatus::Running]).await.expect("reads").is_empty());
    }
}
