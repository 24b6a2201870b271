-- A user's ledger entries are stored in the order they are read: by user,
-- then time (WITHOUT ROWID, keyed by user, time and id) instead of by id
-- with a separate index by user.
--
-- Entries are only ever read as a user's statement, newest first; nothing
-- looks one up by its id and no table refers to them. Each charge wrote a
-- page of the table and a page of `cost_ledger_by_user` (together ~8% of a
-- turn's WAL frames at 100 turns/s, bench/walcount.py); it now writes one.
-- The id stays in the key, so an entry is still told apart from another
-- charged to the same user in the same millisecond. Same columns, same
-- references; the table is rebuilt the documented way (the runner turns
-- foreign keys off and checks them before it commits).
CREATE TABLE cost_ledger_rebuilt (
    id            TEXT    NOT NULL,
    user_id       TEXT    NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    api_call_id   TEXT    NOT NULL REFERENCES api_calls (id) ON DELETE CASCADE,
    credits       INTEGER NOT NULL,
    balance_after INTEGER,
    created_at    INTEGER NOT NULL,
    PRIMARY KEY (user_id, created_at, id)
) WITHOUT ROWID;
INSERT INTO cost_ledger_rebuilt SELECT * FROM cost_ledger;
DROP TABLE cost_ledger;
ALTER TABLE cost_ledger_rebuilt RENAME TO cost_ledger;
