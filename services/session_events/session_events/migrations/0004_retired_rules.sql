-- A business rule is retired at most once: by a person's retraction
-- (`artifact.business_rule_retracted`, payload `rule_id`) or correction (an
-- `artifact.business_rule` whose payload `replaces` it). The log's rules refuse a second
-- one (`rule_not_standing`) on what a batch read; this index keeps that true when two
-- appends in different sessions retire the same rule at the same moment (each session's
-- guard sees only its own session): the later write fails, and its batch is decided
-- again, seeing the first. A branch's copies (`copied_from`) are left out: a copy of the
-- parent's retirement of a rule outside the branch's prefix names the same rule, and the
-- parent's original already retired it; the log still finds copies when it asks whether
-- a rule was retired, so a branch cannot retire its copied rule twice either.
CREATE UNIQUE INDEX events_retired_rule_idx ON events (
    (CASE type WHEN 'artifact.business_rule_retracted' THEN payload->>'rule_id'
               ELSE payload->>'replaces' END))
    WHERE copied_from IS NULL
      AND (type = 'artifact.business_rule_retracted'
           OR (type = 'artifact.business_rule' AND payload->>'replaces' IS NOT NULL));
