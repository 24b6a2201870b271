//! The SQLite store: Arbor's embedded default, one file on the local disk and
//! no service to run.
//!
//! SQLite allows one writer at a time. Rather than let several pooled
//! connections race for the write lock (and fail with `SQLITE_BUSY` when a
//! read transaction tries to upgrade), every write goes through a pool of
//! exactly one connection and starts with `BEGIN IMMEDIATE`; reads use a
//! separate pool and, thanks to WAL, never wait for the writer. The busy
//! timeout still covers other processes (`arbor users add` while the server
//! runs). Because all writes of this process are serialized, each invariant
//! the engine relies on (one running turn, quota, unique message ids) also
//! holds by the database's own constraints, exactly as on PostgreSQL.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, LazyLock, Weak};
use std::time::Duration;

use arbor_core::ids::Millis;
use arbor_core::{Event, Node};
use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, Transaction};
use tokio::sync::broadcast;

use crate::codec::{self, NodeColumns, to_i64};
use crate::*;

/// How long a statement waits for another process's write lock before
/// failing with "database is locked".
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Notices a slow listener may fall behind by before it is told it lagged.
const NOTICE_BUFFER: usize = 1024;

/// The schema, embedded in the binary so `arbor serve` needs no files beside
/// it. Versions are the file name prefixes; a landed file is never edited.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "initial", include_str!("../migrations/sqlite/0001_initial.sql")),
    (2, "turn pending messages", include_str!("../migrations/sqlite/0002_turn_pending_messages.sql")),
];

/// Where a `sqlite:` URL points.
#[derive(Debug, PartialEq, Eq)]
enum Location {
    File(PathBuf),
    /// `sqlite::memory:`: a private database that lives as long as the store
    /// (tests and throwaway runs).
    Memory,
}

fn parse_url(url: &str) -> StoreResult<Location> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .ok_or_else(|| StoreError::Database(format!("{url:?} is not a sqlite:// url")))?;
    // Connection parameters (`?mode=…`) are Arbor's to choose, not the URL's.
    let path = rest.split('?').next().unwrap_or_default();
    match path {
        "" => Err(StoreError::Database(format!("{url:?} names no file: use sqlite://PATH"))),
        ":memory:" => Ok(Location::Memory),
        path => Ok(Location::File(PathBuf::from(path))),
    }
}

/// A SQLite database behind the [`Store`] trait.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    /// One connection: every write of this process, serialized.
    writer: SqlitePool,
    /// Several connections for reads, which WAL lets run beside the writer.
    reader: SqlitePool,
    /// Notices stay in this process: a SQLite database serves one node.
    notices: broadcast::Sender<Notice>,
    /// Keeps the WAL checkpointing task running while any clone of the
    /// store lives (it holds only a weak reference).
    _alive: Arc<()>,
}

impl SqliteStore {
    /// Opens (creating the file and its folder if missing) the database at
    /// `sqlite://PATH`, or a private in-memory one for `sqlite::memory:`,
    /// and applies the migrations it lacks.
    pub async fn open(url: &str) -> StoreResult<SqliteStore> {
        let location = parse_url(url)?;
        let store = match location {
            Location::Memory => {
                // Each in-memory connection is its own database, so one
                // connection serves both roles and must never be recycled.
                let options =
                    SqliteConnectOptions::from_str("sqlite::memory:")?.foreign_keys(true).busy_timeout(BUSY_TIMEOUT);
                let pool = SqlitePoolOptions::new()
                    .max_connections(1)
                    .min_connections(1)
                    .idle_timeout(None)
                    .max_lifetime(None)
                    .connect_with(options)
                    .await?;
                SqliteStore {
                    writer: pool.clone(),
                    reader: pool,
                    notices: broadcast::channel(NOTICE_BUFFER).0,
                    _alive: Arc::new(()),
                }
            }
            Location::File(path) => Self::open_file(&path).await?,
        };
        codec::migrator(MIGRATIONS)
            .run(&store.writer)
            .await
            .map_err(|error| StoreError::Database(format!("migrating {url:?}: {error}")))?;
        Ok(store)
    }

    async fn open_file(path: &Path) -> StoreResult<SqliteStore> {
        if let Some(parent) = path.parent().filter(|parent| !parent.as_os_str().is_empty()) {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|error| StoreError::Database(format!("cannot create {}: {error}", parent.display())))?;
        }
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            // WAL: readers never block the writer nor the writer readers.
            .journal_mode(SqliteJournalMode::Wal)
            // NORMAL is durable across application crashes in WAL mode; only
            // a power loss can drop the last commits, never corrupt the file.
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(BUSY_TIMEOUT);
        // A checkpoint copies the WAL into the database file and fsyncs
        // both, which takes milliseconds on a real disk. SQLite runs one
        // inside the commit that grows the WAL past 1,000 pages, so that
        // write, and every write queued behind it on the single writer,
        // waits for two fsyncs: that was the benchmark's p99 (see
        // bench/REPORT.md). So the writer never checkpoints; a task does, on
        // a connection of its own, in PASSIVE mode, which never takes the
        // write lock. Durability is unchanged: a commit is in the WAL either
        // way, and the checkpoint only moves it.
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone().pragma("wal_autocheckpoint", "0"))
            .await?;
        let readers = std::thread::available_parallelism().map_or(4, |count| count.get()).clamp(2, 8);
        let reader = SqlitePoolOptions::new()
            .max_connections(u32::try_from(readers).unwrap_or(4))
            .connect_with(options.clone())
            .await?;
        let checkpointer = SqlitePoolOptions::new().max_connections(1).connect_with(options).await?;
        let alive = Arc::new(());
        tokio::spawn(checkpoint_wal(checkpointer, Arc::downgrade(&alive)));
        Ok(SqliteStore { writer, reader, notices: broadcast::channel(NOTICE_BUFFER).0, _alive: alive })
    }

    /// A write transaction that holds the write lock from its first
    /// statement, so it never has to upgrade (and fail) half way through.
    async fn write(&self) -> StoreResult<Transaction<'static, Sqlite>> {
        Ok(self.writer.begin_with("BEGIN IMMEDIATE").await?)
    }
}

