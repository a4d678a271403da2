"""The configuration's tables: one frozen record each, holding its own rules.

The rules live in the types themselves (``__attrs_post_init__``), so a :class:`Config` built in
code is held to the same rules as one loaded from a file.
"""

from __future__ import annotations

import os
import pathlib
import urllib.parse
from typing import Any, Final, Literal

import attrs
import platformdirs

from hubd.claimrules import DEFAULT_CLAIMS, TENANT_ROOM, claim_rules_problem
from hubd.config.kinds import (
    Choice,
    Duration,
    Flag,
    Integer,
    Strings,
    Text,
    check_fields,
    field,
    metadata,
    problem,
)
from hubd.dburl import hosts_problem
from hubd.redaction import redact_dsn as redact_url
from hubd.units import format_duration, parse_duration, parse_listen

__all__ = [
    "AdminConfig",
    "DatabaseConfig",
    "EventLoop",
    "EventsConfig",
    "InstanceConfig",
    "LogConfig",
    "LogFormat",
    "LogLevel",
    "OrphanMode",
    "OrphansConfig",
    "ReconcilerConfig",
    "RuntimeConfig",
    "ServerConfig",
    "StateConfig",
    "default_state_dir",
    "fields_of",
]

MAX_CONNECTIONS_CEILING: Final = 1 << 20
"""Linux's default ``fs.nr_open``: no process can hold more descriptors than this."""

