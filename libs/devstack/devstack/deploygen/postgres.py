"""The CloudNativePG objects: the cluster and its roles, the database and its schemas,
the pooler, and the continuous backup."""

from __future__ import annotations

from typing import Any

from devstack.deploygen.k8s import metadata
from devstack.deploygen.model import PG_CLUSTER, PG_DATABASE, PG_POOLER, Deployed

# Continuous backup through CloudNativePG's Barman Cloud plugin (the in-tree
# `barmanObjectStore` is deprecated since 1.26): WAL archive and base backups in an
# S3 bucket, reached with the keys of BACKUP_SECRET. The overlays set where the bucket is.
BARMAN_PLUGIN = "barman-cloud.cloudnative-pg.io"
BACKUP_STORE = "agentbus-backups"
BACKUP_SECRET = "agentbus-backup"
BACKUP_KEYS = ("ACCESS_KEY_ID", "ACCESS_SECRET_KEY")
BACKUP_RETENTION = "30d"
# CloudNativePG's cron has a seconds field; the operator's clock (UTC in its image).
BACKUP_SCHEDULE = "0 0 3 * * *"


def postgres(services: list[Deployed]) -> list[dict[str, Any]]:
    """The CloudNativePG cluster, one role per service owning only its schema, the pooler."""
    stored = [s for s in services if s.schema is not None]
    cluster = {
        "apiVersion": "postgresql.cnpg.io/v1",
        "kind": "Cluster",
        "metadata": metadata(PG_CLUSTER, "postgres"),
        "spec": {
            "instances": 3,
            "primaryUpdateStrategy": "unsupervised",
            "storage": {"size": "20Gi"},
            "affinity": {
                "enablePodAntiAffinity": True,
                "podAntiAffinityType": "required",
                "topologyKey": "kubernetes.io/hostname",
            },
            "resources": {
                # bench/append.py: Postgres spends 0.27-0.33 ms CPU per append.
                "requests": {"cpu": "500m", "memory": "1Gi"},
                "limits": {"memory": "2Gi"},
            },
            "postgresql": {
                "parameters": {
                    # The pooler opens at most default_pool_size (40) per role: 40 x the
                    # roles, plus replication, the operator and a superuser's reserve.
                    "max_connections": str(40 * len(stored) + 50),
                }
            },
            # The database's owner is not a service: it owns the database, not the
            # schemas, and no service connects as it.
            "bootstrap": {"initdb": {"database": PG_DATABASE, "owner": "agentbus_owner"}},
            # Every WAL segment goes to the object store as it fills (or after
            # archive_timeout, 5 min): with a base backup, a point-in-time recovery.
            "plugins": [
                {
                    "name": BARMAN_PLUGIN,
                    "isWALArchiver": True,
                    "parameters": {"barmanObjectName": BACKUP_STORE},
                }
            ],
            "managed": {
                "roles": [
                    {
                        "name": s.name,
                        "ensure": "present",
                        "login": True,
                        # Session pooling: a client holds its server connection. 2
                        # replicas x AGENTBUS_DB_POOL_MAX 10, one more during a rolling
                        # update, and the migration Job: 31 at most.
                        "connectionLimit": 40,
                        "passwordSecret": {"name": s.role_secret},
                    }
                    for s in stored
                ]
            },
        },
    }
    database = {
        "apiVersion": "postgresql.cnpg.io/v1",
        "kind": "Database",
        "metadata": metadata(PG_DATABASE, "postgres"),
        "spec": {
            "cluster": {"name": PG_CLUSTER},
            "name": PG_DATABASE,
            "owner": "agentbus_owner",
            # Each role owns its own schema and has no CREATE on the database (nor, since
            # Postgres 15, on `public`): its rights end at its schema.
            "schemas": [{"name": s.schema, "owner": s.name} for s in stored],
        },
    }
    pooler = {
        "apiVersion": "postgresql.cnpg.io/v1",
        "kind": "Pooler",
        "metadata": metadata(PG_POOLER, "postgres"),
        "spec": {
            "cluster": {"name": PG_CLUSTER},
            "instances": 2,
            "type": "rw",
            "pgbouncer": {
                # Session pooling: asyncpg prepares every statement (a named statement
                # cache per connection), the pool sets `search_path` as a startup
                # parameter, migrate holds a session advisory lock and the outbox relay
                # LISTENs; all of these are per server session, which transaction pooling
                # would hand to another client. The pooler still caps and queues the
                # server connections and survives a failover.
                "poolMode": "session",
                "parameters": {
                    "max_client_conn": "1000",
                    "default_pool_size": "40",
                    # Forward the pool's search_path startup parameter (pgbouncer >= 1.20).
                    "track_extra_parameters": "search_path",
                },
            },
        },
    }
    return [cluster, database, pooler, *backup()]


def backup() -> list[dict[str, Any]]:
    """Where the cluster archives its WAL and base backups, and a base backup a day."""
    s3_key = [{"name": BACKUP_SECRET, "key": key} for key in BACKUP_KEYS]
    store = {
        "apiVersion": "barmancloud.cnpg.io/v1",
        "kind": "ObjectStore",
        "metadata": metadata(BACKUP_STORE, "backup"),
        "spec": {
            # The bucket (and endpoint, for one that is not AWS) is each overlay's.
            "configuration": {
                "destinationPath": f"s3://{BACKUP_STORE}/",
                "s3Credentials": {"accessKeyId": s3_key[0], "secretAccessKey": s3_key[1]},
                "wal": {"compression": "gzip", "maxParallel": 4},
                "data": {"compression": "gzip", "jobs": 2},
            },
            # Base backups older than this, and the WAL only they need, are deleted: a
            # recovery reaches any time in the window.
            "retentionPolicy": BACKUP_RETENTION,
        },
    }
    scheduled = {
        "apiVersion": "postgresql.cnpg.io/v1",
        "kind": "ScheduledBackup",
        "metadata": metadata(f"{PG_CLUSTER}-daily", "backup"),
        "spec": {
            "cluster": {"name": PG_CLUSTER},
            "schedule": BACKUP_SCHEDULE,
            # The first base backup at once: the WAL archive alone recovers nothing.
            "immediate": True,
            "method": "plugin",
            "pluginConfiguration": {"name": BARMAN_PLUGIN},
            # The Backup objects go with this schedule, not with the cluster.
            "backupOwnerReference": "self",
        },
    }
    return [store, scheduled]
