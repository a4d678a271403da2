"""Every HTTP error: a status, a stable ``code`` and a message, as one JSON body.

The application API's errors (its SQLSTATEs, :data:`hubd.errors.API_SQLSTATES`) reach the HTTP
layer as :mod:`hubd.errors` classes through the client; this maps each class to its status once.
"""

from __future__ import annotations

import json
import math
from typing import Final

from aiohttp import web

from hubd.errors import (
    AllocationNotFound,
    DatabaseUnavailable,
    EventCursorExpired,
    HubdError,
    IdempotencyConflict,
    InvalidRequest,
    PoolEmpty,
    QuotaExceeded,
)

__all__ = ["ApiError", "error_response", "from_hubd_error"]

# Most specific first: IdempotencyConflict is an InvalidRequest too.
_STATUSES: Final[tuple[tuple[type[HubdError], int, str], ...]] = (
    (IdempotencyConflict, 409, "idempotency_conflict"),
    (InvalidRequest, 400, "invalid_request"),
    (AllocationNotFound, 404, "not_found"),
    (EventCursorExpired, 410, "cursor_expired"),
    (QuotaExceeded, 429, "quota_exceeded"),
    (PoolEmpty, 503, "pool_empty"),
    (DatabaseUnavailable, 503, "database_unavailable"),
)


class ApiError(Exception):
    """An error answered as is: ``status``, ``code``, ``message`` and extra headers."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def from_hubd_error(exc: HubdError) -> ApiError:
    """The answer to ``exc``: its mapped status and code; any other store error is a 500 whose
    message says no more than that (its text may name internals)."""
    for kind, status, code in _STATUSES:
        if isinstance(exc, kind):
            headers = {}
            if isinstance(exc, QuotaExceeded | PoolEmpty):
                wait = exc.retry_after
                headers["Retry-After"] = str(max(1, math.ceil(wait if wait is not None else 1)))
            elif isinstance(exc, DatabaseUnavailable):
                headers["Retry-After"] = "1"
            return ApiError(status, code, str(exc), headers)
    return ApiError(500, "internal", "the request failed inside hubd; its log says why")


def error_response(error: ApiError) -> web.Response:
    body = {"error": {"code": error.code, "message": error.message}}
    return web.Response(
        status=error.status,
        text=json.dumps(body),
        content_type="application/json",
        headers=error.headers,
    )
