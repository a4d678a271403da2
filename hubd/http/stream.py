"""``GET /v1/events``: the caller's events as Server-Sent Events, resumable with no gap.

Each event's ``id:`` is its feed position, so a reconnecting client's ``Last-Event-ID`` (or
``?after=``) resumes after the last one it got, from any replica: the feed is commit-ordered and
gap-free (docs/api.md, "Events"). A stream reads the feed under the key's wall whenever the
feed's one follower (:class:`~hubd.http.feed.FeedSignal`) says it moved, a page at a time; while
nothing happens it sends a comment every ``HEARTBEAT`` seconds. A reader too slow to take a
page within ``WRITE_TIMEOUT`` is cut off: a stream never holds more than one page for it. A
reader that hung up gives its key's stream slot back within half a second, not at the next
write (:mod:`hubd.http.hangups`): a client that reconnects at once finds its slot free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Final

from aiohttp import web

from hubd.client import Event
from hubd.errors import HubdError
from hubd.http.context import CALLER, HTTP, bounded, streams
from hubd.http.errors import ApiError, from_hubd_error
from hubd.http.values import event_json

__all__ = ["events"]

PAGE: Final = 500
HEARTBEAT: Final = 15.0
WRITE_TIMEOUT: Final = 10.0


async def events(request: web.Request) -> web.StreamResponse:
    caller, state = request[CALLER], request.app[HTTP]
    after_text = request.query.get("after") or request.headers.get("Last-Event-ID")
    allocation_id = request.query.get("allocation_id")
    with streams(state, caller):
        if after_text is None:
            cursor = await bounded(state, caller.client.cursor())
        elif after_text.isdigit() and len(after_text) <= 19:
            cursor = int(after_text)
        else:
            raise ApiError(400, "invalid_request", "after must be a feed position, 0 or more")
        # The feed's position is taken before each page is read: every event up to it had
        # committed by then, so a short page holds them all, and one heard of later is waited
        # for, never taken as read. The first page is read before the answer starts, so a
        # cursor the feed no longer keeps is a plain 410, not a stream that ends at once.
        heard = state.feed.position
        page = await bounded(
            state, caller.client.events_page(after=cursor, allocation_id=allocation_id, limit=PAGE)
        )
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        with state.pages.streaming(caller.tenant, heard):
            await _follow(request, response, page, cursor, heard)
        return response


async def _follow(
    request: web.Request,
    response: web.StreamResponse,
    page: list[Event],
    cursor: int,
    heard: int,
) -> None:
    """Send ``page``, then each page after it as the feed moves, until the API closes, the
    reader goes, or the database fails (said as an ``error`` event: the client resumes)."""
    caller, state = request[CALLER], request.app[HTTP]
    allocation_id = request.query.get("allocation_id")
    session = request.query.get("session")
    loop = asyncio.get_running_loop()
    while not state.closing.is_set():
        chunk = []
        for event in page:
            cursor = event.position
            if session is None or event.session == session:
                chunk.append(f"id: {event.position}\nevent: {event.event}\n")
                chunk.append(f"data: {event_json(event)}\n\n")
        if chunk and not await _send(response, "".join(chunk)):
            break
        if len(page) < PAGE:
            checked = max(cursor, heard)
            quiet_until = loop.time() + HEARTBEAT
            # Woken by the caller's tenant's events only: another tenant's would cost a
            # read of the feed that finds nothing (hubd/http/feed.py).
            while state.feed.position_of(caller.tenant) <= checked and not state.closing.is_set():
                left = quiet_until - loop.time()
                if left <= 0:
                    if not await _send(response, ": heartbeat\n\n"):
                        return
                    quiet_until = loop.time() + HEARTBEAT
                    continue
                with contextlib.suppress(TimeoutError), state.hangups.quiet(request):
                    async with asyncio.timeout(left):
                        await state.feed.moved_past(checked, caller.tenant)
            if state.closing.is_set():
                break
        heard = state.feed.position
        try:
            page = await bounded(
                state,
                state.pages.after(
                    caller.client,
                    caller.tenant,
                    cursor,
                    heard=heard,
                    allocation_id=allocation_id,
                    limit=PAGE,
                ),
            )
        except (ApiError, HubdError) as exc:
            # The answer has begun: say why it ends, then end it; the client resumes.
            await _send(response, f"event: error\ndata: {_reason(exc)}\n\n")
            break


def _reason(exc: Exception) -> str:
    if isinstance(exc, HubdError):
        exc = from_hubd_error(exc)
    assert isinstance(exc, ApiError)
    return json.dumps({"code": exc.code, "message": exc.message})


async def _send(response: web.StreamResponse, text: str) -> bool:
    """Write ``text``; ``False`` when the reader is gone or too slow to take it."""
    try:
        async with asyncio.timeout(WRITE_TIMEOUT):
            await response.write(text.encode())
    except (TimeoutError, ConnectionError):
        return False
    return True
