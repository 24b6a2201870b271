//! The PostgreSQL store: several `arbor serve` nodes on one database.
//!
//! Every rule the engine relies on across nodes is the database's: one
//! running turn per conversation (a partial unique index), unique message
//! ids and event numbers (primary keys), never-lost charges (a balance is
//! changed by one `UPDATE … RETURNING`, which locks the row), and head moves
//! checked against the version under a row lock. Batches go in one
//! statement (`UNNEST` of arrays) and a conversation's tree loads in one
//! ordered query, so no request costs a round trip per row.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use arbor_core::ids::Millis;
use arbor_core::{Event, Node};
use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions};
use sqlx::{Postgres, Row, Transaction};
use tokio::sync::{OnceCell, broadcast, oneshot};

use crate::codec::{self, NodeColumns, to_i64};
use crate::*;

/// The schema, embedded in the binary. Versions are the file name
/// prefixes; a landed file is never edited.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "initial", include_str!("../migrations/postgres/0001_initial.sql")),
    (2, "turn pending messages", include_str!("../migrations/postgres/0002_turn_pending_messages.sql")),
    (3, "lighter turn writes", include_str!("../migrations/postgres/0003_lighter_turn_writes.sql")),
    (4, "running turns indexed once", include_str!("../migrations/postgres/0004_running_turns_indexed_once.sql")),
    (5, "event counter", include_str!("../migrations/postgres/0005_event_counter.sql")),
    (6, "abort function", include_str!("../migrations/postgres/0006_abort_function.sql")),
    (7, "events numbered together", include_str!("../migrations/postgres/0007_events_numbered_together.sql")),
    (8, "event counters apart", include_str!("../migrations/postgres/0008_event_counters_apart.sql")),
    (9, "counters never behind", include_str!("../migrations/postgres/0009_counters_never_behind.sql")),
];

/// Connections per node. PostgreSQL's default limit is 100 connections in
/// all, so a handful of nodes at this size leave room for admin sessions.
const MAX_CONNECTIONS: u32 = 16;
/// How long a request waits for a free connection before failing, rather
/// than queueing forever behind a stuck pool.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle connections are closed after this, and every connection is replaced
/// after `MAX_LIFETIME`, so a fail-over or a server restart heals by itself.
const IDLE_TIMEOUT: Duration = Duration::from_secs(10 * 60);
const MAX_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// The `NOTIFY` channel every node listens on. One channel for all notices
/// keeps a node to one listening connection; the payload says what it is.
const NOTICE_CHANNEL: &str = "arbor_notices";
/// Notices a slow local listener may fall behind by before it is told it
/// lagged.
const NOTICE_BUFFER: usize = 1024;
/// Wait between attempts when the listening connection cannot be re-made.
const LISTEN_RETRY: Duration = Duration::from_secs(1);

/// A PostgreSQL database behind the [`Store`] trait.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    notices: Arc<NoticeHub>,
}

/// This node's end of `LISTEN`: one connection, started on the first
/// [`Store::listen`], fanning notices out to local receivers.
#[derive(Debug)]
struct NoticeHub {
    sender: broadcast::Sender<Notice>,
    /// This store's name in the notices it sends itself, so that its
    /// listener can leave them out (see [`NUMBERED_EVENTS_INSERT`]).
    origin: String,
    started: OnceCell<()>,
    /// Dropped with the last clone of the store, which ends the listening
    /// task (it holds the pool, so it would otherwise outlive the store).
    stop: std::sync::Mutex<Option<oneshot::Receiver<()>>>,
    _stop_sender: oneshot::Sender<()>,
}

/// A notice as sent on [`NOTICE_CHANNEL`]: the store that sent it names
/// itself only where its own listener must leave it out.
#[derive(serde::Deserialize)]
struct Envelope {
    #[serde(default)]
    origin: Option<String>,
    #[serde(flatten)]
    notice: Notice,
}

impl PostgresStore {
    /// Connects to `postgres://…` (or `postgresql://…`) and applies the
    /// migrations it lacks. Nodes starting together are safe: the migrator
    /// holds an advisory lock while it works.
    pub async fn open(url: &str) -> StoreResult<PostgresStore> {
        let options = PgConnectOptions::from_str(url)?;
        let pool = PgPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .min_connections(1)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .idle_timeout(IDLE_TIMEOUT)
            .max_lifetime(MAX_LIFETIME)
            // sqlx's default, kept on purpose: a connection is pinged before
            // it is handed out, so one PostgreSQL dropped while it sat idle
            // (a restart, a fail-over) is replaced instead of failing a turn
            // (test: postgres_pool_replaces_connections_killed_while_idle).
            // Off, PostgreSQL spent ~8% less CPU at 300 turns/s here
            // (bench/analysis.md).
            .test_before_acquire(true)
            .connect_with(options)
            .await?;
        codec::migrator(MIGRATIONS)
            .run(&pool)
            .await
            .map_err(|error| StoreError::Database(format!("migrating the database: {error}")))?;
        let (stop_sender, stop) = oneshot::channel();
        Ok(PostgresStore {
            pool,
            notices: Arc::new(NoticeHub {
                sender: broadcast::channel(NOTICE_BUFFER).0,
                origin: uuid::Uuid::now_v7().simple().to_string(),
                started: OnceCell::new(),
                stop: std::sync::Mutex::new(Some(stop)),
                _stop_sender: stop_sender,
            }),
        })
    }

    /// Opens the listening connection and starts the task that forwards its
    /// notices. `LISTEN` has taken effect when this returns.
    async fn start_listening(&self) -> StoreResult<()> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(NOTICE_CHANNEL).await?;
        let stop = self
            .notices
            .stop
            .lock()
            .map_err(|_| StoreError::Database("the notice hub lock is poisoned".into()))?
            .take();
        let Some(mut stop) = stop else {
            return Err(StoreError::Database("the notice listener was started twice".into()));
        };
        let sender = self.notices.sender.clone();
        let origin = self.notices.origin.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = &mut stop => return,
                    received = listener.try_recv() => match received {
                        Ok(Some(notification)) => {
                            match serde_json::from_str::<Envelope>(notification.payload()) {
                                // Its own batches' events this node's writer
                                // has already.
                                Ok(Envelope { origin: Some(from), .. }) if from == origin => {}
                                Ok(Envelope { notice, .. }) => {
                                    let _ = sender.send(notice);
                                }
                                Err(error) => tracing::warn!(
                                    %error,
                                    payload = notification.payload(),
                                    "ignoring a notice this version does not understand"
                                ),
                            }
                        }
                        // The connection was lost; the next call re-makes it
                        // and listens again. Anything sent meanwhile is gone,
                        // so listeners must re-read the store.
                        Ok(None) => {
                            let _ = sender.send(Notice::Resync);
                        }
                        Err(error) => {
                            tracing::warn!(%error, "listening for notices failed; retrying");
                            tokio::select! {
                                _ = &mut stop => return,
                                _ = tokio::time::sleep(LISTEN_RETRY) => {}
                            }
                        }
                    },
                }
            }
        });
        Ok(())
    }

    async fn begin(&self) -> StoreResult<Transaction<'static, Postgres>> {
        Ok(self.pool.begin().await?)
    }
}

