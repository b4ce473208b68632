"""The HTTP API against the whole platform: each refusal keeps its service's code and
gets the status a client expects; bindings, usage, insights and reanalysis end to end."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from nats.aio.client import Client

from contracts import catalog
from contracts.handoff import OfferHandoff
from domain.errors import DomainError
from gateway.auth import mint
from gateway.bus import Commands
from gateway.http import status_of
from servicekit.metrics import value
from testkit.probes import wait_for

from .conftest import SECRET, Gateway, WsClient

LATENCY = "agentbus_gateway_http_request_duration_seconds_count"
ROUTE = "/api/projects/{project}"

# An analysis is a tool loop through metering: slow on a loaded machine, never timed.
ANALYSIS_TIMEOUT = 90.0


def path(gateway: Gateway, rest: str = "", project: str | None = None) -> str:
    return f"/api/projects/{project or gateway.project}{rest}"


def refusal(r: httpx.Response) -> tuple[int, str]:
    """A refused request as (status, the service's code)."""
    return r.status_code, r.json()["error"]["code"]


def with_headers(gateway: Gateway, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=30)


async def joined(gateway: Gateway, session_id: uuid.UUID) -> WsClient:
    client = await gateway.ws()
    ack = await client.request({"type": "join", "session_id": str(session_id)})
    assert ack["type"] == "ack", ack
    return client


async def closed_session(gateway: Gateway) -> uuid.UUID:
    """A session opened and closed through the gateway: the psychologist analyses it."""
    session_id = await gateway.open_session()
    client = await joined(gateway, session_id)
    closed = await client.request({"type": "close_session"})
    assert closed["type"] == "ack", closed
    await client.ws.close()
    return session_id


async def hypotheses(http: httpx.AsyncClient, gateway: Gateway, **params: str) -> list[Any]:
    r = await http.get(path(gateway, "/insights"), params=params)
    assert r.status_code == 200, r.text
    return [h for group in r.json()["groups"] for h in group["hypotheses"]]


async def hypotheses_of(
    http: httpx.AsyncClient, gateway: Gateway, session_id: uuid.UUID, **params: str
) -> list[Any]:
    return [
        h for h in await hypotheses(http, gateway, **params) if h["session_id"] == str(session_id)
    ]


async def analysed(http: httpx.AsyncClient, gateway: Gateway, session_id: uuid.UUID) -> list[Any]:
    """The session's current hypotheses, once its analysis wrote them."""

    async def found() -> list[Any]:
        return await hypotheses_of(http, gateway, session_id)

    got: list[Any] = await wait_for(
        found, timeout=ANALYSIS_TIMEOUT, what=f"hypotheses about {session_id}"
    )
    return got


# --- the error mapping -------------------------------------------------------------------


async def test_agente_ja_ativo_is_a_conflict(gateway: Gateway, nc: Client) -> None:
    """No route of the API offers a handoff (offers come from the agents' tools), so no
    request can meet `agente_ja_ativo`; the real refusal, through the gateway's own door to
    the services, is checked against the mapping the routes use."""
    session_id = await gateway.open_session()
    client = await joined(gateway, session_id)
    started = await client.request({"type": "start_agent", "agent": "criativo"})
    assert started["type"] == "ack", started
    # Starting it again is no refusal: activation is idempotent.
    again = await client.request({"type": "start_agent", "agent": "criativo"})
    assert again["type"] == "ack" and again["result"]["already_active"] is True

    offer = OfferHandoff(
        project_id=gateway.project, session_id=session_id, from_agent="po", to_agent="criativo"
    )
    with pytest.raises(DomainError) as refused:
        await Commands(nc, timeout=30)(catalog.HANDOFFS_OFFER, offer)
    assert refused.value.code == "agente_ja_ativo"
    assert status_of(refused.value.code) == 409


async def test_malformed_and_invalid_requests_are_unprocessable(gateway: Gateway) -> None:
    session_id = await gateway.open_session()
    bad: list[tuple[str, str, dict[str, Any], str]] = [
        ("GET", "/sessions/not-a-uuid", {}, "invalid_request"),
        ("GET", "/sessions/not-a-uuid/events", {}, "invalid_request"),
        ("POST", "/sessions/not-a-uuid/reanalyze", {}, "invalid_request"),
        ("POST", f"/hypotheses/{uuid.uuid4()}/perhaps", {}, "invalid_request"),
        ("POST", "/hypotheses/not-a-uuid/accept", {}, "invalid_request"),
        ("GET", f"/sessions/{session_id}/events?after_seq=soon", {}, "invalid_request"),
        ("GET", "/handoffs?session_id=yesterday", {}, "invalid_request"),
        ("GET", "/insights?status=maybe", {}, "invalid_request"),
        ("GET", "/usage?group_by=colour", {}, "invalid_request"),
    ]
    async with gateway.http() as http:
        for method, rest, extra, code in bad:
            r = await http.request(method, path(gateway, rest), **extra)
            assert refusal(r) == (422, code), (method, rest, r.text)
        # the refusals changed nothing
        r = await http.get(path(gateway, f"/sessions/{session_id}/events"))
        assert r.status_code == 200 and [e["type"] for e in r.json()["events"]] == [
            "session.opened"
        ]


async def test_unknown_sessions_and_hypotheses_are_not_found(gateway: Gateway) -> None:
    nobody = uuid.uuid4()
    async with gateway.http() as http:
        for method, rest, code in [
            ("GET", f"/sessions/{nobody}", "session_not_found"),
            ("GET", f"/sessions/{nobody}/events", "session_not_found"),
            ("POST", f"/sessions/{nobody}/reanalyze", "session_not_found"),
            ("POST", f"/hypotheses/{nobody}/accept", "hypothesis_not_found"),
            ("POST", f"/hypotheses/{nobody}/dismiss", "hypothesis_not_found"),
        ]:
            r = await http.request(method, path(gateway, rest))
            assert refusal(r) == (404, code), (method, rest, r.text)


async def test_a_token_for_another_project_is_forbidden(gateway: Gateway) -> None:
    other = f"q-{uuid.uuid4().hex[:8]}"
    theirs = await gateway.open_session(project=other)
    async with gateway.http() as http:
        # their project's path
        for method, rest in [
            ("GET", ""),
            ("GET", "/bindings"),
            ("PUT", "/bindings"),
            ("GET", "/usage"),
            ("GET", "/insights"),
            ("GET", f"/sessions/{theirs}"),
        ]:
            r = await http.request(method, path(gateway, rest, project=other), json={})
            assert refusal(r) == (403, "forbidden"), (method, rest, r.text)
        # their session, through my project's path
        for method, rest in [
            ("GET", f"/sessions/{theirs}"),
            ("GET", f"/sessions/{theirs}/events"),
            ("POST", f"/sessions/{theirs}/reanalyze"),
        ]:
            r = await http.request(method, path(gateway, rest))
            assert refusal(r) == (403, "forbidden"), (method, rest, r.text)
        r = await http.put(
            path(gateway, "/bindings"),
            json={"scope": "session", "session_id": str(theirs), "model": "claude-haiku-4-5"},
        )
        assert refusal(r) == (403, "forbidden"), r.text


async def test_no_forged_or_expired_token_is_unauthorized(gateway: Gateway) -> None:
    bearer = "Bearer {}".format
    credentials: dict[str, dict[str, str]] = {
        "none": {},
        "not a bearer": {"authorization": f"Basic {gateway.token()}"},
        "garbage": {"authorization": bearer("not-a-token")},
        "forged": {"authorization": bearer(mint("another-" + "y" * 40, gateway.project, "ana"))},
        "expired": {"authorization": bearer(mint(SECRET, gateway.project, "ana", -60))},
    }
    timed = {
        (method, rest): value(LATENCY, route=ROUTE + rest, method=method, status="401")
        for method, rest in [("GET", "/sessions"), ("POST", "/sessions"), ("GET", "/usage")]
    }
    for name, headers in credentials.items():
        async with with_headers(gateway, **headers) as http:
            for method, rest in timed:
                r = await http.request(method, path(gateway, rest))
                assert refusal(r) == (401, "unauthorized"), (name, method, rest, r.text)
    # each refusal timed under its route template and status (issue 14), no concrete path
    for (method, rest), before in timed.items():
        got = value(LATENCY, route=ROUTE + rest, method=method, status="401")
        assert got == before + len(credentials), (method, rest)
    # a token in the query is refused (a URL ends up in access logs), and a socket's
    # ticket is no token
    async with with_headers(gateway) as http:
        r = await http.get(path(gateway), params={"token": gateway.token()})
        assert refusal(r) == (401, "unauthorized"), r.text
        r = await http.get(path(gateway), headers={"authorization": bearer(await gateway.ticket())})
        assert refusal(r) == (401, "unauthorized"), r.text


# --- bindings -----------------------------------------------------------------------------

SEEDED = {
    ("agent", "psicologo", "claude-opus-4-8"),
    ("agent", "psicologo-leve", "claude-haiku-4-5"),
    ("agent", "criativo", "claude-sonnet-4-6"),
    ("workspace", None, "claude-sonnet-4-6"),
}


def binding_keys(reply: dict[str, Any]) -> set[tuple[str, str | None, str]]:
    return {(b["scope"], b["agent_slug"], b["model"]) for b in reply["bindings"]}


async def test_bindings_are_read_but_never_set_with_a_token(gateway: Gateway) -> None:
    session_id = await gateway.open_session()
    async with gateway.http() as http:
        r = await http.get(path(gateway, "/bindings"))
        assert r.status_code == 200, r.text
        assert binding_keys(r.json()) == SEEDED
        # The model decides what a call costs: the dearest one, bound by anyone holding a
        # token, would be spend without a ceiling. Every shape is refused alike.
        for body in [
            {"scope": "project", "model": "claude-opus-4-8"},
            {"scope": "agent", "agent_slug": "chat", "model": "claude-opus-4-8"},
            {"scope": "session", "session_id": str(session_id), "model": "claude-opus-4-8"},
            {"scope": "workspace", "model": "claude-opus-4-8"},
            {"scope": "project", "model": None},
            {"not": "a binding"},
        ]:
            r = await http.put(path(gateway, "/bindings"), json=body)
            assert refusal(r) == (403, "forbidden"), (body, r.text)
            assert "operator" in r.json()["error"]["message"]
        r = await http.put(path(gateway, "/bindings"), content=b"{not json")
        assert refusal(r) == (403, "forbidden"), r.text
        r = await http.get(path(gateway, "/bindings"))
        assert binding_keys(r.json()) == SEEDED, "a token changed a binding"


# --- limits -------------------------------------------------------------------------------


async def test_limits_show_the_projects_and_the_persons_with_their_windows(
    gateway: Gateway,
) -> None:
    async with gateway.http() as http:
        r = await http.get(path(gateway, "/limits"))
    assert r.status_code == 200, r.text
    seen = {(u["scope"], u["name"], u["metric"], u["window"]) for u in r.json()["limits"]}
    # the seeded defaults, for this token's project and person
    for scope, name in [("project", gateway.project), ("person", "ana")]:
        for metric, window in [
            ("micros", "day"),
            ("micros", "month"),
            ("requests", "minute"),
            ("tokens", "minute"),
        ]:
            assert (scope, name, metric, window) in seen, (scope, metric, window)
    assert r.json()["exhausted"] == []


# --- usage --------------------------------------------------------------------------------


async def test_usage_after_a_chat_turn_has_tokens_and_cost_per_agent(gateway: Gateway) -> None:
    session_id = await gateway.open_session()
    client = await joined(gateway, session_id)
    assert (await client.request({"type": "start_agent", "agent": "criativo"}))["type"] == "ack"
    sent = await client.request(
        {"type": "chat", "text": "Quero um app de receitas", "client_msg_id": "m-1"}
    )
    assert sent["type"] == "ack", sent
    await wait_for(lambda: client.of("done"), timeout=60, what="the turn to end")
    assert client.of("done")[0]["error_code"] is None

    async with gateway.http() as http:

        async def criativo_usage() -> dict[str, Any] | None:
            r = await http.get(
                path(gateway, "/usage"),
                params={"group_by": "agent,model", "session_id": str(session_id)},
            )
            assert r.status_code == 200, r.text
            groups = [g for g in r.json()["groups"] if g["key"]["agent"] == "criativo"]
            return groups[0] if groups else None

        group = await wait_for(criativo_usage, timeout=30, what="the turn's usage")
        assert group["key"]["model"] == "claude-sonnet-4-6"
        assert group["calls"] >= 1 and group["errors"] == 0
        assert group["usage"]["input_tokens"] > 0 and group["usage"]["output_tokens"] > 0
        assert group["cost_micros"] > 0

        # the default grouping names the session; another session's usage is not in it
        r = await http.get(path(gateway, "/usage"))
        assert r.status_code == 200
        summary = r.json()
        assert {g["key"]["session"] for g in summary["groups"]} == {str(session_id)}
        assert summary["total_cost_micros"] == sum(g["cost_micros"] for g in summary["groups"])
        assert summary["total_cost_micros"] > 0

    other = f"q-{uuid.uuid4().hex[:8]}"
    async with gateway.http(other) as theirs:
        r = await theirs.get(path(gateway, "/usage", other))
        assert r.status_code == 200 and r.json()["groups"] == []


# --- insights: accept and dismiss ---------------------------------------------------------


async def test_hypotheses_are_accepted_or_dismissed_once(gateway: Gateway) -> None:
    first, second = await closed_session(gateway), await closed_session(gateway)
    async with gateway.http() as http:
        [accepted] = await analysed(http, gateway, first)
        [dismissed] = await analysed(http, gateway, second)
        assert accepted["status"] == dismissed["status"] == "proposed"

        r = await http.post(path(gateway, f"/hypotheses/{accepted['id']}/accept"))
        assert r.status_code == 200, r.text
        decided = r.json()["hypothesis"]
        assert (decided["id"], decided["status"], decided["decided_by"]) == (
            accepted["id"],
            "accepted",
            "user:ana",
        )
        r = await http.post(path(gateway, f"/hypotheses/{dismissed['id']}/dismiss"))
        assert r.status_code == 200 and r.json()["hypothesis"]["status"] == "dismissed"

        # each decision is final
        for hypothesis in (accepted, dismissed):
            for decision in ("accept", "dismiss"):
                r = await http.post(path(gateway, f"/hypotheses/{hypothesis['id']}/{decision}"))
                assert refusal(r) == (409, "invalid_transition"), (decision, r.text)

        assert [h["id"] for h in await hypotheses(http, gateway, status="accepted")] == [
            accepted["id"]
        ]
        assert [h["id"] for h in await hypotheses(http, gateway, status="dismissed")] == [
            dismissed["id"]
        ]
        assert await hypotheses(http, gateway, status="proposed") == []

    # another project's token, on its own path, finds no hypothesis of this project
    other = f"q-{uuid.uuid4().hex[:8]}"
    async with gateway.http(other) as theirs:
        r = await theirs.post(path(gateway, f"/hypotheses/{accepted['id']}/dismiss", other))
        assert refusal(r) == (404, "hypothesis_not_found"), r.text


# --- reanalysis ---------------------------------------------------------------------------


async def test_reanalysis_supersedes_the_analysis_and_the_insights_show_the_new_one(
    gateway: Gateway,
) -> None:
    session_id = await closed_session(gateway)
    async with gateway.http() as http:
        before = await analysed(http, gateway, session_id)
        previous = {h["analysis_id"] for h in before}
        assert len(previous) == 1

        r = await http.post(path(gateway, f"/sessions/{session_id}/reanalyze"), timeout=150)
        assert r.status_code == 200, r.text
        outcome = r.json()
        assert outcome["status"] == "completed", outcome
        assert outcome["superseded_analysis_id"] in previous
        assert outcome["analysis_id"] not in previous and outcome["hypotheses"]

        after = await hypotheses_of(http, gateway, session_id)
        assert {h["id"] for h in after} == {h["id"] for h in outcome["hypotheses"]}
        assert {h["analysis_id"] for h in after} == {outcome["analysis_id"]}
        assert all(h["current"] for h in after)
        assert not {h["id"] for h in before} & {h["id"] for h in after}


async def test_reanalysing_an_open_session_is_a_conflict(gateway: Gateway) -> None:
    session_id = await gateway.open_session()
    async with gateway.http() as http:
        r = await http.post(path(gateway, f"/sessions/{session_id}/reanalyze"))
        assert refusal(r) == (409, "session_not_closed"), r.text
        assert r.json()["error"]["details"] == {"session_id": str(session_id)}
        r = await http.get(path(gateway, "/insights"))
        assert r.status_code == 200 and r.json()["groups"] == []
