"""How allocations look to people and scripts: the ``--json`` shape and the next step in words."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final

from hubd.store.allocations import FORGOTTEN
from hubd.store.rows import Allocation, LedgerEntry, Status

__all__ = ["NO_DAEMON", "allocation_json", "ledger_json", "next_step", "rfc3339"]


def rfc3339(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def allocation_json(
    allocation: Allocation, history: Sequence[LedgerEntry] | None = None
) -> dict[str, Any]:
    """The allocation as ``--json`` prints it. ``endpoint`` and ``metadata`` are what the
    current generation's provisioner or sidecar published (``None``: nothing); ``ready_when``
    is ``None`` until a claim resolves it from the provisioner's configuration."""
    data: dict[str, Any] = {
        "id": allocation.id,
        "status": str(allocation.status),
        "generation": allocation.generation,
        "provisioner": allocation.provisioner_id,
        "tenant_id": allocation.tenant_id,
        "session_id": allocation.session_id,
        "idempotency_key": allocation.idempotency_key,
        "sidecar_id": allocation.sidecar_id,
        "external_ref": allocation.external_ref,
        "ready": allocation.ready,
        "ready_when": allocation.ready_when,
        "endpoint": allocation.endpoint,
        "metadata": None if allocation.metadata is None else dict(allocation.metadata),
        "connect_deadline": rfc3339(allocation.connect_deadline),
        "next_attempt_at": rfc3339(allocation.next_attempt_at),
        "failure_code": allocation.failure_code,
        "failure_message": allocation.failure_message,
        "sidecar_exit": allocation.exit_message,
        "expires_at": rfc3339(allocation.expires_at),
        "idle_timeout": allocation.idle_timeout,
        "idle_at": rfc3339(allocation.idle_at),
        "provisioning_since": rfc3339(allocation.starting_since),
        "end_reason": allocation.end_reason,
        "pool": allocation.pool_id,
        "taken_at": rfc3339(allocation.taken_at),
        "handover_pending": allocation.handover_pending,
        "replacements": allocation.replacements,
        "spec": dict(allocation.spec),
        "created_at": rfc3339(allocation.created_at),
    }
    if history is not None:
        data["history"] = [ledger_json(entry) for entry in history]
    return data


def ledger_json(entry: LedgerEntry) -> dict[str, Any]:
    return {
        "seq": entry.seq,
        "at": rfc3339(entry.at),
        "generation": entry.generation,
        "kind": entry.kind,
        "phase": str(entry.phase),
        "from_status": entry.from_status,
        "to_status": entry.to_status,
        "error_code": entry.error_code,
        "message": entry.message,
        "duration_ms": entry.duration_ms,
        "lease_id": entry.lease_id,
        "instance_id": entry.instance_id,
    }


def _clock(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%H:%M:%SZ")


NO_DAEMON: Final = "no hubd daemon is running against this database (start `hubd run`); then: "


def next_step(allocation: Allocation, now: datetime, *, daemon_alive: bool = True) -> str:
    """What happens next to ``allocation``, as an operator would say it. ``daemon_alive``:
    whether any daemon's heartbeat is within its TTL; without one, an active allocation waits
    for one to start, whatever its schedule says."""
    step = _next_step(allocation, now)
    if daemon_alive or allocation.status.terminal:
        return step
    return NO_DAEMON + step


def _next_step(allocation: Allocation, now: datetime) -> str:
    a = allocation
    last_error = f", last error {a.failure_code}: {a.failure_message}" if a.failure_code else ""
    if a.status.terminal and a.failure_code == FORGOTTEN:
        return (
            f"nothing: forgotten by an operator ({a.failure_message}); whatever sidecar "
            f"{a.sidecar_id or '-'} left behind is the operator's to clean up"
        )
    if a.status is Status.RELEASED:
        return "nothing: released"
    if a.status is Status.FAILED:
        return f"nothing: failed ({a.failure_code}: {a.failure_message})"
    if a.status is Status.DESTROY_FAILED:
        return (
            f"an operator must check for leaked infrastructure of sidecar {a.sidecar_id} "
            f"({a.failure_code}: {a.failure_message})"
        )
    if a.lease_id is not None and a.lease_expires_at is not None and a.lease_expires_at > now:
        return f"being reconciled now (lease held until {_clock(a.lease_expires_at)})"
    if a.ready:
        return "nothing: ready, sidecar connected"
    when = a.next_attempt_at
    at = "now" if when is None or when <= now else f"at {_clock(when)}"
    if a.status is Status.PENDING:
        return f"provisioning a sidecar {at}"
    if a.status is Status.PROVISIONING:
        return f"checking an ensure whose outcome was not recorded {at}"
    if a.status is Status.ALLOCATED:
        if a.connect_deadline is not None and a.connect_deadline > now:
            return f"waiting for the sidecar to connect until {_clock(a.connect_deadline)}"
        return f"checking the sidecar's connection {at}{last_error}"
    attempt = a.destroy_attempts + (a.ensure_attempts if a.status is Status.REPLACING else 0)
    verb = "replacing the sidecar" if a.status is Status.REPLACING else "destroying the sidecar"
    if attempt:
        return f"retrying: {verb} {at}, attempt {attempt + 1}{last_error}"
    return f"{verb} {at}{last_error}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, indent: str = "") -> None:
    """``rows`` under ``headers`` in columns as wide as their widest cell, two spaces apart."""
    table = [tuple(headers), *(tuple(r) for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    for row in table:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print(indent + "  ".join(cells).rstrip())
