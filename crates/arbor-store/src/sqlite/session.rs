//! A connection as a store call sees it, with the prepared statements of
//! the thread that owns it.
//!
//! rusqlite's statement cache (`prepare_cached`) finds a statement by its
//! text: each use hashes the SQL (a few hundred bytes), compares it, copies
//! it into a new `Arc<str>` as the statement's key, and on return hashes it
//! again into a linked map that allocates a node. A turn runs about 35
//! statements on the writer alone, and that bookkeeping was ~3% of a
//! turn's instructions (bench/profile.md). The hot statements are
//! constants, so [`Session::cached`] keys them by the address of their
//! text instead, in a map that lives on the connection's own thread beside
//! the connection (a thread that owns its connection keeps its statements
//! in the same stack frame, so nothing borrows from itself). A session
//! without such a map (a point read on a borrowed connection) falls back to
//! rusqlite's cache.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::{Deref, DerefMut};

use rusqlite::{CachedStatement, Connection, PrepFlags, Statement};

/// The prepared statements of one connection, by the address of their SQL.
pub(super) type Statements<'c> = RefCell<HashMap<usize, Statement<'c>, BuildHasherDefault<AddressHasher>>>;

/// Hashes a statement's address with one multiplication. The keys are the
/// addresses of our own constants, so SipHash's defence against chosen
/// keys buys nothing, and it cost ~140 instructions a lookup (two a
/// statement: taking it out and putting it back), ~0.7% of a turn. The
/// multiplier (2^64 / φ, odd) carries the address's varying low bits into
/// the high bits, which the map reads as well as the low ones.
#[derive(Default)]
pub(super) struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    /// Not used by [`Statements`], whose `usize` keys go through
    /// `write_usize`; the trait needs it, so other input is folded a byte
    /// at a time through the same multiply.
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(byte));
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_usize(&mut self, value: usize) {
        self.write_u64(value as u64);
    }
}

/// A connection and, on the thread that owns it, its prepared statements.
pub(crate) struct Session<'s, 'c> {
    connection: &'c Connection,
    statements: Option<&'s Statements<'c>>,
}

impl<'s, 'c> Session<'s, 'c> {
    /// A session whose constant statements stay prepared in `statements`.
    pub(super) fn new(connection: &'c Connection, statements: &'s Statements<'c>) -> Session<'s, 'c> {
        Session { connection, statements: Some(statements) }
    }

    /// A session that uses rusqlite's cache (a borrowed connection).
    pub(super) fn borrowed(connection: &'c Connection) -> Session<'s, 'c> {
        Session { connection, statements: None }
    }

    /// The prepared statement for `sql`, a constant: taken from the
    /// session's statements (prepared on first use) and given back when the
    /// returned guard is dropped. Statements leave it reset (rusqlite resets
    /// after `execute` and when a query's rows are dropped), and every use
    /// binds all its parameters.
    pub(crate) fn cached(&self, sql: &'static str) -> rusqlite::Result<Cached<'s, 'c>> {
        let Some(statements) = self.statements else {
            return self.connection.prepare_cached(sql).map(Cached::Shared);
        };
        let key = sql.as_ptr() as usize;
        // The same statement in use twice at once (nested): the second gets
        // one of its own, and whichever is returned last is kept.
        let statement = match statements.borrow_mut().remove(&key) {
            Some(statement) => statement,
            None => self.connection.prepare_with_flags(sql, PrepFlags::SQLITE_PREPARE_PERSISTENT)?,
        };
        Ok(Cached::Own { home: statements, key, statement: Some(statement) })
    }
}

impl Deref for Session<'_, '_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.connection
    }
}

/// A prepared statement lent by [`Session::cached`].
pub(crate) enum Cached<'s, 'c> {
    Own { home: &'s Statements<'c>, key: usize, statement: Option<Statement<'c>> },
    Shared(CachedStatement<'c>),
}

impl<'c> Deref for Cached<'_, 'c> {
    type Target = Statement<'c>;

    fn deref(&self) -> &Statement<'c> {
        match self {
            Cached::Own { statement, .. } => statement.as_ref().expect("held until dropped"),
            Cached::Shared(statement) => statement,
        }
    }
}

impl DerefMut for Cached<'_, '_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match self {
            Cached::Own { statement, .. } => statement.as_mut().expect("held until dropped"),
            Cached::Shared(statement) => statement,
        }
    }
}

impl Drop for Cached<'_, '_> {
    fn drop(&mut self) {
        if let Cached::Own { home, key, statement } = self
            && let Some(statement) = statement.take()
            && let Ok(mut statements) = home.try_borrow_mut()
        {
            statements.insert(*key, statement);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COUNT: &str = "SELECT COUNT(*) FROM t";
    const INSERT: &str = "INSERT INTO t VALUES (?)";

    #[test]
    fn constant_statements_stay_prepared_and_work_nested() {
        let connection = Connection::open_in_memory().expect("opens");
        connection.execute_batch("CREATE TABLE t (v INTEGER)").expect("table");
        let statements = Statements::default();
        let session = Session::new(&connection, &statements);
        for value in 0..3 {
            session.cached(INSERT).expect("prepared").execute([value]).expect("inserted");
        }
        assert_eq!(statements.borrow().len(), 1, "one statement, prepared once and reused");
        // The same statement twice at once: both run, one is kept.
        let outer = session.cached(COUNT).expect("prepared");
        let mut inner = session.cached(COUNT).expect("prepared");
        let counted: i64 = inner.query_row([], |row| row.get(0)).expect("counts");
        drop(inner);
        drop(outer);
        assert_eq!(counted, 3);
        assert_eq!(statements.borrow().len(), 2);
        // A statement given back mid-query is reset: the next use starts over.
        {
            let mut all = session.cached("SELECT v FROM t ORDER BY v").expect("prepared");
            let mut rows = all.query([]).expect("query");
            let _first = rows.next().expect("step");
        }
        let mut again = session.cached("SELECT v FROM t ORDER BY v").expect("prepared");
        let values: Vec<i64> =
            again.query_map([], |row| row.get(0)).expect("query").collect::<Result<_, _>>().expect("rows");
        assert_eq!(values, [0, 1, 2]);
        drop(again);

        // A borrowed connection's session uses rusqlite's cache.
        let borrowed = Session::borrowed(&connection);
        let counted: i64 = borrowed.cached(COUNT).expect("prepared").query_row([], |row| row.get(0)).expect("counts");
        assert_eq!(counted, 3);
    }
}
