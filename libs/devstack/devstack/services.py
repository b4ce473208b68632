"""The services the launcher runs, found through entry points (no list kept here).

Each service declares itself in its own `pyproject.toml`:

    [project.entry-points."agentbus.services"]
    session_events = "session_events"      # NATS micro name = the module `python -m` runs

and a service that serves the web client also names how to link to it:

    [project.entry-points."agentbus.web"]
    gateway = "gateway.auth:dev_link"      # (project_id, user) -> a ready URL

The NATS users come from `contracts.catalog.ACCESS`: a service found here without a user
there could not connect to the secured server, so it is refused up front, and the stack
starts the services in the catalog's order. A test checks that the two agree, and that
docker-compose and deploy/k8s run the same services.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import entry_points

from contracts import catalog
from servicekit.service import Service

SERVICES_GROUP = "agentbus.services"
WEB_GROUP = "agentbus.web"


@dataclass(frozen=True)
class ServiceSpec:
    """A service the stack runs: its micro name and the module `python -m` starts."""

    name: str
    module: str


class UnknownService(RuntimeError):
    """An entry point names a service the catalog gives no NATS user."""


def discover() -> list[ServiceSpec]:
    """Every installed service, in the catalog's order."""
    order = [access.service for access in catalog.ACCESS]
    found = {ep.name: ServiceSpec(ep.name, ep.value) for ep in entry_points(group=SERVICES_GROUP)}
    unknown = sorted(set(found) - set(order))
    if unknown:
        raise UnknownService(
            f"{', '.join(unknown)}: declared under {SERVICES_GROUP!r} but without an Access "
            "(NATS user) in contracts/contracts/catalog.py; add it there, then `make nats-config`"
        )
    return [found[name] for name in order if name in found]


WebLink = Callable[..., str]


def web_links() -> dict[str, WebLink]:
    """The services that serve the web client: name → their link maker (project, user)."""
    return {ep.name: ep.load() for ep in entry_points(group=WEB_GROUP)}


def declared(spec: ServiceSpec) -> Service:
    """The service's declaration (`svc` of its `app` module, the shape every service
    has): its schema and migrations, for the migration Job and the deploy generator.
    Loaded at run time, like the entry point itself, so the launcher imports no service."""
    svc = getattr(import_module(f"{spec.module}.app"), "svc", None)
    if not isinstance(svc, Service):
        raise UnknownService(f"{spec.module}.app has no `svc` (a servicekit Service)")
    return svc