/// The rows of a batch of nodes: the sixteen arrays of [`NodeArrays`],
/// always bound first ($1–$16), one row per node.
macro_rules! node_rows {
    () => {
        "UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], \
         $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[], $13::text[], \
         $14::text[], $15::text[], $16::bigint[])"
    };
}

/// Inserts a batch of nodes ([`node_rows`]). `WITH ORDINALITY … ORDER BY`
/// hands the rows to the insert in batch order, so `seq` (the creation
/// order) follows the order the engine gave. Foreign keys are checked at
/// the end of the statement, so a node may name an earlier one of the same
/// batch as its parent.
macro_rules! nodes_insert {
    () => {
        concat!(
            "INSERT INTO messages (",
            node_columns!(),
            ") SELECT ",
            node_columns!(),
            " FROM ",
            node_rows!(),
            " WITH ORDINALITY AS batch (",
            node_columns!(),
            ", position) ORDER BY position"
        )
    };
}

const NODES_INSERT: &str = nodes_insert!();

/// A new running turn, its messages and the head moved to the last of them,
/// in one statement (the round trips of three were on the path of every
/// turn's first token). Parameters: $1–$16 the messages' arrays
/// (`NodeArrays`), $17–$36 the turn (`bind_turn`), $37 the new head, $38 the
/// time, $39 the conversation and $40, $41 the lease's owner and expiry
/// (NULL without one). Returns the new head version; when the
/// conversation is gone it fails with `arbor_abort` (`NotFound`) and keeps
/// nothing, so it needs no transaction around it.
const START_TURN: &str = concat!(
    "WITH started AS (INSERT INTO turns (",
    turn_columns!(),
    ", lease_owner, lease_expires_at) VALUES ($17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, \
       $30, $31, $32, $33, $34, $35, $36, $40, $41) RETURNING 1), \
     added AS (",
    nodes_insert!(),
    " RETURNING 1), \
     head AS (UPDATE conversations SET head_id = $37, head_version = head_version + 1, updated_at = $38 \
       WHERE id = $39 RETURNING head_version) \
     SELECT COALESCE((SELECT head_version FROM head), arbor_abort('the conversation is gone'))"
);

/// One node, inserted or, when its id exists, updated in place (identity
/// and place in the tree stay as they were).
const NODE_UPSERT: &str = concat!(
    "INSERT INTO messages (",
    node_columns!(),
    ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16) ",
    node_upsert_conflict!()
);

async fn insert_nodes<N: Borrow<Node>>(tx: &mut Transaction<'static, Postgres>, nodes: &[N]) -> StoreResult<()> {
    NodeArrays::new(nodes)?.bind(sqlx::query(NODES_INSERT)).execute(&mut **tx).await?;
    Ok(())
}

/// Inserts a batch of one conversation's nodes and moves its head to the
/// last of them, inside the caller's transaction; returns the new head
/// version.
async fn append_on<N: Borrow<Node> + Sync>(
    tx: &mut Transaction<'static, Postgres>,
    nodes: &[N],
    updated_at: Millis,
) -> StoreResult<i64> {
    let (conversation_id, last_id) = codec::batch_target(nodes)?;
    insert_nodes(tx, nodes).await?;
    let version: Option<i64> = sqlx::query_scalar(
        "UPDATE conversations SET head_id = $1, head_version = head_version + 1, \
         updated_at = $2 WHERE id = $3 RETURNING head_version",
    )
    .bind(last_id)
    .bind(updated_at)
    .bind(conversation_id)
    .fetch_optional(&mut **tx)
    .await?;
    version.ok_or(StoreError::NotFound)
}

/// A batch of nodes as column-wise arrays, one per parameter of an
/// `UNNEST` insert ([`node_rows`]: [`NODES_INSERT`], [`START_TURN`], [`FINISH_TURN`]).
struct NodeArrays<'a> {
    conversation_ids: Vec<&'a str>,
    ids: Vec<&'a str>,
    parent_ids: Vec<Option<&'a str>>,
    roles: Vec<&'a str>,
    contents: Vec<Option<&'a str>>,
    parts: Vec<Option<String>>,
    tool_calls: Vec<Option<String>>,
    tool_call_ids: Vec<Option<&'a str>>,
    tool_names: Vec<Option<&'a str>>,
    tool_statuses: Vec<Option<&'static str>>,
    models: Vec<Option<&'a str>>,
    providers: Vec<Option<&'a str>>,
    turn_ids: Vec<Option<&'a str>>,
    copied_froms: Vec<Option<&'a str>>,
    statuses: Vec<&'a str>,
    created_ats: Vec<i64>,
}

impl<'a> NodeArrays<'a> {
    fn new<N: Borrow<Node>>(nodes: &'a [N]) -> StoreResult<Self> {
        let mut arrays = NodeArrays {
            conversation_ids: Vec::with_capacity(nodes.len()),
            ids: Vec::with_capacity(nodes.len()),
            parent_ids: Vec::with_capacity(nodes.len()),
            roles: Vec::with_capacity(nodes.len()),
            contents: Vec::with_capacity(nodes.len()),
            parts: Vec::with_capacity(nodes.len()),
            tool_calls: Vec::with_capacity(nodes.len()),
            tool_call_ids: Vec::with_capacity(nodes.len()),
            tool_names: Vec::with_capacity(nodes.len()),
            tool_statuses: Vec::with_capacity(nodes.len()),
            models: Vec::with_capacity(nodes.len()),
            providers: Vec::with_capacity(nodes.len()),
            turn_ids: Vec::with_capacity(nodes.len()),
            copied_froms: Vec::with_capacity(nodes.len()),
            statuses: Vec::with_capacity(nodes.len()),
            created_ats: Vec::with_capacity(nodes.len()),
        };
        for node in nodes.iter().map(N::borrow) {
            let columns = NodeColumns::new(node)?;
            arrays.conversation_ids.push(node.conversation_id.as_str());
            arrays.ids.push(node.id.as_str());
            arrays.parent_ids.push(node.parent_id.as_deref());
            arrays.roles.push(node.message.role.as_str());
            arrays.contents.push(node.message.content.as_deref());
            arrays.parts.push(columns.parts);
            arrays.tool_calls.push(columns.tool_calls);
            arrays.tool_call_ids.push(node.message.tool_call_id.as_deref());
            arrays.tool_names.push(node.message.tool_name.as_deref());
            arrays.tool_statuses.push(columns.tool_status);
            arrays.models.push(node.model.as_deref());
            arrays.providers.push(node.provider.as_deref());
            arrays.turn_ids.push(node.turn_id.as_deref());
            arrays.copied_froms.push(node.copied_from.as_deref());
            arrays.statuses.push(node.status.as_str());
            arrays.created_ats.push(node.created_at);
        }
        Ok(arrays)
    }

