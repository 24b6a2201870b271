-- Arbor's SQLite schema, version 1.
--
-- Conventions: ids are TEXT made by the engine (UUID v7, or a client's
-- message id); times are INTEGER milliseconds since the Unix epoch; money is
-- INTEGER credits (1 credit = 1 micro-dollar); JSON is TEXT, kept exactly as
-- the engine serialized it so opaque provider data goes back byte for byte.
-- Landed migrations are never edited: change the schema with a new file.

-- Users. A NULL balance means unlimited credits. `reserved_credits` is held
-- by calls in flight (see credit_reservations): a reservation succeeds only
-- while balance - reserved covers it, so concurrent turns cannot overspend.
CREATE TABLE users (
    id               TEXT    PRIMARY KEY NOT NULL,
    name             TEXT    NOT NULL UNIQUE,
    is_admin         INTEGER NOT NULL DEFAULT 0 CHECK (is_admin IN (0, 1)),
    balance_credits  INTEGER,
    reserved_credits INTEGER NOT NULL DEFAULT 0 CHECK (reserved_credits >= 0),
    created_at       INTEGER NOT NULL
);

-- API keys, kept only as the hex SHA-256 of the key. A key is looked up by
-- its hash on every request, hence the unique index the UNIQUE gives.
CREATE TABLE api_keys (
    id         TEXT    PRIMARY KEY NOT NULL,
    user_id    TEXT    NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    key_hash   TEXT    NOT NULL UNIQUE,
    prefix     TEXT    NOT NULL,
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
);

CREATE INDEX api_keys_by_user ON api_keys (user_id);

-- Conversations. `head_id` is not a foreign key: the head and the messages
-- reference each other, and the store checks the head exists when it moves.
-- `head_version` is bumped on every head move (optimistic concurrency).
CREATE TABLE conversations (
    id            TEXT    PRIMARY KEY NOT NULL,
    owner_id      TEXT    NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    title         TEXT,
    system_prompt TEXT,
    preset_id     TEXT,
    model         TEXT    NOT NULL,
    head_id       TEXT,
    head_version  INTEGER NOT NULL DEFAULT 0,
    summary       TEXT,
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL
);

-- Serves the owner's listing, newest first, and its keyset cursor.
CREATE INDEX conversations_by_owner
    ON conversations (owner_id, created_at DESC, id DESC);

-- Messages: the nodes of each conversation's tree. Ids are unique within a
-- conversation only (clients choose them, like `u1`). `seq` is the global
-- creation order, used to return a conversation's nodes as they were
-- written; it is the rowid, so it costs no extra index. The parent must be a
-- node of the same conversation (NULL for a root).
CREATE TABLE messages (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    id              TEXT    NOT NULL,
    parent_id       TEXT,
    role            TEXT    NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    content         TEXT,
    parts           TEXT,           -- JSON array of parts; NULL when none
    tool_calls      TEXT,           -- JSON array of tool calls; NULL when none
    tool_call_id    TEXT,
    tool_name       TEXT,
    tool_status     TEXT,
    model           TEXT,
    provider        TEXT,
    turn_id         TEXT,
    copied_from     TEXT,
    status          TEXT    NOT NULL DEFAULT 'complete',
    created_at      INTEGER NOT NULL,
    -- The key the engine uses: one id per conversation.
    UNIQUE (conversation_id, id),
    FOREIGN KEY (conversation_id, parent_id)
        REFERENCES messages (conversation_id, id) ON DELETE CASCADE
);

-- Turns. The partial unique index below is what makes "one running turn per
-- conversation" hold across tasks and processes: a second insert or update
-- to 'running' fails in the database, not in anyone's memory.
-- `lease_owner` / `lease_expires_at` name the node running the turn and how
-- long its claim lasts, so another node can take over a dead node's turns.
CREATE TABLE turns (
    id                 TEXT    PRIMARY KEY NOT NULL,
    conversation_id    TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    user_id            TEXT    NOT NULL,
    user_message_id    TEXT    NOT NULL,
    status             TEXT    NOT NULL CHECK (status IN
        ('queued', 'running', 'succeeded', 'failed', 'cancelled', 'interrupted')),
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
    lease_expires_at   INTEGER
);

CREATE UNIQUE INDEX turns_one_running_per_conversation
    ON turns (conversation_id) WHERE status = 'running';

-- Queue order and crash recovery read turns by status, oldest first.
CREATE INDEX turns_by_status ON turns (status, created_at, id);
CREATE INDEX turns_by_conversation ON turns (conversation_id, created_at);

-- One row per provider call. Billing history outlives conversations, so
-- `conversation_id` / `turn_id` are plain values, not foreign keys.
CREATE TABLE api_calls (
    id                 TEXT    PRIMARY KEY NOT NULL,
    turn_id            TEXT,
    conversation_id    TEXT,
    user_id            TEXT    NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    kind               TEXT    NOT NULL,
    provider           TEXT    NOT NULL,
    model              TEXT    NOT NULL,
    input_tokens       INTEGER NOT NULL,
    output_tokens      INTEGER NOT NULL,
    thinking_tokens    INTEGER NOT NULL,
    cached_tokens      INTEGER NOT NULL,
    cache_write_tokens INTEGER NOT NULL,
    latency_ms         INTEGER NOT NULL,
    ttft_ms            INTEGER,
    status             TEXT    NOT NULL,
    error_code         TEXT,
    cost_micro_usd     INTEGER NOT NULL,
    created_at         INTEGER NOT NULL
);

CREATE INDEX api_calls_by_turn ON api_calls (turn_id, created_at);

-- One row per charge against a user's credits, with the balance after it
-- (NULL for unlimited users), so a user's statement can be read back.
CREATE TABLE cost_ledger (
    id            TEXT    PRIMARY KEY NOT NULL,
    user_id       TEXT    NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    api_call_id   TEXT    NOT NULL REFERENCES api_calls (id) ON DELETE CASCADE,
    credits       INTEGER NOT NULL,
    balance_after INTEGER,
    created_at    INTEGER NOT NULL
);

CREATE INDEX cost_ledger_by_user ON cost_ledger (user_id, created_at DESC, id DESC);

-- Credits held for calls in flight. A row lives from reserve to settle (or
-- release); one left behind by a crashed node is released when it expires.
CREATE TABLE credit_reservations (
    id         TEXT    PRIMARY KEY NOT NULL,
    user_id    TEXT    NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    credits    INTEGER NOT NULL CHECK (credits >= 0),
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
);

CREATE INDEX credit_reservations_by_expiry ON credit_reservations (expires_at);

-- The events of each conversation's stream, numbered by the engine. The
-- primary key makes a reused sequence number a conflict, so a resuming
-- client can never be shown two different events under one id.
CREATE TABLE events (
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq             INTEGER NOT NULL,
    turn_id         TEXT,
    name            TEXT    NOT NULL,
    data            TEXT    NOT NULL,
    created_at      INTEGER NOT NULL,
    PRIMARY KEY (conversation_id, seq)
) WITHOUT ROWID;
