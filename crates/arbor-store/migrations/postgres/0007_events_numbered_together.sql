-- Moves the event counters of several conversations for one batch of
-- events: for each conversation in IDS (sorted by the caller, so that two
-- batches lock shared conversations in the same order and cannot deadlock),
-- COUNTS numbers are taken after the larger of its counter and its highest
-- stored event (conversations with events from before the counter need no
-- backfill). The row stays locked until the commit, so numbers become
-- visible in order. Returns each conversation that exists with the last
-- number before its batch and the last number of it; a conversation that
-- is gone is left out.
--
-- One UPDATE by key per conversation, not one UPDATE joined to the list:
-- a join may be planned as a scan of the whole table (see FINISH_TURN in
-- postgres.rs), a key lookup cannot.
CREATE FUNCTION arbor_number_events(ids TEXT[], counts BIGINT[])
RETURNS TABLE (conversation TEXT, last_before BIGINT, last_seq BIGINT)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    FOR i IN 1 .. coalesce(cardinality(ids), 0) LOOP
        UPDATE conversations SET event_seq = GREATEST(event_seq,
                (SELECT COALESCE(MAX(events.seq), 0) FROM events WHERE events.conversation_id = ids[i])) + counts[i]
            WHERE id = ids[i]
            RETURNING id, event_seq - counts[i], event_seq INTO conversation, last_before, last_seq;
        IF FOUND THEN
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
