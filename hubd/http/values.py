"""What the HTTP API reads and writes: request bodies checked field by field, allocations and
events as JSON (the columns of ``hubd_v1.allocations`` and ``hubd_v1.events``, docs/api.md)."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta
from typing import Any

import attrs

from hubd.client import AllocationInfo, Event
from hubd.http.errors import ApiError

__all__ = ["NewAllocation", "allocation_json", "event_json", "seconds_field", "text_field"]


@attrs.frozen(kw_only=True)
class NewAllocation:
    provisioner: str
    tenant: str | None
    session: str | None
    spec: dict[str, Any]
    idempotency_key: str | None
    ready_when: str | None
    lifetime: timedelta | None
    idle_timeout: timedelta | None

    @classmethod
    def from_body(cls, body: object, *, idempotency_key: str | None) -> NewAllocation:
        """A create request's body; the ``Idempotency-Key`` header, when given, must agree
        with a key in the body."""
        if not isinstance(body, dict):
            raise _invalid("the body must be a JSON object")
        unknown = sorted(set(body) - _CREATE_FIELDS)
        if unknown:
            raise _invalid(f"unknown field {unknown[0]!r:.60}")
        spec = body.get("spec", {})
        if spec is None:
            spec = {}
        if not isinstance(spec, dict):
            raise _invalid("spec must be a JSON object")
        key = text_field(body, "idempotency_key")
        if idempotency_key is not None and key is not None and key != idempotency_key:
            raise _invalid("the Idempotency-Key header and idempotency_key differ")
        provisioner = text_field(body, "provisioner")
        if provisioner is None:
            raise _invalid("provisioner is required")
        return cls(
            provisioner=provisioner,
            tenant=text_field(body, "tenant"),
            session=text_field(body, "session"),
            spec=spec,
            idempotency_key=key or idempotency_key,
            ready_when=text_field(body, "ready_when"),
            lifetime=seconds_field(body, "lifetime_s"),
            idle_timeout=seconds_field(body, "idle_timeout_s"),
        )


_CREATE_FIELDS = frozenset(
    {
        "provisioner",
        "tenant",
        "session",
        "spec",
        "idempotency_key",
        "ready_when",
        "lifetime_s",
        "idle_timeout_s",
    }
)


def text_field(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _invalid(f"{name} must be a string")
    return value


def seconds_field(body: dict[str, Any], name: str) -> timedelta | None:
    """A duration in seconds: a positive finite number, at most ten years."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(f"{name} must be a number of seconds")
    if not math.isfinite(value) or not 0 < value <= 315_360_000:
        raise _invalid(f"{name} must be a positive number of seconds, at most ten years")
    return timedelta(seconds=value)


def allocation_json(info: AllocationInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "status": info.status,
        "ready": info.ready,
        "generation": info.generation,
        "provisioner": info.provisioner,
        "tenant": info.tenant,
        "session": info.session,
        "spec": dict(info.spec),
        "idempotency_key": info.idempotency_key,
        "ready_when": info.ready_when,
        "endpoint": info.endpoint,
        "metadata": None if info.metadata is None else dict(info.metadata),
        "failure_code": info.failure_code,
        "failure_message": info.failure_message,
        "created_at": _time(info.created_at),
        "updated_at": _time(info.updated_at),
        "finished_at": _time(info.finished_at),
        "expires_at": _time(info.expires_at),
        "end_reason": info.end_reason,
        "idle_timeout_s": None if info.idle_timeout is None else info.idle_timeout.total_seconds(),
        "idle_at": _time(info.idle_at),
        "warm": info.warm,
    }


def event_json(event: Event) -> str:
    return json.dumps(
        {
            "position": event.position,
            "at": _time(event.at),
            "allocation_id": event.allocation_id,
            "tenant": event.tenant,
            "session": event.session,
            "event": event.event,
            "status": event.status,
            "ready": event.ready,
            "generation": event.generation,
            "endpoint": event.endpoint,
            "metadata": None if event.metadata is None else dict(event.metadata),
            "failure_code": event.failure_code,
            "failure_message": event.failure_message,
            "expires_at": _time(event.expires_at),
            "idle_at": _time(event.idle_at),
            "end_reason": event.end_reason,
            "warm": event.warm,
        }
    )


def _time(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request", message)
