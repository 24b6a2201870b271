-- A running turn is kept in one partial index instead of two (as in the
-- SQLite schema's migration 7). Every turn starts running, so each one was
-- inserted into both the unique index that allows one running turn per
-- conversation and the index of live turns. The unique index now leads
-- with the status and also serves "the running turns" (crash recovery,
-- expired leases); the other index keeps only queued turns. The rule is
-- the same: at most one running turn per conversation.
DROP INDEX turns_one_running_per_conversation;
CREATE UNIQUE INDEX turns_one_running_per_conversation ON turns (status, conversation_id) WHERE status = 'running';
DROP INDEX turns_live;
CREATE INDEX turns_queued ON turns (status, created_at, id) WHERE status = 'queued';
