"""The session event log: the append-only source of truth of every session."""
