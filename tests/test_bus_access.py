"""The access the contracts declare matches what the services really do (no drift)."""

from __future__ import annotations

from contracts import catalog
from criativo.app import inputs_spec
from criativo.settings import CriativoSettings
from handoff.app import CLOSINGS
from psychologist.app import closings_spec
from psychologist.settings import PsychologistSettings
from servicekit.consumer import ConsumerSpec


def declared(spec: ConsumerSpec) -> catalog.Durable:
    return catalog.Durable(spec.durable, spec.stream)


def test_every_durable_consumer_of_a_service_is_declared_for_it() -> None:
    wired = {
        "criativo": [declared(inputs_spec(CriativoSettings()))],
        "handoff": [declared(CLOSINGS)],
        "psychologist": [declared(closings_spec(PsychologistSettings()))],
    }
    for access in catalog.ACCESS:
        assert list(access.durables) == wired.get(access.service, []), access.service


def test_every_service_of_the_catalog_has_a_declared_access() -> None:
    serving = {c.service for c in catalog.COMMANDS}
    assert serving <= {a.service for a in catalog.ACCESS}
