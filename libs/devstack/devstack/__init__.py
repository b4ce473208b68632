"""The `agentbus` launcher and CLI: above every service, imported by none."""
