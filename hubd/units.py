"""The units an operator writes by hand: durations and listen addresses.

Shared by the configuration, the CLI and plugins, none of which need the others to read
``"30s"`` or ``"127.0.0.1:8765"``.
"""

from __future__ import annotations

import ipaddress
import math
import re
from decimal import Decimal
from typing import Final

__all__ = ["DURATION_HINT", "format_duration", "parse_duration", "parse_listen", "positive"]

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")
_DURATION = re.compile(rf"(?:{_DURATION_PART.pattern})+")
_UNIT_SECONDS: Final = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
}
DURATION_HINT: Final = 'write it as e.g. "500ms", "30s", "2m", "1h" or "1m30s"'


def positive(seconds: float, written: object) -> float:
    """``seconds`` if it is a positive, finite duration; else :class:`ValueError` quoting
    ``written`` (what the operator wrote)."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"must be positive, not {written!r}")
    return seconds


def parse_duration(value: str | float) -> float:
    """Parse ``"500ms"``, ``"30s"``, ``"2m"``, ``"1h"``, ``"1m30s"`` or a number of seconds.

    Returns positive, finite seconds; raises :class:`ValueError` (usable as an argparse ``type``)
    for any other text, including zero and negative durations, and :class:`TypeError` for a value
    that is neither text nor a number.
    """
    if isinstance(value, bool):
        raise TypeError(f"must be a duration, not a boolean; {DURATION_HINT}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.startswith("-"):
            raise ValueError(f"must be positive, not {value!r}")
        if not _DURATION.fullmatch(text):
            raise ValueError(f"invalid duration {value!r}; {DURATION_HINT}")
        # Summed in Decimal so that "100ms" is exactly 0.1 and "1.1s" exactly 1.1.
        seconds = float(sum(Decimal(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(text)))
    else:
        raise TypeError(f'must be a duration string such as "30s", not {type(value).__name__}')
    return positive(seconds, value)


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
