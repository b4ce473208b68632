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
agentbus limits show PROJECT [--person P]
                                  the spend and rate limits in force, and what the
                                  current windows used
agentbus limits set (--project P | --person P) [--day-usd X] [--month-usd X]
                    [--requests-per-minute N] [--tokens-per-minute N]
                                  an operator sets the limits of one project or person
                                  (P `*`: the default of all); what is not named is
                                  as the default (on the default: no limit)
agentbus nats-config              the NATS users and permissions, passwords from env
agentbus secrets [--write .env]   new random secrets for docker-compose, as env lines
                                  (NATS passwords, Postgres, the gateway's token secret);
                                  --write creates the file, mode 0600 (`nats-passwords`:
                                  the same)

On the embedded stack (`make up`) the credentials come from `.agentbus/`; with
`NATS_URL` set, from `NATS_USER`/`NATS_PASSWORD` (none: anonymous).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client

from contracts.subjects import LIMITS_SET, LIMITS_STATUS
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
from servicekit.permissions import ADMIN, OPS, PROVISION, USERS, inbox_prefix


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


async def _call(subject: str, body: str, timeout: float, user: str = ADMIN) -> int:
    """Send a command as `user`, print its reply; 1 when the reply is an error."""
    nc = await _connect(user)
    try:
        msg = await nc.request(subject, body.encode(), timeout=timeout)
    except nats.errors.NoRespondersError:
        print(f"no service answers {subject}: is it running?", file=sys.stderr)
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


def _write_secrets(path: Path, text: str, replace: bool) -> int:
    """Create `path` readable by its owner alone; an existing one only with `replace`."""
    # Made 0600 as it is created, never readable in between; O_EXCL (or O_NOFOLLOW when
    # replacing) so a file or link already there is not written through.
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC | os.O_NOFOLLOW if replace else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        print(
            f"{path} exists, and the NATS and Postgres data may have been started with its "
            "secrets: keep it, or pass --replace to write new ones",
            file=sys.stderr,
        )
        return 1
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        print(f"{path} is a symbolic link: not written through it", file=sys.stderr)
        return 1
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)  # a replaced file keeps its old mode otherwise
        out.write(text)
    print(f"wrote {path} (mode 0600)")
    return 0


def _micros(usd: str | None) -> int | None:
    return None if usd is None else round(float(usd) * 1_000_000)


async def _limits(args: argparse.Namespace) -> int:
    """Show or set limits as the operator (`ops`: the one user besides `admin` allowed to)."""
    if args.action == "show":
        body: dict[str, Any] = {"project_id": args.project, "person": args.person}
        subject = LIMITS_STATUS
    else:
        scope, name = ("project", args.project) if args.project else ("person", args.person)
        limits = {
            "micros_per_day": _micros(args.day_usd),
            "micros_per_month": _micros(args.month_usd),
            "requests_per_minute": args.requests_per_minute,
            "tokens_per_minute": args.tokens_per_minute,
        }
        body, subject = {"scope": scope, "name": name, "limits": limits}, LIMITS_SET
    return await _call(subject, json.dumps(body), timeout=10, user=OPS)


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
    limits = sub.add_parser("limits", help="show or set spend and rate limits (operator)")
    action = limits.add_subparsers(dest="action", required=True)
    show = action.add_parser("show", help="the limits in force and the windows' use")
    show.add_argument("project")
    show.add_argument("--person", help="a person's too (the `sub` of their token)")
    setting = action.add_parser("set", help="set one project's or person's limits ('*': default)")
    whose = setting.add_mutually_exclusive_group(required=True)
    whose.add_argument("--project", help="a project id, or '*' for every project's default")
    whose.add_argument("--person", help="a person, or '*' for every person's default")
    setting.add_argument("--day-usd", help="spend per UTC day, in US dollars")
    setting.add_argument("--month-usd", help="spend per UTC month, in US dollars")
    setting.add_argument("--requests-per-minute", type=int, help="model calls per minute")
    setting.add_argument("--tokens-per-minute", type=int, help="model tokens per minute")
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
    deploy.add_argument(
        "--keep",
        metavar="FILE",
        type=argparse.FileType("r"),
        help="with --secrets: keep the values of these Secrets (`kubectl get secrets -o yaml`, "
        "- for stdin) and make only the missing ones",
    )
    made = sub.add_parser(
        "secrets",
        aliases=["nats-passwords"],
        help="new random secrets for docker-compose (NATS, Postgres, gateway) as NAME=value",
    )
    made.add_argument(
        "--write", metavar="PATH", type=Path, help="create PATH (mode 0600) instead of printing"
    )
    made.add_argument(
        "--replace", action="store_true", help="replace PATH if it exists (every secret new)"
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
    if args.command == "limits":
        return asyncio.run(_limits(args))
    if args.command in ("secrets", "nats-passwords"):
        from devstack.deploygen import compose_secrets

        if args.write is None:
            print(compose_secrets(), end="")
            return 0
        return _write_secrets(args.write, compose_secrets(), args.replace)
    if args.command == "deploy-config":
        from devstack import deploygen

        if args.secrets:
            keep = None
            if args.keep is not None:
                with args.keep:
                    held = args.keep.read()
                try:
                    keep = deploygen.cluster_secrets(held)
                except ValueError as exc:
                    print(f"--keep {args.keep.name}: {exc}", file=sys.stderr)
                    return 2
            print(deploygen.secrets_manifest(deploygen.deployed_services(), keep), end="")
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
