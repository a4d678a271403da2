"""What every HTTP request can reach: the API's shared state, and who is calling."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Iterator
from typing import Final, TypeVar

import attrs
from aiohttp import web

from hubd.client import Client
from hubd.http.errors import ApiError
from hubd.http.feed import FeedSignal
from hubd.http.hangups import HangUps
from hubd.http.pages import TenantPages
from hubd.store.api_keys import ApiKeyStore

__all__ = ["CALLER", "HTTP", "Caller", "HttpState", "bounded", "streams"]


_T = TypeVar("_T")

GRACE: Final = 2.0
"""Seconds past ``database_timeout`` before a request's work is cancelled: the client's own
bound, which fails it cleanly, comes first."""


@attrs.define(kw_only=True)
class HttpState:
    client: Client
    """Unwalled: an operator's key uses it as is, a tenant's key through ``for_tenant``."""
    keys: ApiKeyStore
    feed: FeedSignal
    pages: TenantPages = attrs.field(factory=TenantPages)
    """Each streaming tenant's recent events, read once for all its streams."""
    max_streams_per_key: int
    database_timeout: float = 10.0
    closing: asyncio.Event = attrs.field(factory=asyncio.Event)
    """Set when the API shuts down: streams and waits answer at once."""
    open_streams: collections.Counter[str] = attrs.field(factory=collections.Counter)
    """Event streams and waits open now, by key id."""
    hangups: HangUps = attrs.field(factory=HangUps)
    """Ends the quiet streams whose readers hung up."""


@attrs.frozen(kw_only=True)
class Caller:
    key_id: str
    tenant: str | None
    """The key's tenant; ``None``: an operator's key, which sees every tenant."""
    client: Client
    """The client to act through: walled into ``tenant`` when there is one."""


HTTP = web.AppKey("hubd_http", HttpState)
CALLER = web.RequestKey("hubd_caller", Caller)
"""The request's :class:`Caller`, set by the authentication middleware."""


async def bounded(state: HttpState, work: Awaitable[_T]) -> _T:
    """``work``'s result, or 503 once it has taken the database's time budget: a database that
    stopped answering (a partition, a dead connection) holds no caller for good. The client
    bounds each statement itself and closes its connection (:class:`hubd.client.Client`'s
    ``timeout``); this is the whole request's bound, a little later, which cancels."""
    try:
        async with asyncio.timeout(state.database_timeout + GRACE):
            return await work
    except TimeoutError:
        raise ApiError(
            503,
            "database_unavailable",
            f"the database did not answer within {state.database_timeout:g} s",
            {"Retry-After": "1"},
        ) from None


@contextlib.contextmanager
def streams(state: HttpState, caller: Caller) -> Iterator[None]:
    """Hold one of the key's ``max_streams_per_key`` stream slots (429 when none is free)."""
    if state.open_streams[caller.key_id] >= state.max_streams_per_key:
        raise ApiError(
            429,
            "too_many_streams",
            f"this key holds {state.max_streams_per_key} streams and waits open already",
            {"Retry-After": "1"},
        )
    state.open_streams[caller.key_id] += 1
    try:
        yield
    finally:
        state.open_streams[caller.key_id] -= 1
        if not state.open_streams[caller.key_id]:
            del state.open_streams[caller.key_id]
