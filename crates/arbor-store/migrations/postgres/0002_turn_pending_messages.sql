-- A queued turn's messages, kept durably (as JSON, the internal message
-- format of tree nodes) from the moment they are sent until the turn starts
-- and records them in the tree under the head as it is then.
ALTER TABLE turns ADD COLUMN pending_messages TEXT NOT NULL DEFAULT '[]';
