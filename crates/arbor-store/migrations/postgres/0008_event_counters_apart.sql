-- The event counters move out of the conversations' rows into a table of
-- their own. A batch of events holds its conversations' counters until it
-- commits; while they were columns of `conversations`, that was the row a
-- turn's start and end update (the head), so a turn's end waited for any
-- batch holding its conversation, and a batch for any turn's end (through
-- its WAL flush), and each of them held the rest of its rows meanwhile.
-- Now they touch different rows and do not wait for each other.
CREATE TABLE event_counters (
    conversation_id TEXT   PRIMARY KEY REFERENCES conversations (id) ON DELETE CASCADE,
    seq             BIGINT NOT NULL
);
INSERT INTO event_counters (conversation_id, seq) SELECT id, event_seq FROM conversations WHERE event_seq > 0;
ALTER TABLE conversations DROP COLUMN event_seq;

-- As in migration 7: for each conversation in IDS (sorted by the caller,
-- so that two batches lock shared counters in the same order and cannot
-- deadlock), COUNTS numbers are taken after the larger of its counter and
-- its highest stored event; the counter stays locked until the commit, so
-- numbers become visible in order. A conversation's first batch makes its
-- counter (a concurrent first batch waits for it and then moves it on). A
-- conversation that is gone is left out; one deleted between the check
-- and the insert fails the batch on the foreign key, and the event
-- writer's retry leaves it out.
CREATE OR REPLACE FUNCTION arbor_number_events(ids TEXT[], counts BIGINT[])
RETURNS TABLE (conversation TEXT, last_before BIGINT, last_seq BIGINT)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    stored BIGINT;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(ids), 0) LOOP
        PERFORM 1 FROM conversations WHERE id = ids[i];
        CONTINUE WHEN NOT FOUND;
        stored := (SELECT COALESCE(MAX(events.seq), 0) FROM events WHERE events.conversation_id = ids[i]);
        INSERT INTO event_counters AS counter (conversation_id, seq) VALUES (ids[i], stored + counts[i])
            ON CONFLICT (conversation_id) DO UPDATE SET seq = GREATEST(counter.seq, stored) + counts[i]
            RETURNING counter.conversation_id, counter.seq - counts[i], counter.seq
            INTO conversation, last_before, last_seq;
        RETURN NEXT;
    END LOOP;
END
$$;
