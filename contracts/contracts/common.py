"""Shapes shared by every message: identifiers, actors and the error reply."""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

# --- what every text and integer of a message must be -------------------------
#
# Postgres cannot store NUL in `text` or `jsonb`, UTF-8 cannot encode a lone
# surrogate, and a `bigint` column holds signed 64 bits: a value outside these is
# refused at the door (`invalid_request` naming the field), never half-written.
# Every str and int field of a command or an event payload is one of the types
# below; `contracts/tests/test_field_types.py` walks the models to keep it so.

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# No single text may be longer than a whole request may be (servicekit's endpoint
# refuses requests over 1 MiB before parsing); fields with a tighter meaning say so.
MAX_TEXT_CHARS = 1_000_000
# How deep free JSON (`payload`, a tool's input) may nest.
MAX_JSON_DEPTH = 64

_SURROGATE = re.compile(r"[\ud800-\udfff]")


def storable_text(value: str) -> str:
    """`value` unchanged, or a refusal when Postgres or UTF-8 could not keep it."""
    if "\x00" in value:
        raise ValueError("must not contain the NUL character (\\u0000)")
    if _SURROGATE.search(value):
        raise ValueError("must not contain a lone UTF-16 surrogate")
    return value


def within_int64(value: int) -> int:
    """`value` unchanged, or a refusal when a signed 64-bit integer cannot hold it."""
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"must be between {INT64_MIN} and {INT64_MAX} (a signed 64-bit integer)")
    return value


def _check_json(value: Any, path: str, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{path or 'value'}: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        try:
            storable_text(value)
        except ValueError as exc:
            raise ValueError(f"{path or 'value'}: {exc}") from None
    elif isinstance(value, bool):
        return
    elif isinstance(value, int):
        try:
            within_int64(value)
        except ValueError as exc:
            raise ValueError(f"{path or 'value'}: {exc}") from None
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path or 'value'}: must be a finite number")
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                raise ValueError(f"{where}: keys must be strings")
            try:
                storable_text(key)
            except ValueError as exc:
                raise ValueError(f"{path or 'key'} (a key): {exc}") from None
            _check_json(item, where, depth + 1)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_json(item, f"{path}[{i}]", depth + 1)


def storable_json(value: dict[str, Any]) -> dict[str, Any]:
    """`value` unchanged, or a refusal naming the first text, number or depth that
    `jsonb` could not keep."""
    _check_json(value, "", 1)
    return value


# The validators, kept as objects so the field-type test can find them on a field.
TEXT_CHECK = AfterValidator(storable_text)
INT64_CHECK = AfterValidator(within_int64)
JSON_CHECK = AfterValidator(storable_json)

# Free text of any length a request may carry.
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS), TEXT_CHECK]
# A short name or key (idempotency keys, tool-use ids, client refs).
Key = Annotated[str, StringConstraints(min_length=1, max_length=200), TEXT_CHECK]
# An integer a `bigint` column can hold.
Int64 = Annotated[int, INT64_CHECK]
# Free JSON (an event's `payload`, a tool's `input`): every text and number storable.
JsonObject = Annotated[dict[str, Any], JSON_CHECK]

# A project id is a subject token (`<type>.<project>.<session>`), so it may not
# contain dots, wildcards or whitespace.
ProjectId = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$", strip_whitespace=False), TEXT_CHECK
]
AgentSlug = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$"), TEXT_CHECK]
# `user:<id>` for a person, `agent:<slug>` for an agent, `system:<component>` for
# the platform itself (e.g. `system:handoff-lifecycle`).
Actor = Annotated[
    str,
    StringConstraints(pattern=r"^(user|agent|system):[A-Za-z0-9_.@-]{1,128}$"),
    TEXT_CHECK,
]


def person_of(actor: str) -> str | None:
    """The person an actor is (`user:<id>` -> `<id>`), or None for an agent or the system."""
    kind, _, name = actor.partition(":")
    return name if kind == "user" and name else None


