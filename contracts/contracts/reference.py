"""The command and event reference (`docs/reference.md`), generated from this package.

Every table in it is read off the catalog (`COMMANDS`, `ACCESS`), the event types and
their payload models, the streams and the error codes, so it cannot drift from the
code: `test_reference.py` fails while the checked-in page is stale. Regenerate it with

    .venv/bin/python -m contracts.reference --write

(`make asyncapi` regenerates it beside the AsyncAPI document). Unlike `asyncapi.py` it
needs nothing but pydantic: the field tables come from each model's JSON schema.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from contracts import catalog, streams, subjects
from contracts.catalog import COMMANDS, PROJECT, PUBLICATIONS, SESSION, Command, Publication
from contracts.common import ErrorCode, ErrorReply, Message
from contracts.events import PAYLOADS, Event, EventType

DOCUMENT_PATH = Path(__file__).resolve().parent.parent.parent / "docs" / "reference.md"
REGENERATE = ".venv/bin/python -m contracts.reference --write"

# Who calls a command besides the services `catalog.ACCESS` names.
OPERATORS = "operators (`ops`)"


def _escape(text: str) -> str:
    """`text` fit for one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _doc(model: type[Message]) -> str:
    """The model's docstring as one paragraph per blank-line-separated block."""
    lines = (model.__doc__ or "").strip().splitlines()
    paragraphs: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            paragraphs[-1].append(line.strip())
        elif paragraphs[-1]:
            paragraphs.append([])
    return "\n\n".join(" ".join(p) for p in paragraphs if p)


def _anchor(heading: str) -> str:
    """The link to a heading, as GitHub slugs it: lower case, punctuation dropped."""
    slug = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return "#" + slug.replace(" ", "-")


def _limits(schema: dict[str, Any]) -> str:
    """A schema's size and range constraints, briefly."""
    shown: list[str] = []
    low, high = schema.get("minLength"), schema.get("maxLength")
    if low is not None or high is not None:
        shown.append(f"{low or 0}–{high} chars" if high is not None else f"≥ {low} chars")
    low, high = schema.get("minItems"), schema.get("maxItems")
    if low is not None or high is not None:
        shown.append(f"{low or 0}–{high} items" if high is not None else f"≥ {low} items")
    for key, sign in (
        ("minimum", "≥"),
        ("exclusiveMinimum", ">"),
        ("maximum", "≤"),
        ("exclusiveMaximum", "<"),
    ):
        if key in schema:
            shown.append(f"{sign} {schema[key]}")
    return f" ({', '.join(shown)})" if shown else ""


def _type(schema: dict[str, Any]) -> str:
    """A JSON schema as a short type expression, models linked to their section."""
    if "$ref" in schema:
        name = str(schema["$ref"]).rsplit("/", 1)[-1]
        return f"[`{name}`]({_anchor(name)})"
    if "const" in schema:
        return f'`"{schema["const"]}"`'
    if "enum" in schema:
        return " \\| ".join(f'`"{value}"`' for value in schema["enum"])
    if "anyOf" in schema:
        return " \\| ".join(_type(option) for option in schema["anyOf"])
    kind = schema.get("type")
    if kind == "array":
        return f"list[{_type(schema.get('items', {}))}]" + _limits(schema)
    if kind == "object":
        values = schema.get("additionalProperties")
        inner = _type(values) if isinstance(values, dict) and values else "any"
        return f"dict[str, {inner}]"
    if kind == "string":
        pattern = schema.get("pattern")
        shape = f" `{_escape(str(pattern))}`" if pattern else ""
        return f"{schema.get('format', 'string')}{shape}{_limits(schema)}"
    if kind in ("integer", "number", "boolean", "null"):
        return f"{kind}{_limits(schema)}"
    return "any"


