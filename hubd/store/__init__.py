"""The store: hubd's only door to PostgreSQL. Nothing here imports from higher layers."""

from hubd.store.allocations import AllocationStore
from hubd.store.database import Database, connect_database
from hubd.store.ledger import LedgerStore
from hubd.store.models import (
    ACTIVE_STATUSES,
    TERMINAL_STATUSES,
    Allocation,
    EffectRow,
    Fence,
    LedgerEntry,
    Phase,
    Status,
)
from hubd.store.transitions import AttemptKind, ParkMode
from hubd.store.values import Failure

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
