"""metering as a real process for `test_conversation_model.py`: the scripted provider,
writing every request it is sent as one JSON line to `$AGENTBUS_TEST_PROMPTS_PATH`.

That file is the record of what the model read, which the test checks prompt by
prompt. metering itself is untouched: its `main` takes the provider to use (as its
in-process test fixture does), and this module only gives it its script and the
scripted provider that logs (`metering.providers.scripted.LoggingScripted`).
Run with this folder on `PYTHONPATH`: `python -m conversation_model_metering`.
"""

from __future__ import annotations

import os
from pathlib import Path

from metering.app import main
from metering.providers.scripted import LoggingScripted, Script, ScriptStep
from metering.settings import MeteringSettings
from servicekit.runtime import run_service

PROMPTS_ENV = "AGENTBUS_TEST_PROMPTS_PATH"

# Criativo's offline steps, paced so that turns last a few hundred ms and the
# person's messages (0–300 ms apart) land while a turn is still streaming. A message
# saying "RULE" is recorded as a rule citing it; any other is echoed.
SCRIPT = Script(
    steps=[
        ScriptStep(contains="product_brief", responder="criativo_brief", token_delay_ms=5),
        ScriptStep(
            has_tool="emit_artifact",
            contains="RULE",
            after_tool_result=False,
            responder="criativo_rule",
            token_delay_ms=15,
        ),
        ScriptStep(
            has_tool="emit_artifact",
            after_tool_result=True,
            text="Anotei essa regra. O que mais?",
            token_delay_ms=15,
        ),
        ScriptStep(responder="echo", token_delay_ms=15),
    ]
)


if __name__ == "__main__":
    provider = LoggingScripted(SCRIPT, Path(os.environ[PROMPTS_ENV]), prompts=True)
    run_service("metering", main(MeteringSettings(provider="scripted"), provider))
