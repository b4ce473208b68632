-- The guard of a batch written without locks (group_commit.py). A batch of appends is
-- decided against its sessions as one statement read them, without locks, and written by
-- one statement that moves each session's `last_seq` on only where it still is what the
-- batch read. `moved` is how many sessions that statement moved, `expected` how many it
-- should have: when another writer (a replica's batch, a close) moved one in between,
-- this raises, the whole statement is undone (nothing written, no seq handed out), and
-- the batch is decided again under the sessions' row locks.
CREATE FUNCTION sessions_unmoved(moved bigint, expected bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF moved <> expected THEN
        RAISE EXCEPTION 'a session moved since the batch read it (% of % as read)',
            moved, expected USING ERRCODE = 'serialization_failure';
    END IF;
    RETURN true;
END $$;
