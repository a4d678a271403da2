"""The store: hubd's only door to PostgreSQL. Nothing here imports from higher layers.

The names below are loaded on first use: importing one of the store's driver-free modules
(:mod:`~hubd.store.inputs`, :mod:`~hubd.store.rows`, :mod:`~hubd.store.connection_values`)
runs this file first, and must not load the driver with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hubd.store.allocations import AllocationStore
    from hubd.store.database import Database, connect_database
    from hubd.store.inputs import AttemptKind, Failure, ParkMode
    from hubd.store.ledger import LedgerStore
    from hubd.store.rows import (
        ACTIVE_STATUSES,
        TERMINAL_STATUSES,
        Allocation,
        EffectRow,
        Fence,
        LedgerEntry,
        Phase,
        Status,
    )

__all__ = [
    "ACTIVE_STATUSES",
    "TERMINAL_STATUSES",
    "Allocation",
    "AllocationStore",
    "AttemptKind",
    "Database",
    "EffectRow",
    "Failure",
    "Fence",
    "LedgerEntry",
    "LedgerStore",
    "ParkMode",
    "Phase",
    "Status",
    "connect_database",
]

_HOMES = {
    "AllocationStore": "allocations",
    "Database": "database",
    "connect_database": "database",
    "LedgerStore": "ledger",
    **dict.fromkeys(
        (
            "ACTIVE_STATUSES",
            "TERMINAL_STATUSES",
            "Allocation",
            "EffectRow",
            "Fence",
            "LedgerEntry",
            "Phase",
            "Status",
        ),
        "rows",
    ),
    **dict.fromkeys(("AttemptKind", "Failure", "ParkMode"), "inputs"),
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
