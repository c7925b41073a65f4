"""Errors the HTTP layer turns into status codes."""

from __future__ import annotations

__all__ = ["RequestError"]


class RequestError(Exception):
    """A request that cannot be served: ``status`` 4xx for the client's mistakes, 5xx for ours."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
