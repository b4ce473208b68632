"""What the tests and the benches run agentbus with, never shipped in the image.

- `testkit.plugin` (a pytest plugin): the test servers, real NATS and real Postgres;
- `testkit.metering` (a pytest plugin): metering running in the test's process;
- `testkit.servers`, `testkit.services`, `testkit.probes`, `testkit.forgeries`: the
  helpers tests and benches call to reach those servers, run services and see outcomes;
- `testkit.fake_sse`, `testkit.fake_chat_api` (OpenAI-compatible) and
  `testkit.fake_messages_api` (Anthropic): local model APIs that the official SDKs talk
  to over HTTP, so a provider's real code path runs without a network.

It imports the code it tests the way a service does: contracts (streams, subjects,
events), servicekit (the embedded servers, provisioning, `call`), so a test's servers
and calls are the ones `make up` runs; and, in `testkit.metering` only, the metering
service, whose real `main` the plugin runs. It is a separate distribution in the root's
dev group, outside the workspace members, so the production image (which installs every
member) holds neither it nor pytest; no production package imports it (an
import-linter contract).
"""
