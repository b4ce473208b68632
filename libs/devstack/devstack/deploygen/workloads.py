"""A service's own objects: its Deployment, PodDisruptionBudget, Service and, when it
serves the web client, its Ingress."""

from __future__ import annotations

from typing import Any

from devstack.deploygen.k8s import (
    app_labels,
    container_security,
    metadata,
    nats_env,
    pod_security,
    pod_selector,
    postgres_env,
    secret_env,
)
from devstack.deploygen.model import (
    GATEWAY_SECRET,
    METRICS_PORT,
    PG_POOLER,
    PROVIDER_SECRET,
    WEB_PORT,
    Deployed,
)
from devstack.deploygen.telemetry import TELEMETRY_CONFIG


def _env(s: Deployed) -> list[dict[str, Any]]:
    env = nats_env(s.name)
    if s.schema is not None:
        env += postgres_env(s, PG_POOLER)
        # The migration Job migrates; the service waits, not ready, for its schema.
        env.append({"name": "AGENTBUS_MIGRATE", "value": "false"})
    env += [
        # Every stream replicated on the three NATS servers (nats.yaml).
        {"name": "AGENTBUS_STREAM_REPLICAS", "value": "3"},
        # The pod name, published as the `instance` metadata of its NATS micro endpoint.
        {
            "name": "AGENTBUS_INSTANCE_ID",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
        },
        {"name": "AGENTBUS_METRICS_HOST", "value": "0.0.0.0"},
        {"name": "AGENTBUS_METRICS_PORT", "value": str(METRICS_PORT)},
        {"name": "AGENTBUS_LOG_FORMAT", "value": "json"},
        {"name": "AGENTBUS_LOG_LEVEL", "value": "INFO"},
        # The rest of tracing comes from the agentbus-telemetry ConfigMap (envFrom).
        {"name": "OTEL_SERVICE_NAME", "value": s.name},
    ]
    if s.web:
        env += [
            {"name": "AGENTBUS_GATEWAY_HOST", "value": "0.0.0.0"},
            {"name": "AGENTBUS_GATEWAY_PORT", "value": str(WEB_PORT)},
            # Every replica signs and checks tokens with the same secret; set here, the
            # gateway never tries to create one in its read-only filesystem.
            secret_env("AGENTBUS_GATEWAY_SECRET", GATEWAY_SECRET, "AGENTBUS_GATEWAY_SECRET"),
        ]
    if s.provider:
        # Without a key, metering answers from its offline script and says so at start
        # (and in its `$SRV.INFO` metadata, where the gateway reads the offline notice).
        for key in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL"):
            env.append(secret_env(key, PROVIDER_SECRET, key, optional=True))
    return env


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "metrics"},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _pod_labels(s: Deployed) -> dict[str, str]:
    labels = app_labels(s.dns, "service")
    # What the NetworkPolicies select on (network-policies.yaml).
    if s.schema is not None:
        labels["agentbus.io/postgres"] = "true"
    if s.provider:
        labels["agentbus.io/internet"] = "true"
    if s.web:
        labels["agentbus.io/web"] = "true"
    return labels


def deployment(s: Deployed) -> dict[str, Any]:
    ports = [{"name": "metrics", "containerPort": METRICS_PORT}]
    if s.web:
        ports.insert(0, {"name": "http", "containerPort": WEB_PORT})
    container = {
        "name": s.dns,
        # Set to your registry and tag with `images:` in the overlay.
        "image": "agentbus",
        # The image's entry point is `python -m`; this is the module.
        "args": [s.module],
        "ports": ports,
        "env": _env(s),
        # Tracing, off until the ConfigMap names an exporter (telemetry.yaml).
        "envFrom": [{"configMapRef": {"name": TELEMETRY_CONFIG}}],
        "resources": {
            "requests": {"cpu": s.sizing.cpu, "memory": s.sizing.memory},
            "limits": {"cpu": "1", "memory": s.sizing.memory},
        },
        # In-process HTTP on the metrics port (servicekit.metrics), no interpreter
        # started per probe. /livez is the event loop answering: a NATS or Postgres
        # outage never restarts the pods; /readyz (NATS, Postgres, its schema at the
        # expected version, consumers running) only takes them out of rotation. The
        # startup probe gives a first start time to connect and wait for its schema.
        "startupProbe": _probe("/livez", 2, 60),
        "livenessProbe": _probe("/livez", 10, 3),
        "readinessProbe": _probe("/readyz", 5, 2),
        "securityContext": container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(s.dns, "service"),
        "spec": {
            "replicas": 2,
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "selector": {"matchLabels": {"app.kubernetes.io/name": s.dns}},
            "template": {
                "metadata": {
                    "labels": _pod_labels(s),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(METRICS_PORT),
                    },
                },
                "spec": {
                    # SIGTERM: stop taking work, finish what is in flight, close.
                    "terminationGracePeriodSeconds": s.grace_seconds,
                    "securityContext": pod_security(),
                    "affinity": {
                        "podAntiAffinity": {
                            "preferredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "weight": 100,
                                    "podAffinityTerm": {
                                        "topologyKey": "kubernetes.io/hostname",
                                        "labelSelector": {
                                            "matchLabels": {"app.kubernetes.io/name": s.dns}
                                        },
                                    },
                                }
                            ]
                        }
                    },
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }


def disruption_budget(s: Deployed) -> dict[str, Any]:
    # maxUnavailable rather than minAvailable: a drain never takes two replicas at once,
    # and an overlay that runs one replica can still be drained.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(s.dns, "service"),
        "spec": {
            "maxUnavailable": 1,
            "selector": pod_selector(s),
        },
    }


def service(s: Deployed) -> dict[str, Any]:
    ports: list[dict[str, Any]] = [
        {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}
    ]
    if s.web:
        ports.insert(0, {"name": "http", "port": 80, "targetPort": "http"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(s.dns, "service"),
        "spec": {"selector": {"app.kubernetes.io/name": s.dns}, "ports": ports},
    }


def ingress(s: Deployed) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": {
            **metadata(s.dns, "service"),
            # WebSockets stay open for a session: no proxy timeout cuts them at 60 s.
            "annotations": {
                "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",
                "nginx.ingress.kubernetes.io/proxy-send-timeout": "3600",
            },
        },
        "spec": {
            # The overlay sets the host (and TLS) it is served under.
            "rules": [
                {
                    "host": "agentbus.example.com",
                    "http": {
                        "paths": [
                            {
                                "path": "/",
                                "pathType": "Prefix",
                                "backend": {"service": {"name": s.dns, "port": {"name": "http"}}},
                            }
                        ]
                    },
                }
            ]
        },
    }
