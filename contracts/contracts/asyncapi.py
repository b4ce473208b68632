"""The AsyncAPI document of the bus, generated from this package by FastStream.

The broker built here is a description, never connected: its subscribers and
publishers exist only so FastStream's generator can read subjects and models off
them, and its handlers are never run. Regenerate the checked-in document with

    .venv/bin/python -m contracts.asyncapi --write

(or `python -m contracts.asyncapi > contracts/asyncapi.json`); `test_asyncapi.py`
fails while it is stale. FastStream is imported only here, so the rest of
`contracts` stays free of it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any, Literal

from faststream.nats import NatsBroker
from faststream.specification import AsyncAPI
from pydantic import create_model

from contracts import streams, subjects
from contracts.catalog import COMMANDS, PROJECT, PUBLICATIONS, SESSION, Command, Publication
from contracts.common import ErrorReply, Message
from contracts.events import PAYLOADS, Event, EventType

DOCUMENT_PATH = Path(__file__).resolve().parent.parent / "asyncapi.json"
REGENERATE = ".venv/bin/python -m contracts.asyncapi --write"

SERVER_URL = "nats://127.0.0.1:4222"
SERVER_DESCRIPTION = (
    "The server `NATS_URL` names; with it unset, agentbus embeds its own on a free port."
)
# A command's reply goes to the inbox the requester chose; there is no fixed subject.
REPLY_INBOX = "{reply_to}"

DESCRIPTION = (
    "The agentbus bus. Commands are request/reply on core NATS (`cmd.<service>.<verb>`, "
    "one queue group per service); each is answered with its reply model or with "
    "`ErrorReply`. Events committed to the session log are published on JetStream at "
    "`<domain>.<name>.<project_id>.<session_id>`, with `Nats-Msg-Id` set to the event id. "
    "The other subjects (streaming turns, metering's notices, dead letters) each say "
    "whether a stream keeps them. "
    "Generated from the `contracts` package by `python -m contracts.asyncapi`; do not edit."
)


def _first_line(model: type[Message]) -> str:
    return (model.__doc__ or model.__name__).strip().splitlines()[0]


def _documented_handler(command: Command[Any, Any]) -> Callable[..., Awaitable[None]]:
    """A no-op handler whose signature carries the request model; it is never run."""

    async def handler(body: Any) -> None:
        return None

    name = command.subject.replace(".", "_")
    handler.__name__ = handler.__qualname__ = name
    # FastStream reads the message schema off the signature; setattr because mypy
    # does not know functions carry `__signature__`.
    body = inspect.Parameter(
        "body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=command.request
    )
    setattr(handler, "__signature__", inspect.Signature([body], return_annotation=None))  # noqa: B010
    return handler


def _event_model(event_type: EventType) -> type[Event]:
    """`Event` narrowed to one type: `type` is that constant, `payload` its contract model."""
    name = "".join(word.capitalize() for word in re.split(r"[._]", event_type.value)) + "Event"
    payload = PAYLOADS[event_type]
    # A Literal of a runtime value, which mypy cannot check; pydantic renders a `const`.
    constant: Any = Literal.__getitem__(event_type.value)
    model: type[Event] = create_model(
        name,
        __base__=Event,
        __doc__=f"A committed `{event_type.value}` event; its payload is `{payload.__name__}`.",
        type=(constant, ...),
        payload=(payload, ...),
    )
    return model


def _kept(publication: Publication) -> str:
    stream = publication.stream
    return f"In stream `{stream.name}`." if stream else "Core NATS only: not kept."


def _reply_channel(command: Command[Any, Any]) -> str:
    return f"{command.subject}:Reply"


def build_broker() -> NatsBroker:
    """The bus as a documentation-only broker: never connected, handlers never run."""
    # FastStream documents channels per server, so one must be named (it is never
    # dialled); it is the URL servicekit's settings default to.
    broker = NatsBroker(specification_url=SERVER_URL, description=SERVER_DESCRIPTION)
    for command in COMMANDS:
        reply = command.reply.__name__
        broker.subscriber(
            command.subject,
            queue=command.service,
            title=command.subject,
            description=(
                f"{_first_line(command.request)} Served by `{command.service}` (queue group). "
                f"Replies `{reply}`, or `ErrorReply` on any failure (malformed requests included)."
            ),
        )(_documented_handler(command))
        broker.publisher(
            REPLY_INBOX,
            title=_reply_channel(command),
            description=f"The reply to `{command.subject}`: `{reply}` or `ErrorReply`.",
            schema=command.reply | ErrorReply,
        )
    for event_type in EventType:
        payload = PAYLOADS[event_type]
        broker.publisher(
            subjects.event_filter(event_type, PROJECT, SESSION),
            title=event_type.value,
            description=(
                f"{_first_line(payload)} An `Event` whose payload is `{payload.__name__}`, "
                f"in stream `{streams.EVENTS.name}`."
            ),
            schema=_event_model(event_type),
        )
    for publication in PUBLICATIONS:
        broker.publisher(
            publication.address,
            title=publication.title,
            description=f"{publication.description} {_kept(publication)}",
            schema=publication.body,
        )
    return broker


def _fit_to_agentbus(document: dict[str, Any]) -> None:
    """Correct the two places where FastStream's output does not describe this bus."""
    # FastStream gives every message a `correlation_id` header; agentbus sets none.
    for message in document["components"]["messages"].values():
        message.pop("correlationId", None)
    # FastStream does not emit AsyncAPI 3's `reply`: link each command to its reply.
    for command in COMMANDS:
        channel = _reply_channel(command)
        messages = document["channels"][channel]["messages"]
        document["operations"][command.subject]["reply"] = {
            "channel": {"$ref": f"#/channels/{channel}"},
            "messages": [{"$ref": f"#/channels/{channel}/messages/{name}"} for name in messages],
        }


def build_document() -> str:
    """The AsyncAPI 3.0 document as pretty JSON with sorted keys, byte-stable across runs."""
    specification = AsyncAPI(
        build_broker(),
        title="agentbus",
        version=version("agentbus-contracts"),
        description=DESCRIPTION,
    ).to_specification()
    document: dict[str, Any] = specification.to_jsonable()
    _fit_to_agentbus(document)
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Print the document, or write it over the checked-in copy with `--write`."""
    parser = argparse.ArgumentParser(prog="python -m contracts.asyncapi", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {DOCUMENT_PATH.name}")
    args = parser.parse_args(argv)
    document = build_document().encode()
    if args.write:
        DOCUMENT_PATH.write_bytes(document)
    else:
        sys.stdout.buffer.write(document)


if __name__ == "__main__":
    main()
