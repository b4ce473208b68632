-- A hold names the replica that made it and the call it reserved for, so that when the
-- replica dies between the provider call and the bill, a survivor (or the replica
-- itself, restarted under the same instance id) can write the call's usage row in its
-- place: billed at the hold, the call's worst case, since its real usage died with it.
ALTER TABLE budget_holds
    ADD COLUMN replica    text,
    ADD COLUMN kind       text,
    ADD COLUMN provider   text,
    ADD COLUMN model      text,
    ADD COLUMN agent_slug text,
    ADD COLUMN session_id uuid;

-- A usage row written from a hold rather than from the call: its cost is the hold (the
-- worst case), its tokens unknown (0), its status `error` with code `replica_lost`.
ALTER TABLE token_usage ADD COLUMN billed_at_hold boolean NOT NULL DEFAULT false;
