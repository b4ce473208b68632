"""Commands, replies and deltas of the `metering` service: the only door to an LLM.

Content blocks follow the Anthropic Messages API shapes (text, tool_use,
tool_result), so the harness speaks one vocabulary and the `anthropic` provider
passes them through without translation.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Annotated, Literal
from uuid import UUID

from pydantic import Field, StringConstraints, model_validator

from contracts.common import TEXT_CHECK, AgentSlug, Int64, JsonObject, Message, ProjectId, Text

# Ids chosen by the caller (the harness): a run groups the turns one budget covers,
# a turn is one provider call and the key its usage row is idempotent on.
RunId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,128}$"), TEXT_CHECK]
TurnId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,128}$"), TEXT_CHECK]
# A `/` is allowed for the names OpenAI-compatible servers use (`Qwen/Qwen2.5-7B-Instruct`).
ModelName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:/-]{1,128}$"), TEXT_CHECK]
ToolName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$"), TEXT_CHECK]
ToolUseId = Annotated[str, StringConstraints(min_length=1, max_length=128), TEXT_CHECK]
# Deltas may only go where a client of the bus listens for them: a session's
# `agent.delta.<project>.<session>` (captured by the DELTAS stream) or a private
# inbox. Anything else would let a caller publish onto command or event subjects.
DeltaSubject = Annotated[
    str,
    StringConstraints(
        pattern=r"^(agent\.delta\.[A-Za-z0-9_-]{1,64}\.[A-Za-z0-9_-]{1,64}|_INBOX\.[A-Za-z0-9_.-]{1,200})$"
    ),
    TEXT_CHECK,
]

# The person a call is made for: the `sub` of their token, the `<id>` of their
# `user:<id>` actor. Their limits apply to it, beside the project's.
Person = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.@-]{1,128}$"), TEXT_CHECK]

# A streaming turn's beat goes to a subject of its own caller's choosing, within
# `metering.alive.*` only (contracts.subjects.alive_subject).
AliveSubject = Annotated[
    str, StringConstraints(pattern=r"^metering\.alive\.[A-Za-z0-9_-]{1,64}$"), TEXT_CHECK
]
# How often a caller may ask to hear the beat: not so often that beats cost like tokens.
MIN_ALIVE_EVERY_SECONDS, MAX_ALIVE_EVERY_SECONDS = 0.1, 60.0

MAX_OUTPUT_TOKENS = 64_000
# The longest a caller waits for a model turn's reply: a turn can take minutes (long
# outputs, provider retries), and metering bills it whether or not its caller still
# waits, so waiting long costs nothing extra. Metering's right to answer on the bus
# outlives it (`servicekit.permissions.REPLY_GRANT_SECONDS`).
TURN_TIMEOUT_SECONDS = 600.0
UsageStatus = Literal["ok", "error", "cancelled"]
BindingScope = Literal["session", "agent", "project", "workspace"]
# Who serves a binding's model: `anthropic`, `openai` (any OpenAI-compatible server:
# Ollama, vLLM, LM Studio) or `scripted`. A binding that names none is served by the
# provider metering is configured with (`AGENTBUS_PROVIDER`).
ProviderName = Literal["anthropic", "openai", "scripted"]
# What metering announces in its NATS micro metadata (`$SRV.INFO.metering`): the provider
# that serves a binding naming none, and under `offline` "true" when that is the offline
# script (the page's "offline model" notice), so no other service needs the provider key.
METADATA_PROVIDER = "provider"
METADATA_OFFLINE = "offline"


class TextBlock(Message):
    """Text the model wrote (or a person's words in a user message)."""

    type: Literal["text"] = "text"
    text: Text


class ToolUseBlock(Message):
    """The model asks for a tool to be run with `input`."""

    type: Literal["tool_use"] = "tool_use"
    id: ToolUseId
    name: ToolName
    input: JsonObject


class ToolResultBlock(Message):
    """What a tool returned; `is_error` marks a message the model should correct itself from."""

    type: Literal["tool_result"] = "tool_result"
    tool_use_id: ToolUseId
    content: Text
    is_error: bool = False


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]
ReplyBlock = Annotated[TextBlock | ToolUseBlock, Field(discriminator="type")]


