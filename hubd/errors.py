"""Every error hubd raises on purpose.

::

    HubdError
     ├── ConfigError (ValueError)         invalid configuration; the CLI exits 2
     ├── EmbeddedPostgresError            the embedded server cannot be had
     ├── StoreError                       the database refused or failed a statement
     │    ├── DatabaseUnavailable (ConnectionError)   unreachable; "unknown", never "absent"
     │    │    └── DatabaseReadOnly                   only a read-only server answered
     │    ├── AllocationNotFound (LookupError)        no allocation with that id
     │    ├── SchemaMissing                           the database was never migrated
     │    ├── EventCursorExpired                      a cursor older than the feed keeps
     │    ├── QuotaExceeded                           the tenant's quota refused a request
     │    ├── PoolEmpty                               a warm pool refused a miss
     │    └── InvalidRequest (ValueError)             bad input to the store
     │         └── IdempotencyConflict                the key names another request
     ├── LeaseLost                        a claim no longer owns its allocation
     ├── SidecarNotConnected              no sidecar connect came within a wait
     ├── OperationTimeout (TimeoutError)  an external operation outlived operation_timeout
     ├── BatchFull (TimeoutError)         too many requests wait for a batched statement
     ├── PluginError                      a provisioner plugin misbehaved
     │    └── PluginLoadError             a plugin cannot be loaded or is misconfigured
     └── InitializationUncertain          an on-ready hook may have left work behind

Messages never carry secrets (tokens, passwords): callers redact before raising.
"""

from __future__ import annotations

import re

__all__ = [
    "API_SQLSTATES",
    "AllocationNotFound",
    "BatchFull",
    "ConfigError",
    "DatabaseReadOnly",
    "DatabaseUnavailable",
    "EmbeddedPostgresError",
    "EventCursorExpired",
    "HubdError",
    "IdempotencyConflict",
    "InitializationUncertain",
    "InvalidRequest",
    "LeaseLost",
    "OperationTimeout",
    "PluginError",
    "PluginLoadError",
    "PoolEmpty",
    "QuotaExceeded",
    "SchemaMissing",
    "SidecarNotConnected",
    "StoreError",
]


class HubdError(Exception):
    """An error raised by hubd."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message if message is not None else (self.__doc__ or "").strip())


class ConfigError(HubdError, ValueError):
    """The configuration is invalid."""


class EmbeddedPostgresError(HubdError):
    """The embedded PostgreSQL server could not be started."""


class StoreError(HubdError):
    """The database failed a statement."""


class DatabaseUnavailable(StoreError, ConnectionError):
    """The database cannot be reached right now."""


class DatabaseReadOnly(DatabaseUnavailable):
    """The server that answered is read-only (a standby, or ``default_transaction_read_only``):
    as unavailable as one that does not answer, since hubd's every step writes."""


class AllocationNotFound(StoreError, LookupError):
    """No allocation has that id."""


class SchemaMissing(StoreError):
    """no hubd schema here: run `hubd migrate` or start `hubd run` once"""


class InvalidRequest(StoreError, ValueError):
    """The request is malformed."""


class IdempotencyConflict(InvalidRequest):
    """The idempotency key already names an allocation requested differently."""


class QuotaExceeded(StoreError):
    """The tenant's quota refused the request (docs/api.md, ``HU429``): the message names the
    limit (``max_active``, ``max_pending`` or the request rate), the tenant, and when to retry;
    ``retry_after`` is that wait in seconds when the rate refused it, else ``None``."""

    @property
    def retry_after(self) -> float | None:
        found = re.search(r"retry in ([0-9.]+) s", str(self))
        return float(found.group(1)) if found else None


class PoolEmpty(StoreError):
    """The request's warm pool had no member ready and refuses a miss (docs/api.md, ``HU503``);
    ``retry_after`` is the wait its message names, in seconds."""

    @property
    def retry_after(self) -> float | None:
        found = re.search(r"retry in ([0-9.]+) s", str(self))
        return float(found.group(1)) if found else None


class EventCursorExpired(StoreError):
    """The event cursor is older than the feed keeps: read the state again, then follow on."""


class LeaseLost(HubdError):
    """The claim no longer owns its allocation's lease."""


class SidecarNotConnected(HubdError):
    """The sidecar did not connect before its connect deadline."""


class OperationTimeout(HubdError, TimeoutError):
    """An external operation did not finish within operation_timeout."""


class BatchFull(HubdError, TimeoutError):
    """Too many requests wait for a batched statement: this one would not be answered in time."""


class PluginError(HubdError):
    """A provisioner plugin misbehaved."""


class PluginLoadError(PluginError):
    """A provisioner plugin could not be loaded."""


class InitializationUncertain(HubdError):
    """The on-ready hook failed in a way that may have left work behind; replace the sidecar."""


API_SQLSTATES: dict[str, type[StoreError]] = {
    "22023": InvalidRequest,  # invalid_parameter_value: a request's check, naming the argument
    "P0002": AllocationNotFound,  # no_data_found: no allocation has that id
    "HU409": IdempotencyConflict,
    "HU410": EventCursorExpired,
    "HU429": QuotaExceeded,
    "HU503": PoolEmpty,
}
"""The SQLSTATEs the application API (``hubd_v1``, docs/api.md) raises, by the error each is."""
