"""Handoffs between agents and the agent activation rule (ADR 0008, ADR 0182)."""