const NODE_INSERT: &str =
    concat!("INSERT INTO messages (", node_columns!(), ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)");

/// The same insert, but an existing node with the id is updated in place
/// (its identity and place in the tree stay as they were).
const NODE_UPSERT: &str = concat!(
    "INSERT INTO messages (",
    node_columns!(),
    ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) \
     ON CONFLICT (conversation_id, id) DO UPDATE SET \
     content = excluded.content, parts = excluded.parts, tool_calls = excluded.tool_calls, \
     tool_call_id = excluded.tool_call_id, tool_name = excluded.tool_name, \
     tool_status = excluded.tool_status, model = excluded.model, \
     provider = excluded.provider, status = excluded.status"
);

async fn insert_node(tx: &mut Transaction<'static, Sqlite>, statement: &'static str, node: &Node) -> StoreResult<()> {
    let columns = NodeColumns::new(node)?;
    sqlx::query(statement)
        .bind(&node.conversation_id)
        .bind(&node.id)
        .bind(&node.parent_id)
        .bind(node.message.role.as_str())
        .bind(&node.message.content)
        .bind(&columns.parts)
        .bind(&columns.tool_calls)
        .bind(&node.message.tool_call_id)
        .bind(&node.message.tool_name)
        .bind(columns.tool_status)
        .bind(&node.model)
        .bind(&node.provider)
        .bind(&node.turn_id)
        .bind(&node.copied_from)
        .bind(node.status.as_str())
        .bind(node.created_at)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// How often the WAL is checkpointed (see `open_file`).
const CHECKPOINT_EVERY: Duration = Duration::from_millis(200);

/// Checkpoints the WAL every [`CHECKPOINT_EVERY`] until the store is gone.
/// PASSIVE copies what no reader still needs and never waits for a lock;
/// the next write after a complete checkpoint starts the WAL over, so it
/// stays small.
async fn checkpoint_wal(pool: SqlitePool, alive: Weak<()>) {
    let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if alive.strong_count() == 0 {
            break;
        }
        if let Err(error) = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)").execute(&pool).await {
            tracing::warn!(%error, "checkpointing the SQLite write-ahead log failed");
        }
    }
    pool.close().await;
}

/// Row counts of the multi-row event inserts, largest first. A batch is
/// split greedily into these (27 events: 16 + 8 + 2 + 1), so a handful of
/// fixed statements, each prepared once per connection, store any batch.
const EVENT_INSERT_ROWS: [usize; 6] = [32, 16, 8, 4, 2, 1];

/// `INSERT INTO events ... VALUES (...), (...)` with `rows` rows of bound
/// parameters (at most 32 × 6 = 192, well under SQLite's limit).
fn event_insert(rows: usize) -> &'static str {
    static STATEMENTS: LazyLock<Vec<String>> = LazyLock::new(|| {
        EVENT_INSERT_ROWS
            .iter()
            .map(|&rows| {
                let values = vec!["(?, ?, ?, ?, ?, ?)"; rows].join(", ");
                format!(concat!("INSERT INTO events (", event_columns!(), ") VALUES {}"), values)
            })
            .collect()
    });
    let index = EVENT_INSERT_ROWS.iter().position(|&size| size == rows).unwrap_or(EVENT_INSERT_ROWS.len() - 1);
    &STATEMENTS[index]
}

/// Inserts events in a few multi-row statements rather than one statement
/// per event: each statement is a round trip to the connection's thread,
/// and a streamed turn writes a few dozen events.
async fn insert_events(tx: &mut Transaction<'static, Sqlite>, events: &[Event]) -> StoreResult<()> {
    let mut rest = events;
    while !rest.is_empty() {
        let rows = EVENT_INSERT_ROWS.iter().copied().find(|&size| size <= rest.len()).unwrap_or(1);
        let (chunk, tail) = rest.split_at(rows);
        let mut query = sqlx::query(event_insert(rows));
        for event in chunk {
            query = query
                .bind(&*event.conversation_id)
                .bind(event.seq)
                .bind(event.turn_id.as_deref())
                .bind(event.name.as_str())
                .bind(&*event.data)
                .bind(event.created_at);
        }
        query.execute(&mut **tx).await?;
        rest = tail;
    }
    Ok(())
}

