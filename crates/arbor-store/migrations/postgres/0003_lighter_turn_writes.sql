-- Turns are read by status only while they are live (the queue, crash
-- recovery, expired leases), and finished turns are nearly all of them: the
-- index keeps only live turns, so a finished turn leaves it and the index
-- stays small. (SQLite's 0003 also drops AUTOINCREMENT from messages.seq;
-- PostgreSQL's identity column never had that cost.)
DROP INDEX turns_by_status;
CREATE INDEX turns_live ON turns (status, created_at, id) WHERE status IN ('queued', 'running');
