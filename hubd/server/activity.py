"""A sidecar's ``activity`` (architecture §4): its allocation's idle clock starts again.

Activity is reported often (a sidecar may say so on every request it serves), so the hub
writes little for it: the reports of every socket that arrive while one statement runs go in
the next (:class:`~hubd.server.batching.Batcher`), and the statement itself leaves a clock
restarted within the last second as it is. What decides that an allocation went idle is the
database's clock and the row (the deadline sweep), never this process's memory: a report this
hub has not written yet when it stops is lost, and costs at most the second it would have
added.
"""

from __future__ import annotations

from hubd.errors import BatchFull, StoreError
from hubd.redaction import describe_error
from hubd.routing import Target
from hubd.server.batching import Batcher
from hubd.server.sockets import SocketEntry
from hubd.store.connections import ConnectionStore

__all__ = ["ActivityRecorder"]


class ActivityRecorder:
    """Writes sidecars' activity, batched across sockets."""

    def __init__(self, connections: ConnectionStore, *, timeout: float) -> None:
        self.batcher: Batcher[Target, bool] = Batcher(
            connections.record_activity,
            name="sidecar-activity",
            timeout=timeout,
            max_waiting=16384,
        )

    async def record(self, entry: SocketEntry) -> bool | None:
        """``entry``'s sidecar showed activity. ``True``: its idle clock runs from now (or
        from less than a second ago); ``False``: it has none (no idle timeout, not allocated,
        or the socket's generation is no longer current); ``None``: not known, the database
        did not answer in time (the socket stays open: a lost report is not a protocol
        fault, and the sidecar reports again)."""
        try:
            recorded = await self.batcher.request(entry.target)
        except (StoreError, TimeoutError, BatchFull) as exc:
            entry.log.warning("sidecar_activity_not_recorded", error=describe_error(exc))
            return None
        return bool(recorded)

    async def close(self) -> None:
        await self.batcher.close()
