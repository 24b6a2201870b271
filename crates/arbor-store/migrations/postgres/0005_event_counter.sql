-- Each conversation counts the events the database numbered for it, so that
-- a batch is numbered, stored and announced in one statement (one round trip
-- instead of five: BEGIN, the lock, the insert, COMMIT, NOTIFY). The
-- counter starts at 0 for every conversation; the statement numbers from
-- the larger of it and the highest stored number, so conversations with
-- events from before this column need no backfill.
ALTER TABLE conversations ADD COLUMN event_seq BIGINT NOT NULL DEFAULT 0;
