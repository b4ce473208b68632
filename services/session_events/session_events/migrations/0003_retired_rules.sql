-- A business rule is retired at most once: by a person's retraction
-- (`artifact.business_rule_retracted`, payload `rule_id`) or correction (an
-- `artifact.business_rule` whose payload `replaces` it). The log's rules refuse a second
-- one (`rule_not_standing`) on what a batch read; this index keeps that true when two
-- appends in different sessions retire the same rule at the same moment (each session's
-- guard sees only its own session): the later write fails, and its batch is decided
-- again, seeing the first. It is also how the log finds whether a rule was retired.
CREATE UNIQUE INDEX events_retired_rule_idx ON events (
    (CASE type WHEN 'artifact.business_rule_retracted' THEN payload->>'rule_id'
               ELSE payload->>'replaces' END))
    WHERE type = 'artifact.business_rule_retracted'
       OR (type = 'artifact.business_rule' AND payload->>'replaces' IS NOT NULL);
