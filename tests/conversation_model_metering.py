"""metering as a real process for `test_conversation_model.py`: the scripted provider,
writing every request it is sent as one JSON line to `$AGENTBUS_TEST_PROMPTS_PATH`.

That file is the record of what the model read, which the test checks prompt by
prompt. metering itself is untouched: its `main` takes the provider to use (as its
in-process test fixture does), and this module only wraps the scripted one.
Run with this folder on `PYTHONPATH`: `python -m conversation_model_metering`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from metering.app import MeteringSettings, main
from metering.providers.base import OnText, Progress, ProviderReply, ProviderRequest
from metering.providers.scripted import Script, ScriptedProvider, ScriptStep
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


class RecordingScripted(ScriptedProvider):
    """The scripted provider, appending each request to a JSON-lines file first."""

    def __init__(self, script: Script, path: Path) -> None:
        super().__init__(script)
        self._path = path

    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        line = {
            "agent": request.agent_slug,
            "tools": [t.name for t in request.tools],
            "messages": [m.model_dump(mode="json") for m in request.messages],
        }
        with self._path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
        return await super().complete(request, progress, on_text)


if __name__ == "__main__":
    provider = RecordingScripted(SCRIPT, Path(os.environ[PROMPTS_ENV]))
    run_service("metering", main(MeteringSettings(provider="scripted"), provider))
