"""Settings every service reads from its environment (pydantic-settings)."""

from __future__ import annotations

import os
import socket

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    """Where the servers are and how a service instance behaves.

    `NATS_URL` and `DATABASE_URL` are read unprefixed, as every tool names them;
    the rest use the `AGENTBUS_` prefix.
    """

    model_config = SettingsConfigDict(env_prefix="AGENTBUS_", extra="ignore", populate_by_name=True)

    nats_url: str = Field(default="nats://127.0.0.1:4222", validation_alias="NATS_URL")
    database_url: str = Field(
        default="postgresql://postgres@127.0.0.1:5432/postgres", validation_alias="DATABASE_URL"
    )
    # This instance's NATS identity (each service has its own user). Unset: the
    # credentials in `NATS_URL`, if any, else anonymous (a plain NATS that allows it).
    nats_user: str | None = Field(default=None, validation_alias="NATS_USER")
    nats_password: str | None = Field(default=None, validation_alias="NATS_PASSWORD")
    # A JSON file of every user's password (the embedded test servers' secrets): with no
    # NATS_USER, a service connects as the user named after it when the file has it.
    nats_secrets_file: str | None = None
    instance_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    log_level: str = "INFO"
    log_format: str = "auto"  # json | console | auto (console on a terminal)
    # 1 locally; 3 on a clustered JetStream (deploy/k8s).
    stream_replicas: int = 1
    db_pool_min: int = 2
    # Apply the schema's migrations at start (a laptop, compose). In a deployment a Job
    # per service migrates and the service only waits, not ready, until its schema is
    # at the version its code expects (AGENTBUS_MIGRATE=false): replicas starting
    # together never race a migration, and the running code never meets an older schema.
    migrate: bool = True
    schema_poll_seconds: float = 2.0
    db_pool_max: int = 10
    # Requests handled at once per endpoint; replicas add to it.
    endpoint_concurrency: int = 256
    outbox_batch: int = 256
    outbox_poll_seconds: float = 1.0
    # How long a relay's claim keeps its rows from other relays (servicekit.outbox.relay):
    # the rows of a relay that died wait that long for another.
    outbox_lease_seconds: float = 10.0
    # The /metrics, /livez, /readyz HTTP port (servicekit.metrics); 0 takes a free one.
    # 127.0.0.1 by default; a pod sets 0.0.0.0 so that Prometheus and the probes reach it.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # How long a service waits out a dependency that is restarting (no responders,
    # timeouts, `unavailable` replies) before it reports the outage: about as long
    # as a person waits for an answer.
    dependency_wait_seconds: float = 60.0
    # Retention of the kit's tables (servicekit.retention): claims are kept the longest
    # max_age of the streams a service consumes plus this margin; dead letters this many
    # days; pruned every interval, in batches.
    claims_margin_seconds: float = 24 * 3600.0
    dead_letter_retention_days: float = 14.0
    retention_interval_seconds: float = 3600.0
    retention_batch: int = 5000
