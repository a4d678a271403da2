"""The handshake's admission: websockets' ``process_request``, the asyncio shell around the
decisions of :mod:`hubd.server.handshake`.

Authentication happens here, before the upgrade, so an unauthenticated peer never holds an open
websocket: one batched statement (:mod:`hubd.server.batching`, on a pool of its own) checks the
handshake's credentials and, only where they open its allocation's identity, records the
connection; the answer is the protocol's own check, in constant time, on the identity that
statement read. An allocation that keeps reconnecting is refused with 429 and ``Retry-After``,
after its identity was checked and with nothing written.
"""

from __future__ import annotations

import asyncio
import http
from collections.abc import Collection
from typing import Any

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from hubd.errors import BatchFull, StoreError
from hubd.logs import Sampler
from hubd.redaction import describe_error, scrub
from hubd.server.batching import Batcher
from hubd.server.connection import SidecarConnection
from hubd.server.handshake import (
    UNAUTHORIZED,
    HandshakeRequest,
    Rejection,
    authorize,
    check_origin,
    parse_request,
    unavailable,
)
from hubd.server.limits import BucketMap, ListenerLimits
from hubd.server.router import SocketRouter
from hubd.server.slots import SourceGate
from hubd.server.wire import ServerStats, note, remote_of
from hubd.store.connection_values import Admission, Admitted, RecordOutcome, SidecarIdentity
from hubd.tokens import hash_token, new_reconnect_secret

__all__ = ["Admitter"]

log = structlog.get_logger(__name__)


