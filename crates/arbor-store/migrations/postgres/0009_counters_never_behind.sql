-- From here on a conversation's event counter is never behind its stored
-- events: this sets each counter to at least its highest stored number
-- (making the counters of conversations that have events but none), and
-- `append_events` moves the counter past what it stores. So a batch moves
-- an existing counter by key alone; the highest stored number is read only
-- when a conversation's counter is made. Before, every conversation of
-- every batch read it, and checked that the conversation exists, which an
-- existing counter (deleted with its conversation) already says: for a
-- streamed turn, whose deltas land in a batch each, those two statements
-- ran ~20 times a turn (bench/analysis.md).
INSERT INTO event_counters AS counter (conversation_id, seq)
    SELECT conversation_id, MAX(seq) FROM events GROUP BY conversation_id
    ON CONFLICT (conversation_id) DO UPDATE SET seq = GREATEST(counter.seq, EXCLUDED.seq);

-- As in migration 8, the existing counter moved by key, or else made:
-- after the highest stored number, once the conversation is found (a
-- concurrent first batch makes it first; this one then waits and moves
-- it on). Locks are taken in the order a deletion takes them
-- (`delete_conversation` deletes the counter, then the conversation): an
-- existing counter before the conversation (its events' foreign key), and
-- for a new counter the conversation first (`FOR KEY SHARE`, which head
-- moves do not wait for), so that neither can wait for the other in a
-- cycle.
CREATE OR REPLACE FUNCTION arbor_number_events(ids TEXT[], counts BIGINT[])
RETURNS TABLE (conversation TEXT, last_before BIGINT, last_seq BIGINT)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    FOR i IN 1 .. coalesce(cardinality(ids), 0) LOOP
        UPDATE event_counters SET seq = seq + counts[i] WHERE conversation_id = ids[i]
            RETURNING conversation_id, seq - counts[i], seq INTO conversation, last_before, last_seq;
        IF NOT FOUND THEN
            PERFORM 1 FROM conversations WHERE id = ids[i] FOR KEY SHARE;
            CONTINUE WHEN NOT FOUND;
            INSERT INTO event_counters AS counter (conversation_id, seq)
                VALUES (ids[i], (SELECT COALESCE(MAX(events.seq), 0) FROM events
                                 WHERE events.conversation_id = ids[i]) + counts[i])
                ON CONFLICT (conversation_id) DO UPDATE SET seq = counter.seq + counts[i]
                RETURNING counter.conversation_id, counter.seq - counts[i], counter.seq
                INTO conversation, last_before, last_seq;
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
