"""What the application API returns: an allocation as ``hubd_v1.allocations`` shows it, and an
event of the feed. Both are read-only values; neither carries a token, a secret or a lease."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import attrs

__all__ = ["TERMINAL", "AllocationInfo", "Event"]

TERMINAL = frozenset({"released", "failed", "destroy_failed"})
"""Statuses an allocation never leaves."""


def _json_object(value: object) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        # A caller's connection without a JSON codec hands jsonb over as text.
        value = json.loads(value)
    assert isinstance(value, Mapping)
    return value


@attrs.frozen(kw_only=True)
class AllocationInfo:
    """One row of ``hubd_v1.allocations``."""

    id: str
    status: str
    """pending, provisioning, allocated, replacing, releasing, released, failed, destroy_failed."""
    ready: bool
    """Allocated, and its current sidecar connected (and, with ``ready_when = 'declared'``, said
    it is ready); false again as soon as it is lost."""
    generation: int
    """Bumped whenever the sidecar is abandoned (replacement, release)."""
    provisioner: str
    tenant: str | None
    session: str | None
    spec: Mapping[str, Any]
    idempotency_key: str | None
    ready_when: str | None
    endpoint: str | None
    """Where the current generation's sidecar serves, as its provisioner or sidecar published."""
    metadata: Mapping[str, Any] | None
    failure_code: str | None
    failure_message: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    expires_at: datetime | None = None
    """When it must end (its lifetime, or an extension; :meth:`Client.extend`); ``None``:
    never."""
    end_reason: str | None = None
    """Once it ends (or a release began): who or what ended it: ``application``, ``operator``,
    ``expired``, ``idle``, ``unserved``, ``provisioning_timeout``, or a failure's code."""
    idle_timeout: timedelta | None = None
    """How long it may show no activity once ready (``None``: for ever)."""
    idle_at: datetime | None = None
    """While allocated: when it ends ``idle`` unless its sidecar reports activity or
    :meth:`Client.touch` / :meth:`Client.extend` is called first."""
    warm: bool = False
    """The request took a ready member of a warm pool (docs/pools.md), rather than waiting
    for a sidecar of its own."""

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> AllocationInfo:
        values: dict[str, Any] = {
            field.name: row[field.name] if field.default is attrs.NOTHING else row.get(field.name)
            for field in attrs.fields(cls)
        }
        values["spec"] = _json_object(values["spec"]) or {}
        values["metadata"] = _json_object(values["metadata"])
        return cls(**values)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


@attrs.frozen(kw_only=True)
class Event:
    """One event of the feed: what an allocation became, at the commit that made it so.

    ``position`` is the feed's cursor: positions grow in commit order, and reading after a
    position returns every later event, whenever its transaction began.
    """

    position: int
    at: datetime
    allocation_id: str
    tenant: str | None
    session: str | None
    event: str
    """requested, provisioning, allocated, ready, not_ready, replacing, releasing, published,
    expiring, extended, released, failed or destroy_failed."""
    status: str
    ready: bool
    generation: int
    endpoint: str | None
    metadata: Mapping[str, Any] | None
    failure_code: str | None
    failure_message: str | None
    expires_at: datetime | None = None
    end_reason: str | None = None
    idle_at: datetime | None = None
    warm: bool = False
    """The allocation was taken from a warm pool."""

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Event:
        values: dict[str, Any] = {
            field.name: row[field.name] if field.default is attrs.NOTHING else row.get(field.name)
            for field in attrs.fields(cls)
        }
        values["metadata"] = _json_object(values["metadata"])
        return cls(**values)
