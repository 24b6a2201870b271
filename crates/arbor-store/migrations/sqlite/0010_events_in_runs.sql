-- Events are stored a run to a row: consecutive events of one conversation
-- (`seq` to `last_seq`) in one text body.
--
-- A turn writes about seven events in one or two batches, and a row each
-- cost ~14,000 instructions on the writer (the statement, the foreign key's
-- lookup of the conversation, the row and its index entry): about a tenth
-- of a turn (bench/profile.md). The body holds, per event, a header
-- `created_at name turn_len data_len:` (lengths in bytes, -1 for an event of
-- no turn), then the turn id and the JSON payload as given
-- (crates/arbor-store/src/sqlite/packed.rs reads and writes it). The index
-- finds the rows ending after a number (replays, and the check that a
-- number is not used twice) and the last number, without the table.
-- Existing events become rows of one event each.
CREATE TABLE events_in_runs (
    id              INTEGER PRIMARY KEY,
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq             INTEGER NOT NULL,
    last_seq        INTEGER NOT NULL CHECK (last_seq >= seq),
    body            TEXT    NOT NULL
);
INSERT INTO events_in_runs (id, conversation_id, seq, last_seq, body)
    SELECT id, conversation_id, seq, seq,
           created_at || ' ' || name || ' ' || COALESCE(length(CAST(turn_id AS BLOB)), -1) || ' '
               || length(CAST(data AS BLOB)) || ':' || COALESCE(turn_id, '') || data
    FROM events ORDER BY id;
DROP TABLE events;
ALTER TABLE events_in_runs RENAME TO events;
CREATE INDEX events_by_conversation ON events (conversation_id, last_seq, seq);
