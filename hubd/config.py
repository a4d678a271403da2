"""Typed hubd configuration: a TOML file, then ``HUBD_<SECTION>_<KEY>`` environment overrides.

Every key has a default, so no file at all runs a single local daemon on the embedded database.
``config/hubd.toml`` documents every key with its default value (a test holds the two equal).

Loading is a pure function of (file contents, environment): each value is parsed to its key's
kind, the environment is laid over the file, and the sections are built. The rules live in the
types themselves (``__attrs_post_init__``), so a :class:`Config` built in code is held to the same
rules as one loaded from a file. Every problem is one :class:`~hubd.errors.ConfigError` whose
message starts with what the operator must fix — the dotted key, or the environment variable::

    reconciler.operation_timeout: must be shorter than reconciler.lease_duration (30s ≥ 20s)

Durations are written ``"500ms"``, ``"30s"``, ``"2m"``, ``"1h"``, ``"1m30s"`` (or a bare TOML
number of seconds) and held as ``float`` seconds.
"""

from __future__ import annotations

import datetime
import difflib
import ipaddress
import math
import os
import pathlib
import re
import tomllib
import typing
import urllib.parse
from collections.abc import Iterator, Mapping
from decimal import Decimal
from typing import Any, Final, Literal

import attrs
import platformdirs

from hubd.errors import ConfigError
from hubd.redaction import REDACTED as _REDACTED
from hubd.redaction import redact_dsn
from hubd.tomlout import render_toml

__all__ = [
    "AdminConfig",
    "Config",
    "DatabaseConfig",
    "InstanceConfig",
    "LogConfig",
    "LogFormat",
    "LogLevel",
    "OrphanMode",
    "OrphansConfig",
    "ProvisionerConfig",
    "ReconcilerConfig",
    "ServerConfig",
    "StateConfig",
    "default_state_dir",
    "format_duration",
    "load_config",
    "parse_duration",
    "parse_listen",
    "redact_url",
    "render_toml",
]

LogFormat = Literal["json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]
OrphanMode = Literal["destroy", "dry-run", "off"]

# ---------------------------------------------------------------------------------------------
# Durations and addresses
# ---------------------------------------------------------------------------------------------

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")
_DURATION = re.compile(rf"(?:{_DURATION_PART.pattern})+")
_UNIT_SECONDS: Final = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
}
_DURATION_HINT = 'write it as e.g. "500ms", "30s", "2m", "1h" or "1m30s"'


