"""Metering's commands: validate, call one domain rule or the turn runner, persist, reply."""

from __future__ import annotations

from datetime import UTC, datetime

from nats.aio.client import Client

# `catalog` names metering's catalogue of models and prices, a handler dependency.
from contracts import catalog as commands
from contracts.common import ErrorCode
from contracts.metering import (
    BindingSetReply,
    BindingsReply,
    CancelReply,
    CancelTurn,
    LimitsSetReply,
    LimitsStatus,
    LimitsStatusRequest,
    ListBindings,
    LlmStream,
    LlmTurn,
    ResolveBinding,
    ResolvedBinding,
    SetBinding,
    SetLimits,
    TurnReply,
    UsageSummaryReply,
    UsageSummaryRequest,
)
from domain.errors import DomainError
from domain.metering import check_binding, check_limits
from metering.catalog import Catalog
from metering.repository import MeteringRepository
from metering.turns import TurnRunner
from servicekit.service import Service

SERVICE = "metering"
VERSION = "0.1.0"
svc = Service(
    SERVICE,
    VERSION,
    "The only door to the LLM: bindings, budgets, usage.",
    schema="metering",
    migrations=["metering.migrations"],
)


@svc.command(commands.LLM_TURN)
async def turn(cmd: LlmTurn, runner: TurnRunner) -> TurnReply:
    return await runner.run(cmd)


@svc.command(commands.LLM_STREAM)
async def stream(cmd: LlmStream, runner: TurnRunner) -> TurnReply:
    return await runner.run(cmd)


@svc.command(commands.LLM_CANCEL)
async def cancel(
    cmd: CancelTurn, repo: MeteringRepository, runner: TurnRunner, nc: Client
) -> CancelReply:
    # Any replica may receive it; the one running the turn hears the announcement.
    # A turn of another project or session has no row under these keys and runs on
    # no replica under them, so it is answered `cancelling` and left untouched.
    if await repo.turn_ended(cmd.turn_id, cmd.project_id, cmd.session_id):
        return CancelReply(turn_id=cmd.turn_id, status="finished")
    await runner.cancels.announce(nc, cmd)
    return CancelReply(turn_id=cmd.turn_id, status="cancelling")


@svc.command(commands.BINDINGS_SET)
async def set_binding(
    cmd: SetBinding, repo: MeteringRepository, catalog: Catalog, runner: TurnRunner, nc: Client
) -> BindingSetReply:
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


@svc.command(commands.BINDINGS_LIST)
async def list_bindings(cmd: ListBindings, repo: MeteringRepository) -> BindingsReply:
    return BindingsReply(bindings=await repo.list_bindings(cmd.project_id))


@svc.command(commands.BINDINGS_RESOLVE)
async def resolve(cmd: ResolveBinding, catalog: Catalog) -> ResolvedBinding:
    binding = catalog.resolve(cmd.agent_slug, cmd.project_id, cmd.session_id)
    return ResolvedBinding(model=binding.model, decided_by=binding)


@svc.command(commands.USAGE_SUMMARY)
async def usage_summary(cmd: UsageSummaryRequest, repo: MeteringRepository) -> UsageSummaryReply:
    return await repo.summary(cmd)


@svc.command(commands.LIMITS_SET)
async def set_limits(cmd: SetLimits, repo: MeteringRepository) -> LimitsSetReply:
    # Read by every admission from the table itself: no cache to tell of the change.
    check_limits(cmd)
    return await repo.set_limits(cmd)


@svc.command(commands.LIMITS_STATUS)
async def limits_status(cmd: LimitsStatusRequest, repo: MeteringRepository) -> LimitsStatus:
    return await repo.limits_status(cmd.project_id, cmd.person)
