-- The guard of a reservation written in one statement (`metering.budgets.reserve_whole`):
-- the run's hold, the turn's claim and its share on the limits' counters go in together,
-- and a turn that cannot have all of them (a limit it does not fit under, a turn id
-- claimed under another run) must leave none. Raising undoes the whole statement;
-- `refusal` is the error's message, `detail` (what refused, as JSON) its detail.
CREATE FUNCTION reservation_whole(refusal text, detail text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF refusal IS NOT NULL THEN
        RAISE EXCEPTION '%', refusal USING DETAIL = coalesce(detail, '');
    END IF;
    RETURN true;
END $$;
