"""The I/O plumbing every agentbus service shares."""
