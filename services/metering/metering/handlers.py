"""Metering's commands: validate, call one domain rule or the turn runner, persist, reply."""

from __future__ import annotations

from datetime import UTC, datetime

from nats.aio.client import Client

from contracts import subjects
from contracts.common import ErrorCode
from contracts.metering import (
    BindingSetReply,
    BindingsReply,
    CancelReply,
    CancelTurn,
    ListBindings,
    LlmStream,
    LlmTurn,
    ResolveBinding,
    ResolvedBinding,
    SetBinding,
    TurnReply,
    UsageSummaryReply,
    UsageSummaryRequest,
)
from domain.errors import DomainError
from domain.metering import check_binding
from metering.catalog import Catalog
from metering.repository import MeteringRepository
from metering.turns import TurnRunner
from servicekit.endpoint import Endpoints

SERVICE = "metering"
VERSION = "0.1.0"


def build_endpoints(
    repo: MeteringRepository, catalog: Catalog, runner: TurnRunner, nc: Client
) -> Endpoints:
    """Every command of metering, wired to its parts."""
    api = Endpoints(SERVICE, VERSION, "The only door to the LLM: bindings, budgets, usage.")

    @api.command(subjects.LLM_TURN, LlmTurn)
    async def turn(cmd: LlmTurn) -> TurnReply:
        return await runner.run(cmd)

    @api.command(subjects.LLM_STREAM, LlmStream)
    async def stream(cmd: LlmStream) -> TurnReply:
        return await runner.run(cmd)

    @api.command(subjects.LLM_CANCEL, CancelTurn)
    async def cancel(cmd: CancelTurn) -> CancelReply:
        # Any replica may receive it; the one running the turn hears the announcement.
        # A turn of another project or session has no row under these keys and runs on
        # no replica under them, so it is answered `cancelling` and left untouched.
        if await repo.turn_ended(cmd.turn_id, cmd.project_id, cmd.session_id):
            return CancelReply(turn_id=cmd.turn_id, status="finished")
        await runner.cancels.announce(nc, cmd)
        return CancelReply(turn_id=cmd.turn_id, status="cancelling")

    @api.command(subjects.BINDINGS_SET, SetBinding)
    async def set_binding(cmd: SetBinding) -> BindingSetReply:
        check_binding(cmd)
        if runner.providers.get(cmd.provider) is None:
            raise DomainError(
                ErrorCode.INVALID_BINDING,
                f"provider {cmd.provider} is not configured on metering (it has "
                f"{', '.join(runner.providers.names)}); set OPENAI_BASE_URL for `openai`",
                provider=cmd.provider,
            )
        if cmd.model is not None and not catalog.knows(cmd.model, datetime.now(UTC).date()):
            raise DomainError(
                ErrorCode.UNKNOWN_MODEL,
                f"model {cmd.model} has no price, so its calls could not be metered; "
                "bind a priced model",
                model=cmd.model,
            )
        binding = await repo.set_binding(cmd)
        await catalog.announce_change(nc)
        return BindingSetReply(binding=binding, removed=binding is None)

    @api.command(subjects.BINDINGS_LIST, ListBindings)
    async def list_bindings(cmd: ListBindings) -> BindingsReply:
        return BindingsReply(bindings=await repo.list_bindings(cmd.project_id))

    @api.command(subjects.BINDINGS_RESOLVE, ResolveBinding)
    async def resolve(cmd: ResolveBinding) -> ResolvedBinding:
        binding = catalog.resolve(cmd.agent_slug, cmd.project_id, cmd.session_id)
        return ResolvedBinding(model=binding.model, decided_by=binding)

    @api.command(subjects.USAGE_SUMMARY, UsageSummaryRequest)
    async def usage_summary(cmd: UsageSummaryRequest) -> UsageSummaryReply:
        return await repo.summary(cmd)

    return api
