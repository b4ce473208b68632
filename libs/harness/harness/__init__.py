"""The agent harness: ToolLoop, tools, hooks and the metering client.

Agents always run inside the harness, and the harness never talks to an LLM
provider directly: only the metering service does (ADR 0008 decision 2).
"""

from harness.client import MeteringClient, StreamSilent, TurnLost
from harness.loop import LoopContext, LoopResult, LoopStatus, ToolLoop, TurnIds
from harness.tools import Halt, PostToolHook, PreToolHook, Tool, ToolResult

__all__ = [
    "Halt",
    "LoopContext",
    "LoopResult",
    "LoopStatus",
    "MeteringClient",
    "PostToolHook",
    "PreToolHook",
    "StreamSilent",
    "Tool",
    "ToolLoop",
    "ToolResult",
    "TurnIds",
    "TurnLost",
]
