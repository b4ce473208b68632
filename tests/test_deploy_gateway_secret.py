"""The gateway in a pod: its signing secret comes from the environment (offline).

Its root filesystem is read-only there, so it must never try to create a secret file:
with AGENTBUS_GATEWAY_SECRET set it reads nothing from disk, and without it, where the
state folder cannot be written, it says which setting is missing instead of crashing
on the write.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.auth import load_secret


def unwritable_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # Under a regular file no folder can be made, even as root (the tests may run as root,
    # which a read-only mode would not stop).
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("AGENTBUS_STATE_DIR", str(blocker / "state"))
    return blocker / "state"


def test_a_configured_secret_is_used_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = unwritable_state(tmp_path, monkeypatch)

    assert load_secret("shared-by-every-replica") == "shared-by-every-replica"
    assert not state.exists()


def test_without_one_on_a_read_only_filesystem_it_names_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unwritable_state(tmp_path, monkeypatch)

    with pytest.raises(RuntimeError, match="AGENTBUS_GATEWAY_SECRET"):
        load_secret(None)