    /// Binds the sixteen arrays, in column order, as the next parameters.
    fn bind(self, query: PgQuery<'a>) -> PgQuery<'a> {
        query
            .bind(self.conversation_ids)
            .bind(self.ids)
            .bind(self.parent_ids)
            .bind(self.roles)
            .bind(self.contents)
            .bind(self.parts)
            .bind(self.tool_calls)
            .bind(self.tool_call_ids)
            .bind(self.tool_names)
            .bind(self.tool_statuses)
            .bind(self.models)
            .bind(self.providers)
            .bind(self.turn_ids)
            .bind(self.copied_froms)
            .bind(self.statuses)
            .bind(self.created_ats)
    }
}

/// A query with PostgreSQL's arguments, for the helpers that bind a row.
type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

/// Binds a call's eighteen columns, in `api_call_columns!` order, as the
/// next parameters.
fn bind_call<'q>(query: PgQuery<'q>, call: &'q ApiCall) -> PgQuery<'q> {
    query
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
}

async fn upsert_node(tx: &mut Transaction<'static, Postgres>, node: &Node) -> StoreResult<()> {
    let columns = NodeColumns::new(node)?;
    sqlx::query(NODE_UPSERT)
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

/// Stores a model call, its message and its charge, inside the caller's
/// transaction (shared by `record_call` and `settle_reservation`).
async fn charge_call(
    tx: &mut Transaction<'static, Postgres>,
    call: &ApiCall,
    message: Option<&Node>,
) -> StoreResult<LedgerEntry> {
    if let Some(node) = message {
        upsert_node(tx, node).await?;
    }
    bind_call(
        sqlx::query(concat!(
            "INSERT INTO api_calls (",
            api_call_columns!(),
            ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, \
             $17, $18)"
        )),
        call,
    )
    .execute(&mut **tx)
    .await?;
    let credits = to_i64(call.cost_micro_usd);
    // One statement reads and writes the balance under the row lock, so
    // charges from every node add up and none is lost. A NULL
    // (unlimited) balance stays NULL.
    let balance_after: Option<Option<i64>> = sqlx::query_scalar(
        "UPDATE users SET balance_credits = balance_credits - $1 WHERE id = $2 \
         RETURNING balance_credits",
    )
    .bind(credits)
    .bind(&call.user_id)
    .fetch_optional(&mut **tx)
    .await?;
    let balance_after = balance_after.ok_or(StoreError::NotFound)?;
    let entry = LedgerEntry::for_call(call, balance_after);
    sqlx::query(concat!("INSERT INTO cost_ledger (", ledger_columns!(), ") VALUES ($1, $2, $3, $4, $5, $6)"))
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

/// Holds a reservation's credits, inside the caller's transaction.
async fn reserve(tx: &mut Transaction<'static, Postgres>, reservation: &Reservation) -> StoreResult<ReserveOutcome> {
    // The check and the hold are one statement. Under READ COMMITTED a
    // concurrent reservation waits for this row lock and then re-checks
    // the condition against the new total, so the sum held can never
    // pass the balance, whichever node asks.
    let held: Option<Option<i64>> = sqlx::query_scalar(
        "UPDATE users SET reserved_credits = reserved_credits + $1 \
         WHERE id = $2 AND (balance_credits IS NULL OR balance_credits - reserved_credits >= $1) \
         RETURNING balance_credits - reserved_credits",
    )
    .bind(reservation.credits)
    .bind(&reservation.user_id)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(available_after) = held else {
        let available: Option<Option<i64>> =
            sqlx::query_scalar("SELECT balance_credits - reserved_credits FROM users WHERE id = $1")
                .bind(&reservation.user_id)
                .fetch_optional(&mut **tx)
                .await?;
        let available = available.ok_or(StoreError::NotFound)?;
        return Ok(ReserveOutcome::Insufficient { available: available.unwrap_or(0) });
    };
    sqlx::query(
        "INSERT INTO credit_reservations (id, user_id, credits, created_at, expires_at) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(&reservation.id)
    .bind(&reservation.user_id)
    .bind(reservation.credits)
    .bind(reservation.created_at)
    .bind(reservation.expires_at)
    .execute(&mut **tx)
    .await?;
    Ok(ReserveOutcome::Reserved { available_after })
}

/// Gives a reservation's credits back, inside the caller's transaction.
/// Returns whether the reservation still existed.
async fn release(tx: &mut Transaction<'static, Postgres>, reservation_id: &str) -> StoreResult<bool> {
    let released: Option<i64> = sqlx::query_scalar(
        "WITH gone AS (DELETE FROM credit_reservations WHERE id = $1 RETURNING user_id, credits) \
         UPDATE users SET reserved_credits = GREATEST(users.reserved_credits - gone.credits, 0) \
         FROM gone WHERE users.id = gone.user_id RETURNING gone.credits",
    )
    .bind(reservation_id)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(released.is_some())
}

/// Numbers a batch of events of one or more conversations, stores them and
/// announces them, in one statement and so in one transaction of its own;
/// returns, for each conversation that exists, the number before its
/// batch's first (its events are `last_before + 1 ..` in the order given,
/// as `codec::number_events` numbers them). A conversation that is gone
/// has no row, and its events are not stored.
///
/// - Numbering: `arbor_number_events` (migrations 7 to 9) moves each
///   conversation's counter (its row of `event_counters`, not the
///   conversation's row, which a turn's start and end update) past its part
///   of the batch, by key, in the order of $1 (sorted, so batches lock
///   shared counters alike). The update (for a conversation's first batch,
///   the insert) holds the counter until the statement commits, so a
///   concurrent
///   batch (of any node) waits, then numbers from the counter as this one
///   left it (PostgreSQL re-reads a row updated meanwhile): numbers have no
///   holes and become visible in order. A counter is never behind its
///   conversation's stored events (`append_events` moves it too), so the
///   highest stored number is read only when a conversation's counter is
///   made, and an existing counter also says the conversation exists.
/// - Durability: events are not waited on (viewers have them once
///   numbered), so the commit does not wait for the WAL flush
///   (`synchronous_commit` off for this transaction). WAL is flushed in
///   order, so the next synchronous commit (a turn's start or end, on any
///   node) makes these durable too; a crash of the database can lose only a
///   suffix of the events, never leave a gap.
/// - The announcement: a [`Notice::Events`] per conversation, up to its
///   last number, sent with the commit, for the other nodes. It names this
///   store as its `origin`, and this store's listener leaves it out: the
///   node's own writer publishes the batch once this returns, and a notice
///   that came first would make the node read the events back.
///
/// One statement for all the conversations a batch holds: streamed turns
/// emit a `delta` every few milliseconds each, so a batch used to be one
/// statement (and commit) per event (bench/analysis.md). The side effects
/// are in the final `SELECT`, evaluated once per row of `bumped`.
/// Parameters: $1 the conversations (sorted, distinct), $2 how many events
/// each has in the batch, $3–$7 the events' conversations, turn ids,
/// names, data and times, $8 the notice channel, $9 the origin.
const NUMBERED_EVENTS_INSERT: &str = concat!(
    "WITH bumped AS (SELECT * FROM arbor_number_events($1::text[], $2::bigint[])), \
     stored AS (INSERT INTO events (",
    event_columns!(),
    ") SELECT batch.conversation_id, bumped.last_before + row_number() OVER \
         (PARTITION BY batch.conversation_id ORDER BY batch.position), \
       batch.turn_id, batch.name, batch.data, batch.created_at \
       FROM UNNEST($3::text[], $4::text[], $5::text[], $6::text[], $7::bigint[]) \
       WITH ORDINALITY AS batch (conversation_id, turn_id, name, data, created_at, position) \
       JOIN bumped ON bumped.conversation = batch.conversation_id RETURNING 1) \
     SELECT conversation, last_before, set_config('synchronous_commit', 'off', true), \
       pg_notify($8, json_build_object('kind', 'events', 'conversation_id', conversation, 'seq', last_seq, \
         'origin', $9::text)::text)::text \
     FROM bumped"
);

/// Inserts events in one statement (`UNNEST` of column arrays).
async fn insert_events(connection: &mut PgConnection, events: &[Event]) -> StoreResult<()> {
    let conversation_ids: Vec<&str> = events.iter().map(|e| &*e.conversation_id).collect();
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    let turn_ids: Vec<Option<&str>> = events.iter().map(|e| e.turn_id.as_deref()).collect();
    let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
    let data: Vec<&str> = events.iter().map(|e| &*e.data).collect();
    let created_ats: Vec<i64> = events.iter().map(|e| e.created_at).collect();
    // Events of a conversation that no longer exists are left out (see
    // `Store::append_events`). A deletion that commits between this check
    // and the row's foreign key check still fails the batch (`NotFound`);
    // the event writer's retry then leaves that conversation out. The
    // counters move past what is stored, so that events numbered by the
    // database later come after these (migration 9: a counter is never
    // behind its conversation's events).
    sqlx::query(concat!(
        "WITH stored AS (INSERT INTO events (",
        event_columns!(),
        ") SELECT * FROM UNNEST($1::text[], $2::bigint[], $3::text[], $4::text[], \
         $5::text[], $6::bigint[]) AS batch (conversation_id, seq, turn_id, name, data, created_at) \
         WHERE EXISTS (SELECT 1 FROM conversations WHERE conversations.id = batch.conversation_id) \
         RETURNING conversation_id, seq) \
         INSERT INTO event_counters AS counter (conversation_id, seq) \
         SELECT conversation_id, MAX(seq) FROM stored GROUP BY conversation_id \
         ON CONFLICT (conversation_id) DO UPDATE SET seq = GREATEST(counter.seq, EXCLUDED.seq)"
    ))
    .bind(conversation_ids)
    .bind(seqs)
    .bind(turn_ids)
    .bind(names)
    .bind(data)
    .bind(created_ats)
    .execute(connection)
    .await?;
    Ok(())
}

/// A finished turn in one statement: the reservation given back, the reply
/// stored (inserted, or updated in place), the call, its charge and ledger
/// row, the head moved to the reply and the turn's final state. The same
/// rules as the separate statements: the balance changes in one `UPDATE …
/// RETURNING` under the row lock, foreign keys are checked at the end of
/// the statement (so the ledger row may name the call inserted beside it).
/// A row is changed at most once per statement in PostgreSQL, so the
/// user's charge and the release of their reservation are one update; a
/// reservation of another user (the engine makes none) is released apart.
/// An unlimited user's row (no balance, nothing reserved given back) is
/// not updated: its `NULL` would stay `NULL`, and the update's row lock,
/// held through the commit's WAL flush, made every turn of one user (an
/// application calling with one key) wait for the one before it.
/// The head is found by the reply's conversation id as a value (`id =
/// (SELECT …)`), not by joining the reply: planned while conversations was
/// small, the join became a hash join over the whole table: every finished
/// turn read all of conversations (~250 rows a turn after 4,000 turns on 450
/// conversations), a cost that grows with the table (bench/analysis.md).
/// Parameters: $1–$16 the reply as `NodeArrays` of one node, or of none;
/// $17 the reservation (or NULL); $18–$35 the call (`bind_call`);
/// $36 the time of the head move; $37–$53 the turn (`bind_turn_update`).
/// Returns NULL, the
/// user's balance after and the new head version (with a reply), and sends
/// $55 (the turn's [`Notice::TurnFinished`], see [`notice_payload`]) on the
/// channel $54 with the commit. When the
/// user, the reply's conversation or the turn is gone, the first column
/// calls `arbor_abort` (`NotFound`) and the statement keeps nothing (nor
/// sends anything), so it needs no transaction around it.
const FINISH_TURN: &str = concat!(
    "WITH gone AS (DELETE FROM credit_reservations WHERE id = $17 RETURNING user_id, credits), \
     released AS (UPDATE users SET reserved_credits = GREATEST(users.reserved_credits - gone.credits, 0) \
       FROM gone WHERE users.id = gone.user_id AND users.id <> $21 RETURNING 1), \
     reply AS (INSERT INTO messages (",
    node_columns!(),
    ") SELECT ",
    node_columns!(),
    " FROM ",
    node_rows!(),
    " AS batch (",
    node_columns!(),
    ") ",
    node_upsert_conflict!(),
    " RETURNING conversation_id, id), \
     call AS (INSERT INTO api_calls (",
    api_call_columns!(),
    ") VALUES ($18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31, $32, $33, $34, $35) \
       RETURNING 1), \
     charged AS (UPDATE users SET balance_credits = balance_credits - $34, \
       reserved_credits = GREATEST(users.reserved_credits \
         - COALESCE((SELECT sum(gone.credits) FROM gone WHERE gone.user_id = users.id), 0), 0) \
       WHERE id = $21 AND (balance_credits IS NOT NULL \
         OR EXISTS (SELECT 1 FROM gone WHERE gone.user_id = users.id)) RETURNING balance_credits), \
     payer AS (SELECT 1 FROM users WHERE id = $21), \
     entry AS (INSERT INTO cost_ledger (",
    ledger_columns!(),
    ") SELECT $18, $21, $18, $34, (SELECT balance_credits FROM charged), $35 FROM payer RETURNING 1), \
     head AS (UPDATE conversations SET head_id = (SELECT id FROM reply), head_version = head_version + 1, \
       updated_at = $36 WHERE id = (SELECT conversation_id FROM reply) RETURNING head_version), \
     finished AS (UPDATE turns SET status = $37, model = $38, iterations = $39, input_tokens = $40, \
       output_tokens = $41, thinking_tokens = $42, cached_tokens = $43, \
       cache_write_tokens = $44, cost_micro_usd = $45, reply_message_id = $46, \
       error_code = $47, error_message = $48, started_at = $49, finished_at = $50, \
       pending_messages = $51 WHERE conversation_id = $52 AND id = $53 RETURNING 1) \
     SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM payer) OR NOT EXISTS (SELECT 1 FROM finished) \
         OR (cardinality($1::text[]) > 0 AND NOT EXISTS (SELECT 1 FROM head)) \
         THEN arbor_abort('the user, the reply''s conversation or the turn is gone') END, \
       (SELECT balance_credits FROM charged), (SELECT head_version FROM head), \
       pg_notify($54, $55)::text"
);

/// A notice as sent on [`NOTICE_CHANNEL`] (the listener reads it back as
/// an [`Envelope`]).
fn notice_payload(notice: &Notice) -> StoreResult<String> {
    arbor_core::json::to_string(notice)
        .map_err(|error| StoreError::Database(format!("cannot encode a notice: {error}")))
}

/// The usual start of a turn ([`START_TURN`]) with `executor` (the pool, or
/// a transaction that also reserves credits); returns the new head version.
async fn start_usual<'e, E>(
    executor: E,
    turn: &Turn,
    nodes: &[Arc<Node>],
    updated_at: Millis,
    lease: Option<(&str, Millis)>,
) -> StoreResult<i64>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let (conversation_id, last_id) = codec::batch_target(nodes)?;
    let query = bind_turn(NodeArrays::new(nodes)?.bind(sqlx::query(START_TURN)), turn);
    let row = query
        .bind(last_id)
        .bind(updated_at)
        .bind(conversation_id)
        .bind(lease.map(|(owner, _)| owner))
        .bind(lease.map(|(_, expires_at)| expires_at))
        .fetch_one(executor)
        .await
        .map_err(codec::running_turn_conflict)?;
    Ok(row.try_get::<i64, _>(0)?)
}

/// Inserts a turn with `executor` (the pool, or a shared transaction).
async fn insert_turn_on<'e, E>(executor: E, turn: &Turn) -> StoreResult<()>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    bind_turn(
        sqlx::query(concat!(
            "INSERT INTO turns (",
            turn_columns!(),
            ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, \
             $17, $18, $19, $20)"
        )),
        turn,
    )
    .execute(executor)
    .await
    .map_err(codec::running_turn_conflict)?;
    Ok(())
}

