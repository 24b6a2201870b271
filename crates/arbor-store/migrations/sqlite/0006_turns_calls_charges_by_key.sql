-- Turns, API calls and ledger entries are stored in the order of their
-- keys (WITHOUT ROWID) rather than in a rowid table with a separate index
-- on the key.
--
-- Their keys are time-ordered UUIDs, so rows still arrive at the end of
-- the table. But a rowid table with a TEXT PRIMARY KEY is two b-trees:
-- every turn inserted into each key index too, and rewrote a page of each
-- in the WAL (~12% of the frames a turn wrote at 200 turns/s,
-- bench/walcount.py), and finding a turn by its id to finish it took two
-- searches. Same columns, same constraints, same indexes; the tables are
-- rebuilt the documented way (the runner turns foreign keys off and checks
-- them before it commits).
CREATE TABLE turns_rebuilt (
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
    lease_expires_at   INTEGER,
    pending_messages   TEXT    NOT NULL DEFAULT '[]'
) WITHOUT ROWID;
INSERT INTO turns_rebuilt SELECT * FROM turns;
DROP TABLE turns;
ALTER TABLE turns_rebuilt RENAME TO turns;
CREATE UNIQUE INDEX turns_one_running_per_conversation ON turns (conversation_id) WHERE status = 'running';
CREATE INDEX turns_by_conversation ON turns (conversation_id, created_at);
CREATE INDEX turns_live ON turns (status, created_at, id) WHERE status IN ('queued', 'running');

CREATE TABLE api_calls_rebuilt (
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
) WITHOUT ROWID;
INSERT INTO api_calls_rebuilt SELECT * FROM api_calls;
DROP TABLE api_calls;
ALTER TABLE api_calls_rebuilt RENAME TO api_calls;
CREATE INDEX api_calls_by_turn ON api_calls (turn_id, created_at);

CREATE TABLE cost_ledger_rebuilt (
    id            TEXT    PRIMARY KEY NOT NULL,
    user_id       TEXT    NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    api_call_id   TEXT    NOT NULL REFERENCES api_calls (id) ON DELETE CASCADE,
    credits       INTEGER NOT NULL,
    balance_after INTEGER,
    created_at    INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO cost_ledger_rebuilt SELECT * FROM cost_ledger;
DROP TABLE cost_ledger;
ALTER TABLE cost_ledger_rebuilt RENAME TO cost_ledger;
CREATE INDEX cost_ledger_by_user ON cost_ledger (user_id, created_at, id);
