"""Upgrades apply cleanly: a Job's name carries what it runs (offline).

A Job's pod template is immutable, so `kubectl apply` of a changed Job under the name
of one that still exists is refused. Each migration Job is named by a hash of its spec,
the service's migration set (servicekit's tables, then its own: names and contents),
its version and the versions of the code it runs; the provisioning Job by its spec, the
stream and bucket declarations and its code's versions. A new release is a new Job
beside the old one; the same release is the same Job, which applies unchanged.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from contracts import streams
from devstack.deploycheck import build
from devstack.deploygen import Deployed, deployed_services, jobs, migration_job, provision_job

ROOT = Path(__file__).resolve().parent.parent
HASHED = re.compile(r"^(?P<base>.+)-[0-9a-f]{10}$")


def name(job: dict[str, Any]) -> str:
    value: str = job["metadata"]["name"]
    return value


def handoff() -> Deployed:
    [service] = [s for s in deployed_services() if s.name == "handoff"]
    return service


def migration_package(root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """An importable package of migrations of its own, as a service's is."""
    package = f"upgrade_probe_{uuid.uuid4().hex[:8]}"
    folder = root / package
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "0001_first.sql").write_text("CREATE TABLE first (id bigint PRIMARY KEY);\n")
    monkeypatch.syspath_prepend(str(root))
    return package, folder


def test_a_new_migration_set_is_a_new_job_and_the_same_set_the_same_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package, folder = migration_package(tmp_path, monkeypatch)
    service = replace(handoff(), migrations=(package,))

    first = name(migration_job(service))
    assert name(migration_job(service)) == first
    match = HASHED.match(first)
    assert match is not None and match["base"] == "migrate-handoff"

    (folder / "0002_second.sql").write_text("ALTER TABLE first ADD COLUMN note text;\n")
    second = name(migration_job(service))
    assert second != first
    assert HASHED.match(second) is not None

    # a file's content, not only its name
    (folder / "0002_second.sql").write_text("ALTER TABLE first ADD COLUMN other text;\n")
    assert name(migration_job(service)) not in {first, second}

    # content, not history: the same set again is the same Job
    (folder / "0002_second.sql").unlink()
    assert name(migration_job(service)) == first
    # what selects a service's Jobs across releases stays put
    assert migration_job(service)["metadata"]["labels"]["app.kubernetes.io/name"] == (
        "migrate-handoff"
    )


def test_a_new_version_is_a_new_migration_job() -> None:
    service = handoff()
    bumped = {**dict(service.code_versions), "agentbus-servicekit": "9.9.9"}

    assert name(migration_job(replace(service, version="9.9.9"))) != name(migration_job(service))
    assert name(migration_job(replace(service, code_versions=tuple(bumped.items())))) != name(
        migration_job(service)
    )
    assert name(migration_job(replace(service))) == name(migration_job(service))


def test_new_stream_declarations_or_a_new_version_are_a_new_provisioning_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = name(provision_job())
    assert name(provision_job()) == before
    match = HASHED.match(before)
    assert match is not None and match["base"] == "agentbus-provision"

    longer = replace(streams.EVENTS, max_age_seconds=streams.EVENTS_MAX_AGE_SECONDS * 2)
    with monkeypatch.context() as m:
        m.setattr(streams, "ALL", [longer, *streams.ALL[1:]])
        assert name(provision_job()) != before
    with monkeypatch.context() as m:
        m.setattr(streams, "BUCKETS", [replace(streams.LEASES, ttl_seconds=30.0)])
        assert name(provision_job()) != before
    with monkeypatch.context() as m:
        m.setattr(jobs, "version", lambda distribution: "9.9.9")
        assert name(provision_job()) != before
    assert name(provision_job()) == before


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_every_applied_job_is_named_by_its_content_and_referred_to_by_no_name(
    overlay: str,
) -> None:
    docs = build(ROOT / "deploy" / "k8s" / "overlays" / overlay)
    jobs = [d for d in docs if d["kind"] == "Job"]
    others = json.dumps([d for d in docs if d["kind"] != "Job"])

    assert {j["metadata"]["labels"]["app.kubernetes.io/name"] for j in jobs} == {
        "agentbus-provision",
        *(f"migrate-{s.dns}" for s in deployed_services() if s.schema is not None),
    }
    for job in jobs:
        match = HASHED.match(name(job))
        assert match is not None, name(job)
        assert match["base"] == job["metadata"]["labels"]["app.kubernetes.io/name"]
        # the policies select Jobs by label: a new name needs no other change
        assert name(job) not in others
        # the Jobs of past releases do not pile up
        assert 0 < job["spec"]["ttlSecondsAfterFinished"] <= 86400