def _fields(schema: dict[str, Any]) -> list[str]:
    """The table of a model's fields: name, type, required or its default."""
    properties: dict[str, Any] = schema.get("properties", {})
    if not properties:
        return ["No fields."]
    required = set(schema.get("required", []))
    rows = ["| field | type | required |", "|---|---|---|"]
    for name, field in properties.items():
        if name in required:
            need = "yes"
        elif "default" in field:
            default = field["default"]
            need = f"no (default `{default!r}`)" if default is not None else "no"
        else:
            need = "no"
        rows.append(f"| `{name}` | {_type(field)} | {_escape(need)} |")
    return rows


class _Models:
    """The nested models every table links to, collected once by name."""

    def __init__(self) -> None:
        self.schemas: dict[str, dict[str, Any]] = {}
        # Models with a section of their own (`Event`, `ErrorReply`): not repeated.
        self.shown: set[str] = set()

    def schema(self, model: type[Message]) -> dict[str, Any]:
        """`model`'s JSON schema; its nested models are kept for the models section."""
        schema = model.model_json_schema()
        for name, nested in schema.pop("$defs", {}).items():
            known = self.schemas.setdefault(name, nested)
            if known != nested:
                raise ValueError(f"two different models are both named {name}")
        return schema


def _model_block(
    models: _Models, title: str, model: type[Message], where: str | None = None
) -> list[str]:
    """`title` and the model's name, where it travels, its docstring and its fields."""
    schema = models.schema(model)
    lead = [where, ""] if where else []
    return [f"{title} `{model.__name__}`", "", *lead, _doc(model), "", *_fields(schema), ""]


def _callers(subject: str) -> list[str]:
    callers = [f"`{a.service}`" for a in catalog.ACCESS if subject in a.calls]
    if subject in catalog.OPERATOR_COMMANDS:
        callers.append(OPERATORS)
    return callers


def _command_index() -> list[str]:
    rows = ["| command | served by | request | reply |", "|---|---|---|---|"]
    for command in COMMANDS:
        link = _anchor(command.subject)
        rows.append(
            f"| [`{command.subject}`]({link}) | `{command.service}` | "
            f"`{command.request.__name__}` | `{command.reply.__name__}` |"
        )
    return rows


def _command(models: _Models, command: Command[Any, Any]) -> list[str]:
    callers = _callers(command.subject)
    return [
        f"#### `{command.subject}`",
        "",
        f"Called by {', '.join(callers) if callers else 'no service (the `admin` CLI)'}. "
        f"Replies `{command.reply.__name__}` or [`ErrorReply`](#errorreply).",
        "",
        *_model_block(models, "**Request**", command.request),
        *_model_block(models, "**Reply**", command.reply),
    ]


def _event(models: _Models, event_type: EventType) -> list[str]:
    payload = PAYLOADS[event_type]
    schema = models.schema(payload)
    return [
        f"### `{event_type.value}`",
        "",
        f"Subject `{subjects.event_filter(event_type, PROJECT, SESSION)}`, "
        f"stream `{streams.EVENTS.name}`. Payload `{payload.__name__}`: {_doc(payload)}",
        "",
        *_fields(schema),
        "",
    ]


def _publication(models: _Models, publication: Publication) -> list[str]:
    stream = publication.stream
    kept = f"stream `{stream.name}`" if stream else "core NATS only (not kept)"
    publishers = ", ".join(f"`{service}`" for service in catalog.publishers_of(publication))
    lead = (
        f"Subject `{publication.address}`, {kept}, published by {publishers}. "
        f"{publication.description}"
    )
    if publication.body is None:
        return [f"### `{publication.title}`", "", lead, ""]
    body = publication.body
    return [
        f"### `{publication.title}`",
        "",
        f"{lead} Body `{body.__name__}`: {_doc(body)}",
        "",
        *_fields(models.schema(body)),
        "",
    ]


def _seconds(seconds: float) -> str:
    if not seconds:
        return "forever"
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)} {unit}"
    return f"{seconds:g} s"


