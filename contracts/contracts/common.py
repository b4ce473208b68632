"""Shapes shared by every message: identifiers, actors and the error reply."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# A project id is a subject token (`<type>.<project>.<session>`), so it may not
# contain dots, wildcards or whitespace.
ProjectId = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$", strip_whitespace=False)
]
AgentSlug = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]
# `user:<id>` for a person, `agent:<slug>` for an agent, `system:<component>` for
# the platform itself (e.g. `system:handoff-lifecycle`).
Actor = Annotated[str, StringConstraints(pattern=r"^(user|agent|system):[A-Za-z0-9_.@-]{1,128}$")]


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
    PROVIDER_ERROR = "provider_error"
    PROVIDER_OVERLOADED = "provider_overloaded"
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
