"""The whole configuration: every section, the provisioners, and how it is shown back.

``Config()`` is the default configuration; :meth:`Config.to_display_dict` renders the effective
one as the config file writes it, with secrets replaced.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any, Final

import attrs

from hubd.config.http import HttpConfig
from hubd.config.kinds import kind_of, problem
from hubd.config.pools import PoolConfig
from hubd.config.provisioners import ProvisionerConfig
from hubd.config.sections import (
    AdminConfig,
    DatabaseConfig,
    EventsConfig,
    InstanceConfig,
    LogConfig,
    OrphansConfig,
    ReconcilerConfig,
    RuntimeConfig,
    ServerConfig,
    StateConfig,
)
from hubd.redaction import REDACTED as _REDACTED
from hubd.redaction import redact_dsn
from hubd.units import format_duration

__all__ = ["SECTIONS", "Config", "redact_url"]

redact_url = redact_dsn

_SECRET_WORDS: Final = ("password", "secret", "token")


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
    http: HttpConfig = attrs.field(factory=HttpConfig)
    reconciler: ReconcilerConfig = attrs.field(factory=ReconcilerConfig)
    instance: InstanceConfig = attrs.field(factory=InstanceConfig)
    orphans: OrphansConfig = attrs.field(factory=OrphansConfig)
    events: EventsConfig = attrs.field(factory=EventsConfig)
    runtime: RuntimeConfig = attrs.field(factory=RuntimeConfig)
    provisioners: tuple[ProvisionerConfig, ...] = attrs.field(factory=_default_provisioners)
    pools: tuple[PoolConfig, ...] = ()
    log: LogConfig = attrs.field(factory=LogConfig)

    def __attrs_post_init__(self) -> None:
        seen: dict[str, int] = {}
        for index, provisioner in enumerate(self.provisioners):
            if provisioner.id in seen:
                raise problem(
                    f"provisioners[{index}].id",
                    f"duplicate provisioner id {provisioner.id!r} "
                    f"(also provisioners[{seen[provisioner.id]}])",
                )
            seen[provisioner.id] = index
        pools: dict[str, int] = {}
        matched: dict[tuple[str, str], int] = {}
        for index, pool in enumerate(self.pools):
            if pool.id in pools:
                raise problem(
                    f"pools[{index}].id",
                    f"duplicate pool id {pool.id!r} (also pools[{pools[pool.id]}])",
                )
            pools[pool.id] = index
            if pool.provisioner not in seen:
                raise problem(
                    f"pools[{index}].provisioner",
                    f"{pool.provisioner!r:.80} is no provisioner of this configuration",
                )
            # A request matches a pool by provisioner and spec: two alike pools would split it.
            key = (pool.provisioner, json.dumps(pool.spec, sort_keys=True))
            if key in matched:
                raise problem(
                    f"pools[{index}]",
                    f"same provisioner and spec as pools[{matched[key]}]",
                )
            matched[key] = index

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
        for name in SECTIONS:
            section = getattr(self, name)
            table: dict[str, Any] = {}
            for attribute in attrs.fields(type(section)):
                value = getattr(section, attribute.name)
                table[attribute.name] = kind_of(attribute).display(value)
            out[name] = table
        out["database"]["url"] = redact_url(self.database.url)
        provisioners = [
            {
                "id": p.id,
                "plugin": p.plugin,
                "ready_when": p.ready_when,
                "max_lifetime": "" if p.max_lifetime is None else format_duration(p.max_lifetime),
                "idle_timeout": "" if p.idle_timeout is None else format_duration(p.idle_timeout),
                "provisioning_timeout": (
                    ""
                    if p.provisioning_timeout is None
                    else format_duration(p.provisioning_timeout)
                ),
                "options": _redact_options(p.options),
            }
            for p in self.provisioners
        ]
        pools = [
            {
                "id": p.id,
                "provisioner": p.provisioner,
                "spec": p.spec,
                "size": p.size,
                "refill_rate": p.refill_rate,
                "miss": p.miss,
                "miss_wait": "" if not p.miss_wait else format_duration(p.miss_wait),
            }
            for p in self.pools
        ]
        # Rebuilt so that provisioners come before [log], as in config/hubd.toml; no pools is
        # no [[pools]] at all (TOML has no empty array of tables).
        log = out.pop("log")
        return {
            **out,
            "provisioners": provisioners,
            **({"pools": pools} if pools else {}),
            "log": log,
        }


SECTIONS: Final[Mapping[str, type[Any]]] = {
    "database": DatabaseConfig,
    "state": StateConfig,
    "server": ServerConfig,
    "admin": AdminConfig,
    "http": HttpConfig,
    "reconciler": ReconcilerConfig,
    "instance": InstanceConfig,
    "orphans": OrphansConfig,
    "events": EventsConfig,
    "runtime": RuntimeConfig,
    "log": LogConfig,
}
