-- Events are stored in the order they arrive, with the conversation's
-- numbering in an index beside them.
--
-- Keyed by (conversation_id, seq) WITHOUT ROWID, every event went into its
-- conversation's stretch of the table: with many conversations busy at
-- once, each batch the event writer committed rewrote a page per
-- conversation and split pages in the middle of the tree (~9 WAL pages per
-- turn, 41% of all the pages a turn wrote; bench/walcount.py). In a rowid
-- table new events are appended at the end, where the events of all
-- conversations share pages; only the index's small entries go into each
-- conversation's stretch. The index is unique, so a reused number is still
-- a conflict, and it serves the replays (`seq > ?` in order) and the last
-- number by itself. Same columns, same constraints.
CREATE TABLE events_rebuilt (
    id              INTEGER PRIMARY KEY,
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq             INTEGER NOT NULL,
    turn_id         TEXT,
    name            TEXT    NOT NULL,
    data            TEXT    NOT NULL,
    created_at      INTEGER NOT NULL
);
INSERT INTO events_rebuilt (conversation_id, seq, turn_id, name, data, created_at)
    SELECT conversation_id, seq, turn_id, name, data, created_at FROM events ORDER BY created_at, conversation_id, seq;
DROP TABLE events;
ALTER TABLE events_rebuilt RENAME TO events;
CREATE UNIQUE INDEX events_by_conversation ON events (conversation_id, seq);
