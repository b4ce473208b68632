"""Wiring of the metering service: the one place its parts are put together."""

from __future__ import annotations

from contracts.metering import METADATA_OFFLINE, METADATA_PROVIDER
from metering.cancels import Cancellations
from metering.catalog import Catalog
from metering.handlers import SERVICE, svc
from metering.providers.base import Provider, Providers
from metering.providers.scripted import DEFAULT_SCRIPT, Script, ScriptedProvider
from metering.replicas import ReplicaLock
from metering.repository import MeteringRepository
from metering.settings import MeteringSettings
from metering.sweeper import run_orphan_sweeper, run_sweeper, settle_own
from metering.turns import TurnRunner
from servicekit.logs import get_logger
from servicekit.runtime import run_service

log = get_logger(__name__)


def build_provider(settings: MeteringSettings, script: Script | None = None) -> Provider:
    """The provider configuration asks for; without a key, the offline script, said loudly."""
    choice = settings.provider
    if choice == "auto":
        choice = "anthropic" if settings.anthropic_api_key else "scripted"
    if choice == "anthropic":
        from metering.providers.anthropic import AnthropicProvider

        if not settings.anthropic_api_key:
            raise SystemExit("AGENTBUS_PROVIDER=anthropic needs ANTHROPIC_API_KEY")
        log.info("provider_anthropic", base_url=settings.anthropic_base_url or "SDK default")
        return AnthropicProvider(
            api_key=settings.anthropic_api_key,
            base_url=settings.anthropic_base_url,
            max_retries=settings.provider_max_retries,
            timeout=settings.provider_timeout_seconds,
            connections=settings.endpoint_concurrency,
        )
    if script is None:
        script = Script.from_file(settings.script_path) if settings.script_path else DEFAULT_SCRIPT
    log.warning(
        "provider_scripted",
        reason="ANTHROPIC_API_KEY is not set"
        if settings.provider == "auto"
        else "AGENTBUS_PROVIDER=scripted",
        script=settings.script_path or "built-in offline demo script",
        note="model replies are scripted, not generated; set ANTHROPIC_API_KEY for real ones",
    )
    return ScriptedProvider(script)


def announced(providers: Providers) -> dict[str, str]:
    """What this replica tells `$SRV.INFO.metering`: its default provider, and whether that
    is the offline script."""
    name = providers.default.name
    return {METADATA_PROVIDER: name, METADATA_OFFLINE: str(name == ScriptedProvider.name).lower()}


def build_providers(settings: MeteringSettings, default: Provider) -> Providers:
    """`default` and, when configured, the OpenAI-compatible provider beside it."""
    if not (settings.openai_base_url or settings.openai_api_key):
        return Providers(default)
    from metering.providers.openai import OpenAICompatibleProvider

    log.info("provider_openai", base_url=settings.openai_base_url or "SDK default")
    openai = OpenAICompatibleProvider(
        api_key=settings.openai_api_key,
        base_url=settings.openai_base_url,
        max_retries=settings.provider_max_retries,
        timeout=settings.provider_timeout_seconds,
        connections=settings.endpoint_concurrency,
    )
    return Providers(default, openai)


async def main(
    settings: MeteringSettings | None = None,
    provider: Provider | None = None,
    cancels: Cancellations | None = None,
) -> None:
    """Serve metering's commands until stopped (tests pass their own provider, and the
    cancels they watch, here)."""
    settings = settings or MeteringSettings()
    providers = build_providers(settings, provider or build_provider(settings))
    cancels = cancels or Cancellations(settings.cancel_memory_seconds)
    async with svc.open(settings) as rt:
        repo = MeteringRepository(rt.pool, settings.instance_id)
        # Alive, as Postgres sees it, before the first hold: then what an earlier process
        # of this id left is settled, since none of its calls runs any more.
        lock = ReplicaLock(settings.database_url, settings.instance_id)
        await lock.take()
        await settle_own(repo)
        rt.background(lock.keep(), "replica-lock")
        catalog = Catalog(repo)
        await catalog.reload()
        rt.background(catalog.watch(rt.nc, settings.catalog_refresh_seconds), "catalog-watch")
        rt.background(
            run_sweeper(
                repo, settings.abandoned_hold_seconds, settings.hold_sweep_interval_seconds
            ),
            "hold-sweeper",
        )
        rt.background(run_orphan_sweeper(repo, settings.orphan_sweep_seconds), "orphan-sweeper")
        # Listening before serving: a replica hears every cancel of the streams it runs.
        cancel_sub = await cancels.subscribe(rt.nc)
        runner = TurnRunner(repo, catalog, providers, rt.nc, cancels, settings.coalescing)
        try:
            await svc.serve(
                rt, metadata=announced(providers), repo=repo, catalog=catalog, runner=runner
            )
        finally:
            await lock.close()
            # Still listening while the turns in flight finished (`serve` drains them): a
            # person can stop a stream of a replica that is shutting down (another replica
            # serves the cancel).
            await cancel_sub.unsubscribe()
            await providers.close()


def run() -> None:
    """Entry point: `python -m metering`."""
    run_service(SERVICE, main())
