"""Criativo's core as a sans-IO machine: one input and the conversation give one plan
(`domain.criativo.plan`); a turn's result gives how the input ends (`conclude`).

Each table row is an input kind in a conversation state and the whole value the core
answers, so the rules are read here without NATS, Postgres or a model.
"""

from __future__ import annotations

from uuid import UUID

import pytest

from contracts.criativo import AgentDone
from contracts.events import (
    AgentError,
    AgentResponse,
    BusinessRule,
    Event,
    EventType,
    TurnUsage,
)
from contracts.metering import ChatMessage
from domain.criativo import (
    CRIATIVO_ACTOR,
    EMIT_ARTIFACT,
    NO_OUTCOME,
    Action,
    Ask,
    Conversation,
    Failure,
    Finish,
    Plan,
    Prompts,
    Record,
    Refusal,
    Reply,
    Then,
    acts_on,
    apply,
    artifact_call,
    brief_from_reply,
    conclude,
    offer_refused,
    plan,
    readable_reason,
    rebuild,
    rules_digest,
)

from .test_criativo_rules import (
    ACT,
    ACTIVE,
    BRIEF,
    CLOSED,
    FOREIGN,
    INACTIVE,
    LOG,
    M1,
    M2,
    M3,
    R2,
    READY,
    SESSION,
    WITH_BRIEF,
    A,
    U,
    answer,
    ev,
    said,
)

PROMPTS = Prompts(criativo="SYSTEM", consolidation="ASK {readiness_id}")
CLOSING = UUID("00000000-0000-4000-8000-000000000071")
ACCEPTED = UUID("00000000-0000-4000-8000-000000000081")
USAGE = TurnUsage(model="m", input_tokens=10, output_tokens=5, cost_micros=7)


def system(conv: Conversation) -> str:
    return f"SYSTEM\nBusiness rules recorded so far:\n{rules_digest(conv)}"


def by_id(log: list[Event], event_id: UUID) -> Event:
    return next(e for e in log if e.id == event_id)


BACKLOG = [*LOG, said(6, M3, "and on sundays?")]
ANSWERED = [*LOG, answer(6, R2, M2, "noted")]
READY_LOG = [*ANSWERED, ev(7, READY, EventType.CRIATIVO_READINESS_CONFIRMED)]
READY_CLOSED = [*READY_LOG, ev(8, FOREIGN, EventType.SESSION_CLOSED)]
WITHOUT_CRIATIVO = [*LOG[1:], ev(6, READY, EventType.CRIATIVO_READINESS_CONFIRMED)]
BRIEF_LOG = [
    *READY_LOG,
    ev(8, BRIEF, EventType.ARTIFACT_PRODUCT_BRIEF, {}, READY, CRIATIVO_ACTOR),
]
OTHERS = [
    *LOG,
    ev(6, ACCEPTED, EventType.HANDOFF_ACCEPTED, {}, None, "user:ana"),
    ev(7, CLOSING, EventType.SESSION_CLOSED),
]


def ana_asks(
    agent: str, cause: UUID, turn_id: str, system: str, *messages: ChatMessage, tool: bool = False
) -> Ask:
    """An ask in SESSION of project "p", for ana, who sent every input of these logs."""
    tools = (EMIT_ARTIFACT,) if tool else ()
    return Ask(agent, cause, SESSION, "p", turn_id, system, messages, tools, person="ana")


# What Criativo asks the model to answer M2 in LOG: everything said before it, the
# rules in the system prompt, the tool; its turn ids are numbered from the message.
CRIATIVO_ANSWERS_M2 = ana_asks(
    "criativo",
    M2,
    f"criativo.{M2}",
    system(ACTIVE),
    U(M1, "a bakery app"),
    A("for whom?"),
    U(M2, "orders close at 6pm"),
    tool=True,
)
PLAIN_ANSWERS_M2 = ana_asks(
    "chat", M2, f"chat.{M2}", "", ChatMessage(role="user", content="orders close at 6pm")
)
CONSOLIDATION = ana_asks(
    "criativo",
    READY,
    f"criativo.{READY}.brief",
    system(rebuild(SESSION, READY_LOG)),
    U(M1, "a bakery app"),
    A("for whom?"),
    U(M2, "orders close at 6pm"),
    A("noted"),
    ChatMessage(role="user", content=f"ASK {READY}"),
)

