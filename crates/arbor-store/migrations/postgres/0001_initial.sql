-- Arbor's PostgreSQL schema, version 1: the same tables and rules as the
-- SQLite schema, for several `arbor serve` nodes sharing one database.
--
-- Conventions: ids are TEXT made by the engine (UUID v7, or a client's
-- message id); times are BIGINT milliseconds since the Unix epoch; money is
-- BIGINT credits (1 credit = 1 micro-dollar). JSON columns are TEXT, not
-- JSONB, on purpose: JSONB reorders keys and rewrites spacing, while Arbor
-- must return event payloads and provider data byte for byte as written.
-- Landed migrations are never edited: change the schema with a new file.

-- Users. A NULL balance means unlimited credits. `reserved_credits` is held
-- by calls in flight (see credit_reservations): a reservation succeeds only
-- while balance - reserved covers it, so concurrent turns on any node cannot
-- overspend.
CREATE TABLE users (
    id               TEXT    PRIMARY KEY,
    name             TEXT    NOT NULL UNIQUE,
    is_admin         BOOLEAN NOT NULL DEFAULT FALSE,
    balance_credits  BIGINT,
    reserved_credits BIGINT  NOT NULL DEFAULT 0 CHECK (reserved_credits >= 0),
    created_at       BIGINT  NOT NULL
);

-- API keys, kept only as the hex SHA-256 of the key, looked up by hash on
-- every request (the UNIQUE gives the index).
CREATE TABLE api_keys (
    id         TEXT   PRIMARY KEY,
    user_id    TEXT   NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    key_hash   TEXT   NOT NULL UNIQUE,
    prefix     TEXT   NOT NULL,
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);

CREATE INDEX api_keys_by_user ON api_keys (user_id);

-- Conversations. `head_id` is not a foreign key: the head and the messages
-- reference each other, and the store checks the head exists when it moves.
-- `head_version` is bumped on every head move (optimistic concurrency).
CREATE TABLE conversations (
    id            TEXT   PRIMARY KEY,
    owner_id      TEXT   NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    title         TEXT,
    system_prompt TEXT,
    preset_id     TEXT,
    model         TEXT   NOT NULL,
    head_id       TEXT,
    head_version  BIGINT NOT NULL DEFAULT 0,
    summary       TEXT,
    created_at    BIGINT NOT NULL,
    updated_at    BIGINT NOT NULL
);

-- Serves the owner's listing, newest first, and its keyset cursor.
CREATE INDEX conversations_by_owner
    ON conversations (owner_id, created_at DESC, id DESC);

-- Messages: the nodes of each conversation's tree. Ids are unique within a
-- conversation only (clients choose them, like `u1`). `seq` records creation
-- order across the whole table; the (conversation_id, seq) index lets a
-- whole tree load in one ordered index scan. The parent must be a node of
-- the same conversation (NULL for a root).
CREATE TABLE messages (
    conversation_id TEXT   NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    id              TEXT   NOT NULL,
    seq             BIGINT GENERATED ALWAYS AS IDENTITY,
    parent_id       TEXT,
    role            TEXT   NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
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
    status          TEXT   NOT NULL DEFAULT 'complete',
    created_at      BIGINT NOT NULL,
    PRIMARY KEY (conversation_id, id),
    FOREIGN KEY (conversation_id, parent_id)
        REFERENCES messages (conversation_id, id) ON DELETE CASCADE
);

CREATE INDEX messages_in_order ON messages (conversation_id, seq);