/// Sets a conversation's head to its last appended node, returning the new
/// head version; `NotFound` when the conversation does not exist.
async fn advance_head(
    tx: &mut Transaction<'static, Sqlite>,
    conversation_id: &str,
    head_id: &str,
    updated_at: Millis,
) -> StoreResult<i64> {
    let version: Option<i64> = sqlx::query_scalar(
        "UPDATE conversations SET head_id = ?, head_version = head_version + 1, updated_at = ? \
         WHERE id = ? RETURNING head_version",
    )
    .bind(head_id)
    .bind(updated_at)
    .bind(conversation_id)
    .fetch_optional(&mut **tx)
    .await?;
    version.ok_or(StoreError::NotFound)
}

/// Stores a model call, its message and its charge, inside the caller's
/// transaction (shared by `record_call` and `settle_reservation`).
async fn charge_call(
    tx: &mut Transaction<'static, Sqlite>,
    call: &ApiCall,
    message: Option<&Node>,
) -> StoreResult<LedgerEntry> {
    if let Some(node) = message {
        insert_node(tx, NODE_UPSERT, node).await?;
    }
    sqlx::query(concat!(
        "INSERT INTO api_calls (",
        api_call_columns!(),
        ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    ))
    .bind(&call.id)
    .bind(&call.turn_id)
    .bind(&call.conversation_id)
    .bind(&call.user_id)
    .bind(&call.kind)
    .bind(&call.provider)
    .bind(&call.model)
    .bind(to_i64(call.usage.input_tokens))
    .bind(to_i64(call.usage.output_tokens))
    .bind(to_i64(call.usage.thinking_tokens))
    .bind(to_i64(call.usage.cached_tokens))
    .bind(to_i64(call.usage.cache_write_tokens))
    .bind(to_i64(call.latency_ms))
    .bind(call.ttft_ms.map(to_i64))
    .bind(&call.status)
    .bind(&call.error_code)
    .bind(to_i64(call.cost_micro_usd))
    .bind(call.created_at)
    .execute(&mut **tx)
    .await?;
    let credits = to_i64(call.cost_micro_usd);
    // The deduction is one statement, so it reads and writes the balance
    // under the same lock: concurrent charges add up, none is lost. A
    // NULL (unlimited) balance stays NULL.
    let balance_after: Option<Option<i64>> = sqlx::query_scalar(
        "UPDATE users SET balance_credits = balance_credits - ? WHERE id = ? \
         RETURNING balance_credits",
    )
    .bind(credits)
    .bind(&call.user_id)
    .fetch_optional(&mut **tx)
    .await?;
    let balance_after = balance_after.ok_or(StoreError::NotFound)?;
    let entry = LedgerEntry {
        // One charge per call, so the call's id names its ledger row too
        // and the store invents no id of its own.
        id: call.id.clone(),
        user_id: call.user_id.clone(),
        api_call_id: call.id.clone(),
        credits,
        balance_after,
        created_at: call.created_at,
    };
    sqlx::query(concat!("INSERT INTO cost_ledger (", ledger_columns!(), ") VALUES (?, ?, ?, ?, ?, ?)"))
        .bind(&entry.id)
        .bind(&entry.user_id)
        .bind(&entry.api_call_id)
        .bind(entry.credits)
        .bind(entry.balance_after)
        .bind(entry.created_at)
        .execute(&mut **tx)
        .await?;
    Ok(entry)
}

/// Gives a reservation's credits back, inside the caller's transaction.
/// Returns whether the reservation still existed.
async fn release(tx: &mut Transaction<'static, Sqlite>, reservation_id: &str) -> StoreResult<bool> {
    let released: Option<(String, i64)> =
        sqlx::query_as("DELETE FROM credit_reservations WHERE id = ? RETURNING user_id, credits")
            .bind(reservation_id)
            .fetch_optional(&mut **tx)
            .await?;
    let Some((user_id, credits)) = released else {
        return Ok(false);
    };
    sqlx::query("UPDATE users SET reserved_credits = MAX(reserved_credits - ?, 0) WHERE id = ?")
        .bind(credits)
        .bind(user_id)
        .execute(&mut **tx)
        .await?;
    Ok(true)
}

/// Inserts a turn with `executor` (the pool, or a shared transaction).
async fn insert_turn_on<'e, E>(executor: E, turn: &Turn) -> StoreResult<()>
where
    E: sqlx::Executor<'e, Database = Sqlite>,
{
    sqlx::query(concat!(
        "INSERT INTO turns (",
        turn_columns!(),
        ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    ))
    .bind(&turn.id)
    .bind(&turn.conversation_id)
    .bind(&turn.user_id)
    .bind(&turn.user_message_id)
    .bind(turn.status.as_str())
    .bind(&turn.model)
    .bind(i64::from(turn.iterations))
    .bind(to_i64(turn.usage.input_tokens))
    .bind(to_i64(turn.usage.output_tokens))
    .bind(to_i64(turn.usage.thinking_tokens))
    .bind(to_i64(turn.usage.cached_tokens))
    .bind(to_i64(turn.usage.cache_write_tokens))
    .bind(to_i64(turn.cost_micro_usd))
    .bind(&turn.reply_message_id)
    .bind(&turn.error_code)
    .bind(&turn.error_message)
    .bind(turn.created_at)
    .bind(turn.started_at)
    .bind(turn.finished_at)
    .bind(codec::pending_json(turn))
    .execute(executor)
    .await
    .map_err(codec::running_turn_conflict)?;
    Ok(())
}

