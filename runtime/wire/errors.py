"""Errors the HTTP layers turn into status codes, and the body they answer with."""

from __future__ import annotations

from typing import Any

__all__ = ["RequestError", "error_body"]


class RequestError(Exception):
    """A request that cannot be served: ``status`` 4xx for the client's mistakes, 5xx for ours.

    ``headers`` go on the answer as they are (``Retry-After`` on a 503 for a full queue).
    """

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "code"}}``, for every 4xx and 5xx."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    elif status == 404:
        kind = "not_found_error"
    elif status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "code": status}}