class ChatMessage(Message):
    """One message of the conversation sent to the model."""

    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class ToolSpec(Message):
    """A tool the model may call: its name, what it does and its input's JSON schema."""

    name: ToolName
    description: Text = ""
    input_schema: JsonObject


class LlmTurn(Message):
    """`cmd.llm.turn`: one model call, priced and charged to the run's budget."""

    run_id: RunId
    turn_id: TurnId
    agent_slug: AgentSlug
    project_id: ProjectId
    session_id: UUID | None = None
    system: Text = ""
    messages: list[ChatMessage] = Field(min_length=1, max_length=2000)
    tools: list[ToolSpec] = Field(default_factory=list, max_length=64)
    max_tokens: Int64 = Field(ge=1, le=MAX_OUTPUT_TOKENS)
    # The run's whole budget in µUSD; the first turn of a run that names it sets it.
    budget_micros: Int64 | None = Field(default=None, ge=0)
    # Whom the call is for (a person's message, readiness or reanalysis); their limits
    # apply beside the project's. None: the project's limits alone.
    person: Person | None = None

    @model_validator(mode="after")
    def _starts_with_user(self) -> LlmTurn:
        if self.messages[0].role != "user":
            raise ValueError("the conversation must start with a user message")
        return self


class LlmStream(LlmTurn):
    """`cmd.llm.stream`: the same turn, with text deltas published on `delta_subject`."""

    delta_subject: DeltaSubject
    # The event the turn answers (a person's message), stamped on every delta so a
    # client can place the streaming text before the response event exists.
    causation_id: UUID | None = None
    # Given, the replica handling the turn publishes the turn's id there as it takes the
    # turn, then every `alive_every_seconds` until it replies: a caller that hears nothing for
    # a few beats knows the replica is gone, before or after the first delta, without
    # reading a single delta (harness.client). The id tells apart the turns of a caller
    # that names one subject for all its streams.
    alive_subject: AliveSubject | None = None
    alive_every_seconds: float = Field(
        default=5.0, ge=MIN_ALIVE_EVERY_SECONDS, le=MAX_ALIVE_EVERY_SECONDS
    )


class CancelTurn(Message):
    """`cmd.llm.cancel`: stop a running `cmd.llm.stream` turn of this project's session.

    The provider stream is aborted, no delta follows, the turn's `TurnReply` comes
    back with `stop_reason: "cancelled"` and the text produced so far, and its
    `token_usage` row has status `cancelled` with the usage consumed up to the abort.
    A turn of another project or session is never touched.
    """

    turn_id: TurnId
    project_id: ProjectId
    session_id: UUID


class CancelReply(Message):
    """`cancelling`: the replica running the turn was told; `finished`: it had already ended."""

    turn_id: TurnId
    status: Literal["cancelling", "finished"]


class TokenUsage(Message):
    """Tokens one call consumed, as the provider reported them (cumulative, never summed)."""

    input_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)
    cache_write_5m_tokens: int = Field(default=0, ge=0)
    cache_write_1h_tokens: int = Field(default=0, ge=0)
    cache_read_tokens: int = Field(default=0, ge=0)


class TurnReply(Message):
    """The model's whole message, what it cost and what is left of the run's budget."""

    turn_id: TurnId
    content: list[ReplyBlock]
    # The provider's stop reason, or "cancelled" when `cmd.llm.cancel` stopped the
    # stream (`content` then holds the text produced up to the abort).
    stop_reason: str
    model: ModelName
    usage: TokenUsage
    cost_micros: int = Field(ge=0)
    # None when the run has no budget.
    budget_remaining_micros: int | None
    # True when this turn_id had already completed: the stored reply, nothing called.
    duplicate: bool = False


class TurnDelta(Message):
    """A piece of text of a streaming turn, published on the turn's `delta_subject`.

    `seq` numbers the deltas metering published for the turn, from 1 and without gaps;
    a delta's text is everything the provider streamed since the one before (several
    tokens gathered over a short window), so joined in `seq` order they are the turn's
    text, and (turn_id, seq) names a delta, wherever it is read from again.
    """

    turn_id: TurnId
    seq: int = Field(ge=1)
    text: str
    # Wall-clock seconds (time.time()) when the provider produced this text (its first
    # piece), so a subscriber can measure the latency metering added.
    emitted_at: float
    causation_id: UUID | None = None


