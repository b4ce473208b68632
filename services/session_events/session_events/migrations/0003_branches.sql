-- Branches (`cmd.sessions.fork`): a session forked from another keeps where it came from,
-- and the client's fork id, so a repeated fork request answers the branch it made.
ALTER TABLE sessions
    ADD COLUMN parent_session_id uuid REFERENCES sessions (id),
    ADD COLUMN forked_at_seq     bigint,
    ADD COLUMN fork_id           text,
    ADD CONSTRAINT sessions_branch_is_whole CHECK (
        (parent_session_id IS NULL) = (forked_at_seq IS NULL)
        AND (parent_session_id IS NULL) = (fork_id IS NULL));
CREATE UNIQUE INDEX sessions_fork_idx ON sessions (parent_session_id, fork_id)
    WHERE parent_session_id IS NOT NULL;

-- In a branch's prefix, the parent's event each copy was made from.
ALTER TABLE events ADD COLUMN copied_from uuid;
