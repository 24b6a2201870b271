-- Two things every turn wrote and nobody needs, found by counting the WAL
-- pages a turn writes (bench/walcount.py, bench/REPORT.md).
--
-- 1. `messages.seq` loses AUTOINCREMENT. It only orders a conversation's
--    nodes as they were written; a plain rowid does that too (a new row is
--    always above every row there is), without the sqlite_sequence row that
--    AUTOINCREMENT updated on every insert. SQLite cannot alter a column, so
--    the table is rebuilt the documented way (the migration runs with
--    foreign keys off and checks them before it commits). Same columns, same
--    order, same constraints.
CREATE TABLE messages_rebuilt (
    seq             INTEGER PRIMARY KEY,
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    id              TEXT    NOT NULL,
    parent_id       TEXT,
    role            TEXT    NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    content         TEXT,
    parts           TEXT,
    tool_calls      TEXT,
    tool_call_id    TEXT,
    tool_name       TEXT,
    tool_status     TEXT,
    model           TEXT,
    provider        TEXT,
    turn_id         TEXT,
    copied_from     TEXT,
    status          TEXT    NOT NULL DEFAULT 'complete',
    created_at      INTEGER NOT NULL,
    UNIQUE (conversation_id, id),
    FOREIGN KEY (conversation_id, parent_id)
        REFERENCES messages (conversation_id, id) ON DELETE CASCADE
);
INSERT INTO messages_rebuilt SELECT * FROM messages;
DROP TABLE messages;
ALTER TABLE messages_rebuilt RENAME TO messages;

-- 2. Turns are read by status only while they are live (the queue, crash
--    recovery, expired leases), and finished turns are nearly all of them:
--    the index keeps only live turns, so a finished turn leaves it and the
--    index stays a few pages. Queries that use it repeat its condition
--    word for word, which is how SQLite knows they may.
DROP INDEX turns_by_status;
CREATE INDEX turns_live ON turns (status, created_at, id) WHERE status IN ('queued', 'running');
