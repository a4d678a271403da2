"""The allocation routes: create, get, list, release, extend, touch, and wait (docs/http.md).

Each calls the ``hubd_v1`` function an application role would, on a client walled into the
key's tenant (:meth:`hubd.client.Client.for_tenant`); an operator's key, which sees every
tenant, calls them unwalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, Final

from aiohttp import web

from hubd.client import AllocationInfo, Client
from hubd.http.context import CALLER, HTTP, HttpState, bounded, streams
from hubd.http.errors import ApiError
from hubd.http.values import NewAllocation, allocation_json, seconds_field, text_field

__all__ = ["routes"]

MAX_WAIT: Final = 300.0
"""The longest a wait may last, in seconds; a longer ``timeout`` is cut to it."""
LIST_LIMIT: Final = 1000
STATUSES: Final = frozenset(
    {"pending", "provisioning", "allocated", "replacing", "releasing", "released", "failed",
     "destroy_failed"}
)  # fmt: skip

routes = web.RouteTableDef()


@routes.post("/v1/allocations")
async def create(request: web.Request) -> web.Response:
    caller = request[CALLER]
    wanted = NewAllocation.from_body(
        await _json(request), idempotency_key=request.headers.get("Idempotency-Key")
    )
    if caller.tenant is not None and wanted.tenant not in (None, caller.tenant):
        raise ApiError(403, "forbidden", f"this key may request only for tenant {caller.tenant!r}")
    info = await caller.client.request(
        wanted.provisioner,
        tenant=wanted.tenant,
        session=wanted.session,
        spec=wanted.spec,
        idempotency_key=wanted.idempotency_key,
        ready_when=wanted.ready_when,
        lifetime=wanted.lifetime,
        idle_timeout=wanted.idle_timeout,
    )
    return _allocation(info, status=201)


@routes.get("/v1/allocations")
async def list_allocations(request: web.Request) -> web.Response:
    caller = request[CALLER]
    status = request.query.get("status")
    if status is not None and status not in STATUSES:
        raise ApiError(400, "invalid_request", f"status must be one of {sorted(STATUSES)}")
    limit = _integer(request.query.get("limit", "100"), "limit", 1, LIST_LIMIT)
    rows = await caller.client.list(
        status=status, session=request.query.get("session"), limit=limit
    )
    return web.json_response({"allocations": [allocation_json(info) for info in rows]})


@routes.get("/v1/allocations/{id}")
async def get(request: web.Request) -> web.Response:
    return _allocation(await request[CALLER].client.get(request.match_info["id"]))


@routes.post("/v1/allocations/{id}/release")
async def release(request: web.Request) -> web.Response:
    body = await _json(request, empty_ok=True)
    reason = text_field(body, "reason") or "released through the HTTP API"
    client: Client = request[CALLER].client
    return _allocation(await client.release(request.match_info["id"], reason=reason[:500]))


@routes.post("/v1/allocations/{id}/extend")
async def extend(request: web.Request) -> web.Response:
    lifetime = seconds_field(await _json(request), "lifetime_s")
    if lifetime is None:
        raise ApiError(400, "invalid_request", "lifetime_s is required")
    return _allocation(await request[CALLER].client.extend(request.match_info["id"], lifetime))


@routes.post("/v1/allocations/{id}/touch")
async def touch(request: web.Request) -> web.Response:
    return _allocation(await request[CALLER].client.touch(request.match_info["id"]))


@routes.get("/v1/allocations/{id}/wait")
async def wait(request: web.Request) -> web.Response:
    """Answer as soon as the allocation is ready (``until=ready``, the default) or has ended
    (``until=ended``; a release under way counts as ending for ``ready``), or at ``timeout``
    seconds with its state then; ``Hubd-Wait`` says which."""
    caller, state = request[CALLER], request.app[HTTP]
    until = request.query.get("until", "ready")
    if until not in ("ready", "ended"):
        raise ApiError(400, "invalid_request", "until must be 'ready' or 'ended'")
    timeout = min(_number(request.query.get("timeout", "30"), "timeout"), MAX_WAIT)
    allocation_id = request.match_info["id"]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    with streams(state, caller):
        while True:
            with state.feed.watching(allocation_id) as woken:
                info = await bounded(state, caller.client.get(allocation_id))
                outcome = _outcome(info, until)
                left = deadline - loop.time()
                if outcome is None and left > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(left):
                            await _either(woken, state)
                    if not state.closing.is_set():
                        continue
                    outcome = "closing"
            return _allocation(info, headers={"Hubd-Wait": outcome or "timeout"})


def _outcome(info: AllocationInfo, until: str) -> str | None:
    if info.terminal:
        return "ended"
    if until == "ready" and info.ready:
        return "ready"
    if until == "ready" and info.status == "releasing":
        return "ended"
    return None


async def _either(woken: asyncio.Event, state: HttpState) -> None:
    """Until ``woken`` or the API's shutdown."""
    waits = {asyncio.ensure_future(woken.wait()), asyncio.ensure_future(state.closing.wait())}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for each in waits:
            each.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def _json(request: web.Request, *, empty_ok: bool = False) -> dict[str, Any]:
    """The request's body as a JSON object (``{}`` for none where ``empty_ok``). Its size was
    bounded before it was read (the application's ``client_max_size``)."""
    text = await request.text()
    if not text.strip():
        if empty_ok:
            return {}
        raise ApiError(400, "invalid_request", "a JSON object body is required")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        raise ApiError(400, "invalid_request", "the body is not JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request", "the body must be a JSON object")
    return body


def _allocation(
    info: AllocationInfo, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(allocation_json(info), status=status, headers=headers)


def _integer(text: str, name: str, low: int, high: int) -> int:
    if not text.isdigit() or not low <= int(text) <= high:
        raise ApiError(400, "invalid_request", f"{name} must be a whole number {low} to {high}")
    return int(text)


def _number(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value != value:  # noqa: PLR0124 -- NaN is not a number of seconds
        raise ApiError(400, "invalid_request", f"{name} must be a number of seconds, 0 or more")
    return value