class Message(BaseModel):
    """Base of every wire model: unknown fields are an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ErrorCode(StrEnum):
    """Codes a caller can branch on; each service adds its own to this one list."""

    MALFORMED_JSON = "malformed_json"
    INVALID_REQUEST = "invalid_request"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"
    # session_events
    UNKNOWN_EVENT_TYPE = "unknown_event_type"
    RESERVED_EVENT_TYPE = "reserved_event_type"
    INVALID_PAYLOAD = "invalid_payload"
    SESSION_NOT_FOUND = "session_not_found"
    SESSION_CLOSED = "session_closed"
    CAUSATION_NOT_FOUND = "causation_not_found"
    BRIEF_REQUIRES_READINESS = "brief_requires_readiness"
    ACTOR_NOT_ALLOWED = "actor_not_allowed"
    # a retraction or correction naming no business rule of the session's project
    RULE_NOT_FOUND = "rule_not_found"
    # a retraction or correction of a rule already retracted or replaced
    RULE_NOT_STANDING = "rule_not_standing"
    # a fork's `at_seq` names no event of the parent's conversation
    FORK_POINT_NOT_FOUND = "fork_point_not_found"
    # handoff (ADR 0182 keeps the Portuguese codes on the wire)
    AGENTE_JA_ATIVO = "agente_ja_ativo"
    HANDOFF_NOT_FOUND = "handoff_not_found"
    HANDOFF_NOT_IN_SESSION = "handoff_not_in_session"
    INVALID_TRANSITION = "invalid_transition"
    ACTIVATION_REFUSED = "activation_refused"
    UNKNOWN_AGENT = "unknown_agent"
    TARGET_NOT_ALLOWED = "target_not_allowed"
    SESSION_NOT_IN_PROJECT = "session_not_in_project"
    ARTIFACT_NOT_FOUND = "artifact_not_found"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    # metering
    BUDGET_EXCEEDED = "budget_exceeded"
    BUDGET_MISMATCH = "budget_mismatch"
    INVALID_BINDING = "invalid_binding"
    NO_BINDING = "no_binding"
    UNKNOWN_MODEL = "unknown_model"
    TURN_IN_PROGRESS = "turn_in_progress"
    TURN_ALREADY_FAILED = "turn_already_failed"
    # a turn id already used by another request (another run, project or prompt)
    TURN_ID_REUSED = "turn_id_reused"
    INVALID_LIMITS = "invalid_limits"
    PROVIDER_ERROR = "provider_error"
    PROVIDER_OVERLOADED = "provider_overloaded"
    # a service the turn needs (metering, the log) stayed unreachable for longer than a
    # person waits; nothing is wrong with the message: sending it again will work
    DEPENDENCY_UNAVAILABLE = "dependency_unavailable"
    # psychologist (ADR 0015)
    INVALID_HYPOTHESIS = "invalid_hypothesis"
    EVIDENCE_NOT_FOUND = "evidence_not_found"
    EVIDENCE_NOT_IN_SESSION = "evidence_not_in_session"
    TERMINATION_ANALYSIS_REQUIRED = "termination_analysis_required"
    HYPOTHESIS_NOT_FOUND = "hypothesis_not_found"
    SESSION_NOT_CLOSED = "session_not_closed"
    # criativo (the emit_artifact tool's refusals, read by the model)
    ARTIFACT_NOT_EMITTABLE = "artifact_not_emittable"
    UNKNOWN_ARTIFACT_TYPE = "unknown_artifact_type"
    INVALID_ARTIFACT = "invalid_artifact"
    ORIGIN_NOT_IN_CONVERSATION = "origin_not_in_conversation"
    # gateway
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    RATE_LIMITED = "rate_limited"
    NOT_JOINED = "not_joined"


class ErrorBody(Message):
    """What went wrong: `code` to branch on, `message` for a person or a model to act on."""

    code: str
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class ErrorReply(Message):
    """The reply of any command that failed: `{"error": {"code", "message", "details"}}`."""

    error: ErrorBody