/// Binds a turn's twenty columns, in `turn_columns!` order, as the next
/// parameters.
fn bind_turn<'q>(query: PgQuery<'q>, turn: &'q Turn) -> PgQuery<'q> {
    let query = query.bind(&turn.id).bind(&turn.conversation_id).bind(&turn.user_id).bind(&turn.user_message_id);
    bind_turn_outcome(query, turn)
        .bind(turn.created_at)
        .bind(turn.started_at)
        .bind(turn.finished_at)
        .bind(codec::pending_json(turn))
}

/// Binds a turn's status, model, iterations, usage, cost, reply and error:
/// the twelve columns from `status` to `error_message` that an insert and
/// an update of a turn write in the same order.
fn bind_turn_outcome<'q>(query: PgQuery<'q>, turn: &'q Turn) -> PgQuery<'q> {
    query
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
}

/// Binds what a turn's update writes (status, totals, error, times,
/// pending messages), then its conversation and id: seventeen parameters.
fn bind_turn_update<'q>(query: PgQuery<'q>, turn: &'q Turn) -> PgQuery<'q> {
    bind_turn_outcome(query, turn)
        .bind(turn.started_at)
        .bind(turn.finished_at)
        .bind(codec::pending_json(turn))
        .bind(&turn.conversation_id)
        .bind(&turn.id)
}

