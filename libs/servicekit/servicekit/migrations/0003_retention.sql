-- Retention (servicekit.retention) deletes the oldest claims in batches: without an
-- index on their age, every batch would read the whole table.
CREATE INDEX processed_messages_age_idx ON processed_messages (processed_at);
