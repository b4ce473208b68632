"""The deployment's names and each service as the deployment sees it: its sizing, its
Postgres role, what its migration Job runs."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import packages_distributions, version
from pathlib import Path

from contracts import catalog
from devstack.services import declared, discover, web_links

K8S = Path("deploy/k8s")
BASE = K8S / "base"
NAMESPACE = "agentbus"
PART_OF = {"app.kubernetes.io/part-of": "agentbus"}
# Inside a pod every port is its own: fixed ones keep probes and scrapes simple.
METRICS_PORT = 9090
WEB_PORT = 8480
# CloudNativePG: the cluster, the database, and the PgBouncer pooler the services use.
PG_CLUSTER = "agentbus-db"
PG_DATABASE = "agentbus"
PG_POOLER = "agentbus-pooler"
NATS_SECRET = "agentbus-nats"
PROVIDER_SECRET = "agentbus-providers"
GATEWAY_SECRET = "agentbus-gateway"
# The distributions whose code a migration Job runs besides the service's own: their
# versions are part of what names it.
MIGRATE_CODE = ("agentbus-servicekit", "agentbus-devstack")


@dataclass(frozen=True)
class Sizing:
    """Requests of one replica, and where the figure comes from."""

    cpu: str
    memory: str
    why: str


# CPU per operation from the benches (each measures its own baseline; figures from the
# last session notes, 2 shared cores). A Python service runs on one event loop, so it
# never uses more than a core: the limit is 1 and the request is the steady load one
# replica is sized for. Memory: resident size seen under the benches, with headroom.
SIZING = {
    "session_events": Sizing(
        "200m", "256Mi", "bench/append.py: 0.39 ms service CPU per append -> 500 appends/s"
    ),
    "handoff": Sizing(
        "100m",
        "192Mi",
        "bench/handoff.py: 3.7 ms CPU per superseding offer over all processes, ~2.2 ms "
        "outside the log's two appends -> ~45 offers/s",
    ),
    "metering": Sizing(
        "250m",
        "256Mi",
        "bench/chat.py: ~0.2 ms CPU per streamed token over all processes -> 1,250 tokens/s "
        "(25 streams at 50 tokens/s)",
    ),
    "gateway": Sizing(
        "250m",
        "256Mi",
        "bench/gateway.py, bench/chat.py: ~0.2 ms CPU per token fanned out -> 1,250 frames/s",
    ),
}
DEFAULT_SIZING = Sizing("100m", "192Mi", "no bench figure yet: one model turn at a time")


@dataclass(frozen=True)
class Deployed:
    """One service as the deployment sees it."""

    name: str  # NATS micro name and NATS user (`session_events`)
    module: str  # what `python -m` runs
    schema: str | None  # its Postgres schema, None for a service that keeps nothing
    web: bool  # serves the web client (a port, the Ingress)
    provider: bool  # reaches a model provider (its keys, egress to the internet)
    durables: bool  # holds JetStream deliveries (model turns) that a stop would replay
    version: str = ""  # its declared version (`svc.version`)
    migrations: tuple[str, ...] = ()  # its migration packages, after servicekit's own
    # (distribution, version) of the code its migration Job runs
    code_versions: tuple[tuple[str, str], ...] = ()

    @property
    def dns(self) -> str:
        """Its name in k8s and compose (`session_events` → `session-events`)."""
        return self.name.replace("_", "-")

    @property
    def role_secret(self) -> str:
        """The Secret of its Postgres role (kubernetes.io/basic-auth)."""
        return f"agentbus-pg-{self.dns}"

    @property
    def sizing(self) -> Sizing:
        return SIZING.get(self.name, DEFAULT_SIZING)

    @property
    def grace_seconds(self) -> int:
        # A durable delivery can be a model turn of minutes; JetStream redelivers what a
        # stopped replica held, so a longer grace only spares a replayed turn.
        return 60 if self.durables else 30


def deployed_services() -> list[Deployed]:
    """Every installed service, in the catalog's order."""
    access = {a.service: a for a in catalog.ACCESS}
    web = set(web_links())
    distributions = packages_distributions()
    result = []
    for spec in discover():
        svc = declared(spec)
        code = [*distributions.get(spec.module, []), *MIGRATE_CODE]
        result.append(
            Deployed(
                name=spec.name,
                module=spec.module,
                schema=svc.schema,
                web=spec.name in web,
                provider=catalog.LLM_TURN.service == spec.name,
                durables=bool(access[spec.name].durables),
                version=svc.version,
                migrations=tuple(svc.migrations),
                code_versions=tuple((d, version(d)) for d in sorted(set(code))),
            )
        )
    return result
