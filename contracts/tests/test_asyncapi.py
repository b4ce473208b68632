"""The checked-in AsyncAPI document is the one `contracts` generates, and it describes
every subject of the bus: each command, each event, and everything else a service
publishes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from contracts import subjects
from contracts.asyncapi import DOCUMENT_PATH, REGENERATE, build_document
from contracts.catalog import ACCESS, COMMANDS, PROJECT, SESSION
from contracts.common import ErrorReply, Message
from contracts.events import PAYLOADS, EventType

# Read off `contracts.subjects`, so a command added there but not to COMMANDS fails here.
COMMAND_SUBJECTS = sorted(
    value
    for value in vars(subjects).values()
    if isinstance(value, str) and value.startswith("cmd.")
)


# Every subject a service publishes outside request/reply: what its NATS user may publish
# (`catalog.ACCESS`; the secured server refuses the rest, so the whole suite keeps it
# honest), and the dead letters the kit's consumer sends for each durable.
PUBLISHED = sorted(
    {
        *(subject for access in ACCESS for subject in access.publishes),
        *(subjects.dead_letter_subject(d.name) for access in ACCESS for d in access.durables),
    }
)


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(build_document())
    return parsed


def addresses(document: dict[str, Any]) -> set[str]:
    return {channel["address"] for channel in document["channels"].values()}


def test_checked_in_document_is_current() -> None:
    checked_in = DOCUMENT_PATH.read_text(encoding="utf-8") if DOCUMENT_PATH.exists() else ""
    assert checked_in == build_document(), (
        f"{DOCUMENT_PATH.name} is stale: the contracts changed since it was generated. "
        f"Regenerate it from the repository root with `{REGENERATE}` and commit the result."
    )


@pytest.mark.parametrize("subject", COMMAND_SUBJECTS)
def test_every_command_is_served_and_answered(document: dict[str, Any], subject: str) -> None:
    assert subject in addresses(document)
    operation = document["operations"][subject]
    assert operation["action"] == "receive"
    assert operation["reply"]["messages"], f"{subject} documents no reply"


def test_commands_table_covers_every_command_subject() -> None:
    assert sorted(command.subject for command in COMMANDS) == COMMAND_SUBJECTS


@pytest.mark.parametrize("event_type", list(EventType))
def test_every_event_type_is_published(document: dict[str, Any], event_type: EventType) -> None:
    assert subjects.event_filter(event_type, PROJECT, SESSION) in addresses(document)
    assert document["operations"][event_type.value]["action"] == "send"


def test_every_model_is_in_the_schemas(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    models: set[type[Message]] = {*PAYLOADS.values(), ErrorReply}
    models |= {m for command in COMMANDS for m in (command.request, command.reply)}
    assert sorted(m.__name__ for m in models if m.__name__ not in schemas) == []


def test_streaming_subjects_are_documented(document: dict[str, Any]) -> None:
    assert subjects.delta_subject(PROJECT, SESSION) in addresses(document)
    assert subjects.done_subject(PROJECT, SESSION) in addresses(document)


def covers(address: str, subject: str) -> bool:
    """Whether a channel `address` (`{token}` for a value its messages name) takes in
    `subject`, a subject or a filter of single-token wildcards."""
    wanted, offered = subject.split("."), address.split(".")
    return len(wanted) == len(offered) and all(
        token.startswith("{") or token == part for token, part in zip(offered, wanted, strict=True)
    )


@pytest.mark.parametrize("subject", PUBLISHED)
def test_every_published_subject_is_documented(document: dict[str, Any], subject: str) -> None:
    assert any(covers(address, subject) for address in addresses(document)), (
        f"{subject} is published but not in the AsyncAPI document: declare it in "
        "contracts.catalog (PUBLICATIONS) and regenerate"
    )
