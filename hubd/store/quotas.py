"""Tenant quotas: the operator's limits on what one tenant may ask for.

A row of ``hubd_tenant_quotas`` (migration 0021) bounds one tenant's allocations not yet ended
(``max_active``), those still waiting for a sidecar (``max_pending``) and its request rate (a
bucket of ``burst`` requests refilled at ``rate`` a second). The ``default`` row applies to
every tenant without a row of its own, and to requests with no tenant unless ``untenanted`` has
one; each tenant is counted on its own. The limits are enforced by ``hubd_admit_request`` in the
request's own statement, whichever replica or application makes it (docs/operations.md,
"Quotas"); here they are set, cleared and read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

from hubd.errors import InvalidRequest
from hubd.store.database import Database
from hubd.store.inputs import validate_label
from hubd.store.queries import load_queries

__all__ = ["DEFAULT", "UNTENANTED", "Quota", "QuotaScope", "Quotas", "TenantUsage"]

SQL = load_queries("quotas.sql")

DEFAULT: Final = "default"
UNTENANTED: Final = "untenanted"
MAX_RATE: Final = 1_000_000
MAX_COUNT: Final = 1_000_000_000


@attrs.frozen
class QuotaScope:
    """Whose quota: one tenant's (``tenant``), the default's, or requests with no tenant."""

    key: str

    @classmethod
    def tenant(cls, tenant_id: str) -> QuotaScope:
        checked = validate_label("tenant", tenant_id)
        if checked is None:
            raise InvalidRequest("a tenant's quota needs the tenant")
        return cls("tenant:" + checked)

    @classmethod
    def default(cls) -> QuotaScope:
        return cls(DEFAULT)

    @classmethod
    def untenanted(cls) -> QuotaScope:
        return cls(UNTENANTED)

    def describe(self) -> str:
        if self.key == DEFAULT:
            return "the default quota (every tenant without one of its own)"
        if self.key == UNTENANTED:
            return "requests with no tenant"
        return f"tenant {self.key.removeprefix('tenant:')!r}"


@attrs.frozen(kw_only=True)
class Quota:
    """One scope's limits; ``None``: no such limit."""

    scope: QuotaScope
    max_active: int | None = None
    max_pending: int | None = None
    rate: float | None = None
    burst: int | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any], key: str = "tenant_key") -> Quota:
        return cls(
            scope=QuotaScope(row[key]),
            max_active=row["max_active"],
            max_pending=row["max_pending"],
            rate=row["rate"],
            burst=row["burst"],
        )


@attrs.frozen(kw_only=True)
class TenantUsage:
    """What one tenant (or the default, or requests with no tenant) uses, and what applies."""

    scope: QuotaScope
    active: int
    pending: int
    quota: Quota | None
    """Its own quota, else the default's; ``None`` when neither exists."""
    tokens: float | None
    """What its request bucket holds now (``None``: no rate, or no request yet)."""
    admitted: int
    """Requests admitted under a quota since its bucket was (re)started."""


class Quotas:
    """Sets, clears and reads the quotas."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def set(
        self,
        scope: QuotaScope,
        *,
        max_active: int | None = None,
        max_pending: int | None = None,
        rate: float | None = None,
        burst: int | None = None,
        clear: frozenset[str] = frozenset(),
    ) -> Quota:
        """Set the limits given, keep the others, remove those named in ``clear``
        (``max_active``, ``max_pending``, ``rate``); raises :class:`InvalidRequest` naming a
        bad value."""
        for name, value in (("max_active", max_active), ("max_pending", max_pending)):
            if value is not None and not 0 <= value <= MAX_COUNT:
                raise InvalidRequest(f"{name} must be 0 to {MAX_COUNT}, not {value}")
        if (rate is None) != (burst is None):
            raise InvalidRequest("a request rate needs both a rate and a burst")
        if rate is not None and not 0 < rate <= MAX_RATE:
            raise InvalidRequest(f"rate must be above 0 and at most {MAX_RATE} a second")
        if burst is not None and not 1 <= burst <= MAX_RATE:
            raise InvalidRequest(f"burst must be 1 to {MAX_RATE}, not {burst}")
        unknown = clear - {"max_active", "max_pending", "rate"}
        if unknown:
            raise InvalidRequest(f"no such limit to clear: {', '.join(sorted(unknown))}")
        row = await self._db.fetchrow(
            "set quota",
            SQL.set_quota(
                tenant_key=scope.key,
                max_active=max_active,
                max_pending=max_pending,
                rate=None if rate is None else float(rate),
                burst=burst,
                clear_active="max_active" in clear,
                clear_pending="max_pending" in clear,
                clear_rate="rate" in clear,
            ),
        )
        assert row is not None
        return Quota.from_row(row)

    async def clear(self, scope: QuotaScope) -> bool:
        """Remove the scope's quota; whether there was one."""
        removed: bool = await self._db.fetchval(
            "clear quota", SQL.clear_quota(tenant_key=scope.key)
        )
        return removed

    async def usage(self, *, limit: int = 10_000) -> list[TenantUsage]:
        """Every tenant with allocations not yet ended or a quota of its own: the default
        first, then requests with no tenant, then tenants by name."""
        rows = await self._db.fetch("tenant usage", SQL.usage(limit=limit))
        return [
            TenantUsage(
                scope=QuotaScope(row["tenant_key"]),
                active=row["active"],
                pending=row["pending"],
                quota=None if row["quota_key"] is None else Quota.from_row(row, "quota_key"),
                tokens=row["tokens"],
                admitted=row["admitted"],
            )
            for row in rows
        ]
