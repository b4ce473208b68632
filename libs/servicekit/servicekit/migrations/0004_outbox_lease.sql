-- The relay claims rows with a lease (servicekit.outbox.relay): `lease` names the claim
-- that holds the row until `leased_until`; both NULL for a row no relay holds. Added to
-- tables that exist (a row written before is simply not held), no default to rewrite.
ALTER TABLE outbox ADD COLUMN leased_until timestamptz, ADD COLUMN lease uuid;
