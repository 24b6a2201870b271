//! Translation between the record types and database columns, shared by the
//! SQLite and PostgreSQL stores so both read and write rows the same way.
//!
//! The decoders read rows through [`RowSource`], which both backends' row
//! types implement (sqlx's PostgreSQL rows, rusqlite's SQLite rows wrapped
//! in [`SqliteRow`]): both
//! schemas store the same column names as the same Rust types (`String`,
//! `i64`, `bool`), so one decoder per record serves both and the two stores
//! cannot drift apart in how, say, a tool call is parsed back.

use std::borrow::{Borrow, Cow};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arbor_core::message::NodeStatus;
use arbor_core::{Event, EventName, Message, Node, Part, Role, ToolCall, ToolStatus, Usage};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::SqlSafeStr;
use sqlx::migrate::{Migration, MigrationType, Migrator};

use crate::{ApiCall, Conversation, LedgerEntry, StoreError, StoreResult, Turn, TurnStatus, User};

/// Counters are `u64` in Rust and signed 64-bit in both databases. Real
/// token counts and costs are far below `i64::MAX`; saturating keeps a
/// corrupt value from wrapping into a negative charge.
pub(crate) fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The inverse of [`to_i64`]; a negative stored value (never written by
/// Arbor) reads as zero rather than as a huge number.
pub(crate) fn to_u64(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// A list column: NULL when empty, to keep plain text messages small.
pub(crate) fn json_list<T: Serialize>(items: &[T]) -> StoreResult<Option<String>> {
    if items.is_empty() {
        return Ok(None);
    }
    arbor_core::json::to_string(items)
        .map(Some)
        .map_err(|error| StoreError::Database(format!("cannot serialize a json column: {error}")))
}

fn parse_json_list<T: DeserializeOwned>(column: &str, text: Option<String>) -> StoreResult<Vec<T>> {
    match text {
        None => Ok(Vec::new()),
        Some(text) => serde_json::from_str(&text)
            .map_err(|error| StoreError::Database(format!("stored {column} is not valid json: {error}"))),
    }
}

pub(crate) fn tool_status_text(status: Option<ToolStatus>) -> Option<&'static str> {
    status.map(|status| match status {
        ToolStatus::Success => "success",
        ToolStatus::Error => "error",
        ToolStatus::Cancelled => "cancelled",
        ToolStatus::Denied => "denied",
    })
}

fn parse_tool_status(text: Option<String>) -> StoreResult<Option<ToolStatus>> {
    let Some(text) = text else { return Ok(None) };
    let status = match text.as_str() {
        "success" => ToolStatus::Success,
        "error" => ToolStatus::Error,
        "cancelled" => ToolStatus::Cancelled,
        "denied" => ToolStatus::Denied,
        _ => return Err(corrupt("tool_status", &text)),
    };
    Ok(Some(status))
}

fn corrupt(column: &str, value: &str) -> StoreError {
    StoreError::Database(format!("stored {column} {value:?} is not a known value"))
}

/// The columns of a node, encoded once so every insert binds the same values.
pub(crate) struct NodeColumns {
    pub parts: Option<String>,
    pub tool_calls: Option<String>,
    pub tool_status: Option<&'static str>,
}

impl NodeColumns {
    pub fn new(node: &Node) -> StoreResult<NodeColumns> {
        Ok(NodeColumns {
            parts: json_list::<Part>(&node.message.parts)?,
            tool_calls: json_list::<ToolCall>(&node.message.tool_calls)?,
            tool_status: tool_status_text(node.message.tool_status),
        })
    }
}

/// A database row whose columns can be read by name as the few types the
/// schemas use. Each backend implements it for its own row type.
///
/// Columns are named by literals: a SQLite query's later rows recognise a
/// column by the name its first row recorded (see [`ColumnPlaces`]).
pub(crate) trait RowSource {
    fn text(&self, column: &'static str) -> StoreResult<String>;
    fn optional_text(&self, column: &'static str) -> StoreResult<Option<String>>;
    fn integer(&self, column: &'static str) -> StoreResult<i64>;
    fn optional_integer(&self, column: &'static str) -> StoreResult<Option<i64>>;
    fn flag(&self, column: &'static str) -> StoreResult<bool>;
}

/// A type a [`RowSource`] column can be read as.
pub(crate) trait FromColumn: Sized {
    fn read(row: &impl RowSource, column: &'static str) -> StoreResult<Self>;
}

macro_rules! from_column {
    ($($type:ty => $method:ident),* $(,)?) => {
        $(impl FromColumn for $type {
            fn read(row: &impl RowSource, column: &'static str) -> StoreResult<Self> {
                row.$method(column)
            }
        })*
    };
}

from_column! {
    String => text,
    Option<String> => optional_text,
    i64 => integer,
    Option<i64> => optional_integer,
    bool => flag,
}

/// The error for a column that cannot be read, naming it.
pub(crate) fn column_error(column: &str, error: impl std::fmt::Display) -> StoreError {
    StoreError::Database(format!("cannot read column {column}: {error}"))
}

/// Reads one column, naming it in the error when it fails.
fn get<T: FromColumn>(row: &impl RowSource, column: &'static str) -> StoreResult<T> {
    T::read(row, column)
}

/// A row is read the same way whatever the type read.
macro_rules! row_source {
    ($row:ty, $get:path) => {
        impl RowSource for $row {
            fn text(&self, column: &'static str) -> StoreResult<String> {
                $get(self, column).map_err(|error| column_error(column, error))
            }
            fn optional_text(&self, column: &'static str) -> StoreResult<Option<String>> {
                $get(self, column).map_err(|error| column_error(column, error))
            }
            fn integer(&self, column: &'static str) -> StoreResult<i64> {
                $get(self, column).map_err(|error| column_error(column, error))
            }
            fn optional_integer(&self, column: &'static str) -> StoreResult<Option<i64>> {
                $get(self, column).map_err(|error| column_error(column, error))
            }
            fn flag(&self, column: &'static str) -> StoreResult<bool> {
                $get(self, column).map_err(|error| column_error(column, error))
            }
        }
    };
}

row_source!(sqlx::postgres::PgRow, sqlx::Row::try_get);
row_source!(SqliteRow<'_, '_>, SqliteRow::get);

/// A SQLite row whose columns are found by name cheaply.
///
/// rusqlite finds a column by name by asking SQLite for each column's name
/// in turn (a call and a `strlen` each) and comparing it case-blind: ~1,300
/// instructions a column read, ~11,000 to decode a conversation and many
/// times that for a long conversation's nodes (`bench/profile.md`). The
/// decoders read columns in the order the statements select them, so the
/// column after the last one read is tried first, and only a miss falls
/// back to rusqlite's search (the decoders below read in the column
/// lists' order, which a test holds them to).
///
/// Even the guess asks SQLite for the column's name (a call, a `strlen`
/// and a UTF-8 check, ~130 instructions): 2,000 columns for a path of 125
/// messages. So the rows of one query share [`ColumnPlaces`]: the first
/// row records each column it read, and the later ones take it from there.
pub(crate) struct SqliteRow<'a, 'r> {
    row: &'a rusqlite::Row<'r>,
    places: Option<&'a ColumnPlaces>,
    /// Columns read from this row so far.
    read: Cell<usize>,
    next: Cell<usize>,
    /// Columns whose name was asked of SQLite, and of those, found by
    /// rusqlite's search (tests count them).
    named: Cell<u32>,
    searches: Cell<u32>,
}

/// Where one query's decoder found each column it read, in the order it
/// read them, as its first row recorded: every row of a statement has the
/// same columns, and a decoder reads the same ones in the same order. A
/// later row takes the n-th column read from here when its name is the one
/// recorded (a comparison of a few bytes); any other read is found as in a
/// first row, and recorded in its place.
#[derive(Default)]
pub(crate) struct ColumnPlaces(RefCell<Vec<(&'static str, usize)>>);

impl ColumnPlaces {
    /// Where the `nth` column read is, when it is the one recorded there.
    fn known(&self, nth: usize, column: &str) -> Option<usize> {
        self.0.borrow().get(nth).and_then(|&(name, index)| (name == column).then_some(index))
    }

    /// Records that the `nth` column read, `column`, is at `index`.
    fn record(&self, nth: usize, column: &'static str, index: usize) {
        let mut places = self.0.borrow_mut();
        if let Some(place) = places.get_mut(nth) {
            *place = (column, index);
        } else if nth == places.len() {
            places.push((column, index));
        }
    }
}

impl<'a, 'r> SqliteRow<'a, 'r> {
    /// A row read alone (one row, or the first of a query without places).
    pub(crate) fn new(row: &'a rusqlite::Row<'r>) -> Self {
        SqliteRow::with_places(row, None)
    }

    /// A row of a query whose rows share `places`.
    pub(crate) fn with_places(row: &'a rusqlite::Row<'r>, places: Option<&'a ColumnPlaces>) -> Self {
        SqliteRow { row, places, read: Cell::new(0), next: Cell::new(0), named: Cell::new(0), searches: Cell::new(0) }
    }

    fn get<T: rusqlite::types::FromSql>(&self, column: &'static str) -> rusqlite::Result<T> {
        let nth = self.read.get();
        self.read.set(nth + 1);
        let index = match self.places.and_then(|places| places.known(nth, column)) {
            Some(index) => index,
            None => {
                let index = self.find(column)?;
                if let Some(places) = self.places {
                    places.record(nth, column, index);
                }
                index
            }
        };
        self.next.set(index + 1);
        self.row.get(index)
    }

    /// The column's index, asked of SQLite: the one after the last read
    /// when it has the name, else searched for.
    fn find(&self, column: &str) -> rusqlite::Result<usize> {
        self.named.set(self.named.get() + 1);
        let statement = self.row.as_ref();
        let guess = self.next.get();
        if statement.column_name(guess).is_ok_and(|name| name == column) {
            return Ok(guess);
        }
        self.searches.set(self.searches.get() + 1);
        statement.column_index(column)
    }

    /// How many columns' names were asked of SQLite.
    #[cfg(test)]
    pub(crate) fn named(&self) -> u32 {
        self.named.get()
    }

    /// How many columns were not where the last one read suggested.
    #[cfg(test)]
    pub(crate) fn searches(&self) -> u32 {
        self.searches.get()
    }
}

macro_rules! decoders {
    ($($name:ident($row:ident) -> $out:ty $body:block)*) => {
        $(
            pub(crate) fn $name($row: &impl RowSource) -> StoreResult<$out> $body
        )*
    };
}

decoders! {
    user_from_row(row) -> User {
        Ok(User {
            id: get(row, "id")?,
            name: get(row, "name")?,
            is_admin: get(row, "is_admin")?,
            balance_credits: get(row, "balance_credits")?,
            created_at: get(row, "created_at")?,
        })
    }

    conversation_from_row(row) -> Conversation {
        Ok(Conversation {
            id: get(row, "id")?,
            owner_id: get(row, "owner_id")?,
            title: get(row, "title")?,
            system_prompt: get(row, "system_prompt")?,
            preset_id: get(row, "preset_id")?,
            model: get(row, "model")?,
            head_id: get(row, "head_id")?,
            head_version: get(row, "head_version")?,
            summary: get(row, "summary")?,
            created_at: get(row, "created_at")?,
            updated_at: get(row, "updated_at")?,
        })
    }

    // Read in `node_columns!`'s order (see `SqliteRow`).
    node_from_row(row) -> Node {
        let conversation_id = get(row, "conversation_id")?;
        let id = get(row, "id")?;
        let parent_id = get(row, "parent_id")?;
        let role: String = get(row, "role")?;
        let message = Message {
            role: Role::parse(&role).ok_or_else(|| corrupt("role", &role))?,
            content: get(row, "content")?,
            parts: parse_json_list("parts", get(row, "parts")?)?,
            tool_calls: parse_json_list("tool_calls", get(row, "tool_calls")?)?,
            tool_call_id: get(row, "tool_call_id")?,
            tool_name: get(row, "tool_name")?,
            tool_status: parse_tool_status(get(row, "tool_status")?)?,
        };
        let (model, provider, turn_id, copied_from) =
            (get(row, "model")?, get(row, "provider")?, get(row, "turn_id")?, get(row, "copied_from")?);
        let status: String = get(row, "status")?;
        Ok(Node {
            id,
            conversation_id,
            parent_id,
            message,
            model,
            provider,
            turn_id,
            copied_from,
            status: NodeStatus::parse(&status).ok_or_else(|| corrupt("status", &status))?,
            created_at: get(row, "created_at")?,
        })
    }

    // Read in `turn_columns!`'s order (see `SqliteRow`).
    turn_from_row(row) -> Turn {
        let (id, conversation_id, user_id, user_message_id) =
            (get(row, "id")?, get(row, "conversation_id")?, get(row, "user_id")?, get(row, "user_message_id")?);
        let status: String = get(row, "status")?;
        let model = get(row, "model")?;
        let iterations: i64 = get(row, "iterations")?;
        Ok(Turn {
            id,
            conversation_id,
            user_id,
            user_message_id,
            status: TurnStatus::parse(&status).ok_or_else(|| corrupt("status", &status))?,
            model,
            iterations: u32::try_from(iterations).unwrap_or(0),
            usage: usage_from_row(row)?,
            cost_micro_usd: to_u64(get(row, "cost_micro_usd")?),
            reply_message_id: get(row, "reply_message_id")?,
            error_code: get(row, "error_code")?,
            error_message: get(row, "error_message")?,
            created_at: get(row, "created_at")?,
            started_at: get(row, "started_at")?,
            finished_at: get(row, "finished_at")?,
            pending_messages: {
                let text: String = get(row, "pending_messages")?;
                serde_json::from_str(&text).map_err(|_| corrupt("pending_messages", &text))?
            },
        })
    }

    usage_from_row(row) -> Usage {
        Ok(Usage {
            input_tokens: to_u64(get(row, "input_tokens")?),
            output_tokens: to_u64(get(row, "output_tokens")?),
            thinking_tokens: to_u64(get(row, "thinking_tokens")?),
            cached_tokens: to_u64(get(row, "cached_tokens")?),
            cache_write_tokens: to_u64(get(row, "cache_write_tokens")?),
        })
    }

    // Read in `api_call_columns!`'s order (see `SqliteRow`).
    api_call_from_row(row) -> ApiCall {
        Ok(ApiCall {
            id: get(row, "id")?,
            turn_id: get(row, "turn_id")?,
            conversation_id: get(row, "conversation_id")?,
            user_id: get(row, "user_id")?,
            kind: get(row, "kind")?,
            provider: get(row, "provider")?,
            model: get(row, "model")?,
            usage: usage_from_row(row)?,
            latency_ms: to_u64(get(row, "latency_ms")?),
            ttft_ms: get::<Option<i64>>(row, "ttft_ms")?.map(to_u64),
            status: get(row, "status")?,
            error_code: get(row, "error_code")?,
            cost_micro_usd: to_u64(get(row, "cost_micro_usd")?),
            created_at: get(row, "created_at")?,
        })
    }

    ledger_from_row(row) -> LedgerEntry {
        Ok(LedgerEntry {
            id: get(row, "id")?,
            user_id: get(row, "user_id")?,
            api_call_id: get(row, "api_call_id")?,
            credits: get(row, "credits")?,
            balance_after: get(row, "balance_after")?,
            created_at: get(row, "created_at")?,
        })
    }

    event_from_row(row) -> Event {
        let name: String = get(row, "name")?;
        let conversation_id: String = get(row, "conversation_id")?;
        let turn_id: Option<String> = get(row, "turn_id")?;
        let data: String = get(row, "data")?;
        Ok(Event {
            seq: get(row, "seq")?,
            conversation_id: Arc::from(conversation_id),
            turn_id: turn_id.map(Arc::from),
            name: EventName::parse(&name).ok_or_else(|| corrupt("name", &name))?,
            data: Arc::from(data),
            created_at: get(row, "created_at")?,
        })
    }
}

/// The conversation a batch of nodes belongs to and the id of its last node
/// (the new head). A batch spans one conversation: the head it moves is that
/// conversation's.
pub(crate) fn batch_target<N: Borrow<Node>>(nodes: &[N]) -> StoreResult<(&str, &str)> {
    let (Some(first), Some(last)) = (nodes.first().map(N::borrow), nodes.last().map(N::borrow)) else {
        return Err(StoreError::Database("append_messages was given no nodes".into()));
    };
    if nodes.iter().any(|node| node.borrow().conversation_id != first.conversation_id) {
        return Err(StoreError::Database("append_messages was given nodes of several conversations".into()));
    }
    Ok((&first.conversation_id, &last.id))
}

/// Names the rule a turn write broke when it is the one-running-turn index,
/// so the caller's 409 can say why.
pub(crate) fn running_turn_conflict(error: sqlx::Error) -> StoreError {
    if let sqlx::Error::Database(database) = &error
        && database.is_unique_violation()
        && (database.constraint() == Some(RUNNING_TURN_INDEX) || database.message().contains("turns.conversation_id"))
    {
        return StoreError::Conflict("the conversation already has a running turn".into());
    }
    StoreError::from(error)
}

/// The partial unique index (in both schemas) that allows one running turn
/// per conversation.
pub(crate) const RUNNING_TURN_INDEX: &str = "turns_one_running_per_conversation";

/// A migrator for migrations embedded with `include_str!` as (version,
/// description, SQL). Embedding keeps the binary self-contained and needs
/// neither sqlx's macros nor the files at run time.
pub(crate) fn migrator(migrations: &[(i64, &'static str, &'static str)]) -> Migrator {
    Migrator::with_migrations(
        migrations
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(version, Cow::Borrowed(description), MigrationType::Simple, sql.into_sql_str(), false)
            })
            .collect(),
    )
}

/// The distinct conversations of a batch of events, sorted, and how many
/// events each has in it.
pub(crate) fn events_by_conversation(events: &[Event]) -> (Vec<&str>, Vec<i64>) {
    let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
    for event in events {
        *counts.entry(&*event.conversation_id).or_default() += 1;
    }
    counts.into_iter().unzip()
}

/// Numbers a batch of events as the database stored it: each
/// conversation's after the last number before its part of the batch
/// (`last_before`), in the order given. Events of a conversation without
/// an entry (gone) are left out.
pub(crate) fn number_events(events: &[Event], mut last_before: HashMap<String, i64>) -> Vec<Event> {
    events
        .iter()
        .filter_map(|event| {
            let last = last_before.get_mut(&*event.conversation_id)?;
            *last += 1;
            Some(Event { seq: *last, ..event.clone() })
        })
        .collect()
}

/// A turn's pending messages as stored.
pub(crate) fn pending_json(turn: &crate::Turn) -> String {
    arbor_core::json::to_string(&turn.pending_messages).unwrap_or_else(|_| "[]".to_string())
}
