-- Ends the statement that calls it with SQLSTATE AR404, which the store
-- reads as "not found". A statement that writes several tables and finds
-- one of its rows gone calls it in its final SELECT, so that it rolls back
-- in its own implicit transaction instead of needing BEGIN and COMMIT
-- around it (two round trips on a turn's path).
CREATE FUNCTION arbor_abort(reason TEXT) RETURNS BIGINT LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'AR404', MESSAGE = reason;
END
$$;
