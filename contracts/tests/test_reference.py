"""The checked-in command and event reference is the one `contracts` generates."""

from __future__ import annotations

import re

import pytest

from contracts.catalog import COMMANDS
from contracts.events import EventType
from contracts.reference import DOCUMENT_PATH, REGENERATE, build_document

LINK = re.compile(r"\]\((#[^)]+)\)")
HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def document() -> str:
    return build_document()


def headings(document: str) -> set[str]:
    """Every heading of the page, as its link (GitHub's slug)."""
    slugs = set()
    for text in HEADING.findall(document):
        slug = "".join(c for c in text.lower() if c.isalnum() or c in " -_")
        slugs.add("#" + slug.replace(" ", "-"))
    return slugs


def test_checked_in_reference_is_current(document: str) -> None:
    checked_in = DOCUMENT_PATH.read_text(encoding="utf-8") if DOCUMENT_PATH.exists() else ""
    assert checked_in == document, (
        f"docs/{DOCUMENT_PATH.name} is stale: the contracts changed since it was generated. "
        f"Regenerate it from the repository root with `{REGENERATE}` (or `make asyncapi`) "
        "and commit the result."
    )


@pytest.mark.parametrize("subject", [command.subject for command in COMMANDS])
def test_every_command_has_its_section(document: str, subject: str) -> None:
    assert f"#### `{subject}`" in document


@pytest.mark.parametrize("event_type", list(EventType))
def test_every_event_type_has_its_section(document: str, event_type: EventType) -> None:
    assert f"### `{event_type.value}`" in document


def test_every_link_within_the_page_reaches_a_heading(document: str) -> None:
    assert sorted(set(LINK.findall(document)) - headings(document)) == []
