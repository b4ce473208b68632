"""`agentbus`: run the stack and talk to it from a terminal.

agentbus up                       start servers and services (what `make up` runs)
agentbus down                     stop them
agentbus call SUBJECT [JSON]      send a command, print the reply
agentbus services                 list the services answering on the bus
agentbus token PROJECT [--user U] a signed token (and link) for the web gateway
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import nats

from servicekit.devstack import read_stack, run_stack, stop_stack
from servicekit.logs import configure_logging


def _nats_url() -> str:
    url = os.environ.get("NATS_URL")
    if url:
        return url
    stack = read_stack()
    if stack is None:
        raise SystemExit("no NATS_URL set and no running stack: start one with `make up`")
    return str(stack["nats_url"])


async def _call(subject: str, body: str, timeout: float) -> int:
    nc = await nats.connect(_nats_url())
    try:
        msg = await nc.request(subject, body.encode(), timeout=timeout)
    except nats.errors.NoRespondersError:
        print(f"no service answers {subject}", file=sys.stderr)
        return 2
    finally:
        await nc.close()
    reply = json.loads(msg.data)
    print(json.dumps(reply, indent=2))
    return 1 if isinstance(reply, dict) and "error" in reply else 0


async def _services() -> int:
    nc = await nats.connect(_nats_url())
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.INFO", b"", reply=inbox)
    try:
        while True:
            msg = await sub.next_msg(timeout=0.5)
            if msg.data:
                info = json.loads(msg.data)
                subjects = ", ".join(sorted(e["subject"] for e in info["endpoints"]))
                print(f"{info['name']:<16} {info['id']}  {subjects}")
    except (nats.errors.TimeoutError, TimeoutError):
        pass
    finally:
        await nc.close()
    return 0


async def _ping(service: str, instance: str | None, timeout: float) -> int:
    """0 when `instance` (any instance if None) of `service` answers `$SRV.PING`."""
    try:
        nc = await nats.connect(_nats_url(), connect_timeout=2, allow_reconnect=False)
    except Exception as exc:
        print(f"cannot reach NATS: {exc!r}", file=sys.stderr)
        return 1
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
    try:
        async with asyncio.timeout(timeout):
            while True:
                msg = await sub.next_msg(timeout=timeout)
                meta = (json.loads(msg.data).get("metadata") or {}) if msg.data else {}
                if msg.data and instance in (None, meta.get("instance")):
                    return 0
    except (TimeoutError, nats.errors.TimeoutError):
        print(f"{service} ({instance or 'any instance'}) did not answer", file=sys.stderr)
        return 1
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentbus", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start NATS, Postgres and every service; Ctrl-C stops them")
    sub.add_parser("down", help="stop a running stack")
    call = sub.add_parser("call", help="send a command and print its reply")
    call.add_argument("subject")
    call.add_argument("json", nargs="?", default="{}")
    call.add_argument("--timeout", type=float, default=5.0)
    sub.add_parser("services", help="list the services answering on the bus")
    ping = sub.add_parser("ping", help="check that a service instance answers (for probes)")
    ping.add_argument("service")
    ping.add_argument(
        "--instance",
        default=os.environ.get("AGENTBUS_INSTANCE_ID"),
        help="the instance to wait for (default: $AGENTBUS_INSTANCE_ID, else any)",
    )
    ping.add_argument("--timeout", type=float, default=3.0)
    token = sub.add_parser("token", help="mint a web gateway token for one project")
    token.add_argument("project")
    token.add_argument("--user", default="dev")
    args = parser.parse_args(argv)

    if args.command == "up":
        configure_logging("devstack", os.environ.get("AGENTBUS_LOG_LEVEL", "INFO"))
        asyncio.run(run_stack())
        return 0
    if args.command == "down":
        print("stopped" if stop_stack() else "no stack was running")
        return 0
    if args.command == "call":
        return asyncio.run(_call(args.subject, args.json, args.timeout))
    if args.command == "token":
        # Imported here: the gateway is a service built on servicekit, not part of it.
        from gateway.auth import dev_link

        print(dev_link(args.project, args.user))
        return 0
    if args.command == "ping":
        return asyncio.run(_ping(args.service, args.instance, args.timeout))
    return asyncio.run(_services())


if __name__ == "__main__":
    sys.exit(main())