class SetBinding(Message):
    """`cmd.bindings.set`: which model an agent uses at one level of the cascade.

    `model: null` removes the binding at that level. Levels and their keys:
    `session` (session_id), `agent` (agent_slug, optionally within project_id),
    `project` (project_id), `workspace` (none). `provider` names who serves the model
    (none: metering's configured provider).
    """

    scope: BindingScope
    project_id: ProjectId | None = None
    agent_slug: AgentSlug | None = None
    session_id: UUID | None = None
    model: ModelName | None
    provider: ProviderName | None = None


class Binding(Message):
    """One binding as stored."""

    scope: BindingScope
    project_id: ProjectId | None = None
    agent_slug: AgentSlug | None = None
    session_id: UUID | None = None
    model: ModelName
    updated_at: datetime | None = None
    provider: ProviderName | None = None


class BindingSetReply(Message):
    """The binding as it now stands (`removed` when `model` was null)."""

    binding: Binding | None
    removed: bool = False


class ListBindings(Message):
    """`cmd.bindings.list`: every binding, or those of one project (plus the global ones)."""

    project_id: ProjectId | None = None


class BindingsReply(Message):
    """Bindings, most specific level first."""

    bindings: list[Binding]


class ResolveBinding(Message):
    """`cmd.bindings.resolve`: the model a turn of this agent would use."""

    agent_slug: AgentSlug
    project_id: ProjectId
    session_id: UUID | None = None


class ResolvedBinding(Message):
    """The model and the binding that decided it."""

    model: ModelName
    decided_by: Binding


UsageDimension = Literal["project", "session", "agent", "model", "day", "run"]


class UsageSummaryRequest(Message):
    """`cmd.usage.summary`: token usage grouped by one or more dimensions, optionally filtered."""

    group_by: list[UsageDimension] = Field(min_length=1, max_length=5)
    project_id: ProjectId | None = None
    session_id: UUID | None = None
    agent_slug: AgentSlug | None = None
    run_id: RunId | None = None
    since: date | None = None
    until: date | None = None


class UsageGroup(Message):
    """One group of the summary: its keys and its totals."""

    key: dict[str, str | None]
    calls: int
    errors: int
    usage: TokenUsage
    cost_micros: int


class UsageSummaryReply(Message):
    """Groups ordered by cost, largest first, and the grand total."""

    groups: list[UsageGroup]
    total_cost_micros: int
    total_calls: int


LimitScope = Literal["project", "person"]
LimitMetric = Literal["micros", "requests", "tokens"]
LimitWindow = Literal["minute", "day", "month"]
# A project id, a person, or `*`: the default of every project (person) without its own.
LimitName = Annotated[str, StringConstraints(pattern=r"^(\*|[A-Za-z0-9_.@-]{1,128})$"), TEXT_CHECK]
DEFAULT_LIMITS = "*"


class SpendLimits(Message):
    """What a project or a person may spend and how fast; windows are UTC and reset at
    their start. On a project's or person's own row, None means "as the default"; on the
    default (`*`), None means no limit."""

    micros_per_day: Int64 | None = Field(default=None, ge=0)
    micros_per_month: Int64 | None = Field(default=None, ge=0)
    requests_per_minute: Int64 | None = Field(default=None, ge=0)
    tokens_per_minute: Int64 | None = Field(default=None, ge=0)


class SetLimits(Message):
    """`cmd.limits.set`: an operator sets the limits of one project, one person, or the
    default of either (`name: "*"`). Only an operator's NATS user may call it."""

    scope: LimitScope
    name: LimitName
    limits: SpendLimits


class LimitsSetReply(Message):
    """The limits as they now stand at that level."""

    scope: LimitScope
    name: LimitName
    limits: SpendLimits


class LimitsStatusRequest(Message):
    """`cmd.limits.status`: the limits in force for a project and (optionally) a person,
    with what the current window has used of each."""

    project_id: ProjectId
    person: Person | None = None


class LimitUse(Message):
    """One limit in force and its current window: used (settled), held (calls in flight)."""

    scope: LimitScope
    name: LimitName
    metric: LimitMetric
    window: LimitWindow
    limit: int
    used: int
    held: int
    resets_at: datetime


class LimitsStatus(Message):
    """Every limit that applies; `exhausted` names those a new call could not fit under now."""

    limits: list[LimitUse]
    exhausted: list[LimitUse]