# (case, the log, the input (an event of the log), the plan)
PLANS: list[tuple[str, list[Event], UUID, Plan]] = [
    # chat messages
    (
        "a message, Criativo active: Criativo answers it with the tool",
        LOG,
        M2,
        Plan(M2, Action.ANSWER_WITH_CRIATIVO, ask=CRIATIVO_ANSWERS_M2),
    ),
    (
        "a message, Criativo never started: the plain chat, the message alone",
        LOG[1:],
        M2,
        Plan(M2, Action.ANSWER_PLAINLY, ask=PLAIN_ANSWERS_M2),
    ),
    (
        "a backlog: the earliest unanswered message first, then plan again",
        BACKLOG,
        M3,
        Plan(M3, Action.ANSWER_WITH_CRIATIVO, ask=CRIATIVO_ANSWERS_M2, then=Then.PLAN_AGAIN),
    ),
    (
        "a message already answered (a redelivery): nothing",
        LOG,
        M1,
        Plan(M1, Action.ALREADY_ANSWERED),
    ),
    (
        "a message in a closed session: nothing",
        [*LOG, ev(9, FOREIGN, EventType.SESSION_CLOSED)],
        M2,
        Plan(M2, Action.SESSION_CLOSED),
    ),
    # readiness
    (
        "readiness: the consolidation turn, no tools, what was said before it",
        READY_LOG,
        READY,
        Plan(READY, Action.CONSOLIDATE, ask=CONSOLIDATION, then=Then.CATCH_UP),
    ),
    (
        "readiness whose brief is in the log (a crash before the offer): offer it",
        BRIEF_LOG,
        READY,
        Plan(
            READY,
            Action.OFFER_EXISTING_BRIEF,
            finish=Finish(
                "criativo", READY, (f"criativo.{READY}.brief",), answer=BRIEF, offer=True
            ),
            then=Then.CATCH_UP,
        ),
    ),
    (
        "readiness without Criativo: nothing",
        WITHOUT_CRIATIVO,
        READY,
        Plan(READY, Action.READINESS_WITHOUT_CRIATIVO),
    ),
    (
        "readiness in a closed session: nothing",
        READY_CLOSED,
        READY,
        Plan(READY, Action.SESSION_CLOSED),
    ),
    # inputs that only move the state, and events Criativo does not act on
    ("Criativo's activation: only the state moves", LOG, ACT, Plan(ACT, Action.NOTHING)),
    ("the session's closing: only the state moves", OTHERS, CLOSING, Plan(CLOSING, Action.NOTHING)),
    ("a handoff accepted: ignored", OTHERS, ACCEPTED, Plan(ACCEPTED, Action.NOTHING)),
    ("an answer in the log: ignored", ANSWERED, R2, Plan(R2, Action.NOTHING)),
]


@pytest.mark.parametrize(
    ("log", "input_id", "expected"), [p[1:] for p in PLANS], ids=[p[0] for p in PLANS]
)
def test_one_input_gets_one_plan(log: list[Event], input_id: UUID, expected: Plan) -> None:
    conv = rebuild(SESSION, log)
    assert plan(conv, by_id(log, input_id), PROMPTS) == expected


def test_consolidation_shows_an_unanswered_message_as_such() -> None:
    log = [*LOG, ev(6, READY, EventType.CRIATIVO_READINESS_CONFIRMED)]
    ask = plan(rebuild(SESSION, log), log[-1], PROMPTS).ask
    assert ask is not None
    assert ask.messages[-2:] == (A(NO_OUTCOME), ChatMessage(role="user", content=f"ASK {READY}"))


@pytest.mark.parametrize(
    ("kind", "acted_on"),
    [
        (EventType.CHAT_MESSAGE, True),
        (EventType.CRIATIVO_READINESS_CONFIRMED, True),
        (EventType.AGENT_ACTIVATED, False),
        (EventType.SESSION_CLOSED, False),
        (EventType.SESSION_CLOSED_ABNORMALLY, False),
        (EventType.HANDOFF_ACCEPTED, False),
    ],
)
def test_only_messages_and_readiness_are_answered(kind: EventType, acted_on: bool) -> None:
    assert acts_on(kind) is acted_on


