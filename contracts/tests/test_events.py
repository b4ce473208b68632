"""Contract tests: event types, their payload models, subjects and streams.

What is checked here is what other processes rely on without importing our code:
subject shapes, stream subjects JetStream will accept, and field names on the wire.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, get_args
from uuid import UUID

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from contracts import common, events, session_events, streams, subjects
from contracts.common import Actor, Message, ProjectId
from contracts.events import PAYLOADS, Event, EventType, HandoffSuperseded

SESSION = UUID("00000000-0000-4000-8000-000000000001")
HANDOFF = UUID("00000000-0000-4000-8000-000000000011")
SUBSTITUTE = UUID("00000000-0000-4000-8000-000000000012")

# Hypothesis would otherwise write its example database into the working tree.
pure = settings(database=None, deadline=None)


def overlap(a: str, b: str) -> bool:
    """Whether some subject matches both NATS filters (`*` one token, `>` one or more)."""
    ta, tb = a.split("."), b.split(".")
    for x, y in zip(ta, tb, strict=False):
        if ">" in (x, y):
            return True
        if x != y and "*" not in (x, y):
            return False
    return len(ta) == len(tb)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("chat.message.*.*", "chat.message.p.s", True),
        ("chat.message.*.*", "chat.message.p", False),
        ("agent.delta.*.*", "agent.response.*.*", False),
        ("agent.*.*.*", "agent.delta.p.s", True),
        ("agent.>", "agent.delta.*.*", True),
        ("agent.>", "agent", False),
        ("deadletter.>", "chat.message.*.*", False),
    ],
    ids=lambda v: str(v),
)
def test_overlap_follows_nats_wildcards(a: str, b: str, expected: bool) -> None:
    assert overlap(a, b) is expected
    assert overlap(b, a) is expected


# --- event types and payloads ----------------------------------------------------------


def test_every_event_type_has_a_payload_model() -> None:
    assert set(PAYLOADS) == set(EventType)
    for model in PAYLOADS.values():
        assert issubclass(model, Message)


@pytest.mark.parametrize("event_type", list(EventType), ids=str)
def test_event_type_is_two_lowercase_tokens(event_type: EventType) -> None:
    assert re.fullmatch(r"[a-z]+\.[a-z_]+", event_type.value)
    assert event_type.domain == event_type.value.split(".")[0]


def test_event_types_are_unique() -> None:
    values = [t.value for t in EventType]
    assert len(values) == len(set(values))


# --- subjects and streams ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("event_type", "project", "session", "expected"),
    [
        (
            EventType.CHAT_MESSAGE,
            "acme",
            SESSION,
            f"chat.message.acme.{SESSION}",
        ),
        (
            EventType.HANDOFF_SUPERSEDED,
            "proj_2-b",
            str(SESSION),
            f"handoff.superseded.proj_2-b.{SESSION}",
        ),
        (
            EventType.HYPOTHESIS_ACCEPTED_FOR_ANAMNESE,
            "p",
            SESSION,
            f"psychologist.hypothesis_accepted_for_anamnese.p.{SESSION}",
        ),
    ],
    ids=["uuid-session", "str-session", "longest-type"],
)
def test_event_subject_is_type_project_session(
    event_type: EventType, project: str, session: UUID | str, expected: str
) -> None:
    assert subjects.event_subject(event_type, project, session) == expected


@pytest.mark.parametrize("event_type", list(EventType), ids=str)
def test_every_event_subject_is_captured_by_events_and_only_by_it(event_type: EventType) -> None:
    subject = subjects.event_subject(event_type, "acme", SESSION)

    assert len(subject.split(".")) == 4
    assert any(overlap(f, subject) for f in streams.EVENTS.subjects)
    for other in streams.ALL:
        if other is not streams.EVENTS:
            assert not any(overlap(f, subject) for f in other.subjects), other.name


def test_events_stream_has_one_filter_per_type() -> None:
    assert sorted(streams.EVENTS.subjects) == sorted(f"{t.value}.*.*" for t in EventType)


@pytest.mark.parametrize(
    "subject",
    [subjects.delta_subject("acme", SESSION), subjects.done_subject("acme", SESSION)],
    ids=["delta", "done"],
)
def test_deltas_go_to_the_deltas_stream_not_the_log(subject: str) -> None:
    assert any(overlap(f, subject) for f in streams.DELTAS.subjects)
    assert not any(overlap(f, subject) for f in streams.EVENTS.subjects)


def test_no_two_streams_overlap() -> None:
    # JetStream refuses to create a stream whose subjects overlap another's.
    for i, a in enumerate(streams.ALL):
        for b in streams.ALL[i + 1 :]:
            clashes = [(x, y) for x in a.subjects for y in b.subjects if overlap(x, y)]
            assert clashes == [], f"{a.name} and {b.name} overlap"


def test_events_and_deltas_do_not_overlap() -> None:
    clashes = [
        (x, y) for x in streams.EVENTS.subjects for y in streams.DELTAS.subjects if overlap(x, y)
    ]
    assert clashes == []


COMMAND_SUBJECTS = [
    value
    for name, value in vars(subjects).items()
    if name.isupper() and isinstance(value, str) and value.startswith("cmd.")
]


@pytest.mark.parametrize("command", COMMAND_SUBJECTS)
def test_no_stream_captures_a_command(command: str) -> None:
    # A stream over a request subject would answer the request with its publish ack.
    for stream in streams.ALL:
        assert not any(overlap(f, command) for f in stream.subjects), stream.name


# --- wire models -------------------------------------------------------------------------


def _wire_models() -> list[type[Message]]:
    found: list[type[Message]] = []
    for module in (common, events, session_events):
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, Message)
                and value.__module__ == module.__name__
            ):
                found.append(value)
    return found


WIRE_MODELS = _wire_models()


def test_every_payload_model_is_a_wire_model() -> None:
    assert set(PAYLOADS.values()) <= set(WIRE_MODELS)


@pytest.mark.parametrize("model", WIRE_MODELS, ids=lambda m: m.__name__)
def test_wire_models_forbid_unknown_fields(model: type[Message]) -> None:
    assert model.model_config.get("extra") == "forbid"
    with pytest.raises(ValidationError) as info:
        model.model_validate({"surprise": 1})
    assert ("surprise",) in [
        e["loc"] for e in info.value.errors() if e["type"] == "extra_forbidden"
    ]


@pytest.mark.parametrize(
    "value",
    ["acme", "proj-1", "proj_2", "A", "x" * 64, "0123456789"],
    ids=repr,
)
def test_project_id_accepts_a_subject_token(value: str) -> None:
    assert TypeAdapter(ProjectId).validate_python(value) == value


@pytest.mark.parametrize(
    "value",
    [
        "",
        "a.b",
        "*",
        ">",
        "acme*",
        "acme>",
        "a b",
        " acme",
        "acme\n",
        "ac\tme",
        "x" * 65,
        "ação",
        "a/b",
    ],
    ids=repr,
)
def test_project_id_refuses_what_would_break_a_subject(value: str) -> None:
    with pytest.raises(ValidationError) as info:
        TypeAdapter(ProjectId).validate_python(value)
    assert info.value.errors()[0]["type"] == "string_pattern_mismatch"


@pytest.mark.parametrize(
    "value",
    [
        "user:ana",
        "agent:criativo",
        "system:handoff-lifecycle",
        "user:ana@example.com",
        "agent:psicologo-leve",
        "user:" + "a" * 128,
    ],
    ids=lambda v: repr(v[:30]),
)
def test_actor_accepts_user_agent_and_system(value: str) -> None:
    assert TypeAdapter(Actor).validate_python(value) == value


@pytest.mark.parametrize(
    "value",
    [
        "ana",
        "criativo",
        "bot:x",
        "User:ana",
        "user:",
        ":ana",
        "agent: criativo",
        "agent:criativo bot",
        "user:ana\n",
        "user:a:b",
        "user:" + "a" * 129,
    ],
    ids=lambda v: repr(v[:30]),
)
def test_actor_refuses_anything_else(value: str) -> None:
    with pytest.raises(ValidationError) as info:
        TypeAdapter(Actor).validate_python(value)
    assert info.value.errors()[0]["type"] == "string_pattern_mismatch"


# --- ADR 0182 wire names -------------------------------------------------------------


def test_handoff_superseded_keeps_the_adr_0182_wire_names() -> None:
    event = HandoffSuperseded(
        handoffId=HANDOFF, toAgent="po", motivo="nova_oferta", substitutaId=SUBSTITUTE
    )

    assert set(HandoffSuperseded.model_fields) == {"handoffId", "toAgent", "motivo", "substitutaId"}
    assert event.model_dump(mode="json") == {
        "handoffId": str(HANDOFF),
        "toAgent": "po",
        "motivo": "nova_oferta",
        "substitutaId": str(SUBSTITUTE),
    }
    assert set(get_args(HandoffSuperseded.model_fields["motivo"].annotation)) == {
        "agente_ativado",
        "nova_oferta",
    }


def test_handoff_superseded_by_activation_has_no_substitute() -> None:
    wire = json.dumps({"handoffId": str(HANDOFF), "toAgent": "po", "motivo": "agente_ativado"})

    event = HandoffSuperseded.model_validate_json(wire)

    assert event.substitutaId is None


# --- Event ---------------------------------------------------------------------------


def _event(**changes: Any) -> Event:
    fields: dict[str, Any] = {
        "id": UUID("00000000-0000-4000-8000-0000000000e1"),
        "session_id": SESSION,
        "project_id": "acme",
        "seq": 1,
        "type": EventType.ARTIFACT_BUSINESS_RULE,
        "actor": "agent:criativo",
        "payload": {"title": "t", "statement": "s", "origin": [str(HANDOFF)]},
        "causation_id": HANDOFF,
        "created_at": datetime(2026, 7, 24, 12, 30, 1, 123456, tzinfo=UTC),
    }
    return Event(**{**fields, **changes})


def test_event_round_trips_through_json() -> None:
    event = _event()

    wire = event.model_dump_json()

    assert Event.model_validate_json(wire) == event
    assert '"type":"artifact.business_rule"' in wire


@pytest.mark.parametrize(
    ("changes", "loc"),
    [
        ({"seq": 0}, ("seq",)),
        ({"type": "chat.mesage"}, ("type",)),
        ({"project_id": "a.b"}, ("project_id",)),
        ({"actor": "ana"}, ("actor",)),
    ],
    ids=["seq-0", "unknown-type", "dotted-project", "bare-actor"],
)
def test_event_refuses_what_the_log_never_writes(changes: dict[str, Any], loc: tuple[str]) -> None:
    with pytest.raises(ValidationError) as info:
        _event(**changes)
    assert [e["loc"] for e in info.value.errors()] == [loc]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)


@pure
@given(
    event_type=st.sampled_from(list(EventType)),
    seq=st.integers(min_value=1, max_value=2**62),
    payload=st.dictionaries(st.text(), json_values, max_size=5),
    causation_id=st.none() | st.uuids(),
    created_at=st.datetimes(
        min_value=datetime(2000, 1, 1),
        max_value=datetime(2100, 1, 1),
        timezones=st.sampled_from([UTC, timezone(timedelta(hours=-3))]),
    ),
)
def test_any_event_round_trips_through_json(
    event_type: EventType,
    seq: int,
    payload: dict[str, Any],
    causation_id: UUID | None,
    created_at: datetime,
) -> None:
    event = _event(
        type=event_type,
        seq=seq,
        payload=payload,
        causation_id=causation_id,
        created_at=created_at,
    )

    assert Event.model_validate_json(event.model_dump_json()) == event
