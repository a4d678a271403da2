"""``[http]``: the HTTP API (docs/http.md), off unless ``listen`` is set."""

from __future__ import annotations

import attrs

from hubd.config.kinds import Duration, Integer, Text, check_fields, field, problem
from hubd.units import parse_duration, parse_listen

__all__ = ["HttpConfig"]


@attrs.frozen(kw_only=True)
class HttpConfig:
    """Where the HTTP API listens and what one caller may hold of it."""

    listen: str = field(Text(), "")
    """``host:port``; empty: no HTTP API."""
    tls_cert: str = field(Text(), "")
    tls_key: str = field(Text(), "")
    max_streams_per_key: int = field(Integer(), 8)
    """Event streams and waits one key may hold open at once; more are refused with 429."""
    pool_size: int = field(Integer(), 8)
    """Database connections the HTTP API's requests share (apart from the daemon's own)."""
    database_timeout: float = field(Duration(), parse_duration("10s"))
    """How long one request's database work may take before it is answered 503."""

    def __attrs_post_init__(self) -> None:
        check_fields("http", self)
        if self.listen:
            try:
                parse_listen(self.listen)
            except ValueError as exc:
                raise problem("http.listen", str(exc)) from None
        if bool(self.tls_cert) != bool(self.tls_key):
            missing = "http.tls_key" if self.tls_cert else "http.tls_cert"
            raise problem(missing, "must be set together with the other (TLS needs both)")
        for name in ("max_streams_per_key", "pool_size"):
            value = getattr(self, name)
            if not 1 <= value <= 10_000:
                raise problem(f"http.{name}", f"must be 1 to 10000, not {value}")

    @property
    def enabled(self) -> bool:
        return bool(self.listen)

    @property
    def host(self) -> str:
        return parse_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return parse_listen(self.listen)[1]
