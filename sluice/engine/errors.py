"""Errors the engine raises to its callers; the server maps them to HTTP statuses."""
from __future__ import annotations

from typing import Optional


class EngineError(Exception):
    pass


class RequestRejected(EngineError):
    """The request cannot be accepted (raised before any output is produced)."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        code: Optional[str] = None,
        param: Optional[str] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code
        self.param = param
        self.retry_after = retry_after


class EngineDeadError(EngineError):
    """The engine loop failed; no request can make progress any more."""
