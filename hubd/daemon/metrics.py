"""Prometheus metrics of one daemon, on a registry of its own (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol, cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hubd.daemon.pools import PoolMetrics
from hubd.routing import Target
from hubd.server.wire import ServerStats
from hubd.store.channels import CONNECTED_CHANNEL, SOCKETS_CHANNEL
from hubd.store.counts import LIMITS, TenantCount

# Every counter would also export a `_created` twin (its creation time) that no dashboard uses
# and every scrape pays for.
cast(Callable[[], None], disable_created_metrics)()  # the library does not annotate it

__all__ = ["HandshakeSlots", "Metrics", "tenant_label"]

_PLUGIN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """The daemon's metrics; also the reconciler's observer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.claims = Counter("hubd_claims", "Claims taken by this daemon", registry=r)
        self.claim_statements = Counter(
            "hubd_claim_statements",
            "Claim statements run (claims / statements: rows leased per statement; a statement "
            "that leased nothing is an idle poll)",
            registry=r,
        )
        self.claim_statements_idle = Counter(
            "hubd_claim_statements_idle", "Claim statements that found nothing due", registry=r
        )
        self.transitions = Counter(
            "hubd_transitions",
            "Status transitions made here",
            ["from_status", "to_status"],
            registry=r,
        )
        self.plugin_seconds = Histogram(
            "hubd_plugin_call_seconds",
            "Plugin call latency",
            ["provisioner", "operation"],
            buckets=_PLUGIN_BUCKETS,
            registry=r,
        )
        self.plugin_outcomes = Counter(
            "hubd_plugin_outcomes",
            "Plugin call outcomes",
            ["provisioner", "operation", "outcome"],
            registry=r,
        )
        # The labelled children the hot path uses, by their labels: each allocation makes
        # several transitions and plugin calls, and ``labels()`` validates and locks per call.
        # The label sets are bounded (statuses, provisioners, operations, outcome types).
        self._transitions: dict[tuple[str, str], Counter] = {}
        self._plugin_calls: dict[tuple[str, str, str], tuple[Histogram, Counter]] = {}
        self.lease_losses = Counter(
            "hubd_lease_losses", "Claims stopped because their lease was lost", registry=r
        )
        self.event_loop = Gauge(
            "hubd_event_loop_info",
            "1, labelled with the event loop this daemon runs on (uvloop or asyncio)",
            ["loop"],
            registry=r,
        )
        self.active_claims = Gauge("hubd_active_claims", "Claims in progress", registry=r)
        self.queue_depth = Gauge(
            "hubd_queue_depth", "Allocations with queued reconciliation steps", registry=r
        )
        self.connected_sidecars = Gauge(
            "hubd_connected_sidecars", "Sidecar sockets open on this daemon", registry=r
        )
        self.sidecar_connects = Counter(
            "hubd_sidecar_connects",
            "Sidecar sockets welcomed here (a sidecar's first connect and each reconnect)",
            registry=r,
        )
        self.sidecar_disconnects = Counter(
            "hubd_sidecar_disconnects",
            "Sidecar sockets lost here: closed by the sidecar or the network, or by the hub for "
            "a violation (not superseded, fenced or retired, not at shutdown)",
            registry=r,
        )
        self.allocations = Gauge(
            "hubd_allocations", "Allocations by status (whole database)", ["status"], registry=r
        )
        self.database_up = Gauge("hubd_database_up", "1 when the database answers", registry=r)
        self.listener_up = Gauge(
            "hubd_listener_up", "1 when the LISTEN connection is up and verified", registry=r
        )
        self.selfcheck_failures = Counter(
            "hubd_notification_selfcheck_failures",
            "Self-notifications that did not come back in time",
            registry=r,
        )
        self.connections_swept = Counter(
            "hubd_connections_swept",
            "Connection records of dead instances cleared by this daemon's sweep",
            registry=r,
        )
        self.connections_reasserted = Counter(
            "hubd_connections_reasserted",
            "Records of sockets still open here written again after a sweep removed them",
            registry=r,
        )
        self.remote_closes = Counter(
            "hubd_sockets_closed_for_peers",
            "Sockets closed here because another replica's write or the socket check said so",
            registry=r,
        )
        self.notices_forged = Counter(
            "hubd_notices_forged",
            "Notifications on hubd_connected or hubd_sockets dropped unread: not authenticated "
            "by the database's key (sent by another role, or by an older hubd), or malformed",
            ["channel"],
            registry=r,
        )
        for channel in (CONNECTED_CHANNEL, SOCKETS_CHANNEL):
            self.notices_forged.labels(channel)  # at 0 from the start, for rate() and alerts
        self.heartbeat_lapses = Counter(
            "hubd_heartbeat_lapses",
            "Times this daemon found its heartbeat older than the instance TTL",
            registry=r,
        )
        self.instances_deleted = Counter(
            "hubd_dead_instances_deleted", "Rows of long-dead instances deleted", registry=r
        )
        self.orphans = Counter(
            "hubd_orphan_sidecars",
            "Sidecars found belonging to no current generation, by what became of them",
            ["provisioner", "outcome"],
            registry=r,
        )
        self.feed_lock_waiters = Gauge(
            "hubd_feed_lock_waiters",
            "Commits waiting for the event feed's lock (pg_locks, read every second)",
            registry=r,
        )
        self.feed_lock_wait = Gauge(
            "hubd_feed_lock_wait_seconds",
            "How long the longest-waiting commit has waited for the event feed's lock",
            registry=r,
        )
        self.feed_lock_terminations = Counter(
            "hubd_feed_lock_holders_terminated",
            "Backends of other roles ended by this daemon for holding the event feed's lock "
            "past events.lock_hold_limit",
            registry=r,
        )
        self.watch_up = Gauge(
            "hubd_provisioner_watch_up",
            "1 while this daemon follows the provisioner's reports of dead sidecars",
            ["provisioner"],
            registry=r,
        )
        self.watch_failures = Counter(
            "hubd_provisioner_watch_failures",
            "Times the provisioner's watch of its sidecars failed or ended, by failure code",
            ["provisioner", "code"],
            registry=r,
        )
        self.sidecar_exits = Counter(
            "hubd_sidecar_exits",
            "Sidecars reported dead by their provisioner and acted on (the current generation's)",
            ["provisioner", "reason"],
            registry=r,
        )
        self.deadlines = Counter(
            "hubd_deadlines",
            "Deadlines this daemon acted on: allocations expired, ended idle, given up not ready "
            "(provisioning_timeout), failed unserved, warned",
            ["kind"],
            registry=r,
        )
        self.loop_errors = Counter(
            "hubd_claim_loop_errors",
            "Errors the claim dispatcher recovered from",
            ["kind"],
            registry=r,
        )
        self._tenants = _TenantCollector()
        r.register(self._tenants)
        self.pools = PoolMetrics(r)

    def bind_gauges(
        self,
        *,
        active_claims: Callable[[], float],
        queue_depth: Callable[[], float],
        connected_sidecars: Callable[[], float],
    ) -> None:
        self.active_claims.set_function(active_claims)
        self.queue_depth.set_function(queue_depth)
        self.connected_sidecars.set_function(connected_sidecars)

    def handle_connected(self, target: Target) -> None:
        """A sidecar's socket was welcomed here (the router's connection events)."""
        self.sidecar_connects.inc()

    def handle_disconnect(self, target: Target) -> None:
        """A sidecar's socket here was lost."""
        self.sidecar_disconnects.inc()

    def bind_listener(self, stats: ServerStats, slots: HandshakeSlots) -> None:
        """Export the sidecar listener's own counters (refusals, aborts, sockets that waited)
        and its handshake slots (held, waited for) at every scrape."""
        self.registry.register(_ListenerCollector(stats, slots))

    def bind_batchers(self, batchers: Callable[[], Iterable[Batched]]) -> None:
        """Export each statement batcher's counts at every scrape: how many statements, how
        many requests they carried (the ratio is the mean batch size) and how many wait.
        ``batchers`` is asked at each scrape: pipelines of transitions appear on first use."""
        self.registry.register(_BatcherCollector(batchers))

    def set_allocation_counts(self, counts: Mapping[str, int], statuses: list[str]) -> None:
        for status in statuses:
            self.allocations.labels(status=status).set(counts.get(status, 0))

    def set_tenant_counts(self, counts: Iterable[TenantCount]) -> None:
        """The per-tenant gauges and refusal counters from the last count: a tenant that left
        the labelled set is gone from the next scrape, not frozen at its last value."""
        self._tenants.counts = tuple(counts)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- ReconcilerObserver ---------------------------------------------------------------

    def claim_statement(self, leased: int) -> None:
        self.claim_statements.inc()
        if leased == 0:
            self.claim_statements_idle.inc()

    def claimed(self) -> None:
        self.claims.inc()

    def lease_lost(self) -> None:
        self.lease_losses.inc()

    def transition(self, from_status: str, to_status: str) -> None:
        key = (from_status, to_status)
        child = self._transitions.get(key)
        if child is None:
            child = self._transitions[key] = self.transitions.labels(
                from_status=from_status, to_status=to_status
            )
        child.inc()

    def plugin_call(self, plugin: str, operation: str, seconds: float, outcome: str) -> None:
        key = (plugin, operation, outcome)
        children = self._plugin_calls.get(key)
        if children is None:
            # The label names the provisioner id (allocations name it), not the plugin module.
            children = self._plugin_calls[key] = (
                self.plugin_seconds.labels(provisioner=plugin, operation=operation),
                self.plugin_outcomes.labels(
                    provisioner=plugin, operation=operation, outcome=outcome
                ),
            )
        children[0].observe(seconds)
        children[1].inc()


