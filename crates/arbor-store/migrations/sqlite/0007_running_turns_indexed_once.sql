-- A running turn is kept in one partial index instead of two.
--
-- Every turn starts running and ends finished, so it entered and left both
-- the unique index that allows one running turn per conversation and the
-- index of live turns (queued or running): four index changes a turn, and
-- at low rates a WAL page of each index in each of the turn's two commits
-- (bench/walcount.py). The unique index now leads with the status, so it
-- also serves "the running turns" (crash recovery, expired leases) on its
-- own; the live-turns index keeps only queued turns, which a turn in the
-- common case never is. The rule is the same: at most one running turn
-- per conversation.
DROP INDEX turns_one_running_per_conversation;
CREATE UNIQUE INDEX turns_one_running_per_conversation ON turns (status, conversation_id) WHERE status = 'running';
DROP INDEX turns_live;
CREATE INDEX turns_queued ON turns (status, created_at, id) WHERE status = 'queued';