/// Writes a turn's status, totals, error and times with `executor` (the
/// pool, or a transaction shared with other writes).
async fn update_turn_on<'e, E>(executor: E, turn: &Turn) -> StoreResult<()>
where
    E: sqlx::Executor<'e, Database = Sqlite>,
{
    let result = sqlx::query(
        "UPDATE turns SET status = ?, model = ?, iterations = ?, input_tokens = ?, \
             output_tokens = ?, thinking_tokens = ?, cached_tokens = ?, cache_write_tokens = ?, \
             cost_micro_usd = ?, reply_message_id = ?, error_code = ?, error_message = ?, \
             started_at = ?, finished_at = ?, pending_messages = ? WHERE conversation_id = ? AND id = ?",
    )
    .bind(turn.status.as_str())
    .bind(&turn.model)
    .bind(i64::from(turn.iterations))
    .bind(to_i64(turn.usage.input_tokens))
    .bind(to_i64(turn.usage.output_tokens))
    .bind(to_i64(turn.usage.thinking_tokens))
    .bind(to_i64(turn.usage.cached_tokens))
    .bind(to_i64(turn.usage.cache_write_tokens))
    .bind(to_i64(turn.cost_micro_usd))
    .bind(&turn.reply_message_id)
    .bind(&turn.error_code)
    .bind(&turn.error_message)
    .bind(turn.started_at)
    .bind(turn.finished_at)
    .bind(codec::pending_json(turn))
    .bind(&turn.conversation_id)
    .bind(&turn.id)
    .execute(executor)
    .await
    .map_err(codec::running_turn_conflict)?;
    if result.rows_affected() == 0 {
        return Err(StoreError::NotFound);
    }
    Ok(())
}