-- Turns. The partial unique index below makes "one running turn per
-- conversation" hold across every node: a second insert or update to
-- 'running' fails in the database, whichever process attempts it.
-- `lease_owner` / `lease_expires_at` name the node running the turn and how
-- long its claim lasts, so another node can take over a dead node's turns.
CREATE TABLE turns (
    id                 TEXT    PRIMARY KEY,
    conversation_id    TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    user_id            TEXT    NOT NULL,
    user_message_id    TEXT    NOT NULL,
    status             TEXT    NOT NULL CHECK (status IN
        ('queued', 'running', 'succeeded', 'failed', 'cancelled', 'interrupted')),
    model              TEXT    NOT NULL,
    iterations         BIGINT  NOT NULL DEFAULT 0,
    input_tokens       BIGINT  NOT NULL DEFAULT 0,
    output_tokens      BIGINT  NOT NULL DEFAULT 0,
    thinking_tokens    BIGINT  NOT NULL DEFAULT 0,
    cached_tokens      BIGINT  NOT NULL DEFAULT 0,
    cache_write_tokens BIGINT  NOT NULL DEFAULT 0,
    cost_micro_usd     BIGINT  NOT NULL DEFAULT 0,
    reply_message_id   TEXT,
    error_code         TEXT,
    error_message      TEXT,
    created_at         BIGINT  NOT NULL,
    started_at         BIGINT,
    finished_at        BIGINT,
    lease_owner        TEXT,
    lease_expires_at   BIGINT
);

CREATE UNIQUE INDEX turns_one_running_per_conversation
    ON turns (conversation_id) WHERE status = 'running';

-- Queue order and crash recovery read turns by status, oldest first.
CREATE INDEX turns_by_status ON turns (status, created_at, id);
CREATE INDEX turns_by_conversation ON turns (conversation_id, created_at);

-- One row per provider call. Billing history outlives conversations, so
-- `conversation_id` / `turn_id` are plain values, not foreign keys.
CREATE TABLE api_calls (
    id                 TEXT   PRIMARY KEY,
    turn_id            TEXT,
    conversation_id    TEXT,
    user_id            TEXT   NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    kind               TEXT   NOT NULL,
    provider           TEXT   NOT NULL,
    model              TEXT   NOT NULL,
    input_tokens       BIGINT NOT NULL,
    output_tokens      BIGINT NOT NULL,
    thinking_tokens    BIGINT NOT NULL,
    cached_tokens      BIGINT NOT NULL,
    cache_write_tokens BIGINT NOT NULL,
    latency_ms         BIGINT NOT NULL,
    ttft_ms            BIGINT,
    status             TEXT   NOT NULL,
    error_code         TEXT,
    cost_micro_usd     BIGINT NOT NULL,
    created_at         BIGINT NOT NULL
);

CREATE INDEX api_calls_by_turn ON api_calls (turn_id, created_at);

-- One row per charge against a user's credits, with the balance after it
-- (NULL for unlimited users), so a user's statement can be read back.
CREATE TABLE cost_ledger (
    id            TEXT   PRIMARY KEY,
    user_id       TEXT   NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    api_call_id   TEXT   NOT NULL REFERENCES api_calls (id) ON DELETE CASCADE,
    credits       BIGINT NOT NULL,
    balance_after BIGINT,
    created_at    BIGINT NOT NULL
);

CREATE INDEX cost_ledger_by_user ON cost_ledger (user_id, created_at DESC, id DESC);
CREATE INDEX cost_ledger_by_call ON cost_ledger (api_call_id);

-- Credits held for calls in flight. A row lives from reserve to settle (or
-- release); one left behind by a dead node is released when it expires.
CREATE TABLE credit_reservations (
    id         TEXT   PRIMARY KEY,
    user_id    TEXT   NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    credits    BIGINT NOT NULL CHECK (credits >= 0),
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL
);

CREATE INDEX credit_reservations_by_expiry ON credit_reservations (expires_at);
CREATE INDEX credit_reservations_by_user ON credit_reservations (user_id);

-- The events of each conversation's stream, numbered by the engine. The
-- primary key makes a reused sequence number a conflict, so a resuming
-- client can never be shown two different events under one id.
CREATE TABLE events (
    conversation_id TEXT   NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq             BIGINT NOT NULL,
    turn_id         TEXT,
    name            TEXT   NOT NULL,
    data            TEXT   NOT NULL,
    created_at      BIGINT NOT NULL,
    PRIMARY KEY (conversation_id, seq)
);
