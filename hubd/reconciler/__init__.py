"""The reconciler: the allocation state machine, its leases, fences and per-allocation queue."""