EventLoop = Literal["uvloop", "asyncio"]
LogFormat = Literal["json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]
OrphanMode = Literal["destroy", "dry-run", "off"]


def _text(default: str) -> str:
    return field(Text(), default)


def _integer(default: int) -> int:
    return field(Integer(), default)


def _flag(default: bool) -> bool:
    return field(Flag(), default)


def _duration(default: str) -> float:
    """A duration field whose default is written as in the config file."""
    return field(Duration(), parse_duration(default))


def _strings() -> tuple[str, ...]:
    return field(Strings(), ())


def fields_of(section: type[Any]) -> dict[str, attrs.Attribute[Any]]:
    return {attribute.name: attribute for attribute in attrs.fields(section)}


def _check_listen(key: str, value: str) -> tuple[str, int]:
    try:
        return parse_listen(value)
    except ValueError as exc:
        raise problem(key, str(exc)) from None


@attrs.frozen(kw_only=True)
class DatabaseConfig:
    """``[database]``: where the single source of truth lives."""

    url: str = _text("")
    """A ``postgres://`` / ``postgresql://`` URL; empty runs the embedded PostgreSQL."""
    pool_size: int = _integer(10)
    """Connections in the daemon's main pool, which claims and sweeps share. Lease renewals (2),
    handshake look-ups (2) and socket records (4) have pools of their own, and the wake-up
    listener one connection: a replica opens at most ``pool_size + 9``. A claim holds a
    connection only while one statement runs, never while it waits on a plugin or a sidecar, so
    the pool need not grow with ``max_concurrent_claims``."""

    def __attrs_post_init__(self) -> None:
        if self.url and not self.url.startswith(("postgres://", "postgresql://")):
            raise problem(
                "database.url",
                "must be empty (embedded PostgreSQL) or a postgres:// or postgresql:// URL, "
                f"not {redact_url(self.url)!r}",
            )
        if self.url:
            _check_dsn("database.url", self.url)
        if self.pool_size < 1:
            raise problem("database.pool_size", f"must be at least 1, not {self.pool_size}")

    @property
    def embedded(self) -> bool:
        """Whether hubd runs its own PostgreSQL under the state directory."""
        return not self.url


def default_state_dir(name: str = "hubd") -> pathlib.Path:
    """Where ``name``'s state lives when ``state.dir`` is empty: ``/var/lib/<name>`` for root
    (what a unit's ``StateDirectory=`` gives; root's home must stay private, and the embedded
    server would need every parent of its data directory searchable), otherwise the platform's
    user data directory (``~/.local/share/<name>`` on Linux)."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return pathlib.Path("/var/lib") / name
    return pathlib.Path(platformdirs.user_data_dir(name, appauthor=False))


def _check_dsn(key: str, url: str) -> None:
    """What the driver would only find out at connect time: a port that is not a number, a URL
    that does not parse. Checked here so ``check-config`` and ``run`` agree (exit 2)."""
    broken = _dsn_problem(url)
    if broken is not None:
        raise problem(key, f"is not a usable database URL ({broken}): {redact_url(url)!r}")


def _dsn_problem(url: str) -> str | None:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        return str(exc)
    # libpq URLs may list several hosts: host1:5432,host2:5433.
    for hostport in parts.netloc.rpartition("@")[2].split(","):
        if hostport.startswith("["):
            end = hostport.find("]")
            if end < 0:
                return "unbalanced brackets around an IPv6 host"
            port = hostport[end + 1 :].removeprefix(":")
        else:
            port = hostport.rpartition(":")[2] if ":" in hostport else ""
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            return f"port {port[:20]!r} is not a number from 1 to 65535"
    return hosts_problem(url)


@attrs.frozen(kw_only=True)
class StateConfig:
    """``[state]``: the directory for the embedded database and other local state."""

    dir: str = _text("")
    """Empty means ``/var/lib/hubd`` for root, else the platform's user data dir for hubd."""

    @property
    def path(self) -> pathlib.Path:
        """The state directory, with the default applied and ``~`` expanded."""
        if not self.dir:
            return default_state_dir()
        return pathlib.Path(self.dir).expanduser().absolute()


# A wildcard bind address cannot be dialled. Sidecars that the built-in local provisioner starts run
# on this host, so loopback reaches them; remote sidecars need server.public_url set explicitly.
_DIAL_HOST: Final = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # noqa: S104 — a lookup, not a bind


@attrs.frozen(kw_only=True)
class ServerConfig:
    """``[server]``: the sidecar websocket listener."""

    listen: str = _text("127.0.0.1:8765")
    public_url: str = _text("")
    """What sidecars are told to dial (one URL, or several separated by commas); empty →
    derived from ``listen``."""
    tls_cert: str = _text("")
    tls_key: str = _text("")
    allowed_origins: tuple[str, ...] = _strings()
    max_connections: int = _integer(4096)
    """Sidecar sockets held at once, unfinished handshakes included; more are refused with 503
    and ``Retry-After``. ``hubd run`` lowers it to fit the open-file limit (and says so)."""

    def __attrs_post_init__(self) -> None:
        _check_listen("server.listen", self.listen)
        if not 1 <= self.max_connections <= MAX_CONNECTIONS_CEILING:
            raise problem(
                "server.max_connections",
                f"must be between 1 and {MAX_CONNECTIONS_CEILING} (one descriptor each), "
                f"not {self.max_connections}",
            )
        if self.public_url:
            # One load-balanced address, or every replica's address separated by commas: the
            # reference sidecar moves to the next one whenever a connection fails.
            for url in self.public_url.split(","):
                parts = urllib.parse.urlsplit(url.strip())
                if parts.scheme not in ("ws", "wss") or not parts.netloc:
                    raise problem(
                        "server.public_url",
                        "must be empty, a ws:// or wss:// URL, or several separated by commas, "
                        f"not {self.public_url!r}",
                    )
        if bool(self.tls_cert) != bool(self.tls_key):
            present, missing = (
                ("server.tls_cert", "server.tls_key")
                if self.tls_cert
                else ("server.tls_key", "server.tls_cert")
            )
            raise problem(
                missing, f"must be set together with {present} (TLS needs both or neither)"
            )
        for index, origin in enumerate(self.allowed_origins):
            if not origin.strip():
                raise problem(f"server.allowed_origins[{index}]", "must not be empty")

    @property
    def host(self) -> str:
        """The listen host, without IPv6 brackets."""
        return parse_listen(self.listen)[0]

    @property
    def port(self) -> int:
        """The listen port (0 asks the OS for a free one)."""
        return parse_listen(self.listen)[1]

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert)

    @property
    def effective_public_url(self) -> str:
        """``public_url``, or ``ws://host:port`` (``wss://`` with TLS) derived from ``listen``."""
        return self.public_url_for(self.port)

    def public_url_for(self, bound_port: int) -> str:
        """The URL sidecars dial, given the port actually bound (differs when ``listen`` uses 0)."""
        if self.public_url:
            return self.public_url
        host = _DIAL_HOST.get(self.host, self.host)
        if ":" in host:
            host = f"[{host}]"
        scheme = "wss" if self.tls_enabled else "ws"
        return f"{scheme}://{host}:{bound_port}"


@attrs.frozen(kw_only=True)
class AdminConfig:
    """``[admin]``: ``/healthz``, ``/readyz`` and ``/metrics``, on loopback by default."""

    listen: str = _text("127.0.0.1:9465")
    tenant_labels: int = _integer(20)
    """Tenants without a quota row of their own that ``/metrics`` names: the most active."""

    def __attrs_post_init__(self) -> None:
        _check_listen("admin.listen", self.listen)
        if not 0 <= self.tenant_labels <= 1000:
            raise problem("admin.tenant_labels", f"must be 0 to 1000, not {self.tenant_labels}")

    @property
    def host(self) -> str:
        return parse_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return parse_listen(self.listen)[1]


