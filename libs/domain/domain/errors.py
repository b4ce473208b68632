"""The one exception the domain raises: a refusal with a code a caller can branch on."""

from __future__ import annotations

from typing import Any

from contracts.common import ErrorCode


class DomainError(Exception):
    """A rule refused the request; `message` is written for a person or a model to act on."""

    def __init__(self, code: ErrorCode | str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = str(code)
        self.message = message
        self.details = details