class Admitter:
    """Decides every handshake before the upgrade: admitted (authenticated, its connection
    recorded, handed to the router) or refused with a status."""

    def __init__(
        self,
        *,
        router: SocketRouter,
        admissions: Batcher[Admission, Admitted],
        lookups: Batcher[str, SidecarIdentity],
        gate: SourceGate[SidecarConnection],
        limits: ListenerLimits,
        stats: ServerStats,
        sampler: Sampler,
        allowed_origins: Collection[str],
        retry_after: int,
    ) -> None:
        self._router = router
        self._admissions = admissions
        # Handshakes of an allocation whose reconnect budget is spent are only looked up (see
        # _too_often): nothing is written for them.
        self._lookups = lookups
        self._gate = gate
        self._stats = stats
        self._sampler = sampler
        self._allowed_origins = frozenset(allowed_origins)
        self._retry_after = retry_after
        self._reconnects = BucketMap(
            limits.reconnect_rate, limits.reconnect_burst, limits.max_tracked
        )

    async def process_request(
        self, connection: ServerConnection, request: Request
    ) -> Response | None:
        """websockets' hook: ``None`` lets the upgrade go on, a response refuses it."""
        assert isinstance(connection, SidecarConnection)
        self._stats.handshakes_in_progress += 1
        try:
            return await self._authenticate(connection, request)
        except Exception as exc:  # noqa: BLE001 -- websockets would log a traceback instead
            # No traceback: its frames could quote the request's headers, the token among
            # them. The scrubbed message and the type locate the bug well enough.
            log.error(  # noqa: TRY400
                "handshake_failed", error=describe_error(exc)
            )
            return self._reject(connection, Rejection(status=500, reason="internal error"), None)
        finally:
            self._stats.handshakes_in_progress -= 1
            connection.handshake_over()

    async def _authenticate(
        self, connection: SidecarConnection, request: Request
    ) -> Response | None:
        parsed = parse_request(request.path, request.headers)
        if isinstance(parsed, Rejection):
            return self._reject(connection, parsed, None)
        rejection = check_origin(parsed.origin, self._allowed_origins)
        if rejection is not None:
            return self._reject(connection, rejection, parsed)
        now = asyncio.get_running_loop().time()
        if not self._reconnects.available(parsed.allocation_id, now):
            return await self._too_often(connection, parsed, now)
        # v2: a fresh secret per connection, the only credential that opens the next one. Only
        # its digest leaves this listener other than in the welcome itself.
        secret = new_reconnect_secret() if parsed.version == 2 else None
        secret_hash = hash_token(secret) if secret is not None else None
        entry = self._router.expect(connection, parsed, remote=remote_of(connection))
        admission = Admission(
            connection_id=entry.connection_id,
            target=entry.target,
            sidecar_id=parsed.sidecar_id,
            version=parsed.version,
            token_hash=hash_token(parsed.token),
            presented_hash=hash_token(parsed.secret) if parsed.secret is not None else None,
            secret_hash=secret_hash,
        )
        try:
            admitted = await self._admissions.request(admission)
        except (StoreError, TimeoutError) as exc:
            # A statement that failed or was given up on may still have committed.
            self._router.abandon(entry, written=False if isinstance(exc, BatchFull) else None)
            return self._unknown(connection, parsed, exc)
        except BaseException:
            self._router.abandon(entry, written=None)
            raise
        if admitted is None:  # pragma: no cover -- admit_many answers every admission
            self._router.abandon(entry, written=None)
            return self._reject(connection, unavailable(self._retry_after), parsed)
        # The answer is the protocol's check, in constant time, on the identity the statement
        # read; the statement wrote only where the same check, made there, admitted it.
        rejection = authorize(parsed, admitted.identity)
        record = admitted.record
        if (rejection is None) != (record is not None):
            log.error(
                "handshake_checks_disagree",
                allocation_id=parsed.allocation_id,
                listener=rejection is None,
                statement=record is not None,
            )
        if rejection is not None or record is None:
            written = record is not None and record.outcome is RecordOutcome.RECORDED
            self._router.abandon(entry, written=written)
            return self._reject(connection, rejection or UNAUTHORIZED, parsed)
        # Counted only once authenticated: anyone may know an allocation id, and spending its
        # budget must take its token. A token holder reconnecting in a loop is slowed to the
        # bucket's rate, each reconnect being a record write and a ledger row. Handshakes of
        # one allocation admitted together may spend a little more than the bucket held.
        self._reconnects.take(parsed.allocation_id, now)
        self._router.admitted(entry, record, secret_hash=secret_hash)
        connection.hubd_entry = entry
        connection.hubd_secret = secret
        connection.hubd_served = record.served
        return None

    async def _too_often(
        self, connection: SidecarConnection, parsed: HandshakeRequest, now: float
    ) -> Response:
        """The allocation's reconnect budget is spent: 429 for a handshake that authenticates
        (checked against its identity, nothing written), the usual refusal for one that
        does not."""
        try:
            identity = await self._lookups.request(parsed.allocation_id)
        except (StoreError, TimeoutError) as exc:
            return self._unknown(connection, parsed, exc)
        rejection = authorize(parsed, identity)
        if rejection is not None:
            return self._reject(connection, rejection, parsed)
        wait = max(1, round(self._reconnects.wait(parsed.allocation_id, now) + 0.5))
        return self._reject(
            connection,
            Rejection(status=429, reason="reconnecting too often", retry_after=wait),
            parsed,
        )

    def _unknown(
        self, connection: SidecarConnection, parsed: HandshakeRequest, exc: Exception
    ) -> Response:
        """The identity could not be checked (or the connection recorded): 503, never 401."""
        log.warning(
            "sidecar_identity_unknown",
            allocation_id=parsed.allocation_id,
            error_type=type(exc).__name__,
        )
        return self._reject(connection, unavailable(self._retry_after), parsed)

    def _reject(
        self,
        connection: SidecarConnection,
        rejection: Rejection,
        parsed: HandshakeRequest | None,
    ) -> Response:
        self._stats.rejected[rejection.status] += 1
        if rejection.status < 500 and rejection.status != 429:
            # The peer got something wrong: its address spends from its failure budget.
            self._gate.failed(connection.source, asyncio.get_running_loop().time())
        context: dict[str, Any] = {"status": rejection.status, "reason": rejection.reason}
        if parsed is not None:
            context.update(
                allocation_id=parsed.allocation_id,
                # Unauthenticated and free-form: a token pasted into the wrong header must not
                # reach the log through it.
                sidecar_id=scrub(parsed.sidecar_id),
                generation=parsed.generation,
            )
        note(
            self._sampler,
            "handshake_rejected",
            f"rejected-{rejection.status}",
            connection,
            **context,
        )
        response = connection.respond(http.HTTPStatus(rejection.status), rejection.reason + "\n")
        if rejection.retry_after is not None:
            response.headers["Retry-After"] = str(rejection.retry_after)
        return response
