"""The ``[[pools]]`` entries: warm pools the daemons keep full (docs/pools.md)."""

from __future__ import annotations

import json
import re
from typing import Any, Final

import attrs

from hubd.config.kinds import Duration, problem, toml_type

__all__ = ["MAX_POOL_SIZE", "PoolConfig", "parse_pools"]

_POOL_ID: Final = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_KEYS: Final = ("id", "provisioner", "spec", "size", "refill_rate", "miss", "miss_wait")
MISSES: Final = ("cold", "wait", "refuse")
MAX_MISS_WAIT: Final = 30.0
MAX_POOL_SIZE: Final = 100_000
MAX_REFILL_RATE: Final = 100_000.0
DEFAULT_REFILL_RATE: Final = 20.0
_MAX_SPEC_BYTES: Final = 65_536


@attrs.frozen(kw_only=True)
class PoolConfig:
    """One ``[[pools]]`` entry: ``size`` ready allocations of ``provisioner`` with ``spec``,
    made again at most ``refill_rate`` a second as requests take them."""

    id: str
    provisioner: str
    spec: dict[str, Any] = attrs.field(factory=dict, hash=False)
    size: int
    refill_rate: float = DEFAULT_REFILL_RATE
    miss: str = "cold"
    """What a request does when no member is ready: ``cold`` (made as without a pool),
    ``wait`` (looks again for up to ``miss_wait`` seconds, then cold) or ``refuse`` (HU503)."""
    miss_wait: float = 0.0


def parse_pools(raw: Any) -> tuple[PoolConfig, ...]:
    """The ``[[pools]]`` array of the config file; a :class:`~hubd.errors.ConfigError` naming
    the entry and key at fault."""
    if not isinstance(raw, list) or not all(isinstance(item, dict) for item in raw):
        raise problem("pools", "must be an array of tables ([[pools]])")
    parsed: list[PoolConfig] = []
    for index, entry in enumerate(raw):
        where = f"pools[{index}]"
        for key in entry:
            if key not in _KEYS:
                raise problem(f"{where}.{key}", f"unknown key; a pool has {', '.join(_KEYS)}")
        for key in ("id", "provisioner"):
            if not isinstance(entry.get(key), str):
                raise problem(
                    f"{where}.{key}",
                    "missing"
                    if key not in entry
                    else f"must be a string, not {toml_type(entry[key])}",
                )
        if not _POOL_ID.fullmatch(entry["id"]):
            raise problem(
                f"{where}.id", f"{entry['id']!r:.80} must match ^[a-z0-9][a-z0-9_.-]{{0,63}}$"
            )
        spec = entry.get("spec", {})
        if not isinstance(spec, dict):
            raise problem(f"{where}.spec", f"must be a table, not {toml_type(spec)}")
        try:
            encoded = json.dumps(spec)
        except (TypeError, ValueError):
            raise problem(
                f"{where}.spec", "must hold JSON values only (no dates or times)"
            ) from None
        if len(encoded.encode()) > _MAX_SPEC_BYTES:
            raise problem(f"{where}.spec", "is larger than 64 KiB as JSON")
        size = entry.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_POOL_SIZE:
            raise problem(
                f"{where}.size",
                f"must be a whole number from 0 to {MAX_POOL_SIZE}, not {size!r:.40}",
            )
        rate = entry.get("refill_rate", DEFAULT_REFILL_RATE)
        if (
            isinstance(rate, bool)
            or not isinstance(rate, int | float)
            or not 0 < rate <= MAX_REFILL_RATE
        ):
            raise problem(
                f"{where}.refill_rate",
                f"must be a number of members a second above 0 and at most {MAX_REFILL_RATE:g}, "
                f"not {rate!r:.40}",
            )
        miss = entry.get("miss", "cold")
        if miss not in MISSES:
            raise problem(f"{where}.miss", f'must be "cold", "wait" or "refuse", not {miss!r:.40}')
        raw_wait = entry.get("miss_wait", "")
        miss_wait = (
            0.0 if raw_wait == "" else float(Duration().from_toml(f"{where}.miss_wait", raw_wait))
        )
        if not 0 <= miss_wait <= MAX_MISS_WAIT:
            raise problem(
                f"{where}.miss_wait", f'must be "" or a duration up to {MAX_MISS_WAIT:g}s'
            )
        if miss == "wait" and miss_wait == 0:
            raise problem(f"{where}.miss_wait", 'must be a duration with miss = "wait"')
        parsed.append(
            PoolConfig(
                id=entry["id"],
                provisioner=entry["provisioner"],
                spec=spec,
                size=size,
                refill_rate=float(rate),
                miss=miss,
                miss_wait=miss_wait,
            )
        )
    return tuple(parsed)
