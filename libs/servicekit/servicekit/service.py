"""One way to write a service: declare its commands and subscriptions once, wire, run.

A service declares its bus surface beside its handlers::

    svc = Service("handoff", "0.1.0", "Handoffs…", schema="handoff",
                  migrations=["handoff.migrations"])

    @svc.command(catalog.HANDOFFS_OFFER)
    async def offer(cmd: OfferHandoff, repo: HandoffRepository) -> OfferReply: ...

    @svc.subscribe(CLOSINGS)
    async def on_closed(event: Event, repo: HandoffRepository) -> None: ...

(`schema=None`: a service that keeps nothing durable, the gateway, gets no Postgres)
and its `app.py`, the composition root (cosmicpython's `bootstrap`), builds the parts
and runs it::

    async with svc.open(settings) as rt:
        relay = rt.relay(CommandSender(rt.nc))
        await svc.serve(rt, repo=HandoffRepository(rt.pool, relay.wake))

The first parameter of a handler is its message, parsed into the model its annotation
names (FastStream: the signature is the contract). A command declared by the catalog's
`Command` has its handler's request and reply annotations checked against the catalog
when it is declared, so a handler wired to the wrong command fails at import, not on
its first request. The others are dependencies, injected by name: whatever `serve` was
given, `nc`, `js`, `pool`, `settings`, and one the kit makes for each message of a
subscription, `attempt`: which delivery of the message this is (`attempt.last`: no
retry follows). A handler writes its state and its events through its repository's
transaction (`servicekit.outbox.with_outbox`), as a command does; a handler whose
effect must happen once per message claims the message id in that same transaction
(`servicekit.consumer.claim_once`), so the claim and the effect commit together.

Subscriptions get the consumer rules of `servicekit.consumer`: ack after the handler
returns (after commit), nak with backoff on failure, dead-letter a message that can
never be parsed (`Permanent`) or ran out of deliveries, keep held messages in
progress; with `per_session=True`, a session's messages are handled in stream order
and different sessions' concurrently.
"""

from __future__ import annotations

import gc
import inspect
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from nats.aio.msg import Msg
from pydantic import BaseModel

from contracts.catalog import Command
from servicekit.consumer import ConsumerSpec, DurableConsumer, Handler, Permanent
from servicekit.endpoint import Endpoints
from servicekit.metrics import CONSUMER_PENDING
from servicekit.retention import Retention, RetentionPolicy
from servicekit.runtime import Runtime, open_runtime, wait_until_stopped
from servicekit.settings import ServiceSettings

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
# A consumer's spec, or how to make it from the service's settings.
SpecOf = ConsumerSpec | Callable[[Any], ConsumerSpec]
# Made by the kit for each message, not given to `serve`.
PER_MESSAGE = frozenset({"attempt"})


@dataclass(frozen=True)
class Attempt:
    """Which delivery of a message this is, out of how many the consumer allows."""

    number: int
    limit: int

    @property
    def last(self) -> bool:
        """No redelivery follows a failure of this one."""
        return self.number >= self.limit


@dataclass(frozen=True)
class Subscription:
    """One durable consumer of a service: its spec, message model and handler."""

    spec: SpecOf
    model: type[BaseModel]
    handler: Callable[..., Awaitable[None]]
    per_session: bool

    def spec_for(self, settings: ServiceSettings) -> ConsumerSpec:
        return self.spec if isinstance(self.spec, ConsumerSpec) else self.spec(settings)


@dataclass(frozen=True)
class _CommandDecl:
    subject: str
    request: type[BaseModel]
    handler: Callable[..., Awaitable[Any]]


def message_model(handler: Callable[..., Any]) -> type[BaseModel]:
    """The model of a handler's first parameter, read off its signature."""
    first = next(iter(inspect.signature(handler).parameters), None)
    try:
        model = typing.get_type_hints(handler).get(first) if first is not None else None
    except NameError:  # an annotation imported only for type checking
        model = None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(
            f"{handler.__qualname__}: annotate its first parameter with the message model "
            "(imported at run time), or name the model in the decorator"
        )
    return model


