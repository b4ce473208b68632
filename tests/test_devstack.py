"""`make up` as a user runs it: the launcher, its embedded servers, a supervised service."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from testkit.probes import wait_for


def demo_turn(n: int, text: str) -> str:
    """A `cmd.llm.turn` of the demo project's chat, as the CLI sends it."""
    return json.dumps(
        {
            "run_id": "demo-run",
            "turn_id": f"demo-turn-{n}",
            "agent_slug": "chat",
            "project_id": "demo",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 200,
        }
    )


def agentbus(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devstack", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def stack_env(tmp_path: Path) -> dict[str, str]:
    # No provider key: tests never reach the internet, and metering runs its offline script.
    unset = ("NATS_URL", "DATABASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    # The gateway's fixed dev port may be taken on a shared machine: use a free one.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {
        **env,
        "AGENTBUS_STATE_DIR": str(tmp_path / "state"),
        "AGENTBUS_LOG_FORMAT": "json",
        "AGENTBUS_GATEWAY_PORT": str(port),
    }


async def test_up_serves_commands_restarts_a_dead_service_and_down_stops_everything(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "devstack", "up"],
        env=stack_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        await wait_for(
            lambda: "agentbus is up" in (tmp_path / "up.log").read_text(),
            timeout=90,
            what="the stack to report it is up",
        )
        stack = json.loads((tmp_path / "state" / "stack.json").read_text())
        assert stack["nats_url"].startswith("nats://127.0.0.1:")
        # each kit service's metrics URL is listed, and answers
        urls = [
            line.split("metrics ", 1)[1].strip()
            for line in (tmp_path / "up.log").read_text().splitlines()
            if line.strip().startswith("metrics http://127.0.0.1:")
        ]
        assert len(urls) >= 5, urls  # every service on the kit (the gateway is not, yet)
        async with httpx.AsyncClient(timeout=10) as http:
            for url in urls:
                assert "agentbus_command_duration_seconds" in (await http.get(url)).text

        opened = agentbus(
            "call",
            "cmd.sessions.open",
            '{"project_id": "demo", "opened_by": "user:me"}',
            env=stack_env,
        )
        assert opened.returncode == 0, opened.stderr
        session_id = json.loads(opened.stdout)["session_id"]
        appended = agentbus(
            "call",
            "cmd.events.append",
            json.dumps(
                {
                    "session_id": session_id,
                    "type": "chat.message",
                    "actor": "user:me",
                    "payload": {"text": "hello from another process"},
                }
            ),
            env=stack_env,
        )
        assert json.loads(appended.stdout)["seq"] == 2
        assert agentbus("ping", "session_events", env=stack_env).returncode == 0
        assert agentbus("ping", "handoff", env=stack_env).returncode == 0
        assert (
            agentbus("ping", "no_such_service", "--timeout", "0.5", env=stack_env).returncode == 1
        )
        refused = agentbus("call", "cmd.events.append", "{oops", env=stack_env)
        assert refused.returncode == 1
        assert json.loads(refused.stdout)["error"]["code"] == "malformed_json"

        answered = agentbus("call", "cmd.llm.turn", demo_turn(1, "hello metering"), env=stack_env)
        assert answered.returncode == 0, answered.stdout
        assert "hello metering" in json.loads(answered.stdout)["content"][0]["text"]
        assert "provider_scripted" in (tmp_path / "up.log").read_text()
        # the operator caps the project's day (as `ops`): the next call is refused, coded
        capped = agentbus("limits", "set", "--project", "demo", "--day-usd", "0", env=stack_env)
        assert capped.returncode == 0, capped.stdout + capped.stderr
        assert json.loads(capped.stdout)["limits"]["micros_per_day"] == 0
        over = agentbus("call", "cmd.llm.turn", demo_turn(2, "once more"), env=stack_env)
        assert json.loads(over.stdout)["error"]["code"] == "budget_exceeded", over.stdout
        shown = agentbus("limits", "show", "demo", env=stack_env)
        assert shown.returncode == 0, shown.stderr
        exhausted = json.loads(shown.stdout)["exhausted"]
        assert [(u["scope"], u["window"]) for u in exhausted] == [("project", "day")]
        # the web client's link, with a token for the demo project, answers
        port = stack_env["AGENTBUS_GATEWAY_PORT"]
        [link] = [
            line.strip()
            for line in (tmp_path / "up.log").read_text().splitlines()
            if line.strip().startswith(f"http://127.0.0.1:{port}/#token=")
        ]
        token = link.split("token=", 1)[1]
        async with httpx.AsyncClient(timeout=10) as http:
            me = await http.get(
                f"http://127.0.0.1:{port}/api/projects/demo",
                headers={"authorization": f"Bearer {token}"},
            )
        assert me.status_code == 200 and me.json()["offline_model"] is True

        children = psutil.Process(up.pid).children()
        [service] = [c for c in children if "session_events" in c.cmdline()]
        service.kill()
        await wait_for(
            lambda: "service_died_restarting" in (tmp_path / "up.log").read_text(),
            what="the supervisor to log the restart",
        )
        listed = await wait_for(
            lambda: (
                (
                    r := agentbus(
                        "call",
                        "cmd.events.list",
                        json.dumps({"session_id": session_id}),
                        env=stack_env,
                    )
                ).returncode
                == 0
                and r
            ),
            timeout=30,
            what="the restarted service to answer",
        )
        # Criativo's plain chat may already have answered the message (seq 3).
        assert [e["seq"] for e in json.loads(listed.stdout)["events"]][:2] == [1, 2]

        pids = [up.pid, *(p.pid for p in psutil.Process(up.pid).children(recursive=True))]
        down = agentbus("down", env=stack_env)
        assert down.stdout.strip() == "stopped"
        assert up.wait(30) == 0
        assert not [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        assert not (tmp_path / "state" / "stack.json").exists()
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGKILL)
        log.close()
