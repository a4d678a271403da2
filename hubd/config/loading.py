"""Loading the configuration: a TOML file, then ``HUBD_<SECTION>_<KEY>`` overrides.

A pure function of (file contents, environment): each value is parsed by its key's kind, the
environment is laid over the file, and the sections are built (and check their own rules).
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Iterator, Mapping
from typing import Any, Final

from hubd.config.kinds import Duration, kind_of, problem, toml_type
from hubd.config.pools import PoolConfig, parse_pools
from hubd.config.provisioners import READY_WHEN_CONNECTED, ProvisionerConfig, provisioner_problem
from hubd.config.root import SECTIONS, Config
from hubd.config.sections import fields_of
from hubd.errors import ConfigError

__all__ = ["load_config"]

_ALL_SECTIONS: Final = (*SECTIONS, "provisioners", "pools")
_PROVISIONER_KEYS: Final = (
    "id",
    "plugin",
    "ready_when",
    "max_lifetime",
    "idle_timeout",
    "provisioning_timeout",
    "options",
)


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
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    provisioners: tuple[ProvisionerConfig, ...] | None = None
    pools: tuple[PoolConfig, ...] = ()
    for name, table in document.items():
        if name == "provisioners":
            provisioners = _parse_provisioners(table)
            continue
        if name == "pools":
            pools = parse_pools(table)
            continue
        section = SECTIONS.get(name)
        if section is None:
            raise ConfigError(f"unknown section {name!r}{_suggest(name, _ALL_SECTIONS)}")
        if not isinstance(table, dict):
            raise problem(name, f"must be a table ([{name}]), not {toml_type(table)}")
        fields = fields_of(section)
        for key, raw in table.items():
            attribute = fields.get(key)
            if attribute is None:
                names = [f"{name}.{other}" for other in fields]
                raise ConfigError(f"unknown key '{name}.{key}'{_suggest(f'{name}.{key}', names)}")
            values[name][key] = kind_of(attribute).from_toml(f"{name}.{key}", raw)
    for name, key, value in _env_overrides(env):
        values[name][key] = value
    sections = {name: section(**values[name]) for name, section in SECTIONS.items()}
    if provisioners is None:
        return Config(**sections, pools=pools)
    return Config(**sections, provisioners=provisioners, pools=pools)


def _env_overrides(env: Mapping[str, str]) -> Iterator[tuple[str, str, Any]]:
    """``(section, key, parsed value)`` for every ``HUBD_<SECTION>_<KEY>`` variable.

    Only that shape is read: a name with no key part, or whose first word names no section, is
    someone else's (a sidecar's ``HUBD_TOKEN``, a script's ``HUBD_LOG``). A known section with an
    unknown key is refused, naming the variable: that is a typo of an override.
    """
    for variable in sorted(env):
        if not variable.startswith("HUBD_") or variable == "HUBD_CONFIG":
            continue
        name, _, key = variable.removeprefix("HUBD_").lower().partition("_")
        if not key:
            # HUBD_LOG=1, HUBD_DEBUG: not of the override's shape, so not meant for us; an
            # unrelated variable that happens to share the prefix must not stop every command.
            continue
        if name in ("provisioners", "pools"):
            raise ConfigError(
                f"{variable}: {name} cannot be set from the environment; use the config file"
            )
        section = SECTIONS.get(name)
        if section is None:
            # HUBD_TOKEN, HUBD_URL, HUBD_SIDECAR_ID, ...: a sidecar's environment, not ours.
            continue
        fields = fields_of(section)
        attribute = fields.get(key)
        if attribute is None:
            names = [f"HUBD_{name}_{other}".upper() for other in fields]
            raise ConfigError(f"{variable}: unknown key '{name}.{key}'{_suggest(variable, names)}")
        where = f"{name}.{key} (from {variable})"
        yield name, key, kind_of(attribute).from_env(where, env[variable])


def _parse_provisioners(raw: Any) -> tuple[ProvisionerConfig, ...]:
    if not isinstance(raw, list) or not all(isinstance(item, dict) for item in raw):
        raise problem("provisioners", "must be an array of tables ([[provisioners]])")
    parsed: list[ProvisionerConfig] = []
    for index, entry in enumerate(raw):
        where = f"provisioners[{index}]"
        for key in entry:
            if key not in _PROVISIONER_KEYS:
                names = [f"{where}.{known}" for known in _PROVISIONER_KEYS]
                raise ConfigError(f"unknown key '{where}.{key}'{_suggest(f'{where}.{key}', names)}")
        for key in ("id", "plugin"):
            if key not in entry:
                raise problem(
                    f"{where}.{key}", "missing; every provisioner needs an id and a plugin"
                )
            if not isinstance(entry[key], str):
                raise problem(f"{where}.{key}", f"must be a string, not {toml_type(entry[key])}")
        options = entry.get("options", {})
        if not isinstance(options, dict):
            raise problem(f"{where}.options", f"must be a table, not {toml_type(options)}")
        ready_when = entry.get("ready_when", READY_WHEN_CONNECTED)
        # Checked here as well as by the record, so the error names the entry's index.
        broken = provisioner_problem(entry["id"], entry["plugin"], ready_when)
        if broken is not None:
            raise problem(f"{where}.{broken[0]}", broken[1])
        parsed.append(
            ProvisionerConfig(
                id=entry["id"],
                plugin=entry["plugin"],
                ready_when=ready_when,
                options=options,
                max_lifetime=_positive(f"{where}.max_lifetime", entry.get("max_lifetime", "")),
                idle_timeout=_positive(f"{where}.idle_timeout", entry.get("idle_timeout", "")),
                provisioning_timeout=_positive(
                    f"{where}.provisioning_timeout", entry.get("provisioning_timeout", "")
                ),
            )
        )
    return tuple(parsed)


def _positive(where: str, raw: object) -> float | None:
    """A provisioner's ``max_lifetime``, ``idle_timeout`` or ``provisioning_timeout``: ``""``
    for none, else a positive duration."""
    if raw == "":
        return None
    seconds = float(Duration().from_toml(where, raw))
    if seconds <= 0:
        raise problem(where, f'must be a positive duration or "" for none, not {raw!r}')
    return seconds


def _suggest(name: str, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