def parse_duration(value: str | float) -> float:
    """Parse ``"500ms"``, ``"30s"``, ``"2m"``, ``"1h"``, ``"1m30s"`` or a number of seconds.

    Returns positive, finite seconds; raises :class:`ValueError` (usable as an argparse ``type``)
    for any other text, including zero and negative durations, and :class:`TypeError` for a value
    that is neither text nor a number.
    """
    if isinstance(value, bool):
        raise TypeError(f"must be a duration, not a boolean; {_DURATION_HINT}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.startswith("-"):
            raise ValueError(f"must be positive, not {value!r}")
        if not _DURATION.fullmatch(text):
            raise ValueError(f"invalid duration {value!r}; {_DURATION_HINT}")
        # Summed in Decimal so that "100ms" is exactly 0.1 and "1.1s" exactly 1.1.
        seconds = float(sum(Decimal(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(text)))
    else:
        raise TypeError(f'must be a duration string such as "30s", not {type(value).__name__}')
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"must be positive, not {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """Render seconds the way the config file writes them: ``"30s"``, ``"500ms"``, ``"1.5s"``.

    ``parse_duration(format_duration(x)) == x`` for every positive finite ``x``.
    """
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    exact = Decimal(repr(float(seconds)))  # repr is the shortest text that reads back the same
    millis = exact * 1000
    if seconds < 1 and millis == millis.to_integral_value():
        return f"{int(millis)}ms"
    return f"{exact:f}s"


def parse_listen(value: str) -> tuple[str, int]:
    """Split ``"host:port"`` (IPv6 as ``"[::1]:8765"``) into the host and a port in 0 to 65535.

    Raises :class:`ValueError` with the problem.
    """
    if value.startswith("["):
        host, sep, port_text = value[1:].partition("]:")
        if not sep:
            raise ValueError(f'must be "[ipv6]:port", not {value!r}')
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} in brackets is not an IPv6 address") from None
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep:
            raise ValueError(f'must be "host:port", e.g. "127.0.0.1:8765", not {value!r}')
        if ":" in host:
            raise ValueError(
                f'an IPv6 address must be in brackets, e.g. "[::1]:8765", not {value!r}'
            )
    if not host or any(ch.isspace() or ch in "/[]" for ch in host):
        raise ValueError(f"invalid host in {value!r}")
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or int(port_text) > 65535:
        raise ValueError(f"port must be a number from 0 to 65535, not {port_text!r}")
    return host, int(port_text)


# ---------------------------------------------------------------------------------------------
# Secrets
# ---------------------------------------------------------------------------------------------

_SECRET_WORDS: Final = ("password", "secret", "token")


redact_url = redact_dsn


def _redact_options(value: Any) -> Any:
    """A copy of provisioner options with every value under a secret-sounding key replaced."""
    if isinstance(value, Mapping):
        return {
            key: _REDACTED
            if any(word in str(key).lower() for word in _SECRET_WORDS)
            else _redact_options(item)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_redact_options(item) for item in value]
    return value


# ---------------------------------------------------------------------------------------------
# Field kinds: every section key declares how it is parsed from TOML and from the environment
# ---------------------------------------------------------------------------------------------

_Kind = Literal["str", "int", "bool", "duration", "str_list", "choice"]
_KIND: Final = "hubd.config.kind"
_CHOICES: Final = "hubd.config.choices"


def _text(default: str) -> str:
    return attrs.field(default=default, metadata={_KIND: "str"})


def _integer(default: int) -> int:
    return attrs.field(default=default, metadata={_KIND: "int"})


def _flag(default: bool) -> bool:
    return attrs.field(default=default, metadata={_KIND: "bool"})


def _duration(default: str) -> float:
    """A duration field whose default is written as in the config file."""
    return attrs.field(default=parse_duration(default), metadata={_KIND: "duration"})


def _strings() -> tuple[str, ...]:
    return attrs.field(default=(), metadata={_KIND: "str_list"})


def _choice_of(literal: object) -> dict[str, object]:
    """Field metadata for a string restricted to the values of a ``Literal`` type."""
    return {_KIND: "choice", _CHOICES: typing.get_args(literal)}


def _fields(section: type[Any]) -> dict[str, attrs.Attribute[Any]]:
    return {field.name: field for field in attrs.fields(section)}


def _fail(key: str, problem: str) -> ConfigError:
    return ConfigError(f"{key}: {problem}")


def _check_durations(section: str, instance: Any) -> None:
    """Every duration is positive and finite, however the section was built."""
    for field in attrs.fields(type(instance)):
        if field.metadata[_KIND] == "duration":
            value = getattr(instance, field.name)
            if not math.isfinite(value) or value <= 0:
                raise _fail(f"{section}.{field.name}", f"must be positive, not {value!r}")


def _check_listen(key: str, value: str) -> tuple[str, int]:
    try:
        return parse_listen(value)
    except ValueError as exc:
        raise _fail(key, str(exc)) from None


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class DatabaseConfig:
    """``[database]``: where the single source of truth lives."""

    url: str = _text("")
    """A ``postgres://`` / ``postgresql://`` URL; empty runs the embedded PostgreSQL."""
    pool_size: int = _integer(10)
    """Connections in the daemon's pool (lease renewals use connections of their own)."""

    def __attrs_post_init__(self) -> None:
        if self.url and not self.url.startswith(("postgres://", "postgresql://")):
            raise _fail(
                "database.url",
                "must be empty (embedded PostgreSQL) or a postgres:// or postgresql:// URL, "
                f"not {redact_url(self.url)!r}",
            )
        if self.url:
            _check_dsn("database.url", self.url)
        if self.pool_size < 1:
            raise _fail("database.pool_size", f"must be at least 1, not {self.pool_size}")

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
    problem = _dsn_problem(url)
    if problem is not None:
        raise _fail(key, f"is not a usable database URL ({problem}): {redact_url(url)!r}")


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
    return None


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

    def __attrs_post_init__(self) -> None:
        _check_listen("server.listen", self.listen)
        if self.public_url:
            # One load-balanced address, or every replica's address separated by commas: the
            # reference sidecar moves to the next one whenever a connection fails.
            for url in self.public_url.split(","):
                parts = urllib.parse.urlsplit(url.strip())
                if parts.scheme not in ("ws", "wss") or not parts.netloc:
                    raise _fail(
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
            raise _fail(missing, f"must be set together with {present} (TLS needs both or neither)")
        for index, origin in enumerate(self.allowed_origins):
            if not origin.strip():
                raise _fail(f"server.allowed_origins[{index}]", "must not be empty")

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

    def __attrs_post_init__(self) -> None:
        _check_listen("admin.listen", self.listen)

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
    operation_timeout: float = _duration("30s")
    max_concurrent_claims: int = _integer(16)
    poll_interval: float = _duration("5s")
    repair_interval: float = _duration("30s")
    shutdown_grace: float = _duration("20s")
    automatic_replacement_recovery: bool = _flag(False)

    def __attrs_post_init__(self) -> None:
        _check_durations("reconciler", self)
        # A plugin call may not outlive the lease that authorised it: once the lease can expire
        # mid-call, another replica may claim the allocation and act on it concurrently.
        if self.operation_timeout >= self.lease_duration:
            raise _fail(
                "reconciler.operation_timeout",
                "must be shorter than reconciler.lease_duration "
                f"({format_duration(self.operation_timeout)} ≥ "
                f"{format_duration(self.lease_duration)})",
            )
        if self.max_concurrent_claims < 1:
            raise _fail(
                "reconciler.max_concurrent_claims",
                f"must be at least 1, not {self.max_concurrent_claims}",
            )


@attrs.frozen(kw_only=True)
class InstanceConfig:
    """``[instance]``: this daemon's liveness row, which other replicas judge it by."""

    heartbeat_interval: float = _duration("5s")
    ttl: float = _duration("20s")

    def __attrs_post_init__(self) -> None:
        _check_durations("instance", self)
        # With a heartbeat no more often than the TTL, a healthy instance would be declared dead
        # between two beats and its sidecars' connections swept.
        if self.heartbeat_interval >= self.ttl:
            raise _fail(
                "instance.heartbeat_interval",
                "must be shorter than instance.ttl "
                f"({format_duration(self.heartbeat_interval)} ≥ {format_duration(self.ttl)})",
            )


@attrs.frozen(kw_only=True)
class OrphansConfig:
    """``[orphans]``: collecting what provisioners run that belongs to no current generation."""

    mode: OrphanMode = attrs.field(default="destroy", metadata=_choice_of(OrphanMode))
    grace: float = _duration("600s")
    interval: float = _duration("60s")
    destroy_unknown: bool = _flag(False)

    def __attrs_post_init__(self) -> None:
        _check_durations("orphans", self)
        field = attrs.fields(OrphansConfig).mode
        if self.mode not in field.metadata[_CHOICES]:
            raise _fail("orphans.mode", _choice_problem(field, self.mode))


@attrs.frozen(kw_only=True)
class LogConfig:
    """``[log]``: structlog output."""

    format: LogFormat = attrs.field(default="json", metadata=_choice_of(LogFormat))
    level: LogLevel = attrs.field(default="info", metadata=_choice_of(LogLevel))

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(LogConfig):
            value = getattr(self, field.name)
            if value not in field.metadata[_CHOICES]:
                raise _fail(f"log.{field.name}", _choice_problem(field, value))


def _choice_problem(field: attrs.Attribute[Any], value: object) -> str:
    return f"must be one of {', '.join(field.metadata[_CHOICES])}; not {value!r}"


_PROVISIONER_ID = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_PROVISIONER_KEYS: Final = ("id", "plugin", "options")


@attrs.frozen(kw_only=True)
class ProvisionerConfig:
    """One ``[[provisioners]]`` entry: a plugin instance under an id that allocations name."""

    id: str
    plugin: str
    """A built-in name, an entry-point name (group ``hubd.provisioners``) or ``"module:attr"``."""
    # Handed to the plugin as is; a dict is not hashable, so it stays out of the hash.
    options: dict[str, Any] = attrs.field(factory=dict, hash=False)

    def __attrs_post_init__(self) -> None:
        if not _PROVISIONER_ID.fullmatch(self.id):
            raise _fail(
                "provisioners.id",
                f"{self.id!r} must match ^[a-z0-9][a-z0-9_.-]{{0,63}}$",
            )
        if not self.plugin.strip():
            raise _fail(f"provisioners[id={self.id}].plugin", "must not be empty")


def _default_provisioners() -> tuple[ProvisionerConfig, ...]:
    return (
        ProvisionerConfig(id="local", plugin="local", options={"command": ["hubd", "sidecar"]}),
    )


# ---------------------------------------------------------------------------------------------
# The whole configuration
# ---------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Config:
    """The daemon's whole configuration; ``Config()`` is the default one."""

    database: DatabaseConfig = attrs.field(factory=DatabaseConfig)
    state: StateConfig = attrs.field(factory=StateConfig)
    server: ServerConfig = attrs.field(factory=ServerConfig)
    admin: AdminConfig = attrs.field(factory=AdminConfig)
    reconciler: ReconcilerConfig = attrs.field(factory=ReconcilerConfig)
    instance: InstanceConfig = attrs.field(factory=InstanceConfig)
    orphans: OrphansConfig = attrs.field(factory=OrphansConfig)
    provisioners: tuple[ProvisionerConfig, ...] = attrs.field(factory=_default_provisioners)
    log: LogConfig = attrs.field(factory=LogConfig)

    def __attrs_post_init__(self) -> None:
        seen: dict[str, int] = {}
        for index, provisioner in enumerate(self.provisioners):
            if provisioner.id in seen:
                raise _fail(
                    f"provisioners[{index}].id",
                    f"duplicate provisioner id {provisioner.id!r} "
                    f"(also provisioners[{seen[provisioner.id]}])",
                )
            seen[provisioner.id] = index

    @property
    def state_path(self) -> pathlib.Path:
        """The state directory, with the platform default applied."""
        return self.state.path

    def provisioner(self, provisioner_id: str) -> ProvisionerConfig | None:
        """The provisioner entry with that id, if configured."""
        return next((p for p in self.provisioners if p.id == provisioner_id), None)

    def to_display_dict(self) -> dict[str, Any]:
        """The effective configuration as TOML-able values, with secrets replaced by ``***``.

        Durations are rendered as in the file (``"30s"``); empty values keep their meaning
        (``state.dir = ""`` is the platform default: see :attr:`state_path`). Loading the rendered
        dict gives back an equal :class:`Config`, apart from the redacted values.
        """
        out: dict[str, Any] = {}
        for name in _SECTIONS:
            section = getattr(self, name)
            table: dict[str, Any] = {}
            for field in attrs.fields(type(section)):
                value = getattr(section, field.name)
                kind = field.metadata[_KIND]
                if kind == "duration":
                    value = format_duration(value)
                elif kind == "str_list":
                    value = list(value)
                table[field.name] = value
            out[name] = table
        out["database"]["url"] = redact_url(self.database.url)
        provisioners = [
            {"id": p.id, "plugin": p.plugin, "options": _redact_options(p.options)}
            for p in self.provisioners
        ]
        # Rebuilt so that provisioners come before [log], as in config/hubd.toml.
        log = out.pop("log")
        return {**out, "provisioners": provisioners, "log": log}


_SECTIONS: Final[Mapping[str, type[Any]]] = {
    "database": DatabaseConfig,
    "state": StateConfig,
    "server": ServerConfig,
    "admin": AdminConfig,
    "reconciler": ReconcilerConfig,
    "instance": InstanceConfig,
    "orphans": OrphansConfig,
    "log": LogConfig,
}
_ALL_SECTIONS: Final = (*_SECTIONS, "provisioners")


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Load the configuration from ``path`` (or ``$HUBD_CONFIG``) and the ``HUBD_*`` environment.

    ``env`` defaults to :data:`os.environ`. Without a path and without ``HUBD_CONFIG`` every key
    takes its default. Raises :class:`~hubd.errors.ConfigError` naming the key at fault.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    if path is None:
        path = environ.get("HUBD_CONFIG") or None
    document = _read_toml(path) if path is not None else {}
    return _build(document, environ)


def _read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    name = os.fspath(path)
    try:
        with open(name, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"{name}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{name}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read config file: {exc.strerror or exc}") from None


def _build(document: Mapping[str, Any], env: Mapping[str, str]) -> Config:
    values: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    provisioners: tuple[ProvisionerConfig, ...] | None = None
    for name, table in document.items():
        if name == "provisioners":
            provisioners = _parse_provisioners(table)
            continue
        section = _SECTIONS.get(name)
        if section is None:
            raise ConfigError(f"unknown section {name!r}{_suggest(name, _ALL_SECTIONS)}")
        if not isinstance(table, dict):
            raise _fail(name, f"must be a table ([{name}]), not {_toml_type(table)}")
        fields = _fields(section)
        for key, raw in table.items():
            field = fields.get(key)
            if field is None:
                names = [f"{name}.{other}" for other in fields]
                raise ConfigError(f"unknown key '{name}.{key}'{_suggest(f'{name}.{key}', names)}")
            values[name][key] = _from_toml(f"{name}.{key}", field, raw)
    for name, key, value in _env_overrides(env):
        values[name][key] = value
    sections = {name: section(**values[name]) for name, section in _SECTIONS.items()}
    if provisioners is None:
        return Config(**sections)
    return Config(**sections, provisioners=provisioners)


def _env_overrides(env: Mapping[str, str]) -> Iterator[tuple[str, str, Any]]:
    """``(section, key, parsed value)`` for every ``HUBD_<SECTION>_<KEY>`` variable."""
    for variable in sorted(env):
        if not variable.startswith("HUBD_") or variable == "HUBD_CONFIG":
            continue
        name, _, key = variable.removeprefix("HUBD_").lower().partition("_")
        if name == "provisioners":
            raise ConfigError(
                f"{variable}: provisioners cannot be set from the environment; use the config file"
            )
        section = _SECTIONS.get(name)
        if section is None:
            # HUBD_TOKEN, HUBD_URL, HUBD_SIDECAR_ID, ...: a sidecar's environment, not ours.
            continue
        fields = _fields(section)
        field = fields.get(key)
        if field is None:
            names = [f"HUBD_{name}_{other}".upper() for other in fields]
            raise ConfigError(f"{variable}: unknown key '{name}.{key}'{_suggest(variable, names)}")
        yield name, key, _from_env(f"{name}.{key} (from {variable})", field, env[variable])


def _from_toml(key: str, field: attrs.Attribute[Any], raw: Any) -> Any:
    """Check a TOML value against its field's kind and convert it."""
    kind: _Kind = field.metadata[_KIND]
    expected = {
        "str": "a string",
        "int": "an integer",
        "bool": "true or false",
        "duration": 'a duration such as "30s"',
        "str_list": "an array of strings",
        "choice": "a string",
    }[kind]
    if kind == "duration":
        if isinstance(raw, bool) or not isinstance(raw, str | int | float):
            raise _fail(key, f"must be {expected}, not {_toml_type(raw)}")
        return _duration_value(key, raw)
    if kind == "int" and isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if kind == "bool" and isinstance(raw, bool):
        return raw
    if kind == "str" and isinstance(raw, str):
        return raw
    if kind == "choice" and isinstance(raw, str):
        return _choice_value(key, field, raw)
    if kind == "str_list" and isinstance(raw, list):
        for index, item in enumerate(raw):
            if not isinstance(item, str):
                raise _fail(f"{key}[{index}]", f"must be a string, not {_toml_type(item)}")
        return tuple(raw)
    raise _fail(key, f"must be {expected}, not {_toml_type(raw)}")


_TRUE: Final = frozenset({"true", "1", "yes"})
_FALSE: Final = frozenset({"false", "0", "no"})


def _from_env(key: str, field: attrs.Attribute[Any], text: str) -> Any:
    """Parse an environment variable's text to its field's kind."""
    kind: _Kind = field.metadata[_KIND]
    if kind == "str":
        return text
    if kind == "int":
        if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
            raise _fail(key, f"must be an integer, not {text!r}")
        return int(text)
    if kind == "bool":
        word = text.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise _fail(key, f"must be true/false, 1/0 or yes/no, not {text!r}")
    if kind == "duration":
        return _duration_value(key, text)
    if kind == "str_list":
        return tuple(item.strip() for item in text.split(",") if item.strip())
    return _choice_value(key, field, text)


def _duration_value(key: str, raw: str | float) -> float:
    try:
        return parse_duration(raw)
    except ValueError as exc:
        raise _fail(key, str(exc)) from None


def _choice_value(key: str, field: attrs.Attribute[Any], text: str) -> str:
    word = text.strip().lower()
    if word not in field.metadata[_CHOICES]:
        raise _fail(key, _choice_problem(field, text))
    return word


def _parse_provisioners(raw: Any) -> tuple[ProvisionerConfig, ...]:
    if not isinstance(raw, list) or not all(isinstance(item, dict) for item in raw):
        raise _fail("provisioners", "must be an array of tables ([[provisioners]])")
    parsed: list[ProvisionerConfig] = []
    for index, entry in enumerate(raw):
        where = f"provisioners[{index}]"
        for key in entry:
            if key not in _PROVISIONER_KEYS:
                names = [f"{where}.{known}" for known in _PROVISIONER_KEYS]
                raise ConfigError(f"unknown key '{where}.{key}'{_suggest(f'{where}.{key}', names)}")
        for key in ("id", "plugin"):
            if key not in entry:
                raise _fail(f"{where}.{key}", "missing; every provisioner needs an id and a plugin")
            if not isinstance(entry[key], str):
                raise _fail(f"{where}.{key}", f"must be a string, not {_toml_type(entry[key])}")
        options = entry.get("options", {})
        if not isinstance(options, dict):
            raise _fail(f"{where}.options", f"must be a table, not {_toml_type(options)}")
        if not _PROVISIONER_ID.fullmatch(entry["id"]):
            raise _fail(f"{where}.id", f"{entry['id']!r} must match ^[a-z0-9][a-z0-9_.-]{{0,63}}$")
        if not entry["plugin"].strip():
            raise _fail(f"{where}.plugin", "must not be empty")
        parsed.append(ProvisionerConfig(id=entry["id"], plugin=entry["plugin"], options=options))
    return tuple(parsed)


def _suggest(name: str, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _toml_type(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, datetime.date | datetime.time):
        return "a date/time"
    return type(value).__name__
