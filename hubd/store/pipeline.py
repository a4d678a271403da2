"""Fenced transitions that arrive together go to the database together.

With many claims in flight, several of them write the same transition at the same moment (bind
a sidecar, park, mark released). Each alone costs a round trip, a pooled connection, a commit and
PostgreSQL's executor set-up; the statements differ only in their arguments. A
:class:`Pipeline` runs every execution of its statement that was asked for while the previous
batch ran as one pipelined ``fetchmany``: one round trip and one transaction, each execution
still its own fenced statement, with its own fence checked at the moment it runs. As with
:mod:`hubd.server.batching`, no timer decides when a batch goes: the first request finds
nothing running and goes at once.

Pipelined, each execution still pays PostgreSQL's executor set-up, which for these
multi-part statements is about as much as the row's own work. A transition whose statement is
written in set form (each parameter an array, one element per row: ``park``, ``mark_released``)
runs a whole batch, or a single request, as one execution of it. Such a statement checks each
row's fence on that row alone, locks the rows one by one in allocation id order before it
writes, and returns the rows it wrote.

Why a batch is safe:

- **Fences.** Each execution is the single-row statement, unchanged (in set form, each row's
  part of the statement, with the conditions of its own fence): it matches only while its
  lease is live and its generation current. A row it updated stays locked until the batch
  commits, so nobody can claim or write that row between the check and the commit: the same
  argument as for one statement, over a longer transaction.
- **Lock order.** A batch holds one row per allocation and runs them in allocation id order,
  so it takes allocation rows in id order and each allocation's connection record (through the
  socket-control trigger) after its allocation: the order every multi-row statement keeps
  (``sql/connections.sql``). A set form locks every row of its batch in id order before it
  writes, and the trigger's records follow at the statement's end, as ``disconnect_many`` and
  ``sweep_stale`` take theirs. Two requests for the same allocation never share a batch.
- **Failures.** An error of one execution aborts the batch's transaction, so nothing of it
  commits; each request is then run again on its own, so an error reaches only the request
  that caused it. An error of the connection or the server reaches every request of the batch:
  whether it committed is unknown, as for a single statement, and every write is fenced, so a
  caller that retries finds the row as it stands.
- **Cancellation.** A request cancelled before its batch starts is dropped and never runs. One
  cancelled while its batch runs waits for the batch to end before it gives up: its write may
  still commit, and the task that asked must stay in flight until that is decided (the claim's
  local work keeps the allocation out of claims until then).
"""

from __future__ import annotations

import asyncio
from collections import deque

import asyncpg
import attrs
from asyncpg import Record

from hubd.store.database import Database
from hubd.store.driver_errors import is_unavailable, translate_errors
from hubd.store.queries import Bound, Statement

__all__ = ["Pipeline"]


@attrs.define(eq=False)
class _Request:
    allocation_id: str
    query: Bound
    future: asyncio.Future[Record | None]
    batch: _Batch | None = None
    """The batch that took the request, once one has."""
    abandoned: bool = False


@attrs.define(eq=False)
class _Batch:
    requests: list[_Request]
    task: asyncio.Task[None]