def test_a_loop_numbers_its_calls_and_one_call_keeps_its_turn_id() -> None:
    assert CRIATIVO_ANSWERS_M2.call_id(2) == f"criativo.{M2}.2"
    assert CRIATIVO_ANSWERS_M2.run_id == f"criativo.{SESSION}"
    assert PLAIN_ANSWERS_M2.call_id(1) == PLAIN_ANSWERS_M2.call_id(2) == f"chat.{M2}"
    assert CONSOLIDATION.call_id(1) == f"criativo.{READY}.brief"


ANSWERING = Plan(M2, Action.ANSWER_WITH_CRIATIVO, ask=CRIATIVO_ANSWERS_M2)
PLAIN = Plan(M2, Action.ANSWER_PLAINLY, ask=PLAIN_ANSWERS_M2)
CONSOLIDATING = Plan(READY, Action.CONSOLIDATE, ask=CONSOLIDATION, then=Then.CATCH_UP)
TURNS = (f"criativo.{M2}.1", f"criativo.{M2}.2")
BRIEF_TEXT = '{"title": "Bakery", "summary": "orders until 6pm"}'
READY_CONV = rebuild(SESSION, READY_LOG)


def failed(agent: str, cause: UUID, code: str) -> Record:
    reason = readable_reason(code)
    return Record(
        EventType.AGENT_ERROR,
        AgentError(agent=agent, code=code, reason=reason),
        cause,
        f"{agent}:error:{cause}",
        f"agent:{agent}",
    )


# (case, conversation, plan, how its turn ended, how the input ends)
CONCLUSIONS: list[tuple[str, Conversation, Plan, Reply | Failure, Finish]] = [
    (
        "Criativo answered: the response, with the last call's turn id and the usage",
        ACTIVE,
        ANSWERING,
        Reply("text", TURNS, USAGE),
        Finish(
            "criativo",
            M2,
            TURNS,
            record=Record(
                EventType.AGENT_RESPONSE,
                AgentResponse(agent="criativo", text="text", turn_id=TURNS[-1], usage=USAGE),
                M2,
                f"criativo:response:{M2}",
            ),
        ),
    ),
    (
        "the person stopped it: the response as far as it went",
        ACTIVE,
        ANSWERING,
        Reply("hal", TURNS[:1], USAGE, stopped=True),
        Finish(
            "criativo",
            M2,
            TURNS[:1],
            record=Record(
                EventType.AGENT_RESPONSE,
                AgentResponse(
                    agent="criativo", text="hal", turn_id=TURNS[0], usage=USAGE, stopped=True
                ),
                M2,
                f"criativo:response:{M2}",
            ),
        ),
    ),
    (
        "the plain chat answered: under its own agent",
        INACTIVE,
        PLAIN,
        Reply("hi", (f"chat.{M2}",), USAGE),
        Finish(
            "chat",
            M2,
            (f"chat.{M2}",),
            record=Record(
                EventType.AGENT_RESPONSE,
                AgentResponse(agent="chat", text="hi", turn_id=f"chat.{M2}", usage=USAGE),
                M2,
                f"chat:response:{M2}",
                "agent:chat",
            ),
        ),
    ),
    (
        "the turn failed: an error the person reads, and the code for the clients",
        ACTIVE,
        ANSWERING,
        Failure("provider_error", TURNS),
        Finish(
            "criativo",
            M2,
            TURNS,
            record=failed("criativo", M2, "provider_error"),
            error_code="provider_error",
        ),
    ),
    (
        "the consolidation replied: the brief on every recorded rule, offered to PO",
        READY_CONV,
        CONSOLIDATING,
        Reply(BRIEF_TEXT, (f"criativo.{READY}.brief",), USAGE),
        Finish(
            "criativo",
            READY,
            (f"criativo.{READY}.brief",),
            record=Record(
                EventType.ARTIFACT_PRODUCT_BRIEF,
                brief_from_reply(BRIEF_TEXT, READY_CONV),
                READY,
                f"criativo:brief:{READY}",
            ),
            offer=True,
        ),
    ),
    (
        "the consolidation failed: an error, no brief, no offer",
        READY_CONV,
        CONSOLIDATING,
        Failure("dependency_unavailable"),
        Finish(
            "criativo",
            READY,
            (),
            record=failed("criativo", READY, "dependency_unavailable"),
            error_code="dependency_unavailable",
        ),
    ),
]


@pytest.mark.parametrize(
    ("conv", "planned", "result", "expected"),
    [c[1:] for c in CONCLUSIONS],
    ids=[c[0] for c in CONCLUSIONS],
)
def test_a_turns_result_gives_how_the_input_ends(
    conv: Conversation, planned: Plan, result: Reply | Failure, expected: Finish
) -> None:
    assert conclude(conv, planned, result) == expected


