"""What a running daemon is made of: the parts, built once the database is open, in one record.

The parts that need no I/O are built first; the record is complete once the sidecar listener
has bound its port, since the URL sidecars are told to dial names it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import attrs
import structlog

from hubd.config import Config
from hubd.daemon.admin import AdminServer
from hubd.daemon.counting import AllocationCounts
from hubd.daemon.exits import ExitWatch
from hubd.daemon.fdlimit import plan_descriptors, raise_open_file_limit
from hubd.daemon.metrics import Metrics
from hubd.daemon.wakeups import NotificationListener
from hubd.errors import ConfigError
from hubd.plugins.protocol import Provisioner, WatchesSidecars
from hubd.reconciler.engine import Reconciler
from hubd.reconciler.settings import Hook, ReconcilerSettings
from hubd.routing import ConnectionEvents
from hubd.server.limits import ListenerLimits
from hubd.server.listener import SidecarServer
from hubd.server.router import SocketRouter
from hubd.store import AllocationStore, Database, LedgerStore, Status, connect_database
from hubd.store.channels import (
    CONNECTED_CHANNEL,
    HANDOVER_CHANNEL,
    SOCKETS_CHANNEL,
    NoticeKey,
    parse_connected_payload,
    parse_handover_payload,
    parse_sockets_payload,
)
from hubd.store.connections import ConnectionStore
from hubd.store.counts import metric_counts
from hubd.store.database import connections_opened
from hubd.store.inputs import ReplacementLimit
from hubd.store.instances import InstanceStore
from hubd.store.migrate import apply_migrations

__all__ = [
    "Listening",
    "Running",
    "listen_error",
    "listening",
    "new_instance_id",
    "opened_database",
    "wake_listener",
]

log = structlog.get_logger(__name__)

COUNT_TIMEOUT = 2.0
"""Seconds a scrape waits for the allocation counts before it renders the last ones."""


def listen_error(key: str, listen: str, exc: OSError) -> ConfigError:
    """One line for a listener that cannot bind: the key, the address, and what to set."""
    variable = "HUBD_" + key.upper().replace(".", "_")
    fix = f"set {variable}=host:port (port 0: any free one) or {key} in the config"
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(f"{key} {listen} is in use — another hubd? {fix}")
    return ConfigError(f"{key} {listen}: cannot listen: {exc.strerror or exc} — {fix}")


def new_instance_id() -> str:
    host = socket.gethostname().split(".")[0][:32] or "host"
    return f"in_{host}_{os.getpid()}_{os.urandom(3).hex()}"


@contextlib.asynccontextmanager
async def opened_database(dsn: str, config: Config) -> AsyncIterator[Database]:
    """The pools, on a migrated schema; closed on the way out."""
    db = await connect_database(
        dsn,
        pool_size=config.database.pool_size,
        command_timeout=config.reconciler.operation_timeout,
    )
    try:
        async with db.connection("migrate") as conn:
            applied = await apply_migrations(conn)
        if applied:
            log.info("schema_migrated", applied=[m.name for m in applied])
        yield db
    finally:
        await db.close()


@attrs.frozen(kw_only=True)
class Listening:
    """The parts that exist before the sidecar listener binds its port."""

    db: Database
    dsn: str
    instance_id: str
    instances: InstanceStore
    connections: ConnectionStore
    router: SocketRouter
    server: SidecarServer

    @classmethod
    def build(
        cls,
        config: Config,
        db: Database,
        dsn: str,
        instance_id: str,
        *,
        notice_key: NoticeKey,
        ready_on_connect: bool,
        events: ConnectionEvents | None = None,
    ) -> Listening:
        """``notice_key``: the database's key for the allocation tags of its notifications
        (read once at start, :func:`~hubd.store.channels.read_notice_key`).
        ``ready_on_connect``: no on-ready hook runs, so a connect may make its parked
        allocation ready itself (see the ``record`` statement). ``events`` hears of each
        socket's welcome and loss (the daemon's metrics)."""
        rc = config.reconciler
        connections = ConnectionStore(
            db, instance_id=instance_id, ready_on_connect=ready_on_connect
        )
        router = SocketRouter(
            connections,
            notice_key=notice_key,
            instance_ttl=config.instance.ttl,
            connect_timeout=rc.connect_timeout,
            event_timeout=rc.operation_timeout,
            events=events,
        )
        limits = ListenerLimits(max_connections=config.server.max_connections)
        plan = plan_descriptors(
            raise_open_file_limit()[0],
            requested=limits.max_connections,
            # The pools and the wake-up listener's own connection.
            pool_connections=connections_opened(config.database.pool_size) + 1,
        )
        if plan.too_low:
            log.warning(
                "open_file_limit_low",
                limit=plan.limit,
                reserved=plan.reserved,
                max_connections=plan.max_connections,
                wanted=plan.requested,
                hint="raise LimitNOFILE= (or ulimit -n) so every sidecar socket fits, or lower "
                "server.max_connections",
            )
        server = SidecarServer.from_config(
            config.server,
            router=router,
            connections=connections,
            limits=limits,
            max_connections=plan.max_connections,
        )
        return cls(
            db=db,
            dsn=dsn,
            instance_id=instance_id,
            instances=InstanceStore(db),
            connections=connections,
            router=router,
            server=server,
        )


@contextlib.asynccontextmanager
async def listening(parts: Listening, config: Config) -> AsyncIterator[str]:
    """The sidecar listener, bound; yields the URL sidecars are told to dial."""
    try:
        await parts.server.start()
    except OSError as exc:
        raise listen_error("server.listen", config.server.listen, exc) from None
    try:
        yield config.server.public_url or config.server.public_url_for(parts.server.port)
    finally:
        await parts.server.close()


def wake_listener(
    *,
    dsn: str,
    db: Database,
    router: SocketRouter,
    metrics: Metrics,
    on_wake: Callable[[], None],
    on_reconnected: Callable[[], None],
    poll_interval: float,
    on_taken: Callable[[], None] = lambda: None,
) -> NotificationListener:
    """The LISTEN connection, wired to ``router``'s repair: a sidecar connected on a peer
    resolves the waits here; a fence or a retirement closes the sockets it names. Both name
    the allocation by its tag, which the router turns back into an id only for what it
    holds, and a payload the database's key does not authenticate is dropped and counted:
    any role may send on these channels."""
    repair, key = router.repair, router.notice_key

    def on_connected(payload: str) -> None:
        notice = parse_connected_payload(payload, key)
        if notice is None:
            metrics.notices_forged.labels(CONNECTED_CHANNEL).inc()
            return
        before = repair.remote_closes
        repair.notice_connected(notice)
        metrics.remote_closes.inc(repair.remote_closes - before)

    def on_sockets(payload: str) -> None:
        control = parse_sockets_payload(payload, key)
        if control is None:
            metrics.notices_forged.labels(SOCKETS_CHANNEL).inc()
            return
        before = repair.remote_closes
        repair.apply_control(control)
        metrics.remote_closes.inc(repair.remote_closes - before)

    def on_handover(payload: str) -> None:
        if parse_handover_payload(payload, key) is None:
            metrics.notices_forged.labels(HANDOVER_CHANNEL).inc()
            return
        router.handover.heard()
        # A member left its pool: the pools refill now, not at their next turn.
        on_taken()

    return NotificationListener(
        dsn=dsn,
        db=db,
        on_wake=on_wake,
        on_connected=on_connected,
        on_sockets=on_sockets,
        on_handover=on_handover,
        on_reconnected=on_reconnected,
        selfcheck_interval=max(poll_interval * 2, 5.0),
        on_selfcheck_failure=metrics.selfcheck_failures.inc,
    )


@attrs.frozen(kw_only=True)
class Running:
    """Everything a serving daemon holds, complete once the sidecar listener is bound."""

    parts: Listening
    hub_ws_url: str
    provisioners: Mapping[str, Provisioner]
    store: AllocationStore
    ledger: LedgerStore
    reconciler: Reconciler
    listener: NotificationListener
    admin: AdminServer
    exits: tuple[ExitWatch, ...] = ()
    """A loop for each provisioner that reports its dead sidecars."""

    @property
    def db(self) -> Database:
        return self.parts.db

    @property
    def router(self) -> SocketRouter:
        return self.parts.router

    @classmethod
    def build(
        cls,
        config: Config,
        parts: Listening,
        *,
        hub_ws_url: str,
        provisioners: Mapping[str, Provisioner],
        metrics: Metrics,
        on_ready: Hook | None,
        on_wake: Callable[[], None],
        on_reconnected: Callable[[], None],
        readiness: Callable[[], str | None],
        readiness_detail: Callable[[], Sequence[str]] = lambda: (),
        on_notified: Callable[[], None] | None = None,
        on_taken: Callable[[], None] = lambda: None,
    ) -> Running:
        rc, db, router = config.reconciler, parts.db, parts.router
        store = AllocationStore(db, instance_id=parts.instance_id)
        ledger = LedgerStore(db, instance_id=parts.instance_id)
        reconciler = Reconciler(
            store=store,
            ledger=ledger,
            connections=parts.connections,
            provisioners=provisioners,
            router=router,
            hub_ws_url=hub_ws_url,
            settings=ReconcilerSettings(
                lease_duration=rc.lease_duration,
                connect_timeout=rc.connect_timeout,
                restart_window=rc.restart_window,
                operation_timeout=rc.operation_timeout,
                max_concurrent_claims=rc.max_concurrent_claims,
                max_claims_per_tenant=rc.max_claims_per_tenant,
                automatic_replacement_recovery=rc.automatic_replacement_recovery,
                replacement_limit=ReplacementLimit(rc.replacement_limit, rc.replacement_window),
                instance_ttl=config.instance.ttl,
                ready_when={p.id: p.ready_when for p in config.provisioners},
            ),
            on_ready=on_ready,
            observer=metrics,
            on_settled=on_wake,
        )
        metrics.bind_gauges(
            active_claims=lambda: reconciler.active_claims,
            queue_depth=lambda: reconciler.queue_depth,
            connected_sidecars=lambda: router.connection_count,
        )
        metrics.bind_listener(parts.server.stats, parts.server.gate)
        metrics.bind_batchers(
            lambda: [
                parts.server.admissions,
                parts.server.lookups,
                *router.batchers,
                *store.pipelines.values(),
            ]
        )

        listener = wake_listener(
            dsn=parts.dsn,
            db=db,
            router=router,
            metrics=metrics,
            on_wake=on_notified or on_wake,
            on_reconnected=on_reconnected,
            poll_interval=rc.poll_interval,
            on_taken=on_taken,
        )
        statuses = [str(status) for status in Status]

        async def count() -> Mapping[Status, int]:
            # The per-tenant counts ride in the statuses' transaction, at their pace.
            found = await metric_counts(db, tenant_labels=config.admin.tenant_labels)
            metrics.set_tenant_counts(found.tenants)
            metrics.pools.set_stats(found.pools)
            return found.statuses

        counts = AllocationCounts(
            count=count,
            publish=lambda found: metrics.set_allocation_counts(found, statuses),
            max_age=rc.poll_interval,
            timeout=COUNT_TIMEOUT,
        )

        async def render_metrics() -> bytes:
            await counts.refresh()
            metrics.listener_up.set(1 if listener.healthy else 0)
            return metrics.render()

        exits = tuple(
            ExitWatch(id, provisioner, store, metrics, timeout=rc.operation_timeout)
            for id, provisioner in sorted(provisioners.items())
            if isinstance(provisioner, WatchesSidecars)
        )
        return cls(
            parts=parts,
            hub_ws_url=hub_ws_url,
            provisioners=provisioners,
            store=store,
            ledger=ledger,
            reconciler=reconciler,
            listener=listener,
            admin=AdminServer(
                host=config.admin.host,
                port=config.admin.port,
                readiness=readiness,
                detail=readiness_detail,
                metrics=render_metrics,
            ),
            exits=exits,
        )
