"""The Jobs of a release: a service's migrations and the streams' provisioning, each
named by a hash of what it runs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from importlib.metadata import version
from typing import Any

from contracts import streams
from devstack.deploygen.k8s import (
    app_labels,
    container_security,
    nats_env,
    pod_security,
    postgres_env,
)
from devstack.deploygen.model import PG_CLUSTER, Deployed
from servicekit.db import KIT_MIGRATIONS, migration_set

# The distributions whose code the provisioning Job runs: their versions are part of
# what names it.
PROVISION_CODE = ("agentbus-contracts", "agentbus-servicekit", "agentbus-devstack")
# Hex digits of sha256 in a Job's name: 40 bits, no two releases collide in practice.
HASH_CHARS = 10
# How long a finished Job (and its pod's log) stays.
JOB_TTL_SECONDS = 3600


def content_hash(content: Any) -> str:
    """A short, stable digest of JSON-able `content`: what a Job's name carries."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]


def _named_job(base: str, component: str, spec: dict[str, Any], inputs: Any) -> dict[str, Any]:
    """A Job named `<base>-<hash>` of its spec and of what it runs (`inputs`).

    A Job's pod template is immutable: applying a changed one under the same name is
    refused. Named by its content, a new release is a new Job beside the old one (which
    its TTL removes) and the same release applies as the same Job, unchanged.
    """
    name = f"{base}-{content_hash({'spec': spec, 'runs': inputs})}"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        # The name label stays `base`: what selects a service's Jobs across releases.
        "metadata": {"name": name, "labels": app_labels(base, component)},
        "spec": spec,
    }


def _job_spec(
    base: str, component: str, container: dict[str, Any], backoff: int, **labels: str
) -> dict[str, Any]:
    return {
        "backoffLimit": backoff,
        # Long enough to read a finished Job's log after an upgrade; then it goes, so
        # the Jobs of past releases do not pile up. Applying the same release again
        # after that runs it again, which changes nothing.
        "ttlSecondsAfterFinished": JOB_TTL_SECONDS,
        "template": {
            "metadata": {"labels": {**app_labels(base, component), **labels}},
            "spec": {
                "restartPolicy": "OnFailure",
                "securityContext": pod_security(),
                "containers": [
                    {
                        **container,
                        "securityContext": container_security(),
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                    }
                ],
                "volumes": [{"name": "tmp", "emptyDir": {}}],
            },
        },
    }


def migration_job(s: Deployed) -> dict[str, Any]:
    base = f"migrate-{s.dns}"
    container = {
        "name": "migrate",
        "image": "agentbus",
        "args": ["devstack.migrate", s.name],
        # Straight to the primary: migrate holds a session advisory lock across its
        # transactions.
        "env": [
            *postgres_env(s, f"{PG_CLUSTER}-rw"),
            {"name": "AGENTBUS_LOG_FORMAT", "value": "json"},
        ],
        "resources": {
            "requests": {"cpu": "50m", "memory": "128Mi"},
            "limits": {"cpu": "1", "memory": "256Mi"},
        },
    }
    # The database may still be forming on the first apply.
    spec = _job_spec(base, "migration", container, 20, **{"agentbus.io/postgres": "true"})
    runs = {
        "service": s.name,
        "version": s.version,
        "code": dict(s.code_versions),
        # The names and checksums `migrate` records: servicekit's tables, then its own.
        "migrations": migration_set([KIT_MIGRATIONS, *s.migrations]),
    }
    return _named_job(base, "migration", spec, runs)


PROVISION = "agentbus-provision"


def provision_job() -> dict[str, Any]:
    """Creates or updates the streams and KV buckets as the `provision` user."""
    container = {
        "name": "provision",
        "image": "agentbus",
        # The image's entry point is `python -m`: `agentbus provision`.
        "args": ["devstack", "provision"],
        "env": [
            *nats_env("provision"),
            # Every stream replicated on the three NATS servers (nats.yaml).
            {"name": "AGENTBUS_STREAM_REPLICAS", "value": "3"},
        ],
        "resources": {
            "requests": {"cpu": "50m", "memory": "128Mi"},
            "limits": {"memory": "256Mi"},
        },
    }
    # NATS may still be forming its cluster on the first apply: retry for a while.
    spec = _job_spec(PROVISION, "provision", container, 10)
    runs = {
        "streams": [asdict(stream) for stream in streams.ALL],
        "buckets": [asdict(bucket) for bucket in streams.BUCKETS],
        "code": {d: version(d) for d in PROVISION_CODE},
    }
    return _named_job(PROVISION, "provision", spec, runs)


PROVISION_HEADER = """\
# Streams have one owner: this Job creates the streams and KV buckets, or brings them
# to the configuration contracts/contracts/streams.py declares, as the `provision` user
# — the only NATS user allowed to create, update or delete a stream. The services only
# check them at start and refuse to start (exit 78, one `streams_not_provisioned` log
# line) until this Job has run, so the first apply sees them restart for a moment.
#
# Its name carries a hash of the declarations, its spec and the versions of the code it
# runs: changed declarations are a new Job on the next apply. To run it again as it is
# (a lost stream; then `agentbus republish --since …` refills EVENTS from Postgres):
#   kubectl -n agentbus delete job -l app.kubernetes.io/name=agentbus-provision
#   kubectl apply -k deploy/k8s/overlays/<overlay>
"""
