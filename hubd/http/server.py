"""The HTTP API's listener: an aiohttp application on the daemon's loop.

aiohttp serves it: a maintained HTTP/1.1 server with request size bounds, keep-alive and
streaming responses, where the admin listener's hand-written one (GET only, one request per
connection) would have to grow a parser, bodies and streams. Authentication is one middleware:
``Authorization: Bearer hubd_<id>.<secret>``, checked against the stored hash in constant time
(:class:`~hubd.store.api_keys.ApiKeyStore`); a key never reaches a log, an error or a metric.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Final

import structlog
from aiohttp import web

from hubd.client import Client
from hubd.config import HttpConfig
from hubd.errors import HubdError
from hubd.http.context import CALLER, HTTP, Caller, HttpState, bounded
from hubd.http.errors import ApiError, error_response, from_hubd_error
from hubd.http.feed import FeedSignal
from hubd.http.routes import routes
from hubd.http.stream import events
from hubd.store.api_keys import ApiKeyStore
from hubd.store.database import Database

__all__ = ["MAX_BODY", "HttpApi", "openapi_document", "serving"]

log = structlog.get_logger(__name__)

MAX_BODY: Final = 320 * 1024
"""A request body at most: a spec's 256 KiB of text and the rest of a request."""
MAX_KEY: Final = 200
"""An Authorization header longer than this holds no key of ours."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def openapi_document() -> dict[str, object]:
    """The OpenAPI document of these routes (``hubd/http/openapi.json``)."""
    text = resources.files("hubd.http").joinpath("openapi.json").read_text(encoding="utf-8")
    document: dict[str, object] = json.loads(text)
    return document


async def _openapi(_request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


@web.middleware
async def _answers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Authenticate, then map every error to its JSON answer."""
    try:
        if request.path == "/v1/openapi.json":
            return await handler(request)
        state = request.app[HTTP]
        request[CALLER] = await bounded(state, _caller(request))
        if _waits(request):
            # They bound each of their own reads: waiting is what they are for.
            return await handler(request)
        return await bounded(state, handler(request))
    except ApiError as exc:
        return error_response(exc)
    except HubdError as exc:
        answer = from_hubd_error(exc)
        if answer.status == 500:
            log.warning("http_request_failed", path=request.path, error=str(exc)[:300])
        return error_response(answer)
    except web.HTTPException as exc:
        if exc.status == 413:
            return error_response(
                ApiError(413, "too_large", f"bodies are at most {MAX_BODY} bytes")
            )
        return error_response(
            ApiError(exc.status, _CODES.get(exc.status, "http_error"), exc.reason)
        )


_CODES: Final = {404: "no_route", 405: "method_not_allowed"}


def _waits(request: web.Request) -> bool:
    return request.path == "/v1/events" or request.path.endswith("/wait")


async def _caller(request: web.Request) -> Caller:
    state = request.app[HTTP]
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key or len(key) > MAX_KEY:
        raise ApiError(
            401, "unauthorized", "an API key is required: Authorization: Bearer hubd_…",
            {"WWW-Authenticate": "Bearer"},
        )  # fmt: skip
    scope = await state.keys.check(key.strip())
    if scope is None:
        raise ApiError(
            401, "unauthorized", "the API key is unknown or revoked",
            {"WWW-Authenticate": 'Bearer error="invalid_token"'},
        )  # fmt: skip
    client = state.client if scope.tenant is None else state.client.for_tenant(scope.tenant)
    return Caller(key_id=scope.key_id, tenant=scope.tenant, client=client)


def application(state: HttpState) -> web.Application:
    app = web.Application(middlewares=[_answers], client_max_size=MAX_BODY)
    app[HTTP] = state
    app.add_routes(routes)
    app.router.add_get("/v1/events", events)
    app.router.add_get("/v1/openapi.json", _openapi)
    return app


class HttpApi:
    """The HTTP API, started and stopped by :func:`serving`."""

    def __init__(self, config: HttpConfig, state: HttpState) -> None:
        self.config = config
        self.state = state
        self.port: int | None = None
        """The bound port once started."""
        self._runner = web.AppRunner(application(state), access_log=None, handle_signals=False)
        self._follower: asyncio.Task[None] | None = None

    async def start(self) -> None:
        context = None
        if self.config.tls_cert:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.config.host, self.config.port, ssl_context=context, backlog=512
        )
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self._follower = asyncio.get_running_loop().create_task(
            self.state.feed.run(), name="http-feed"
        )

    async def close(self) -> None:
        self.state.closing.set()
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        await self._runner.cleanup()
        await self.state.hangups.close()
        await self.state.client.close()


@contextlib.asynccontextmanager
async def serving(config: HttpConfig, dsn: str, db: Database) -> AsyncIterator[HttpApi | None]:
    """The HTTP API while the block runs (``None`` when ``[http] listen`` is empty)."""
    if not config.enabled:
        yield None
        return
    # Each statement is bounded by the client, which closes a connection that outlives it: a
    # statement on a connection the network lost is never waited for.
    client = await Client.connect(dsn, max_size=config.pool_size, timeout=config.database_timeout)
    api = HttpApi(
        config,
        HttpState(
            client=client,
            keys=ApiKeyStore(db),
            feed=FeedSignal(client),
            max_streams_per_key=config.max_streams_per_key,
            database_timeout=config.database_timeout,
        ),
    )
    try:
        await api.start()
    except BaseException:
        await api.close()
        raise
    log.info("http_api_listening", listen=config.listen, port=api.port, tls=bool(config.tls_cert))
    try:
        yield api
    finally:
        await api.close()
