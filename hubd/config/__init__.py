"""Typed hubd configuration: a TOML file, then ``HUBD_<SECTION>_<KEY>`` environment overrides.

Every key has a default, so no file at all runs a single local daemon on the embedded database.
``config/hubd.toml`` documents every key with its default value (a test holds the two equal).

:mod:`~hubd.config.sections` holds the typed tables and their rules,
:mod:`~hubd.config.provisioners` the ``[[provisioners]]`` entries, :mod:`~hubd.config.root`
the whole configuration, :mod:`~hubd.config.kinds` the kinds of value a key holds, and
:mod:`~hubd.config.loading` reads the file and the environment. Every problem is one
:class:`~hubd.errors.ConfigError` whose message starts with what the operator must fix — the
dotted key, or the environment variable::

    reconciler.operation_timeout: must be shorter than reconciler.lease_duration (30s ≥ 20s)

Durations and listen addresses are parsed by :mod:`hubd.units`.
"""

from hubd.config.http import HttpConfig
from hubd.config.loading import load_config
from hubd.config.pools import PoolConfig
from hubd.config.provisioners import ProvisionerConfig
from hubd.config.root import Config, redact_url
from hubd.config.sections import (
    AdminConfig,
    DatabaseConfig,
    EventLoop,
    EventsConfig,
    InstanceConfig,
    LogConfig,
    LogFormat,
    LogLevel,
    OrphanMode,
    OrphansConfig,
    ReconcilerConfig,
    RuntimeConfig,
    ServerConfig,
    StateConfig,
    default_state_dir,
)
from hubd.tomlout import render_toml

__all__ = [
    "AdminConfig",
    "Config",
    "DatabaseConfig",
    "EventLoop",
    "EventsConfig",
    "HttpConfig",
    "InstanceConfig",
    "LogConfig",
    "LogFormat",
    "LogLevel",
    "OrphanMode",
    "OrphansConfig",
    "PoolConfig",
    "ProvisionerConfig",
    "ReconcilerConfig",
    "RuntimeConfig",
    "ServerConfig",
    "StateConfig",
    "default_state_dir",
    "load_config",
    "redact_url",
    "render_toml",
]
