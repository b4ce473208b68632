"""metering as a real process for `bench/chaos.py`: the scripted provider, appending one
JSON line per provider call to `$AGENTBUS_CHAOS_CALLS_PATH` before it answers.

That file is the fake model's own record of its calls, which the chaos run compares with
metering's `token_usage` rows (`metering.providers.scripted.LoggingScripted` writes it).
metering itself is untouched: its `main` takes the provider (as
`tests/conversation_model_metering.py` does). Run with this folder on `PYTHONPATH`
(only this folder: `bench/` holds scripts named like the services):
`python -m chaos_metering`.
"""

from __future__ import annotations

import os
from pathlib import Path

from metering.app import main
from metering.providers.scripted import (
    BRIEF_STEP,
    PSYCHOLOGIST_STEPS,
    LoggingScripted,
    Script,
    ScriptStep,
)
from metering.settings import MeteringSettings
from servicekit.runtime import run_service

CALLS_ENV = "AGENTBUS_CHAOS_CALLS_PATH"

# The offline demo's steps (metering.providers.scripted.DEFAULT_SCRIPT), except that only
# a message saying "RULE" is recorded as a rule, so a person's rules are known in advance;
# turns last a few hundred ms, so messages typed in a burst land while one streams.
SCRIPT = Script(
    token_delay_ms=10,
    steps=[
        *PSYCHOLOGIST_STEPS,
        BRIEF_STEP,
        ScriptStep(
            has_tool="emit_artifact",
            contains="RULE",
            after_tool_result=False,
            responder="criativo_rule",
        ),
        ScriptStep(
            has_tool="emit_artifact", after_tool_result=True, text="Noted that rule. What else?"
        ),
        ScriptStep(responder="echo"),
    ],
)


if __name__ == "__main__":
    provider = LoggingScripted(SCRIPT, Path(os.environ[CALLS_ENV]))
    run_service("metering", main(MeteringSettings(provider="scripted"), provider))
