-- Seeded prices and bindings.
--
-- Prices: Anthropic's public list prices per million tokens (the pricing page of the
-- Claude docs, as published with Claude Opus 4.8 on 2026-05-29; read 2026-11-29):
--   model               input   output  5m cache write  1h cache write  cache read
--   Claude Opus 4.8     $5      $25     $6.25           $10             $0.50
--   Claude Sonnet 4.6   $3      $15     $3.75           $6              $0.30
--   Claude Haiku 4.5    $1      $5      $1.25           $2              $0.10
-- (cache writes are 1.25x input for the 5-minute TTL and 2x for 1 hour; reads 0.1x).
-- Stored in µUSD per million tokens: $1 = 1,000,000.
INSERT INTO prices (model, effective_from, input_micros, output_micros,
                    cache_write_5m_micros, cache_write_1h_micros, cache_read_micros, source)
VALUES
    ('claude-opus-4-8',   '2026-05-29', 5000000, 25000000, 6250000, 10000000, 500000,
     'Anthropic list price, Claude docs pricing page, 2026-05-29'),
    ('claude-sonnet-4-6', '2026-05-29', 3000000, 15000000, 3750000,  6000000, 300000,
     'Anthropic list price, Claude docs pricing page, 2026-05-29'),
    ('claude-haiku-4-5',  '2026-05-29', 1000000,  5000000, 1250000,  2000000, 100000,
     'Anthropic list price, Claude docs pricing page, 2026-05-29');

-- ADR 0015 decision 7: the two psychologist tiers are different agent bindings, so the
-- cascade chooses the model and operators can rebind either without code.
INSERT INTO bindings (scope, agent_slug, model) VALUES
    ('agent', 'psicologo', 'claude-opus-4-8'),
    ('agent', 'psicologo-leve', 'claude-haiku-4-5'),
    ('agent', 'criativo', 'claude-sonnet-4-6');
INSERT INTO bindings (scope, model) VALUES ('workspace', 'claude-sonnet-4-6');
