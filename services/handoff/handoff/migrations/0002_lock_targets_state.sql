-- The first statement of an offer's transaction: take the locks of its targets
-- (`handoff:<project>:<target>`, in the order given: callers sort them), then read each
-- target's state, in one round trip (bench/handoff.py: a target's lock is held for every
-- round trip after it, and at one target the lock is the throughput).
--
-- A function, not one plain statement: under READ COMMITTED a plain statement reads
-- the snapshot taken when it started, i.e. before it waited for a lock, and would miss
-- the offer committed by the holder it waited for. A VOLATILE plpgsql function takes a
-- fresh snapshot for each statement inside it, so each read below sees every decision
-- committed before its target's lock was granted.
--
-- With `wait` false a target whose lock another transaction holds is not waited for:
-- it comes back with `locked` false and no state, and nothing is read for it.
CREATE FUNCTION lock_targets_state(projects text[], targets text[], wait boolean)
RETURNS TABLE (project text, target text, locked boolean, active jsonb, pending jsonb)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    FOR i IN 1 .. coalesce(array_length(projects, 1), 0) LOOP
        project := projects[i];
        target := targets[i];
        active := NULL;
        pending := NULL;
        IF wait THEN
            PERFORM pg_advisory_xact_lock(
                hashtextextended('handoff:' || project || ':' || target, 0));
            locked := true;
        ELSE
            locked := pg_try_advisory_xact_lock(
                hashtextextended('handoff:' || project || ':' || target, 0));
        END IF;
        IF locked THEN
            -- The target's activation in an open session of the project, if any.
            SELECT to_jsonb(a) INTO active FROM (
                SELECT a.project_id, a.session_id, a.agent, a.via, a.handoff_id, a.activated_at
                  FROM activations a
                 WHERE a.project_id = project AND a.agent = target AND a.ended_at IS NULL
                 ORDER BY a.activated_at LIMIT 1) a;
            -- Its `offered` handoffs in the project, oldest first.
            SELECT coalesce(jsonb_agg(to_jsonb(h) ORDER BY h.created_at, h.id), '[]')
              INTO pending
              FROM (SELECT h.id, h.project_id, h.session_id, h.from_agent, h.to_agent,
                           h.artifact_id, h.status, h.created_at, h.updated_at,
                           h.superseded_by
                      FROM handoffs h
                     WHERE h.project_id = project AND h.to_agent = target
                       AND h.status = 'offered') h;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;
