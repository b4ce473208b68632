"""The pure rules of agentbus: inputs in, a decision out. No I/O, clock, uuids or asyncio."""
