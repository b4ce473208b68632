"""`agentbus`: run the stack and talk to it from a terminal.

agentbus up [--replicas N] [--nats-cluster M]
                                  start servers and services (what `make up` runs);
                                  N processes of every service (default 1), the
                                  embedded NATS as a JetStream cluster of M nodes
agentbus down                     stop them
agentbus call SUBJECT [JSON]      send a command, print the reply
agentbus services                 list the service instances answering on the bus
agentbus token PROJECT [--user U] a signed token (and link) for the web gateway
agentbus creds USER               how the NATS CLI connects as USER (ops, provision, …)
agentbus provision                create or update the streams and KV buckets (`provision`)
agentbus republish --session S | --since T
                                  publish the log's events again from Postgres
agentbus nats-config              the NATS users and permissions, passwords from env
agentbus nats-passwords           new random passwords for them, as env lines (.env)

On the embedded stack (`make up`) the credentials come from `.agentbus/`; with
`NATS_URL` set, from `NATS_USER`/`NATS_PASSWORD` (none: anonymous).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import nats
from nats.aio.client import Client

from devstack.services import web_links
from devstack.stack import (
    embedded_credentials,
    env_credentials,
    provision,
    read_stack,
    run_stack,
    secrets_file,
    stop_stack,
)
from servicekit.bus import Credentials, identity_options, server_urls
from servicekit.logs import configure_logging
from servicekit.permissions import ADMIN, PROVISION, USERS, inbox_prefix


def _nats_url() -> str:
    url = os.environ.get("NATS_URL")
    if url:
        return url
    stack = read_stack()
    if stack is None:
        raise SystemExit("no NATS_URL set and no running stack: start one with `make up`")
    return str(stack["nats_url"])


def _credentials(user: str) -> Credentials | None:
    """`user` on the embedded stack; with NATS_URL set, whoever the environment names."""
    if os.environ.get("NATS_URL"):
        return env_credentials()
    return embedded_credentials(user)


async def _connect(user: str = ADMIN, **options: Any) -> Client:
    """A short-lived connection as `user` (`admin`, the local operator, by default)."""
    return await nats.connect(
        server_urls(_nats_url()),
        name=f"agentbus-cli:{user}",
        **identity_options(_credentials(user)),
        **options,
    )


async def _call(subject: str, body: str, timeout: float) -> int:
    nc = await _connect()
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
    nc = await _connect()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.INFO", b"", reply=inbox)
    try:
        while True:
            msg = await sub.next_msg(timeout=0.5)
            if msg.data:
                info = json.loads(msg.data)
                subjects = ", ".join(sorted(e["subject"] for e in info["endpoints"]))
                instance = (info.get("metadata") or {}).get("instance") or "-"
                print(f"{info['name']:<16} {instance:<24} {info['id']}  {subjects}")
    except (nats.errors.TimeoutError, TimeoutError):
        pass
    finally:
        await nc.close()
    return 0


async def _ping(service: str, instance: str | None, timeout: float) -> int:
    """0 when `instance` (any instance if None) of `service` answers `$SRV.PING`."""
    try:
        nc = await _connect(connect_timeout=2, allow_reconnect=False)
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


def _creds(user: str) -> int:
    """Print what the NATS CLI needs to connect as `user` to the embedded stack."""
    credentials = embedded_credentials(user)
    if credentials is None:
        print(
            f"no password for {user!r} in {secrets_file()}: start the stack with `make up` "
            "(elsewhere the passwords are in the environment or the k8s Secret)",
            file=sys.stderr,
        )
        return 1
    stack = read_stack()
    url = str(stack["nats_url"]) if stack else "nats://127.0.0.1:<port of the running stack>"
    flags = (
        f"--server {url} --user {user} --password {credentials.password} "
        f"--inbox-prefix {inbox_prefix(user)}"
    )
    print(f"# the NATS CLI as {user!r} (replies arrive under {inbox_prefix(user)}.>):")
    print(f"nats {flags} <command>")
    print("# or once, as a context:")
    print(f"nats context save agentbus-{user} {flags} --select")
    print("# or in the environment (agentbus commands read NATS_USER/NATS_PASSWORD):")
    print(f"export NATS_URL={url} NATS_USER={user} NATS_PASSWORD={credentials.password}")
    return 0


async def _provision() -> int:
    from servicekit.settings import ServiceSettings

    await provision(_nats_url(), _credentials(PROVISION), ServiceSettings().stream_replicas)
    print("streams and buckets provisioned")
    return 0


def _database_url() -> str:
    url = os.environ.get("DATABASE_URL")
    if url:
        return url
    stack = read_stack()
    if stack is None:
        raise SystemExit("no DATABASE_URL set and no running stack: start one with `make up`")
    return str(stack["database_url"])


async def _republish(session: str | None, since: str | None) -> int:
    from devstack.republish import republish

    # As the log itself: `session_events` is the one user that publishes events.
    nc = await _connect("session_events")
    try:
        sent = await republish(nc.jetstream(), _database_url(), session=session, since=since)
    finally:
        await nc.close()
    print(
        f"republished {sent.published} events: {sent.stored} stored, "
        f"{sent.published - sent.stored} already in the stream (deduplicated)"
    )
    return 0


def _token(project: str, user: str) -> int:
    """A link with a signed token, from the service that serves the web client."""
    links = web_links()
    if not links:
        print("no installed service serves the web client (`agentbus.web`)", file=sys.stderr)
        return 1
    print(links[min(links)](project, user))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentbus", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start NATS, Postgres and every service; Ctrl-C stops them")
    up.add_argument(
        "--replicas", type=int, default=1, help="processes of every service (default 1)"
    )
    up.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        help="embedded NATS nodes, clustered, streams on min(M, 3) of them (default 1)",
    )
    sub.add_parser("down", help="stop a running stack")
    call = sub.add_parser("call", help="send a command and print its reply")
    call.add_argument("subject")
    call.add_argument("json", nargs="?", default="{}")
    call.add_argument("--timeout", type=float, default=5.0)
    sub.add_parser("services", help="list the service instances answering on the bus")
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
    creds = sub.add_parser("creds", help="how the NATS CLI connects as a user")
    creds.add_argument("user", choices=USERS)
    sub.add_parser(
        "provision", help="create or update the streams and KV buckets (the provision user)"
    )
    again = sub.add_parser("republish", help="publish the log's events again from Postgres")
    which = again.add_mutually_exclusive_group(required=True)
    which.add_argument("--session", help="one session's events (its id)")
    which.add_argument("--since", help="every event created since (ISO 8601 time)")
    config = sub.add_parser("nats-config", help="the NATS accounts, users and permissions")
    config.add_argument(
        "--with-admin", action="store_true", help="include the unrestricted `admin` user"
    )
    config.add_argument(
        "--write",
        action="store_true",
        help="write it into deploy/nats/auth.conf and deploy/k8s/nats.yaml (from the repo root)",
    )
    deploy = sub.add_parser(
        "deploy-config",
        help="check (or --write) the per-service files of deploy/ and docker-compose.yml",
    )
    deploy.add_argument("--write", action="store_true", help="write them (from the repo root)")
    deploy.add_argument(
        "--secrets", action="store_true", help="print every k8s Secret with new random values"
    )
    sub.add_parser(
        "nats-passwords", help="new random NATS passwords as NAME=value lines (for .env)"
    )
    args = parser.parse_args(argv)

    if args.command == "up":
        configure_logging("devstack", os.environ.get("AGENTBUS_LOG_LEVEL", "INFO"))
        asyncio.run(run_stack(replicas=args.replicas, nats_cluster=args.nats_cluster))
        return 0
    if args.command == "down":
        print("stopped" if stop_stack() else "no stack was running")
        return 0
    if args.command == "call":
        return asyncio.run(_call(args.subject, args.json, args.timeout))
    if args.command == "token":
        return _token(args.project, args.user)
    if args.command == "ping":
        return asyncio.run(_ping(args.service, args.instance, args.timeout))
    if args.command == "creds":
        return _creds(args.user)
    if args.command == "provision":
        return asyncio.run(_provision())
    if args.command == "republish":
        return asyncio.run(_republish(args.session, args.since))
    if args.command == "nats-passwords":
        import secrets

        from servicekit.natsconf import password_variable

        for user in USERS:
            if user != ADMIN:  # the deployed configs have no unrestricted user
                print(f"{password_variable(user)}={secrets.token_urlsafe(24)}")
        return 0
    if args.command == "deploy-config":
        from pathlib import Path

        from devstack import deploygen

        if args.secrets:
            print(deploygen.secrets_manifest(deploygen.deployed_services()), end="")
            return 0
        if args.write:
            for path in deploygen.write(Path.cwd()):
                print(f"wrote {path}")
            return 0
        outdated = deploygen.stale(Path.cwd())
        for path in outdated:
            print(f"stale: {path} (run `make deploy-config`)")
        return 1 if outdated else 0
    if args.command == "nats-config":
        from pathlib import Path

        from devstack.deployed import deployed_auth, write_deployed_auth

        if args.write:
            for path in write_deployed_auth(Path.cwd()):
                print(f"wrote {path}")
            return 0
        print(deployed_auth(args.with_admin), end="")
        return 0
    return asyncio.run(_services())


if __name__ == "__main__":
    sys.exit(main())