def test_the_brief_rests_on_the_recorded_rules() -> None:
    finish = conclude(READY_CONV, CONSOLIDATING, Reply(BRIEF_TEXT, (), USAGE))
    assert finish.record is not None
    assert finish.record.payload.model_dump()["business_rule_ids"] == [
        r.event_id for r in READY_CONV.rules
    ]


def test_a_plan_that_asked_nothing_has_no_conclusion() -> None:
    with pytest.raises(ValueError, match="asked the model nothing"):
        conclude(ACTIVE, Plan(M1, Action.ALREADY_ANSWERED), Reply("x", (), USAGE))


RESPONSE = UUID("00000000-0000-4000-8000-000000000091")


@pytest.mark.parametrize(
    ("finish", "recorded", "done"),
    [
        (
            CONCLUSIONS[0][4],
            RESPONSE,
            AgentDone(
                agent="criativo", causation_id=M2, turn_ids=list(TURNS), response_id=RESPONSE
            ),
        ),
        (
            CONCLUSIONS[3][4],
            RESPONSE,  # the agent.error is no response: the code says why there is none
            AgentDone(
                agent="criativo", causation_id=M2, turn_ids=list(TURNS), error_code="provider_error"
            ),
        ),
        (
            PLANS[6][3].finish,
            None,
            AgentDone(
                agent="criativo",
                causation_id=READY,
                turn_ids=[f"criativo.{READY}.brief"],
                response_id=BRIEF,
            ),
        ),
    ],
    ids=["a response", "an error", "a brief already in the log"],
)
def test_the_turns_end_names_its_answer_or_why_there_is_none(
    finish: Finish, recorded: UUID | None, done: AgentDone
) -> None:
    assert finish.done(recorded) == done


GOOD_RULE = {"type": "business_rule", "title": "cutoff", "statement": "6pm", "origin": [str(M2)]}


def test_a_valid_rule_is_recorded_once_per_tool_call() -> None:
    assert artifact_call(ACTIVE, CRIATIVO_ANSWERS_M2, "toolu_1", GOOD_RULE) == Record(
        EventType.ARTIFACT_BUSINESS_RULE,
        BusinessRule(title="cutoff", statement="6pm", origin=[M2]),
        M2,
        f"criativo:rule:{M2}:toolu_1",
        CRIATIVO_ACTOR,
    )


@pytest.mark.parametrize(
    ("raw", "starts"),
    [
        ({**GOOD_RULE, "type": "product_brief"}, "artifact_not_emittable: product_brief cannot"),
        ({**GOOD_RULE, "origin": [str(FOREIGN)]}, "origin_not_in_conversation: origin cites"),
    ],
)
def test_a_refused_call_goes_back_to_the_model(raw: dict[str, object], starts: str) -> None:
    refusal = artifact_call(ACTIVE, CRIATIVO_ANSWERS_M2, "toolu_1", raw)
    assert isinstance(refusal, Refusal) and refusal.text.startswith(starts)


def test_a_plan_is_made_on_the_log_as_it_stands() -> None:
    # The same input planned again once its answer is in the log asks nothing more.
    assert plan(ACTIVE, by_id(LOG, M2), PROMPTS).ask is not None
    conv = apply(ACTIVE, answer(6, R2, M2, "noted"))
    assert plan(conv, by_id(LOG, M2), PROMPTS) == Plan(M2, Action.ALREADY_ANSWERED)
    assert plan(CLOSED, by_id(LOG, M2), PROMPTS).ask is None
    assert plan(WITH_BRIEF, ev(6, READY, EventType.CRIATIVO_READINESS_CONFIRMED), PROMPTS).finish


@pytest.mark.parametrize(
    ("code", "told"),
    [
        (
            "agente_ja_ativo",
            Record(
                EventType.AGENT_ERROR,
                AgentError(agent="criativo", code="agente_ja_ativo", reason="PO is active"),
                BRIEF,
                "criativo:offer:x:refused",
            ),
        ),
        ("invalid_request", None),
    ],
    ids=["PO already active: the person is told", "any other refusal: nobody is"],
)
def test_a_refused_offer_of_the_brief(code: str, told: Record | None) -> None:
    assert offer_refused(BRIEF, code, "PO is active", "criativo:offer:x") == told
