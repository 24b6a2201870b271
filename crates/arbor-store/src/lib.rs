//! Persistence. The [`Store`] trait is everything the engine may ask of a
//! database; [`sqlite::SqliteStore`] (the embedded default) and
//! [`postgres::PostgresStore`] (several nodes on one database) implement it,
//! each with its own migrations. Only this crate knows SQL.
//!
//! Every read of user data takes the owner's id, so a query can never reach
//! another user's rows. Ids and timestamps arrive made (by the engine) and are
//! stored as given.
// `unsafe` is denied but for one module, `sqlite::vfs`, which forwards
// SQLite's file calls to its unix VFS through its C interface (see there and
// ARCHITECTURE.md for why).
#![deny(unsafe_code)]

#[macro_use]
mod columns;
mod codec;
pub mod postgres;
pub mod records;
pub mod sqlite;
pub mod testing;

use std::sync::Arc;

use arbor_core::ids::Millis;
use arbor_core::{Event, Node};
use async_trait::async_trait;

pub use records::*;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("not found")]
    NotFound,
    /// A uniqueness rule was broken (a user name, a message id in its
    /// conversation, a second running turn).
    #[error("conflict: {0}")]
    Conflict(String),
    /// The head moved since the caller read it.
    #[error("the head version is {current}, not the expected one")]
    HeadVersionMismatch { current: i64 },
    #[error("database error: {0}")]
    Database(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> StoreError {
        match &error {
            sqlx::Error::RowNotFound => StoreError::NotFound,
            sqlx::Error::Database(database) if database.is_unique_violation() => {
                StoreError::Conflict(database.message().to_string())
            }
            // A row that points at a missing one: the conversation, user or
            // parent message named does not exist.
            sqlx::Error::Database(database) if database.is_foreign_key_violation() => StoreError::NotFound,
            // A PostgreSQL statement that found one of its rows gone and
            // called `arbor_abort` (migration 6).
            sqlx::Error::Database(database) if database.code().as_deref() == Some("AR404") => StoreError::NotFound,
            _ => StoreError::Database(error.to_string()),
        }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Opens the store a database URL names: `sqlite://PATH` (created if
/// missing) or `postgres://…`. Migrations are applied.
pub async fn open(database_url: &str) -> StoreResult<std::sync::Arc<dyn Store>> {
    if database_url.starts_with("sqlite:") {
        Ok(std::sync::Arc::new(sqlite::SqliteStore::open(database_url).await?))
    } else if database_url.starts_with("postgres://") || database_url.starts_with("postgresql://") {
        Ok(std::sync::Arc::new(postgres::PostgresStore::open(database_url).await?))
    } else {
        // The URL may hold a password: name only its scheme.
        let scheme = database_url.split(':').next().unwrap_or_default();
        Err(StoreError::Database(format!(
            "unsupported database url scheme {scheme:?}: use sqlite://PATH or postgres://…"
        )))
    }
}

/// Everything Arbor keeps. Implementations must be safe to share between
/// tasks; each method is one transaction unless it says otherwise.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Whether this process is the only one that can write the database
    /// while it has it open (SQLite under `locking=exclusive`, or in
    /// memory): then a row this process wrote stays as written until it
    /// writes it again, and the engine may keep busy conversations' rows in
    /// memory instead of reading them back for each turn.
    fn sole_writer(&self) -> bool {
        false
    }

    // ---- users and keys ----

    /// Creates a user. `Conflict` when the name is taken.
    async fn create_user(&self, user: &User) -> StoreResult<()>;
    async fn user_by_name(&self, name: &str) -> StoreResult<Option<User>>;
    async fn user(&self, user_id: &str) -> StoreResult<Option<User>>;
    async fn count_users(&self) -> StoreResult<u64>;
    /// Stores a key (only its SHA-256 hash).
    async fn create_api_key(&self, key: &ApiKey) -> StoreResult<()>;
    /// The user a key hash belongs to, if the key exists and is not revoked.
    async fn user_by_key_hash(&self, key_hash: &str) -> StoreResult<Option<User>>;

    // ---- conversations ----

    async fn create_conversation(&self, conversation: &Conversation) -> StoreResult<()>;
    /// The owner's conversation, or `None` (also when someone else owns it).
    async fn conversation(&self, owner_id: &str, conversation_id: &str) -> StoreResult<Option<Conversation>>;
    /// The owner's conversation with the owner's available credits (as
    /// [`Store::available_credits`] reads them), in one read: what a turn
    /// reads first. `None` as for [`Store::conversation`].
    async fn conversation_for_turn(
        &self,
        owner_id: &str,
        conversation_id: &str,
    ) -> StoreResult<Option<(Conversation, Option<i64>)>>;
    /// The owner's conversations, newest first (by `created_at`, then id),
    /// starting after `cursor` when given.
    async fn list_conversations(
        &self,
        owner_id: &str,
        cursor: Option<&ConversationCursor>,
        limit: u32,
    ) -> StoreResult<Vec<Conversation>>;
    /// Changes title / system prompt / default model (fields that are `Some`).
    async fn update_conversation(
        &self,
        owner_id: &str,
        conversation_id: &str,
        update: &ConversationUpdate,
    ) -> StoreResult<Conversation>;
    /// Deletes the conversation and everything in it.
    async fn delete_conversation(&self, owner_id: &str, conversation_id: &str) -> StoreResult<()>;
    /// Moves the head; bumps `head_version`. With `expected_version`, fails
    /// with `HeadVersionMismatch` (changing nothing) when it differs.
    async fn set_head(
        &self,
        conversation_id: &str,
        head_id: Option<&str>,
        expected_version: Option<i64>,
        updated_at: arbor_core::ids::Millis,
    ) -> StoreResult<i64>;

    // ---- messages (tree nodes) ----

    /// Inserts nodes in order, in one transaction, and moves the head to the
    /// last one (bumping `head_version`). `Conflict` when an id exists in the
    /// conversation (nothing is written then).
    async fn append_messages(&self, nodes: &[Node], updated_at: arbor_core::ids::Millis) -> StoreResult<i64>;
    /// Every node of the conversation, in creation order.
    async fn messages(&self, conversation_id: &str) -> StoreResult<Vec<Node>>;
    async fn message(&self, conversation_id: &str, message_id: &str) -> StoreResult<Option<Node>>;
    /// Replaces a stored node's content, parts, tool calls and status (an
    /// interrupted reply being kept, a repaired branch).
    async fn update_message(&self, node: &Node) -> StoreResult<()>;

    // ---- turns ----

    async fn insert_turn(&self, turn: &Turn) -> StoreResult<()>;
    /// Writes the turn's status, totals, error and times.
    async fn update_turn(&self, turn: &Turn) -> StoreResult<()>;
    /// Starts a turn in ONE transaction: writes it as running (inserted, or
    /// updated when `queued_row` says its queued row may exist) and records
    /// the messages it answers, moving the head to the last. Nothing is
    /// written when either fails: `Conflict` for a second running turn or a
    /// message id already in the conversation. With `reservation`, the same
    /// transaction holds credits for the turn's first call as
    /// [`Store::reserve_credits`] does; credits that do not cover it are
    /// reported in [`TurnStarted::reserved`] and the turn and its messages
    /// are written all the same (the user's message is never lost). With
    /// `lease` (`(owner, expires_at)`, as [`Store::renew_lease`] takes it),
    /// the turn is written holding it: a node that dies right after the
    /// start leaves a turn the others can take over, not one without a
    /// lease, which none would. The turn and the nodes are shared (`Arc`):
    /// the caller keeps them (the running turn, the conversation's tree),
    /// and a store that writes on another thread takes them there without a
    /// copy.
    async fn start_turn(
        &self,
        turn: &Arc<Turn>,
        nodes: &[Arc<Node>],
        queued_row: bool,
        updated_at: Millis,
        reservation: Option<&Reservation>,
        lease: Option<(&str, Millis)>,
    ) -> StoreResult<TurnStarted>;
    async fn turn(&self, conversation_id: &str, turn_id: &str) -> StoreResult<Option<Turn>>;
    /// Turns in one of `statuses`, across all conversations (crash recovery).
    async fn turns_with_status(&self, statuses: &[TurnStatus]) -> StoreResult<Vec<Turn>>;

    // ---- model calls, cost and quota ----

    /// In one transaction: stores `message` (if any; a new node, or an update
    /// of an existing one with the same id), the api call, a ledger row
    /// charging `call.cost_micro_usd` credits to `call.user_id`, and deducts
    /// that from the user's balance (when the user has one). The ledger row's
    /// id is the call's. Does not move the head. Recorded spend is real
    /// spend, so the balance may go below zero here; [`Store::reserve_credits`]
    /// is what keeps calls from starting without the credits.
    async fn record_call(&self, call: &ApiCall, message: Option<&Node>) -> StoreResult<LedgerEntry>;
    /// Ends a turn's last model call in ONE transaction (one commit where
    /// separate calls would make four): gives back its reservation (if any),
    /// stores the call, its reply and its charge as [`Store::record_call`]
    /// does, moves the head to the reply (when there is one) and writes the
    /// finished turn. Returns the ledger entry and the head version after
    /// the move. Announces [`Notice::TurnFinished`] to every node's
    /// listeners with its commit, as [`Store::notify`] would, without a
    /// round trip of its own. The turn is shared and the call given, as in
    /// [`Store::start_turn`]: neither is copied to be written.
    async fn finish_turn(
        &self,
        turn: &Arc<Turn>,
        call: ApiCall,
        reply: Option<&Arc<Node>>,
        reservation_id: Option<&str>,
        updated_at: Millis,
    ) -> StoreResult<(LedgerEntry, Option<i64>)>;
    async fn api_calls(&self, turn_id: &str) -> StoreResult<Vec<ApiCall>>;
    async fn ledger(&self, user_id: &str, limit: u32) -> StoreResult<Vec<LedgerEntry>>;
    /// Sets a user's credit balance (`None`: unlimited).
    async fn set_balance(&self, user_id: &str, balance: Option<i64>) -> StoreResult<()>;

    // ---- events ----

    /// Appends events (already numbered) in one transaction. Events of a
    /// conversation that no longer exists are dropped (they would have been
    /// deleted with it; a turn cancelled by the deletion still reports its
    /// end), and the rest of the batch, other conversations' events, is
    /// stored: one deleted conversation must not cost the others theirs.
    /// Events numbered by the store later ([`Store::append_events_numbered`])
    /// come after these.
    async fn append_events(&self, events: &[Event]) -> StoreResult<()>;
    /// Appends events numbered by the database, of one conversation or
    /// several, in one transaction: each conversation's after its highest
    /// stored `seq`, in the order given, holding the conversation's
    /// numbering until the commit. Whichever node writes, numbers have no
    /// holes and become visible in order, so a client resuming after `n`
    /// can never skip an event committed later under a smaller number. The
    /// given `seq` values are ignored; the events are returned as stored,
    /// in the order given. Events of a conversation that does not exist are
    /// left out (as in [`Store::append_events`]), and the others stored.
    /// Each conversation's part is announced to the other nodes' listeners with
    /// the commit ([`Notice::Events`] up to its last number), as
    /// [`Store::notify`] would, without a round trip of its own; this
    /// store's own listeners do not get it (the caller has the events).
    async fn append_events_numbered(&self, events: &[Event]) -> StoreResult<Vec<Event>>;
    /// Events of a conversation with `seq > after`, in order, at most `limit`.
    async fn events_after(&self, conversation_id: &str, after: i64, limit: u32) -> StoreResult<Vec<Event>>;
    /// The highest stored `seq` of a conversation (0 when none).
    async fn last_event_seq(&self, conversation_id: &str) -> StoreResult<i64>;

    // ---- several nodes: wake-ups, quota reservations, turn leases ----

    /// Sends a notice to every listener of every node sharing the database
    /// (this node's included). Best effort: listeners re-read the store.
    async fn notify(&self, notice: &Notice) -> StoreResult<()>;
    /// Subscribes to notices. Every notice sent after this returns is
    /// delivered, unless the receiver lags (then it gets `Lagged` and should
    /// re-read the store, as for [`Notice::Resync`]).
    async fn listen(&self) -> StoreResult<tokio::sync::broadcast::Receiver<Notice>>;

    /// Holds `reservation.credits` of the user's balance for a call about to
    /// be made, atomically against every other reservation and charge: the
    /// sum held never exceeds the balance. `NotFound` for an unknown user,
    /// `Conflict` for a reused reservation id. A turn's first call holds
    /// its credits through [`Store::start_turn`] instead; this is for a
    /// later call of the same turn (a tool loop's next iteration, which the
    /// engine does not make yet).
    async fn reserve_credits(&self, reservation: &Reservation) -> StoreResult<ReserveOutcome>;
    /// [`Store::record_call`] for a reserved call: in the same transaction
    /// the reservation is given back (if it still exists; an expired one may
    /// have been released already) and the call's real cost charged.
    async fn settle_reservation(
        &self,
        reservation_id: &str,
        call: &ApiCall,
        message: Option<&Node>,
    ) -> StoreResult<LedgerEntry>;
    /// Gives a reservation back without a charge (the call was never made).
    /// Returns whether it still existed.
    async fn release_reservation(&self, reservation_id: &str) -> StoreResult<bool>;
    /// Gives back every reservation that expired by `now` (left by a node
    /// that died); returns how many.
    async fn release_expired_reservations(&self, now: Millis) -> StoreResult<u64>;
    /// Credits a user may still reserve (`balance - reserved`; `None` when
    /// unlimited). `NotFound` for an unknown user.
    async fn available_credits(&self, user_id: &str) -> StoreResult<Option<i64>>;

    /// Claims or extends the lease of a running turn for `owner` (a node id)
    /// until `expires_at`. True when `owner` holds the lease now; false when
    /// the turn is not running or another node holds it (then `owner` must
    /// stop the turn: it was taken over).
    async fn renew_lease(&self, turn_id: &str, owner: &str, expires_at: Millis) -> StoreResult<bool>;
    /// Running turns whose lease expired by `now` (their node stopped
    /// renewing: it died), oldest first. Running turns that never had a
    /// lease are not included.
    async fn expired_running_turns(&self, now: Millis) -> StoreResult<Vec<Turn>>;
    /// Takes over a running turn whose lease expired by `now`, for `owner`
    /// until `expires_at`. True for exactly one of several nodes racing for
    /// it; false when it was renewed, taken or finished meanwhile.
    async fn take_over_turn(&self, turn_id: &str, owner: &str, now: Millis, expires_at: Millis) -> StoreResult<bool>;
    /// The lease of a turn: `(owner, expires_at)`, or `None` when it has
    /// none (or the turn does not exist).
    async fn turn_lease(&self, turn_id: &str) -> StoreResult<Option<(String, Millis)>>;
}
