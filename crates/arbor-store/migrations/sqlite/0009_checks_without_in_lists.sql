-- The allowed values of `messages.role` and `turns.status` are checked as
-- a chain of equalities instead of an IN list.
--
-- SQLite evaluates a constant IN list of more than two values by building
-- a temporary b-tree of the values, and a CHECK constraint does so every
-- time it runs: each message inserted and each turn inserted or updated
-- opened, filled and dropped one (a page allocated and zeroed, a page
-- cache made and freed), four times a turn. An OR of equalities is the
-- same rule without it. SQLite cannot change a constraint in place, so both
-- tables are rebuilt the documented way (the runner turns foreign keys off
-- and checks them before it commits), with the same columns, keys and
-- indexes as before.
CREATE TABLE messages_rebuilt (
    seq             INTEGER PRIMARY KEY,
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    id              TEXT    NOT NULL,
    parent_id       TEXT,
    role            TEXT    NOT NULL
        CHECK (role = 'system' OR role = 'user' OR role = 'assistant' OR role = 'tool'),
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

CREATE TABLE turns_rebuilt (
    id                 TEXT    PRIMARY KEY NOT NULL,
    conversation_id    TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    user_id            TEXT    NOT NULL,
    user_message_id    TEXT    NOT NULL,
    status             TEXT    NOT NULL CHECK (status = 'queued' OR status = 'running'
        OR status = 'succeeded' OR status = 'failed' OR status = 'cancelled' OR status = 'interrupted'),
    model              TEXT    NOT NULL,
    iterations         INTEGER NOT NULL DEFAULT 0,
    input_tokens       INTEGER NOT NULL DEFAULT 0,
    output_tokens      INTEGER NOT NULL DEFAULT 0,
    thinking_tokens    INTEGER NOT NULL DEFAULT 0,
    cached_tokens      INTEGER NOT NULL DEFAULT 0,
    cache_write_tokens INTEGER NOT NULL DEFAULT 0,
    cost_micro_usd     INTEGER NOT NULL DEFAULT 0,
    reply_message_id   TEXT,
    error_code         TEXT,
    error_message      TEXT,
    created_at         INTEGER NOT NULL,
    started_at         INTEGER,
    finished_at        INTEGER,
    lease_owner        TEXT,
    lease_expires_at   INTEGER,
    pending_messages   TEXT    NOT NULL DEFAULT '[]'
) WITHOUT ROWID;
INSERT INTO turns_rebuilt SELECT * FROM turns;
DROP TABLE turns;
ALTER TABLE turns_rebuilt RENAME TO turns;
CREATE UNIQUE INDEX turns_one_running_per_conversation ON turns (status, conversation_id) WHERE status = 'running';
CREATE INDEX turns_by_conversation ON turns (conversation_id, created_at);
CREATE INDEX turns_queued ON turns (status, created_at, id) WHERE status = 'queued';
