"""The agent harness: ToolLoop, tools, hooks and the metering client (issue 4).

Agents always run inside the harness, and the harness never talks to an LLM
provider directly: only the metering service does.
"""