class Pipeline:
    """Runs ``statement`` (a fenced transition returning at most the allocation's row) for
    every request made while the previous batch ran."""

    def __init__(
        self, db: Database, statement: Statement, *, set_form: bool = False, max_batch: int = 32
    ) -> None:
        """``set_form``: ``statement`` takes each of its parameters as an array, element i for
        the batch's row i, so a batch of any size is one execution of it; a request's query
        holds its own row's values. Otherwise a batch is ``statement`` pipelined once per row."""
        self._db = db
        self._statement = statement
        self._set_form = set_form
        self._max_batch = max_batch
        self._waiting: deque[_Request] = deque()
        self._runner: asyncio.Task[None] | None = None
        self.batches = 0
        """Batches run so far."""
        self.carried = 0
        """Requests those batches carried."""
        self.executions = 0
        """Statements those batches executed: one a batch in the set form, else one a row."""

    @property
    def name(self) -> str:
        """The statement's name (``bind_initial_sidecar``, ``park``...)."""
        return self._statement.name

    @property
    def waiting(self) -> int:
        """Requests waiting for the next batch."""
        return len(self._waiting)

    async def fetchrow(self, what: str, allocation_id: str, query: Bound) -> Record | None:
        """The row ``query`` returned for ``allocation_id``, or ``None`` if it matched nothing.

        Raises what :func:`~hubd.store.database.translate_errors` makes of the driver's error.
        """
        if query.statement is not self._statement:
            raise ValueError(f"{what}: a pipeline of {self._statement.name} was given another")
        loop = asyncio.get_running_loop()
        request = _Request(allocation_id, query, loop.create_future())
        self._waiting.append(request)
        if self._runner is None:
            # Owned here: it ends on its own once nobody waits, and every request it took
            # waits for its batch, so it never outlives its callers.
            self._runner = loop.create_task(self._run(what), name=f"pipeline {what}")
        try:
            return await request.future
        except asyncio.CancelledError:
            batch = request.batch
            if batch is None:
                self._waiting.remove(request)
                raise
            # The write may still commit: stay until that is decided. A batch every one of
            # whose requests gave up is cancelled, as a single statement would be.
            request.abandoned = True
            if all(each.abandoned for each in batch.requests):
                batch.task.cancel()
            await _outlast(batch.task)
            raise

    async def _run(self, what: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                requests = self._take()
                batch = _Batch(requests, loop.create_task(self._carry(what, requests)))
                for request in requests:
                    request.batch = batch
                # The batch's own task, so that cancelling it (all its requests gave up)
                # leaves this runner to carry the requests that came meanwhile.
                await asyncio.wait({batch.task})
                # Each request refers to its batch and the batch to its requests: emptied, the
                # requests (their rows, their futures) are freed as their callers return,
                # without waiting for the garbage collector. A request cancelled from now on
                # finds its batch ended, with nothing left to abandon.
                batch.requests = []
        finally:
            self._runner = None

    def _take(self) -> list[_Request]:
        taken: dict[str, _Request] = {}
        later: list[_Request] = []
        while self._waiting and len(taken) < self._max_batch:
            request = self._waiting.popleft()
            if request.allocation_id in taken:
                later.append(request)
            else:
                taken[request.allocation_id] = request
        self._waiting.extendleft(reversed(later))
        self.batches += 1
        self.carried += len(taken)
        return [taken[key] for key in sorted(taken)]

    async def _carry(self, what: str, batch: list[_Request]) -> None:
        try:
            async with self._db.connection(what) as conn:
                if len(batch) == 1:
                    only = batch[0]
                    _answer(only, await self._fetchrow(conn, only))
                    return
                try:
                    rows = await self._execute(conn, batch)
                except asyncpg.PostgresError as exc:
                    if is_unavailable(exc):
                        raise
                    # One row's error took the batch's transaction with it: run each on its
                    # own, so its error reaches only the request that caused it.
                    await self._one_by_one(what, conn, batch)
                    return
                by_id = {row["id"]: row for row in rows}
                for request in batch:
                    _answer(request, by_id.get(request.allocation_id))
        except Exception as exc:  # noqa: BLE001 -- handed to each waiting request to raise
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
        except asyncio.CancelledError:
            for request in batch:
                request.future.cancel()
            raise

    async def _execute(self, conn: asyncpg.Connection, batch: list[_Request]) -> list[Record]:
        """The batch's rows: in the set form one execution (each execution pays PostgreSQL's
        executor set-up, for these statements about as much as a row's own work), else the
        statement once per row, pipelined."""
        rows: list[Record]
        if not self._set_form:
            self.executions += len(batch)
            rows = await conn.fetchmany(
                self._statement.sql, [request.query.args for request in batch]
            )
            return rows
        columns = zip(*(request.query.args for request in batch), strict=True)
        self.executions += 1
        rows = await conn.fetch(self._statement.sql, *map(list, columns))
        return rows

    async def _fetchrow(self, conn: asyncpg.Connection, request: _Request) -> Record | None:
        if self._set_form:
            rows = await self._execute(conn, [request])
            return rows[0] if rows else None
        self.executions += 1
        row: Record | None = await conn.fetchrow(self._statement.sql, *request.query.args)
        return row

    async def _one_by_one(self, what: str, conn: asyncpg.Connection, batch: list[_Request]) -> None:
        for request in batch:
            try:
                row = await self._fetchrow(conn, request)
            except asyncpg.PostgresError as exc:
                if is_unavailable(exc):
                    raise
                if not request.future.done():
                    request.future.set_exception(_translated(what, exc))
                continue
            _answer(request, row)


def _translated(what: str, exc: Exception) -> Exception:
    try:
        with translate_errors(what):
            raise exc  # noqa: TRY301 -- the translation is what this raise is for
    except Exception as translated:  # noqa: BLE001 -- returned, for its request to raise
        return translated
    raise AssertionError("translate_errors always raises")  # pragma: no cover


def _answer(request: _Request, row: Record | None) -> None:
    if not request.future.done():
        request.future.set_result(row)


async def _outlast(task: asyncio.Task[None]) -> None:
    """Wait for ``task`` to end, through any further cancellation: it is bounded as a single
    statement is (cancelled once every request of its batch has given up)."""
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            continue
