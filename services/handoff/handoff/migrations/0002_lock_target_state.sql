-- The offer path's first statement under its target's lock: take the lock, then read
-- the target's state, in one round trip (bench/handoff.py: the lock is held for every
-- round trip after it, and at one target the lock is the throughput).
--
-- A function, not one plain statement: under READ COMMITTED a plain statement reads
-- the snapshot taken when it started, i.e. before it waited for the lock, and would
-- miss the offer committed by the holder it waited for. A VOLATILE plpgsql function
-- takes a fresh snapshot for each statement inside it, so the reads below see every
-- decision committed before the lock was granted.
CREATE FUNCTION lock_target_state(project text, target text, OUT active jsonb, OUT pending jsonb)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('handoff:' || project || ':' || target, 0));
    -- The target's activation in an open session of the project, if any.
    SELECT to_jsonb(a) INTO active FROM (
        SELECT a.project_id, a.session_id, a.agent, a.via, a.handoff_id, a.activated_at
          FROM activations a
         WHERE a.project_id = project AND a.agent = target
           AND a.ended_at IS NULL
         ORDER BY a.activated_at LIMIT 1) a;
    -- Its `offered` handoffs in the project, oldest first.
    SELECT coalesce(jsonb_agg(to_jsonb(h) ORDER BY h.created_at, h.id), '[]') INTO pending
      FROM (SELECT h.id, h.project_id, h.session_id, h.from_agent, h.to_agent, h.artifact_id,
                   h.status, h.created_at, h.updated_at, h.superseded_by
              FROM handoffs h
             WHERE h.project_id = project AND h.to_agent = target AND h.status = 'offered') h;
END $$;