class HandshakeSlots(Protocol):
    """What the listener's admission gate says of its handshake slots."""

    @property
    def handshakes(self) -> int: ...

    @property
    def waiting(self) -> int: ...


class _ListenerCollector(Collector):
    """The listener keeps plain counters (it must not depend on Prometheus); they are read
    here, at scrape time, with the reason or status as a label."""

    def __init__(self, stats: ServerStats, slots: HandshakeSlots) -> None:
        self._stats = stats
        self._slots = slots

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        for name, doc, total in (
            (
                "hubd_sidecar_sockets_accepted",
                "Sidecar sockets upgraded by the listener",
                stats.accepted,
            ),
            (
                "hubd_handshakes_queued",
                "Sockets that waited for a handshake slot (unread) instead of taking one at once",
                stats.queued,
            ),
        ):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], total)
            yield counter
        for name, doc, level in (
            (
                "hubd_handshakes_in_progress",
                "Handshake slots held: sockets whose request is being read or decided",
                self._slots.handshakes,
            ),
            (
                "hubd_handshakes_waiting",
                "Sockets waiting, unread, for a handshake slot",
                self._slots.waiting,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], level)
            yield gauge
        for name, doc, label, counts in (
            (
                "hubd_handshakes_rejected",
                "Handshakes answered with an HTTP refusal, by status",
                "status",
                {str(k): v for k, v in stats.rejected.items()},
            ),
            (
                "hubd_sockets_refused",
                "Sockets refused by a resource bound before their request was read, by reason",
                "reason",
                dict(stats.refused_early),
            ),
            (
                "hubd_sockets_aborted",
                "Sockets aborted for a resource bound (stalled reader, eviction), by reason",
                "reason",
                dict(stats.aborted),
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=[label])
            for value, count in sorted(counts.items()):
                family.add_metric([value], count)
            yield family


class Batched(Protocol):
    """What a statement batcher or a pipeline of transitions reports."""

    @property
    def name(self) -> str: ...

    @property
    def waiting(self) -> int: ...

    batches: int
    carried: int


class _BatcherCollector(Collector):
    def __init__(self, batchers: Callable[[], Iterable[Batched]]) -> None:
        self._batchers = batchers

    def collect(self) -> Iterator[Metric]:
        statements = CounterMetricFamily(
            "hubd_batched_statements",
            "Statements run by a batcher (identity look-ups, connection records, secret "
            "acknowledgements, and each fenced transition), each for every request that arrived "
            "while the previous one ran",
            labels=["batcher"],
        )
        requests = CounterMetricFamily(
            "hubd_batched_requests",
            "Requests carried by those statements (divided by statements: the mean batch size)",
            labels=["batcher"],
        )
        waiting = GaugeMetricFamily(
            "hubd_batched_requests_waiting",
            "Requests waiting for a batcher's next statement",
            labels=["batcher"],
        )
        for batcher in self._batchers():
            statements.add_metric([batcher.name], batcher.batches)
            requests.add_metric([batcher.name], batcher.carried)
            waiting.add_metric([batcher.name], batcher.waiting)
        yield statements
        yield requests
        yield waiting


def tenant_label(key: str) -> str:
    """The ``tenant`` label of a per-tenant key (:class:`~hubd.store.counts.TenantCount`): the
    tenant itself, with one more ``_`` in front when it begins with one, so that no tenant's
    label is one of the groups' (``_none``, ``_other``, ``_default``)."""
    if key.startswith("tenant:"):
        tenant = key.removeprefix("tenant:")
        return "_" + tenant if tenant.startswith("_") else tenant
    return {"untenanted": "_none"}.get(key, "_" + key)


class _TenantCollector(Collector):
    """Rebuilt from the last count at every scrape, so the label set is exactly the last
    count's: bounded by the quota rows and ``admin.tenant_labels``, never by the tenants."""

    def __init__(self) -> None:
        self.counts: tuple[TenantCount, ...] = ()

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            "hubd_tenant_active_allocations",
            "Allocations not yet ended, by tenant (each with a quota row, the most active "
            "others up to admin.tenant_labels, _other for the rest, _none without a tenant)",
            labels=["tenant"],
        )
        pending = GaugeMetricFamily(
            "hubd_tenant_pending_allocations",
            "Allocations waiting for a sidecar, by tenant (labelled as the active ones)",
            labels=["tenant"],
        )
        refusals = CounterMetricFamily(
            "hubd_quota_refusals",
            "Requests refused by a quota (HU429), by the quota row that refused (its tenant, "
            "_none, _default) and the limit",
            labels=["tenant", "limit"],
        )
        for count in self.counts:
            label = tenant_label(count.key)
            if count.active is not None and count.pending is not None:
                active.add_metric([label], count.active)
                pending.add_metric([label], count.pending)
            if count.refusals is not None:
                for limit in LIMITS:
                    refusals.add_metric([label, limit], count.refusals.get(limit, 0))
        yield active
        yield pending
        yield refusals