def _streams() -> list[str]:
    rows = [
        "| stream | subjects | storage | kept | at most |",
        "|---|---|---|---|---|",
    ]
    for spec in streams.ALL:
        bound = f"{spec.max_bytes / 1024**3:g} GiB" if spec.max_bytes > 0 else "no bound"
        subject_list = ", ".join(f"`{s}`" for s in _compact(spec.subjects))
        rows.append(
            f"| `{spec.name}` | {subject_list} | {spec.storage} | "
            f"{_seconds(spec.max_age_seconds)} | {bound} |"
        )
    rows += ["", "| KV bucket | what it holds | a key lives |", "|---|---|---|"]
    for bucket in streams.BUCKETS:
        rows.append(f"| `{bucket.name}` | {bucket.description} | {_seconds(bucket.ttl_seconds)} |")
    return rows


def _compact(filters: Iterable[str]) -> list[str]:
    """EVENTS' filters read as one per type; shown as the pattern they share."""
    filters = list(filters)
    if len(filters) > 3:
        return ["<domain>.<name>.*.* (every event type)"]
    return filters


def _errors() -> list[str]:
    codes = ", ".join(f"`{code.value}`" for code in ErrorCode)
    return [
        "Every command answers either its reply or an `ErrorReply`; a caller branches on "
        "`error.code`, never on the message. The codes:",
        "",
        codes,
        "",
    ]


def build_document() -> str:
    """The reference page as markdown, byte-stable across runs."""
    models = _Models()
    lines = [
        "# Command and event reference",
        "",
        "<!-- Generated from the `contracts` package by `python -m contracts.reference "
        "--write` (`make asyncapi`); do not edit by hand. -->",
        "",
        "Every command is request/reply on core NATS, one queue group per service; every "
        "event committed to the session log is published on "
        "`<domain>.<name>.<project_id>.<session_id>` with `Nats-Msg-Id` = the event's id. "
        "Unknown fields are refused in every message. The machine-readable form of the "
        "same bus is [`contracts/asyncapi.json`](../contracts/asyncapi.json); how the parts "
        "fit is in [architecture.md](architecture.md).",
        "",
        "## Commands",
        "",
        *_command_index(),
        "",
    ]
    services = list(dict.fromkeys(command.service for command in COMMANDS))
    for service in services:
        lines += [f"### Served by `{service}`", ""]
        for command in COMMANDS:
            if command.service == service:
                lines += _command(models, command)
    lines += ["## Errors", "", *_model_block(models, "###", ErrorReply), *_errors()]
    models.shown.add(ErrorReply.__name__)
    lines += [
        "## Events",
        "",
        "Only the log (`session_events`) publishes events: a service announces one by "
        "appending it (`cmd.events.append`). Each is an `Event` whose `payload` is its "
        "type's model below.",
        "",
        *_model_block(models, "###", Event),
    ]
    models.shown.add(Event.__name__)
    for event_type in EventType:
        lines += _event(models, event_type)
    lines += [
        "## Other subjects",
        "",
        "Not events of the log: a streaming turn's deltas and end, kept a few minutes in "
        f"`{streams.DELTAS.name}` so a client that reconnects catches up with the turn in "
        "flight; metering's notices to its replicas and its callers, on core NATS only; "
        "the dead letters of the durable consumers.",
        "",
    ]
    for publication in PUBLICATIONS:
        lines += _publication(models, publication)
    lines += ["## Streams and buckets", "", *_streams(), ""]
    lines += ["## Models", "", "The models the tables above link to.", ""]
    for name in sorted(set(models.schemas) - models.shown):
        schema = models.schemas[name]
        description = " ".join(str(schema.get("description", "")).split())
        lines += [f"### {name}", ""]
        if "enum" in schema:
            lines += [f"One of {_type(schema)}.", ""]
            continue
        lines += [description, ""] if description else []
        lines += [*_fields(schema), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> None:
    """Print the page, or write it over the checked-in copy with `--write`."""
    parser = argparse.ArgumentParser(prog="python -m contracts.reference", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write docs/{DOCUMENT_PATH.name}")
    args = parser.parse_args(argv)
    document = build_document().encode()
    if args.write:
        DOCUMENT_PATH.parent.mkdir(exist_ok=True)
        DOCUMENT_PATH.write_bytes(document)
    else:
        sys.stdout.buffer.write(document)


if __name__ == "__main__":
    main()
