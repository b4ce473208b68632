"""The agentbus wire contract: every message model, subject and stream.

Services import from here; nothing else defines a message shape or writes a
subject string.
"""