@attrs.frozen(kw_only=True)
class ReconcilerConfig:
    """``[reconciler]``: claims, leases and the budgets of external operations (architecture §2)."""

    lease_duration: float = _duration("60s")
    connect_timeout: float = _duration("120s")
    restart_window: float = _duration("60s")
    """At a start that finds no other live replica, the least time each sidecar that is not
    connected gets to come back, whatever its deadline was (``connect_timeout`` when longer)."""
    operation_timeout: float = _duration("30s")
    max_concurrent_claims: int = _integer(DEFAULT_CLAIMS)
    max_claims_per_tenant: int = _integer(0)
    """Claim slots one tenant may hold while another tenant is in sight (claimed for within a
    minute); 0: half of ``max_concurrent_claims``, at most ``TENANT_ROOM`` (4). Fewer isolate
    the others from a burst better and leave more of the slots unused while the burst waits
    (docs/operations.md)."""
    poll_interval: float = _duration("5s")
    repair_interval: float = _duration("30s")
    shutdown_grace: float = _duration("20s")
    automatic_replacement_recovery: bool = _flag(False)
    replacement_limit: int = _integer(5)
    """Sidecars of one allocation that may fail within ``replacement_window`` before it ends
    ``failed``; 0: replace for ever."""
    replacement_window: float = _duration("10m")
    pending_timeout: float = _duration("10m")
    """How long a request may wait pending before it fails as ``unserved``."""
    expiry_warning: float = _duration("1m")
    """How long before an allocation's end (lifetime or idle) its ``expiring`` event comes."""
    provisioning_timeout: float = _duration("15m")
    """From claim (or a replacement's start) to ready at most, unless its provisioner says."""
    on_ready: str = _text("")
    """The hook run after a sidecar connects and before its allocation is ready:
    ``"package.module:attr"`` or an entry point in group ``hubd.on_ready``; empty: none
    (``hubd.daemon.hooks``)."""

    def __attrs_post_init__(self) -> None:
        check_fields("reconciler", self)
        if self.replacement_limit < 0:
            limit = self.replacement_limit
            raise problem("reconciler.replacement_limit", f"must be 0 or more, not {limit}")
        if not 0 <= self.max_claims_per_tenant <= self.max_concurrent_claims:
            raise problem(
                "reconciler.max_claims_per_tenant",
                f"must be 0 (half of max_concurrent_claims, at most {TENANT_ROOM}) to "
                f"max_concurrent_claims ({self.max_concurrent_claims}), "
                f"not {self.max_claims_per_tenant}",
            )
        broken = claim_rules_problem(
            lease_duration=self.lease_duration,
            operation_timeout=self.operation_timeout,
            max_concurrent_claims=self.max_concurrent_claims,
            prefix="reconciler.",
            show=format_duration,
        )
        if broken is not None:
            raise problem(f"reconciler.{broken[0]}", broken[1])


@attrs.frozen(kw_only=True)
class InstanceConfig:
    """``[instance]``: this daemon's liveness row, which other replicas judge it by."""

    heartbeat_interval: float = _duration("5s")
    ttl: float = _duration("20s")

    def __attrs_post_init__(self) -> None:
        check_fields("instance", self)
        # With a heartbeat no more often than the TTL, a healthy instance would be declared dead
        # between two beats and its sidecars' connections swept.
        if self.heartbeat_interval >= self.ttl:
            raise problem(
                "instance.heartbeat_interval",
                "must be shorter than instance.ttl "
                f"({format_duration(self.heartbeat_interval)} ≥ {format_duration(self.ttl)})",
            )


@attrs.frozen(kw_only=True)
class OrphansConfig:
    """``[orphans]``: collecting what provisioners run that belongs to no current generation."""

    mode: OrphanMode = attrs.field(default="destroy", metadata=metadata(Choice.of(OrphanMode)))
    grace: float = _duration("600s")
    interval: float = _duration("60s")
    destroy_unknown: bool = _flag(False)

    def __attrs_post_init__(self) -> None:
        check_fields("orphans", self)


@attrs.frozen(kw_only=True)
class EventsConfig:
    """``[events]``: the application event feed (docs/api.md)."""

    retention: float = _duration("24h")
    lock_wait_alarm: float = _duration("5s")
    """A commit waiting longer than this for the feed's lock makes ``/readyz`` not ready and
    logs who holds it (docs/operations.md, "The feed's lock")."""
    lock_hold_limit: float = _duration("30s")
    """While commits have waited longer than this, a holder of another role than the daemon's
    is ended (``pg_terminate_backend``)."""

    def __attrs_post_init__(self) -> None:
        check_fields("events", self)
        # A cut-off before the alarm would end holders nobody was told about.
        if self.lock_hold_limit < self.lock_wait_alarm:
            raise problem(
                "events.lock_hold_limit",
                "must be at least events.lock_wait_alarm "
                f"({format_duration(self.lock_hold_limit)} < "
                f"{format_duration(self.lock_wait_alarm)})",
            )


@attrs.frozen(kw_only=True)
class RuntimeConfig:
    """``[runtime]``: how the daemon's process runs its work."""

    event_loop: EventLoop = attrs.field(default="uvloop", metadata=metadata(Choice.of(EventLoop)))

    def __attrs_post_init__(self) -> None:
        check_fields("runtime", self)


@attrs.frozen(kw_only=True)
class LogConfig:
    """``[log]``: structlog output."""

    format: LogFormat = attrs.field(default="json", metadata=metadata(Choice.of(LogFormat)))
    level: LogLevel = attrs.field(default="info", metadata=metadata(Choice.of(LogLevel)))

    def __attrs_post_init__(self) -> None:
        check_fields("log", self)
