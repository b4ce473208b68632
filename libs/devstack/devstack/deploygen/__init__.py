"""The deployment's per-service files, generated from one place.

Every list of services outside the services themselves — a Deployment,
PodDisruptionBudget and Service per service in deploy/k8s/base/services/, a migration
Job and a Postgres role per service that keeps a schema, the provisioning Job (each Job
named by a hash of what it runs), the tracing ConfigMap, the kustomization's
resources, the monitoring objects of deploy/k8s/monitoring/ (a ServiceMonitor per
service, the PodMonitors of NATS and Postgres, the PrometheusRule and the Grafana
dashboard's ConfigMap, both derived from deploy/monitoring/), docker-compose's service
entries and NATS passwords, the root pyproject's mypy path and import layers — is
written by `agentbus deploy-config --write` from:

- the installed services (`agentbus.services` entry points, devstack.services), each
  with its `svc` declaration (schema, migrations);
- the catalog (`contracts.catalog.ACCESS`: the NATS user, durable consumers; the owner
  of `cmd.llm.turn` is the one service that reaches a model provider);
- the `agentbus.web` entry points (a service that serves the web client gets a port, a
  Service port and the Ingress).

A test fails when a committed file differs from what this writes, so adding a service is
its package (entry point, `svc`), its catalog entry, then `make deploy-config`.

One module per part: `model` (the deployment's names, each service as it sees it and
its sizing), `k8s` (what every object shares), `workloads` (a service's Deployment,
PodDisruptionBudget, Service, Ingress), `jobs` (the migration and provisioning Jobs),
`postgres` (CloudNativePG and the backup), `telemetry`, `monitoring`, `credentials`
(the Secrets and .env), `compose`, `pyproject`, `render` (YAML and the generated
blocks), `files` (every file, written or checked).
"""

from __future__ import annotations

from devstack.deploygen.compose import compose_file
from devstack.deploygen.credentials import cluster_secrets, compose_secrets, secrets_manifest
from devstack.deploygen.files import generated_files, k8s_files, stale, write
from devstack.deploygen.jobs import content_hash, migration_job, provision_job
from devstack.deploygen.model import (
    METRICS_PORT,
    PG_CLUSTER,
    PG_POOLER,
    SIZING,
    Deployed,
    Sizing,
    deployed_services,
)
from devstack.deploygen.monitoring import ALERTS, DASHBOARD, MONITORING, monitoring_files

__all__ = [
    "ALERTS",
    "DASHBOARD",
    "METRICS_PORT",
    "MONITORING",
    "PG_CLUSTER",
    "PG_POOLER",
    "SIZING",
    "Deployed",
    "Sizing",
    "cluster_secrets",
    "compose_file",
    "compose_secrets",
    "content_hash",
    "deployed_services",
    "generated_files",
    "k8s_files",
    "migration_job",
    "monitoring_files",
    "provision_job",
    "secrets_manifest",
    "stale",
    "write",
]