def _check_signature(command: Command[Any, Any], handler: Callable[..., Any]) -> None:
    """Refuse a handler whose request or reply annotation is not the catalog's."""
    first = next(iter(inspect.signature(handler).parameters), None)
    try:
        hints = typing.get_type_hints(handler)
    except NameError as exc:  # an annotation imported only for type checking
        raise TypeError(
            f"{command.subject}: the annotations of {handler.__qualname__} must be importable "
            f"at run time to be checked against the catalog ({exc})"
        ) from None
    found = {
        "request": hints.get(first) if first is not None else None,
        "reply": hints.get("return"),
    }
    expected = {"request": command.request, "reply": command.reply}
    wrong = [part for part in expected if found[part] is not expected[part]]
    if wrong:
        raise TypeError(
            f"{command.subject}: {handler.__qualname__} does not match the catalog: "
            + "; ".join(
                f"{part} expected {_type_name(expected[part])}, found {_type_name(found[part])}"
                for part in wrong
            )
        )


def _type_name(annotation: object) -> str:
    if annotation is None:
        return "no annotation"
    return annotation.__name__ if isinstance(annotation, type) else repr(annotation)


def session_of_subject(msg: Msg) -> str:
    """An event's session: the last token of `<domain>.<name>.<project>.<session>`."""
    return msg.subject.rsplit(".", 1)[-1]