/// Writes a turn's status, totals, error and times with `executor` (the
/// pool, or a transaction shared with other writes).
async fn update_turn_on<'e, E>(executor: E, turn: &Turn) -> StoreResult<()>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let result = bind_turn_update(
        sqlx::query(
            "UPDATE turns SET status = $1, model = $2, iterations = $3, input_tokens = $4, \
             output_tokens = $5, thinking_tokens = $6, cached_tokens = $7, \
             cache_write_tokens = $8, cost_micro_usd = $9, reply_message_id = $10, \
             error_code = $11, error_message = $12, started_at = $13, finished_at = $14, \
             pending_messages = $15 WHERE conversation_id = $16 AND id = $17",
        ),
        turn,
    )
    .execute(executor)
    .await
    .map_err(codec::running_turn_conflict)?;
    if result.rows_affected() == 0 {
        return Err(StoreError::NotFound);
    }
    Ok(())
}

#[async_trait]
impl Store for PostgresStore {
    async fn create_user(&self, user: &User) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO users (id, name, is_admin, balance_credits, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&user.id)
        .bind(&user.name)
        .bind(user.is_admin)
        .bind(user.balance_credits)
        .bind(user.created_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn user_by_name(&self, name: &str) -> StoreResult<Option<User>> {
        let row = sqlx::query(concat!("SELECT ", user_columns!(), " FROM users WHERE name = $1"))
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(codec::user_from_row).transpose()
    }

    async fn user(&self, user_id: &str) -> StoreResult<Option<User>> {
        let row = sqlx::query(concat!("SELECT ", user_columns!(), " FROM users WHERE id = $1"))
            .bind(user_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(codec::user_from_row).transpose()
    }

    async fn count_users(&self) -> StoreResult<u64> {
        let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM users").fetch_one(&self.pool).await?;
        Ok(codec::to_u64(count))
    }

    async fn create_api_key(&self, key: &ApiKey) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO api_keys (id, user_id, key_hash, prefix, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&key.id)
        .bind(&key.user_id)
        .bind(&key.key_hash)
        .bind(&key.prefix)
        .bind(key.created_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn user_by_key_hash(&self, key_hash: &str) -> StoreResult<Option<User>> {
        let row = sqlx::query(
            "SELECT users.id, users.name, users.is_admin, users.balance_credits, \
             users.created_at FROM api_keys JOIN users ON users.id = api_keys.user_id \
             WHERE api_keys.key_hash = $1 AND api_keys.revoked_at IS NULL",
        )
        .bind(key_hash)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(codec::user_from_row).transpose()
    }

    async fn create_conversation(&self, conversation: &Conversation) -> StoreResult<()> {
        sqlx::query(concat!(
            "INSERT INTO conversations (",
            conversation_columns!(),
            ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
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
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn conversation(&self, owner_id: &str, conversation_id: &str) -> StoreResult<Option<Conversation>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            conversation_columns!(),
            " FROM conversations WHERE owner_id = $1 AND id = $2"
        ))
        .bind(owner_id)
        .bind(conversation_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(codec::conversation_from_row).transpose()
    }

    async fn conversation_for_turn(
        &self,
        owner_id: &str,
        conversation_id: &str,
    ) -> StoreResult<Option<(Conversation, Option<i64>)>> {
        // The owner's row exists while the conversation does (the foreign
        // key cascades), so the subquery always finds it.
        let row = sqlx::query(concat!(
            "SELECT ",
            conversation_columns!(),
            ", (SELECT balance_credits - reserved_credits FROM users WHERE users.id = $1) AS available_credits \
             FROM conversations WHERE owner_id = $1 AND id = $2"
        ))
        .bind(owner_id)
        .bind(conversation_id)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let available: Option<i64> = row.try_get("available_credits")?;
        Ok(Some((codec::conversation_from_row(&row)?, available)))
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
                    " FROM conversations WHERE owner_id = $1 \
                     ORDER BY created_at DESC, id DESC LIMIT $2"
                ))
                .bind(owner_id)
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await?
            }
            Some(cursor) => {
                sqlx::query(concat!(
                    "SELECT ",
                    conversation_columns!(),
                    " FROM conversations WHERE owner_id = $1 AND (created_at, id) < ($2, $3) \
                     ORDER BY created_at DESC, id DESC LIMIT $4"
                ))
                .bind(owner_id)
                .bind(cursor.created_at)
                .bind(&cursor.id)
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
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
            "UPDATE conversations SET title = COALESCE($1, title), \
             system_prompt = COALESCE($2, system_prompt), model = COALESCE($3, model), \
             updated_at = $4 WHERE owner_id = $5 AND id = $6 RETURNING ",
            conversation_columns!()
        ))
        .bind(&update.title)
        .bind(&update.system_prompt)
        .bind(&update.model)
        .bind(update.updated_at)
        .bind(owner_id)
        .bind(conversation_id)
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(row) => codec::conversation_from_row(&row),
            None => Err(StoreError::NotFound),
        }
    }

    async fn delete_conversation(&self, owner_id: &str, conversation_id: &str) -> StoreResult<()> {
        // Messages, turns and events go with it (ON DELETE CASCADE); api
        // calls and the ledger stay, as billing history. The event counter
        // goes first, in a statement of its own: an event batch locks the
        // counter and then (checking its events' foreign key) the
        // conversation, so a deletion that locked the conversation first
        // and then waited for the counter could deadlock with it.
        let mut tx = self.begin().await?;
        sqlx::query(
            "DELETE FROM event_counters WHERE conversation_id = $2 \
             AND EXISTS (SELECT 1 FROM conversations WHERE owner_id = $1 AND id = $2)",
        )
        .bind(owner_id)
        .bind(conversation_id)
        .execute(&mut *tx)
        .await?;
        let result = sqlx::query("DELETE FROM conversations WHERE owner_id = $1 AND id = $2")
            .bind(owner_id)
            .bind(conversation_id)
            .execute(&mut *tx)
            .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound);
        }
        tx.commit().await?;
        Ok(())
    }

    async fn set_head(
        &self,
        conversation_id: &str,
        head_id: Option<&str>,
        expected_version: Option<i64>,
        updated_at: Millis,
    ) -> StoreResult<i64> {
        let mut tx = self.begin().await?;
        // The row lock holds other nodes' head moves off until this one
        // commits, so the version compared is the version replaced.
        let current: Option<i64> =
            sqlx::query_scalar("SELECT head_version FROM conversations WHERE id = $1 FOR UPDATE")
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
            let exists: Option<i32> =
                sqlx::query_scalar("SELECT 1 FROM messages WHERE conversation_id = $1 AND id = $2")
                    .bind(conversation_id)
                    .bind(head_id)
                    .fetch_optional(&mut *tx)
                    .await?;
            if exists.is_none() {
                return Err(StoreError::NotFound);
            }
        }
        let version: i64 = sqlx::query_scalar(
            "UPDATE conversations SET head_id = $1, head_version = head_version + 1, \
             updated_at = $2 WHERE id = $3 RETURNING head_version",
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
        let mut tx = self.begin().await?;
        let version = append_on(&mut tx, nodes, updated_at).await?;
        tx.commit().await?;
        Ok(version)
    }

    async fn messages(&self, conversation_id: &str) -> StoreResult<Vec<Node>> {
        let rows =
            sqlx::query(concat!("SELECT ", node_columns!(), " FROM messages WHERE conversation_id = $1 ORDER BY seq"))
                .bind(conversation_id)
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(codec::node_from_row).collect()
    }

    async fn message(&self, conversation_id: &str, message_id: &str) -> StoreResult<Option<Node>> {
        let row =
            sqlx::query(concat!("SELECT ", node_columns!(), " FROM messages WHERE conversation_id = $1 AND id = $2"))
                .bind(conversation_id)
                .bind(message_id)
                .fetch_optional(&self.pool)
                .await?;
        row.as_ref().map(codec::node_from_row).transpose()
    }

    async fn update_message(&self, node: &Node) -> StoreResult<()> {
        let columns = NodeColumns::new(node)?;
        let result = sqlx::query(
            "UPDATE messages SET content = $1, parts = $2, tool_calls = $3, tool_call_id = $4, \
             tool_name = $5, tool_status = $6, model = $7, provider = $8, status = $9 \
             WHERE conversation_id = $10 AND id = $11",
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
        .execute(&self.pool)
        .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    async fn insert_turn(&self, turn: &Turn) -> StoreResult<()> {
        insert_turn_on(&self.pool, turn).await
    }

    async fn update_turn(&self, turn: &Turn) -> StoreResult<()> {
        update_turn_on(&self.pool, turn).await
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
        let usual = !queued_row && !nodes.is_empty();
        if usual && reservation.is_none() {
            // One statement is its own transaction: no BEGIN and COMMIT.
            let head_version = start_usual(&self.pool, turn, nodes, updated_at, lease).await?;
            return Ok(TurnStarted { head_version, reserved: None });
        }
        let mut tx = self.begin().await?;
        let version = if usual {
            start_usual(&mut *tx, turn, nodes, updated_at, lease).await?
        } else {
            let updated = if queued_row { update_turn_on(&mut *tx, turn).await } else { Err(StoreError::NotFound) };
            match updated {
                Ok(()) => {}
                Err(StoreError::NotFound) => insert_turn_on(&mut *tx, turn).await?,
                Err(error) => return Err(error),
            }
            if let Some((owner, expires_at)) = lease {
                sqlx::query("UPDATE turns SET lease_owner = $1, lease_expires_at = $2 WHERE id = $3")
                    .bind(owner)
                    .bind(expires_at)
                    .bind(&turn.id)
                    .execute(&mut *tx)
                    .await?;
            }
            if nodes.is_empty() {
                let version: Option<i64> = sqlx::query_scalar("SELECT head_version FROM conversations WHERE id = $1")
                    .bind(&turn.conversation_id)
                    .fetch_optional(&mut *tx)
                    .await?;
                version.ok_or(StoreError::NotFound)?
            } else {
                append_on(&mut tx, nodes, updated_at).await?
            }
        };
        // Last, after the statements that can conflict with a finishing
        // turn, so that no transaction waits for another while holding the
        // user's row.
        let reserved = match reservation {
            Some(reservation) => Some(reserve(&mut tx, reservation).await?),
            None => None,
        };
        tx.commit().await?;
        Ok(TurnStarted { head_version: version, reserved })
    }

    async fn turn(&self, conversation_id: &str, turn_id: &str) -> StoreResult<Option<Turn>> {
        let row =
            sqlx::query(concat!("SELECT ", turn_columns!(), " FROM turns WHERE conversation_id = $1 AND id = $2"))
                .bind(conversation_id)
                .bind(turn_id)
                .fetch_optional(&self.pool)
                .await?;
        row.as_ref().map(codec::turn_from_row).transpose()
    }

    async fn turns_with_status(&self, statuses: &[TurnStatus]) -> StoreResult<Vec<Turn>> {
        let names: Vec<&str> = statuses.iter().map(|status| status.as_str()).collect();
        // Live turns are found through the partial indexes of running and
        // of queued turns, which the planner can use only when the query
        // implies their conditions.
        let sql = if statuses.iter().all(|status| !status.is_finished()) {
            concat!(
                "SELECT ",
                turn_columns!(),
                " FROM turns WHERE status = 'running' AND 'running' = ANY($1) UNION ALL SELECT ",
                turn_columns!(),
                " FROM turns WHERE status = 'queued' AND 'queued' = ANY($1) ORDER BY created_at, id"
            )
        } else {
            concat!("SELECT ", turn_columns!(), " FROM turns WHERE status = ANY($1) ORDER BY created_at, id")
        };
        let rows = sqlx::query(sql).bind(names).fetch_all(&self.pool).await?;
        rows.iter().map(codec::turn_from_row).collect()
    }

    async fn record_call(&self, call: &ApiCall, message: Option<&Node>) -> StoreResult<LedgerEntry> {
        let mut tx = self.begin().await?;
        let entry = charge_call(&mut tx, call, message).await?;
        tx.commit().await?;
        Ok(entry)
    }

    async fn finish_turn(
        &self,
        turn: &Arc<Turn>,
        call: ApiCall,
        reply: Option<&Arc<Node>>,
        reservation_id: Option<&str>,
        updated_at: Millis,
    ) -> StoreResult<(LedgerEntry, Option<i64>)> {
        // One statement instead of six, and no BEGIN and COMMIT around it:
        // each was a round trip to the database while the turn's `done`
        // waited.
        let replies = reply.map_or(&[][..], std::slice::from_ref);
        let query = NodeArrays::new(replies)?.bind(sqlx::query(FINISH_TURN)).bind(reservation_id);
        let query = bind_call(query, &call).bind(updated_at);
        let finished = Notice::TurnFinished { conversation_id: turn.conversation_id.clone(), turn_id: turn.id.clone() };
        let row = bind_turn_update(query, turn)
            .bind(NOTICE_CHANNEL)
            .bind(notice_payload(&finished)?)
            .fetch_one(&self.pool)
            .await
            .map_err(codec::running_turn_conflict)?;
        let (balance_after, head_version): (Option<i64>, Option<i64>) = (row.try_get(1)?, row.try_get(2)?);
        Ok((LedgerEntry::for_call(&call, balance_after), head_version))
    }

    async fn api_calls(&self, turn_id: &str) -> StoreResult<Vec<ApiCall>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            api_call_columns!(),
            " FROM api_calls WHERE turn_id = $1 ORDER BY created_at, id"
        ))
        .bind(turn_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(codec::api_call_from_row).collect()
    }

    async fn ledger(&self, user_id: &str, limit: u32) -> StoreResult<Vec<LedgerEntry>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            ledger_columns!(),
            " FROM cost_ledger WHERE user_id = $1 ORDER BY created_at DESC, id DESC LIMIT $2"
        ))
        .bind(user_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(codec::ledger_from_row).collect()
    }

    async fn set_balance(&self, user_id: &str, balance: Option<i64>) -> StoreResult<()> {
        let result = sqlx::query("UPDATE users SET balance_credits = $1 WHERE id = $2")
            .bind(balance)
            .bind(user_id)
            .execute(&self.pool)
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
        // One statement is one transaction: a batch is stored whole or not
        // at all.
        let mut connection = self.pool.acquire().await?;
        insert_events(&mut connection, events).await
    }

    async fn append_events_numbered(&self, events: &[Event]) -> StoreResult<Vec<Event>> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let (conversations, counts) = codec::events_by_conversation(events);
        let conversation_ids: Vec<&str> = events.iter().map(|e| &*e.conversation_id).collect();
        let turn_ids: Vec<Option<&str>> = events.iter().map(|e| e.turn_id.as_deref()).collect();
        let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
        let data: Vec<&str> = events.iter().map(|e| &*e.data).collect();
        let created_ats: Vec<i64> = events.iter().map(|e| e.created_at).collect();
        let rows = sqlx::query(NUMBERED_EVENTS_INSERT)
            .bind(conversations)
            .bind(counts)
            .bind(conversation_ids)
            .bind(turn_ids)
            .bind(names)
            .bind(data)
            .bind(created_ats)
            .bind(NOTICE_CHANNEL)
            .bind(&self.notices.origin)
            .fetch_all(&self.pool)
            .await?;
        let mut last_before = HashMap::with_capacity(rows.len());
        for row in &rows {
            last_before.insert(row.try_get::<String, _>(0)?, row.try_get::<i64, _>(1)?);
        }
        Ok(codec::number_events(events, last_before))
    }

    async fn events_after(&self, conversation_id: &str, after: i64, limit: u32) -> StoreResult<Vec<Event>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            event_columns!(),
            " FROM events WHERE conversation_id = $1 AND seq > $2 ORDER BY seq LIMIT $3"
        ))
        .bind(conversation_id)
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(codec::event_from_row).collect()
    }

    async fn last_event_seq(&self, conversation_id: &str) -> StoreResult<i64> {
        let seq: i64 =
            sqlx::query_scalar("SELECT COALESCE(MAX(seq), 0)::bigint FROM events WHERE conversation_id = $1")
                .bind(conversation_id)
                .fetch_one(&self.pool)
                .await?;
        Ok(seq)
    }

    async fn notify(&self, notice: &Notice) -> StoreResult<()> {
        let payload = notice_payload(notice)?;
        sqlx::query("SELECT pg_notify($1, $2)").bind(NOTICE_CHANNEL).bind(payload).execute(&self.pool).await?;
        Ok(())
    }

    async fn listen(&self) -> StoreResult<broadcast::Receiver<Notice>> {
        // Subscribe before making sure the listener runs, so nothing that
        // arrives once this returns can be missed.
        let receiver = self.notices.sender.subscribe();
        self.notices.started.get_or_try_init(|| self.start_listening()).await?;
        Ok(receiver)
    }

    async fn reserve_credits(&self, reservation: &Reservation) -> StoreResult<ReserveOutcome> {
        let mut tx = self.begin().await?;
        let outcome = reserve(&mut tx, reservation).await?;
        tx.commit().await?;
        Ok(outcome)
    }

    async fn settle_reservation(
        &self,
        reservation_id: &str,
        call: &ApiCall,
        message: Option<&Node>,
    ) -> StoreResult<LedgerEntry> {
        let mut tx = self.begin().await?;
        release(&mut tx, reservation_id).await?;
        let entry = charge_call(&mut tx, call, message).await?;
        tx.commit().await?;
        Ok(entry)
    }

    async fn release_reservation(&self, reservation_id: &str) -> StoreResult<bool> {
        let mut tx = self.begin().await?;
        let released = release(&mut tx, reservation_id).await?;
        tx.commit().await?;
        Ok(released)
    }

    async fn release_expired_reservations(&self, now: Millis) -> StoreResult<u64> {
        // One statement: delete the expired rows and give each user back
        // the sum of theirs.
        let released: i64 = sqlx::query_scalar(
            "WITH gone AS ( \
                 DELETE FROM credit_reservations WHERE expires_at <= $1 \
                 RETURNING user_id, credits), \
             per_user AS ( \
                 SELECT user_id, SUM(credits)::bigint AS credits, COUNT(*) AS count \
                 FROM gone GROUP BY user_id), \
             updated AS ( \
                 UPDATE users SET reserved_credits = \
                     GREATEST(users.reserved_credits - per_user.credits, 0) \
                 FROM per_user WHERE users.id = per_user.user_id \
                 RETURNING per_user.count) \
             SELECT COALESCE(SUM(count), 0)::bigint FROM updated",
        )
        .bind(now)
        .fetch_one(&self.pool)
        .await?;
        Ok(codec::to_u64(released))
    }

    async fn available_credits(&self, user_id: &str) -> StoreResult<Option<i64>> {
        let available: Option<Option<i64>> =
            sqlx::query_scalar("SELECT balance_credits - reserved_credits FROM users WHERE id = $1")
                .bind(user_id)
                .fetch_optional(&self.pool)
                .await?;
        available.ok_or(StoreError::NotFound)
    }

    async fn renew_lease(&self, turn_id: &str, owner: &str, expires_at: Millis) -> StoreResult<bool> {
        let result = sqlx::query(
            "UPDATE turns SET lease_owner = $1, lease_expires_at = $2 \
             WHERE id = $3 AND status = 'running' AND (lease_owner IS NULL OR lease_owner = $1)",
        )
        .bind(owner)
        .bind(expires_at)
        .bind(turn_id)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    async fn expired_running_turns(&self, now: Millis) -> StoreResult<Vec<Turn>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            turn_columns!(),
            " FROM turns WHERE status = 'running' AND lease_expires_at <= $1 ORDER BY created_at, id"
        ))
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(codec::turn_from_row).collect()
    }

    async fn take_over_turn(&self, turn_id: &str, owner: &str, now: Millis, expires_at: Millis) -> StoreResult<bool> {
        // The expiry is re-checked in the update itself: of several nodes
        // racing for the turn, the first one's new lease fails the others
        // (each waits for the row lock, then re-reads the lease).
        let result = sqlx::query(
            "UPDATE turns SET lease_owner = $1, lease_expires_at = $2 \
             WHERE id = $3 AND status = 'running' AND lease_expires_at <= $4",
        )
        .bind(owner)
        .bind(expires_at)
        .bind(turn_id)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    async fn turn_lease(&self, turn_id: &str) -> StoreResult<Option<(String, Millis)>> {
        let row: Option<(Option<String>, Option<i64>)> =
            sqlx::query_as("SELECT lease_owner, lease_expires_at FROM turns WHERE id = $1")
                .bind(turn_id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(match row {
            Some((Some(owner), Some(expires_at))) => Some((owner, expires_at)),
            _ => None,
        })
    }
}
