-- The user's statement is read newest first, but its index no longer says
-- DESC. SQLite keeps a DESC index in descending order, so every new charge
-- went in at the front of the user's entries, where a full page is split
-- three ways (rewriting its neighbours and their parent); in ascending
-- order a charge is appended at the end of the user's entries. Found by
-- counting the WAL pages a busy Arbor writes (bench/walcount.py): this
-- index's pages per commit fell from 1.16 to 0.72. The statement reads the
-- index backwards, still without sorting.
DROP INDEX cost_ledger_by_user;
CREATE INDEX cost_ledger_by_user ON cost_ledger (user_id, created_at, id);