def _dependencies(
    handler: Callable[..., Any], deps: Mapping[str, Any], made: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The arguments after the message that `handler` asks for, by name."""
    wanted = list(inspect.signature(handler).parameters)[1:]
    missing = [name for name in wanted if name not in deps and name not in made]
    if missing:
        raise TypeError(f"{handler.__qualname__} needs {missing}: pass them to Service.serve")
    return {name: deps[name] for name in wanted if name in deps}


class Service:
    """A service's commands and subscriptions, declared once; `serve` runs them."""

    def __init__(
        self,
        name: str,
        version: str,
        description: str,
        schema: str | None,
        migrations: list[str] | None = None,
    ) -> None:
        self.name = name
        self.version = version
        self.description = description
        self.schema = schema
        self.migrations = list(migrations or [])
        self.commands: list[_CommandDecl] = []
        self.subscriptions: list[Subscription] = []

    def command(
        self, command: Command[Any, Any] | str, request: type[BaseModel] | None = None
    ) -> Callable[[F], F]:
        """Answer a command with the handler. Given the catalog's `Command`, the handler's
        request and reply annotations must be its models, and this service its server;
        given a bare subject, the request model is the handler's first parameter's."""

        def register(handler: F) -> F:
            if isinstance(command, Command):
                if command.service != self.name:
                    raise TypeError(
                        f"{command.subject} is served by {command.service} in the catalog, "
                        f"not by {self.name}"
                    )
                _check_signature(command, handler)
                subject, model = command.subject, command.request
            else:
                subject, model = command, request or message_model(handler)
            self.commands.append(_CommandDecl(subject, model, handler))
            return handler

        return register

    def subscribe(
        self,
        spec: SpecOf,
        model: type[BaseModel] | None = None,
        *,
        per_session: bool = False,
    ) -> Callable[[F], F]:
        """Consume the durable `spec` (or `spec(settings)`) with the handler."""

        def register(handler: F) -> F:
            parsed = model or message_model(handler)
            self.subscriptions.append(Subscription(spec, parsed, handler, per_session))
            return handler

        return register

    @asynccontextmanager
    async def open(self, settings: ServiceSettings | None = None) -> AsyncIterator[Runtime]:
        """Connect as this service, check the streams, migrate its schema."""
        async with open_runtime(self.name, self.schema, self.migrations, settings) as rt:
            yield rt

    def endpoints(self, deps: Mapping[str, Any]) -> Endpoints:
        """The commands, their dependencies bound, as a NATS micro service."""
        api = Endpoints(self.name, self.version, self.description)
        for cmd in self.commands:
            bound = _dependencies(cmd.handler, deps)
            api.command(cmd.subject, cmd.request)(_with(cmd.handler, bound))
        return api

    async def serve(
        self, rt: Runtime, *, metadata: Mapping[str, str] | None = None, **deps: Any
    ) -> None:
        """Start every subscription and command, then run until stopped (SIGTERM, or a
        background task crashed); stop serving and finish the requests in flight.
        `metadata` is announced in the service's NATS micro info (`$SRV.INFO`)."""
        given = {"nc": rt.nc, "js": rt.js, "settings": rt.settings, **deps}
        if rt.db is not None:
            given["pool"] = rt.db
        endpoints = self.endpoints(given)
        for sub in self.subscriptions:
            await self._start(rt, sub, given)
        if rt.db is not None and rt.schema is not None:
            consumed = [sub.spec_for(rt.settings).stream for sub in self.subscriptions]
            policy = RetentionPolicy.for_service(rt.settings, consumed)
            rt.background(Retention(rt.db, rt.schema, policy).run(), "retention")
        # Announced last: a replica `$SRV.PING` finds is consuming already.
        service = await endpoints.start(
            rt.nc,
            rt.settings.endpoint_concurrency,
            rt.settings.instance_id,
            metrics_url=rt.metrics.url if rt.metrics is not None else "",
            metadata=metadata,
        )
        _freeze_what_started()
        rt.health.serving.set()
        try:
            await wait_until_stopped(rt)
        finally:
            await service.stop()
            await endpoints.drain()

    async def _start(self, rt: Runtime, sub: Subscription, deps: Mapping[str, Any]) -> None:
        spec = sub.spec_for(rt.settings)
        # Created once here, so the pullers below only bind to it.
        await rt.js.add_consumer(spec.stream, spec.config())
        handler = self._consume(sub, spec, deps)
        key = session_of_subject if sub.per_session else None

        async def lag() -> None:
            info = await rt.js.consumer_info(spec.stream, spec.durable)
            CONSUMER_PENDING.labels(spec.durable).set(info.num_pending or 0)

        rt.health.samplers.append(lag)
        for worker in range(spec.workers):
            consumer = DurableConsumer(rt.nc, rt.js, rt.pool, spec, handler, key)
            suffix = f"-{worker}" if spec.workers > 1 else ""
            rt.background(consumer.run(), f"{spec.durable}{suffix}")

    def _consume(self, sub: Subscription, spec: ConsumerSpec, deps: Mapping[str, Any]) -> Handler:
        """The raw-message handler: parse, then run by the handler's signature."""
        wanted = set(inspect.signature(sub.handler).parameters)
        bound = _dependencies(sub.handler, deps, PER_MESSAGE)

        async def handle(msg: Msg) -> None:
            try:
                message = sub.model.model_validate_json(msg.data)
            except ValueError as exc:
                raise Permanent(f"not an event: {exc}") from None
            kwargs = dict(bound)
            if "attempt" in wanted:
                kwargs["attempt"] = Attempt(msg.metadata.num_delivered, spec.max_deliver)
            await sub.handler(message, **kwargs)

        return handle


def _with(handler: Callable[..., Awaitable[Any]], bound: dict[str, Any]) -> Any:
    if not bound:
        return handler

    async def call(message: Any) -> Any:
        return await handler(message, **bound)

    return call


# Allocations (less deallocations) between two collections of the youngest generation.
GC_YOUNG_THRESHOLD = 7000


def _freeze_what_started() -> None:
    """What start-up made (modules, contract schemas, catalogs, connections) lives as long
    as the process: kept out of the collector's scans, so a full collection walks only
    what the requests made (criativo and metering: 63k start-up objects, a 31 ms pause per
    full collection under load, 0 ms frozen). Young objects are collected ten times less
    often: a request's futures, tasks and records survive a few collections while in
    flight, and at the default threshold (700) scanning them took ~4% of the log's CPU
    per append (perf, bench/append.py at 32 producers)."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
