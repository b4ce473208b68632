-- Issue 16: a binding names who serves its model as well as the model, so one agent
-- can run on a local OpenAI-compatible server (Ollama, vLLM, LM Studio) while the
-- others stay on the configured provider. NULL: metering's configured provider, so
-- every existing binding keeps its meaning.
ALTER TABLE bindings ADD COLUMN provider text
    CHECK (provider IN ('anthropic', 'openai', 'scripted'));

-- Local models cost nothing per token; they are priced at 0 so they can be bound and
-- their calls still metered (tokens counted, budgets held at 0). Another local model
-- is bound the same way once it has a row here.
INSERT INTO prices (model, effective_from, input_micros, output_micros,
                    cache_write_5m_micros, cache_write_1h_micros, cache_read_micros, source)
VALUES
    ('llama3.2',      '2026-01-01', 0, 0, 0, 0, 0, 'local model, served by the operator: no price'),
    ('llama3.1:8b',   '2026-01-01', 0, 0, 0, 0, 0, 'local model, served by the operator: no price'),
    ('qwen2.5:7b',    '2026-01-01', 0, 0, 0, 0, 0, 'local model, served by the operator: no price'),
    ('gpt-oss:20b',   '2026-01-01', 0, 0, 0, 0, 0, 'local model, served by the operator: no price');