#[async_trait]
impl Store for SqliteStore {
    async fn create_user(&self, user: &User) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO users (id, name, is_admin, balance_credits, created_at) \
             VALUES (?, ?, ?, ?, ?)",
        )
        .bind(&user.id)
        .bind(&user.name)
        .bind(user.is_admin)
        .bind(user.balance_credits)
        .bind(user.created_at)
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn user_by_name(&self, name: &str) -> StoreResult<Option<User>> {
        let row = sqlx::query(concat!("SELECT ", user_columns!(), " FROM users WHERE name = ?"))
            .bind(name)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(codec::user_from_row).transpose()
    }

    async fn user(&self, user_id: &str) -> StoreResult<Option<User>> {
        let row = sqlx::query(concat!("SELECT ", user_columns!(), " FROM users WHERE id = ?"))
            .bind(user_id)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(codec::user_from_row).transpose()
    }

    async fn count_users(&self) -> StoreResult<u64> {
        let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM users").fetch_one(&self.reader).await?;
        Ok(codec::to_u64(count))
    }

    async fn create_api_key(&self, key: &ApiKey) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO api_keys (id, user_id, key_hash, prefix, created_at) \
             VALUES (?, ?, ?, ?, ?)",
        )
        .bind(&key.id)
        .bind(&key.user_id)
        .bind(&key.key_hash)
        .bind(&key.prefix)
        .bind(key.created_at)
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn user_by_key_hash(&self, key_hash: &str) -> StoreResult<Option<User>> {
        let row = sqlx::query(
            "SELECT users.id, users.name, users.is_admin, users.balance_credits, \
             users.created_at FROM api_keys JOIN users ON users.id = api_keys.user_id \
             WHERE api_keys.key_hash = ? AND api_keys.revoked_at IS NULL",
        )
        .bind(key_hash)
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(codec::user_from_row).transpose()
    }

    async fn create_conversation(&self, conversation: &Conversation) -> StoreResult<()> {
        sqlx::query(concat!(
            "INSERT INTO conversations (",
            conversation_columns!(),
            ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        ))
        .bind(&conversation.id)
        .bind(&conversation.owner_id)
        .bind(&conversation.title)
        .bind(&conversation.system_prompt)
        .bind(&conversation.preset_id)
        .bind(&conversation.model)
        .bind(&conversation.head_id)
        .bind(conversation.head_version)
        .bind(&conversation.summary)
        .bind(conversation.created_at)
        .bind(conversation.updated_at)
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn conversation(&self, owner_id: &str, conversation_id: &str) -> StoreResult<Option<Conversation>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            conversation_columns!(),
            " FROM conversations WHERE owner_id = ? AND id = ?"
        ))
        .bind(owner_id)
        .bind(conversation_id)
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(codec::conversation_from_row).transpose()
    }

    async fn list_conversations(
        &self,
        owner_id: &str,
        cursor: Option<&ConversationCursor>,
        limit: u32,
    ) -> StoreResult<Vec<Conversation>> {
        // Keyset pagination on the (owner_id, created_at DESC, id DESC)
        // index: a page costs the same however deep it is.
        let rows = match cursor {
            None => {
                sqlx::query(concat!(
                    "SELECT ",
                    conversation_columns!(),
                    " FROM conversations WHERE owner_id = ? \
                     ORDER BY created_at DESC, id DESC LIMIT ?"
                ))
                .bind(owner_id)
                .bind(i64::from(limit))
                .fetch_all(&self.reader)
                .await?
            }
            Some(cursor) => {
                sqlx::query(concat!(
                    "SELECT ",
                    conversation_columns!(),
                    " FROM conversations WHERE owner_id = ? AND (created_at, id) < (?, ?) \
                     ORDER BY created_at DESC, id DESC LIMIT ?"
                ))
                .bind(owner_id)
                .bind(cursor.created_at)
                .bind(&cursor.id)
                .bind(i64::from(limit))
                .fetch_all(&self.reader)
                .await?
            }
        };
        rows.iter().map(codec::conversation_from_row).collect()
    }

    async fn update_conversation(
        &self,
        owner_id: &str,
        conversation_id: &str,
        update: &ConversationUpdate,
    ) -> StoreResult<Conversation> {
        let row = sqlx::query(concat!(
            "UPDATE conversations SET title = COALESCE(?, title), \
             system_prompt = COALESCE(?, system_prompt), model = COALESCE(?, model), \
             updated_at = ? WHERE owner_id = ? AND id = ? RETURNING ",
            conversation_columns!()
        ))
        .bind(&update.title)
        .bind(&update.system_prompt)
        .bind(&update.model)
        .bind(update.updated_at)
        .bind(owner_id)
        .bind(conversation_id)
        .fetch_optional(&self.writer)
        .await?;
        match row {
            Some(row) => codec::conversation_from_row(&row),
            None => Err(StoreError::NotFound),
        }
    }

    async fn delete_conversation(&self, owner_id: &str, conversation_id: &str) -> StoreResult<()> {
        // Messages, turns and events go with it (ON DELETE CASCADE); api
        // calls and the ledger stay, as billing history.
        let result = sqlx::query("DELETE FROM conversations WHERE owner_id = ? AND id = ?")
            .bind(owner_id)
            .bind(conversation_id)
            .execute(&self.writer)
            .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    async fn set_head(
        &self,
        conversation_id: &str,
        head_id: Option<&str>,
        expected_version: Option<i64>,
        updated_at: Millis,
    ) -> StoreResult<i64> {
        let mut tx = self.write().await?;
        let current: Option<i64> = sqlx::query_scalar("SELECT head_version FROM conversations WHERE id = ?")
            .bind(conversation_id)
            .fetch_optional(&mut *tx)
            .await?;
        let current = current.ok_or(StoreError::NotFound)?;
        if let Some(expected) = expected_version
            && expected != current
        {
            return Err(StoreError::HeadVersionMismatch { current });
        }
        if let Some(head_id) = head_id {
            let exists: Option<i64> = sqlx::query_scalar("SELECT 1 FROM messages WHERE conversation_id = ? AND id = ?")
                .bind(conversation_id)
                .bind(head_id)
                .fetch_optional(&mut *tx)
                .await?;
            if exists.is_none() {
                return Err(StoreError::NotFound);
            }
        }
        let version: i64 = sqlx::query_scalar(
            "UPDATE conversations SET head_id = ?, head_version = head_version + 1, \
             updated_at = ? WHERE id = ? RETURNING head_version",
        )
        .bind(head_id)
        .bind(updated_at)
        .bind(conversation_id)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(version)
    }

    async fn append_messages(&self, nodes: &[Node], updated_at: Millis) -> StoreResult<i64> {
        let (conversation_id, last_id) = codec::batch_target(nodes)?;
        let mut tx = self.write().await?;
        for node in nodes {
            insert_node(&mut tx, NODE_INSERT, node).await?;
        }
        let version = advance_head(&mut tx, conversation_id, last_id, updated_at).await?;
        tx.commit().await?;
        Ok(version)
    }

    async fn messages(&self, conversation_id: &str) -> StoreResult<Vec<Node>> {
        let rows =
            sqlx::query(concat!("SELECT ", node_columns!(), " FROM messages WHERE conversation_id = ? ORDER BY seq"))
                .bind(conversation_id)
                .fetch_all(&self.reader)
                .await?;
        rows.iter().map(codec::node_from_row).collect()
    }

    async fn message(&self, conversation_id: &str, message_id: &str) -> StoreResult<Option<Node>> {
        let row =
            sqlx::query(concat!("SELECT ", node_columns!(), " FROM messages WHERE conversation_id = ? AND id = ?"))
                .bind(conversation_id)
                .bind(message_id)
                .fetch_optional(&self.reader)
                .await?;
        row.as_ref().map(codec::node_from_row).transpose()
    }

    async fn update_message(&self, node: &Node) -> StoreResult<()> {
        let columns = NodeColumns::new(node)?;
        let result = sqlx::query(
            "UPDATE messages SET content = ?, parts = ?, tool_calls = ?, tool_call_id = ?, \
             tool_name = ?, tool_status = ?, model = ?, provider = ?, status = ? \
             WHERE conversation_id = ? AND id = ?",
        )
        .bind(&node.message.content)
        .bind(&columns.parts)
        .bind(&columns.tool_calls)
        .bind(&node.message.tool_call_id)
        .bind(&node.message.tool_name)
        .bind(columns.tool_status)
        .bind(&node.model)
        .bind(&node.provider)
        .bind(node.status.as_str())
        .bind(&node.conversation_id)
        .bind(&node.id)
        .execute(&self.writer)
        .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    async fn insert_turn(&self, turn: &Turn) -> StoreResult<()> {
        insert_turn_on(&self.writer, turn).await
    }

    async fn update_turn(&self, turn: &Turn) -> StoreResult<()> {
        update_turn_on(&self.writer, turn).await
    }

    async fn start_turn(&self, turn: &Turn, nodes: &[Node], queued_row: bool, updated_at: Millis) -> StoreResult<i64> {
        let mut tx = self.write().await?;
        let updated = if queued_row { update_turn_on(&mut *tx, turn).await } else { Err(StoreError::NotFound) };
        match updated {
            Ok(()) => {}
            Err(StoreError::NotFound) => insert_turn_on(&mut *tx, turn).await?,
            Err(error) => return Err(error),
        }
        let version = if nodes.is_empty() {
            let version: Option<i64> = sqlx::query_scalar("SELECT head_version FROM conversations WHERE id = ?")
                .bind(&turn.conversation_id)
                .fetch_optional(&mut *tx)
                .await?;
            version.ok_or(StoreError::NotFound)?
        } else {
            let (conversation_id, last_id) = codec::batch_target(nodes)?;
            for node in nodes {
                insert_node(&mut tx, NODE_INSERT, node).await?;
            }
            advance_head(&mut tx, conversation_id, last_id, updated_at).await?
        };
        tx.commit().await?;
        Ok(version)
    }

    async fn turn(&self, conversation_id: &str, turn_id: &str) -> StoreResult<Option<Turn>> {
        let row = sqlx::query(concat!("SELECT ", turn_columns!(), " FROM turns WHERE conversation_id = ? AND id = ?"))
            .bind(conversation_id)
            .bind(turn_id)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(codec::turn_from_row).transpose()
    }

    async fn turns_with_status(&self, statuses: &[TurnStatus]) -> StoreResult<Vec<Turn>> {
        // SQLite has no array parameters: the statuses travel as one JSON
        // array, unpacked by json_each, so the statement stays static.
        let names: Vec<&str> = statuses.iter().map(|status| status.as_str()).collect();
        let names = serde_json::to_string(&names).map_err(|error| StoreError::Database(error.to_string()))?;
        let rows = sqlx::query(concat!(
            "SELECT ",
            turn_columns!(),
            " FROM turns WHERE status IN (SELECT value FROM json_each(?)) \
             ORDER BY created_at, id"
        ))
        .bind(names)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(codec::turn_from_row).collect()
    }

    async fn record_call(&self, call: &ApiCall, message: Option<&Node>) -> StoreResult<LedgerEntry> {
        let mut tx = self.write().await?;
        let entry = charge_call(&mut tx, call, message).await?;
        tx.commit().await?;
        Ok(entry)
    }

    async fn finish_turn(
        &self,
        turn: &Turn,
        call: &ApiCall,
        reply: Option<&Node>,
        reservation_id: Option<&str>,
        updated_at: Millis,
    ) -> StoreResult<(LedgerEntry, Option<i64>)> {
        let mut tx = self.write().await?;
        if let Some(reservation_id) = reservation_id {
            release(&mut tx, reservation_id).await?;
        }
        let entry = charge_call(&mut tx, call, reply).await?;
        let head_version = match reply {
            Some(node) => Some(
                sqlx::query_scalar::<_, i64>("UPDATE conversations SET head_id = ?, head_version = head_version + 1, updated_at = ? WHERE id = ? RETURNING head_version")
                    .bind(&node.id)
                    .bind(updated_at)
                    .bind(&node.conversation_id)
                    .fetch_one(&mut *tx)
                    .await?,
            ),
            None => None,
        };
        update_turn_on(&mut *tx, turn).await?;
        tx.commit().await?;
        Ok((entry, head_version))
    }

    async fn api_calls(&self, turn_id: &str) -> StoreResult<Vec<ApiCall>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            api_call_columns!(),
            " FROM api_calls WHERE turn_id = ? ORDER BY created_at, id"
        ))
        .bind(turn_id)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(codec::api_call_from_row).collect()
    }

    async fn ledger(&self, user_id: &str, limit: u32) -> StoreResult<Vec<LedgerEntry>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            ledger_columns!(),
            " FROM cost_ledger WHERE user_id = ? ORDER BY created_at DESC, id DESC LIMIT ?"
        ))
        .bind(user_id)
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(codec::ledger_from_row).collect()
    }

    async fn set_balance(&self, user_id: &str, balance: Option<i64>) -> StoreResult<()> {
        let result = sqlx::query("UPDATE users SET balance_credits = ? WHERE id = ?")
            .bind(balance)
            .bind(user_id)
            .execute(&self.writer)
            .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    async fn append_events(&self, events: &[Event]) -> StoreResult<()> {
        if events.is_empty() {
            return Ok(());
        }
        let mut tx = self.write().await?;
        insert_events(&mut tx, events).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn append_events_numbered(&self, conversation_id: &str, events: &[Event]) -> StoreResult<Vec<Event>> {
        // The write transaction is the lock: no other writer can number
        // events between the read of the last seq and the commit.
        let mut tx = self.write().await?;
        let last: Option<i64> = sqlx::query_scalar(
            "SELECT (SELECT COALESCE(MAX(seq), 0) FROM events WHERE conversation_id = ?1) \
             FROM conversations WHERE id = ?1",
        )
        .bind(conversation_id)
        .fetch_optional(&mut *tx)
        .await?;
        let last = last.ok_or(StoreError::NotFound)?;
        let numbered = codec::number_events(conversation_id, last, events);
        insert_events(&mut tx, &numbered).await?;
        tx.commit().await?;
        Ok(numbered)
    }

    async fn events_after(&self, conversation_id: &str, after: i64, limit: u32) -> StoreResult<Vec<Event>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            event_columns!(),
            " FROM events WHERE conversation_id = ? AND seq > ? ORDER BY seq LIMIT ?"
        ))
        .bind(conversation_id)
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(codec::event_from_row).collect()
    }

    async fn last_event_seq(&self, conversation_id: &str) -> StoreResult<i64> {
        let seq: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(seq), 0) FROM events WHERE conversation_id = ?")
            .bind(conversation_id)
            .fetch_one(&self.reader)
            .await?;
        Ok(seq)
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
        let mut tx = self.write().await?;
        // The check and the hold are one statement, so no other reservation
        // or charge can slip between them.
        let held: Option<Option<i64>> = sqlx::query_scalar(
            "UPDATE users SET reserved_credits = reserved_credits + ? \
             WHERE id = ? AND (balance_credits IS NULL OR balance_credits - reserved_credits >= ?) \
             RETURNING balance_credits - reserved_credits",
        )
        .bind(reservation.credits)
        .bind(&reservation.user_id)
        .bind(reservation.credits)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(available_after) = held else {
            let available: Option<Option<i64>> =
                sqlx::query_scalar("SELECT balance_credits - reserved_credits FROM users WHERE id = ?")
                    .bind(&reservation.user_id)
                    .fetch_optional(&mut *tx)
                    .await?;
            let available = available.ok_or(StoreError::NotFound)?;
            return Ok(ReserveOutcome::Insufficient { available: available.unwrap_or(0) });
        };
        sqlx::query(
            "INSERT INTO credit_reservations (id, user_id, credits, created_at, expires_at) \
             VALUES (?, ?, ?, ?, ?)",
        )
        .bind(&reservation.id)
        .bind(&reservation.user_id)
        .bind(reservation.credits)
        .bind(reservation.created_at)
        .bind(reservation.expires_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(ReserveOutcome::Reserved { available_after })
    }

    async fn settle_reservation(
        &self,
        reservation_id: &str,
        call: &ApiCall,
        message: Option<&Node>,
    ) -> StoreResult<LedgerEntry> {
        let mut tx = self.write().await?;
        release(&mut tx, reservation_id).await?;
        let entry = charge_call(&mut tx, call, message).await?;
        tx.commit().await?;
        Ok(entry)
    }

    async fn release_reservation(&self, reservation_id: &str) -> StoreResult<bool> {
        let mut tx = self.write().await?;
        let released = release(&mut tx, reservation_id).await?;
        tx.commit().await?;
        Ok(released)
    }

    async fn release_expired_reservations(&self, now: Millis) -> StoreResult<u64> {
        let mut tx = self.write().await?;
        let expired: Vec<String> = sqlx::query_scalar("SELECT id FROM credit_reservations WHERE expires_at <= ?")
            .bind(now)
            .fetch_all(&mut *tx)
            .await?;
        for id in &expired {
            release(&mut tx, id).await?;
        }
        tx.commit().await?;
        Ok(expired.len() as u64)
    }

    async fn available_credits(&self, user_id: &str) -> StoreResult<Option<i64>> {
        let available: Option<Option<i64>> =
            sqlx::query_scalar("SELECT balance_credits - reserved_credits FROM users WHERE id = ?")
                .bind(user_id)
                .fetch_optional(&self.reader)
                .await?;
        available.ok_or(StoreError::NotFound)
    }

    async fn renew_lease(&self, turn_id: &str, owner: &str, expires_at: Millis) -> StoreResult<bool> {
        let result = sqlx::query(
            "UPDATE turns SET lease_owner = ?, lease_expires_at = ? \
             WHERE id = ? AND status = 'running' AND (lease_owner IS NULL OR lease_owner = ?)",
        )
        .bind(owner)
        .bind(expires_at)
        .bind(turn_id)
        .bind(owner)
        .execute(&self.writer)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    async fn expired_running_turns(&self, now: Millis) -> StoreResult<Vec<Turn>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            turn_columns!(),
            " FROM turns WHERE status = 'running' AND lease_expires_at <= ? \
             ORDER BY created_at, id"
        ))
        .bind(now)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(codec::turn_from_row).collect()
    }

    async fn take_over_turn(&self, turn_id: &str, owner: &str, now: Millis, expires_at: Millis) -> StoreResult<bool> {
        // The expiry is re-checked in the update itself: of several nodes
        // racing for the turn, the first one's new lease fails the others.
        let result = sqlx::query(
            "UPDATE turns SET lease_owner = ?, lease_expires_at = ? \
             WHERE id = ? AND status = 'running' AND lease_expires_at <= ?",
        )
        .bind(owner)
        .bind(expires_at)
        .bind(turn_id)
        .bind(now)
        .execute(&self.writer)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    async fn turn_lease(&self, turn_id: &str) -> StoreResult<Option<(String, Millis)>> {
        let row: Option<(Option<String>, Option<i64>)> =
            sqlx::query_as("SELECT lease_owner, lease_expires_at FROM turns WHERE id = ?")
                .bind(turn_id)
                .fetch_optional(&self.reader)
                .await?;
        Ok(match row {
            Some((Some(owner), Some(expires_at))) => Some((owner, expires_at)),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use sqlx::Connection;

    use super::*;

    #[test]
    fn urls_name_a_file_or_memory() {
        assert_eq!(parse_url("sqlite://./data/arbor.db").ok(), Some(Location::File(PathBuf::from("./data/arbor.db"))));
        assert_eq!(parse_url("sqlite:///tmp/a.db?mode=rwc").ok(), Some(Location::File(PathBuf::from("/tmp/a.db"))));
        assert_eq!(parse_url("sqlite::memory:").ok(), Some(Location::Memory));
        assert!(parse_url("sqlite://").is_err());
        assert!(parse_url("postgres://x").is_err());
    }

    #[tokio::test]
    async fn files_open_in_wal_mode_with_foreign_keys() {
        let folder = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", folder.path().join("a.db").display());
        let store = SqliteStore::open(&url).await.expect("opens");
        for pool in [&store.writer, &store.reader] {
            let mode: String = sqlx::query_scalar("PRAGMA journal_mode").fetch_one(pool).await.expect("journal mode");
            assert_eq!(mode, "wal");
            let foreign_keys: i64 =
                sqlx::query_scalar("PRAGMA foreign_keys").fetch_one(pool).await.expect("foreign keys");
            assert_eq!(foreign_keys, 1);
            // NORMAL is 1.
            let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous").fetch_one(pool).await.expect("synchronous");
            assert_eq!(synchronous, 1);
        }
    }

    #[test]
    fn event_inserts_have_one_row_of_parameters_per_event() {
        for rows in EVENT_INSERT_ROWS {
            assert_eq!(event_insert(rows).matches('?').count(), rows * 6, "{rows} rows");
        }
    }

    #[tokio::test]
    async fn event_batches_of_any_size_are_stored_whole_and_in_order() {
        let store = SqliteStore::open("sqlite::memory:").await.expect("opens");
        let owner = User { id: "u".into(), name: "u".into(), is_admin: false, balance_credits: None, created_at: 1 };
        store.create_user(&owner).await.expect("user");
        let conversation = Conversation {
            id: "c".into(),
            owner_id: "u".into(),
            title: None,
            system_prompt: None,
            preset_id: None,
            model: "m".into(),
            head_id: None,
            head_version: 0,
            summary: None,
            created_at: 1,
            updated_at: 1,
        };
        store.create_conversation(&conversation).await.expect("conversation");
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
        assert!(store.append_events(&clash).await.is_err());
        assert_eq!(store.last_event_seq("c").await.expect("reads"), next - 1);
    }

    #[tokio::test]
    async fn the_writer_leaves_checkpoints_to_the_background_task() {
        let folder = tempfile::tempdir().expect("temp dir");
        let path = folder.path().join("a.db");
        let store = SqliteStore::open(&format!("sqlite://{}", path.display())).await.expect("opens");
        let automatic: i64 =
            sqlx::query_scalar("PRAGMA wal_autocheckpoint").fetch_one(&store.writer).await.expect("reads");
        assert_eq!(automatic, 0, "the writer never checkpoints in its commits");
        let owner = User { id: "u".into(), name: "u".into(), is_admin: false, balance_credits: None, created_at: 1 };
        store.create_user(&owner).await.expect("writes");
        // An immutable connection reads the database file alone, without the
        // WAL: it sees the row only once a checkpoint has copied it there.
        let file_only = SqliteConnectOptions::new().filename(&path).immutable(true);
        let mut checkpointed = false;
        for _ in 0..50 {
            tokio::time::sleep(CHECKPOINT_EVERY).await;
            let mut connection = sqlx::SqliteConnection::connect_with(&file_only).await.expect("connects");
            let users: i64 = sqlx::query_scalar("SELECT count(*) FROM users WHERE id = 'u'")
                .fetch_one(&mut connection)
                .await
                .expect("reads");
            if users == 1 {
                checkpointed = true;
                break;
            }
        }
        assert!(checkpointed, "the background task copied the commit into the database file");
    }

    #[tokio::test]
    async fn memory_databases_keep_their_rows_while_open() {
        let store = SqliteStore::open("sqlite::memory:").await.expect("opens");
        let user = User { id: "u".into(), name: "n".into(), is_admin: true, balance_credits: None, created_at: 1 };
        store.create_user(&user).await.expect("create");
        assert_eq!(store.user("u").await.expect("read"), Some(user));
        assert_eq!(store.count_users().await.expect("count"), 1);
    }
}
