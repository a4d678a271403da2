"""The event feed's lock under an application that holds it: what the store reads of it, what the
daemon's watch makes of that (readiness, metrics, the log) and the cut-off that ends the holder.

An application role cannot lock ``hubd_feed_lock`` itself, but ``SET CONSTRAINTS ALL IMMEDIATE``
after a request fires the event trigger at once, and the trigger takes the lock for the rest of
the transaction (migration 0016, docs/api.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from structlog.testing import capture_logs

from hubd.daemon.feedwatch import REFUSAL_RETRY, FeedLockWatch, judge
from hubd.daemon.metrics import Metrics
from hubd.store import AllocationStore, Database, connect_database
from hubd.store.events import EventStore, FeedLock, FeedLockHolder, Outcome, Termination
from tests.apikit import app_role
from tests.daemonkit import DaemonProcess, http_get, write_config
from tests.polling import eventually, scaled
from tests.test_daemon import metric_total

pytestmark = pytest.mark.timeout(180)

REQUEST = "SELECT id FROM hubd_v1.request('fake')"


@contextlib.asynccontextmanager
async def holding(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of ``dsn`` whose open transaction holds the feed's lock: a request, then
    ``SET CONSTRAINTS ALL IMMEDIATE``, then nothing."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("BEGIN")
        await conn.fetchval(REQUEST)
        await conn.execute("SET CONSTRAINTS ALL IMMEDIATE")
        yield conn
    finally:
        conn.terminate()


@contextlib.asynccontextmanager
async def committing(dsn: str, query: str = REQUEST) -> AsyncIterator[asyncio.Task[str]]:
    """``query`` committed on a connection of ``dsn`` of its own, in a task the block may await;
    cancelled, and its connection closed, when the block ends."""
    conn = await asyncpg.connect(dsn)
    task = asyncio.create_task(conn.fetchval(query))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        conn.terminate()


async def may_signal_others(dsn: str) -> bool:
    """Whether ``dsn``'s role may end an application role's backend."""
    conn = await asyncpg.connect(dsn)
    try:
        return bool(
            await conn.fetchval(
                "SELECT rolsuper OR pg_has_role(current_user, 'pg_signal_backend', 'USAGE') "
                "FROM pg_roles WHERE rolname = current_user"
            )
        )
    finally:
        await conn.close()


class TestTheStoreReadsTheLock:
    async def test_a_holder_and_the_commit_waiting_behind_it(
        self, database_url: str, db: Database
    ) -> None:
        events = EventStore(db)
        assert await events.feed_lock() == FeedLock(
            waiters=0, longest_wait=0.0, holder=None, own_role=await _current_user(db)
        )
        async with app_role(database_url) as dsn, holding(dsn) as holder:
            role = await holder.fetchval("SELECT current_user")
            alone = await events.feed_lock()
            assert alone.waiters == 0
            assert alone.holder == FeedLockHolder(
                pid=holder.get_server_pid(),
                role=role,
                state="idle in transaction",
                own_role=False,
            )
            async with committing(dsn) as waiting:
                await eventually(
                    lambda: _waiters_with_a_start(events, 1), what="the commit to wait"
                )
                first = await events.feed_lock()
                await eventually(
                    lambda: _waited_longer(events, first.longest_wait), what="the wait to grow"
                )
                assert not waiting.done()
                assert first.holder is not None
                assert first.holder.pid == holder.get_server_pid()
                assert first.holder.role == role
                assert not first.holder.own_role
                assert first.own_role != role
                await holder.execute("ROLLBACK")
                assert await asyncio.wait_for(waiting, 30)
            assert await events.feed_lock() == FeedLock(
                waiters=0, longest_wait=0.0, holder=None, own_role=first.own_role
            )

    async def test_a_holder_of_another_role_is_ended_one_of_its_own_never(
        self, database_url: str, db: Database
    ) -> None:
        if not await may_signal_others(database_url):
            pytest.skip("the test server's role may not end other roles' backends")
        events = EventStore(db)
        # The daemon's own role: held, and left alone.
        async with holding(database_url) as own:
            lock = await events.feed_lock()
            assert lock.holder is not None
            assert lock.holder.own_role
            assert await events.terminate_feed_lock_holder(own.get_server_pid()) == Termination(
                Outcome.GONE
            )
            assert await own.fetchval("SELECT 1") == 1
        async with app_role(database_url) as dsn, holding(dsn) as holder:
            async with committing(dsn) as waiting:
                await eventually(lambda: _waiters_with_a_start(events, 1), what="a waiter")
                pid = holder.get_server_pid()
                assert await events.terminate_feed_lock_holder(pid) == Termination(
                    Outcome.TERMINATED
                )
                assert await asyncio.wait_for(waiting, 30)
            await eventually(lambda: _backend_gone(database_url, pid), what="the holder to end")
            assert await events.terminate_feed_lock_holder(pid) == Termination(Outcome.GONE)

    async def test_a_holder_is_ended_only_while_a_commit_has_waited_the_limit_now(
        self, database_url: str, db: Database
    ) -> None:
        """A daemon that paused acts on an old reading: the statement checks the wait again, so
        a holder whose waiters have not waited the limit now is left alone."""
        if not await may_signal_others(database_url):
            pytest.skip("the test server's role may not end other roles' backends")
        events = EventStore(db)
        async with app_role(database_url) as dsn, holding(dsn) as holder:
            pid = holder.get_server_pid()
            # Held, nobody waiting: whatever an old reading said, nothing is ended.
            assert await events.terminate_feed_lock_holder(pid, waited=0.0) == Termination(
                Outcome.GONE
            )
            async with committing(dsn) as waiting:
                await eventually(lambda: _waiters_with_a_start(events, 1), what="a waiter")
                assert await events.terminate_feed_lock_holder(pid, waited=3600.0) == Termination(
                    Outcome.GONE
                )
                assert await holder.fetchval("SELECT 1") == 1
                assert await events.terminate_feed_lock_holder(pid, waited=0.0) == Termination(
                    Outcome.TERMINATED
                )
                assert await asyncio.wait_for(waiting, 30)

    async def test_a_role_without_pg_signal_backend_is_refused_until_granted_it(
        self, database_url: str
    ) -> None:
        async with (
            app_role(database_url) as app,
            app_role(database_url) as watcher,
            holding(app) as holder,
        ):
            db = await connect_database(watcher, pool_size=1)
            try:
                events = EventStore(db)
                lock = await events.feed_lock()
                assert lock.holder is not None
                assert lock.holder.pid == holder.get_server_pid()
                refused = await events.terminate_feed_lock_holder(holder.get_server_pid())
                assert refused.outcome is Outcome.REFUSED
                assert refused.refusal is not None
                assert "permission denied" in refused.refusal
                admin = await asyncpg.connect(database_url)
                try:
                    try:
                        await admin.execute(f"GRANT pg_signal_backend TO {lock.own_role}")
                    except asyncpg.InsufficientPrivilegeError:
                        return
                finally:
                    await admin.close()
                ended = await events.terminate_feed_lock_holder(holder.get_server_pid())
                assert ended == Termination(Outcome.TERMINATED)
            finally:
                await db.close()


class TestAnApplicationCannotTakeTheLockOtherwise:
    @pytest.mark.parametrize(
        "statement",
        [
            "LOCK TABLE hubd_feed_lock IN EXCLUSIVE MODE",
            "LOCK TABLE hubd_feed_lock IN ACCESS SHARE MODE",
            "SELECT * FROM hubd_feed_lock FOR UPDATE",
            "SELECT * FROM hubd_feed_lock FOR KEY SHARE",
        ],
    )
    async def test_it_may_not_lock_the_table(self, database_url: str, statement: str) -> None:
        async with app_role(database_url) as dsn:
            conn = await asyncpg.connect(dsn)
            try:
                async with conn.transaction():
                    with pytest.raises(asyncpg.InsufficientPrivilegeError):
                        await conn.execute(statement)
            finally:
                await conn.close()

    async def test_advisory_locks_stall_no_commit(self, database_url: str, db: Database) -> None:
        """The feed's lock was an advisory lock once (migration 0013); whatever advisory lock an
        application holds, the old key included, requests commit as usual."""
        async with app_role(database_url) as dsn:
            locker = await asyncpg.connect(dsn)
            try:
                await locker.execute("BEGIN")
                await locker.execute(
                    "SELECT pg_advisory_lock(hashtext('hubd.events')), "
                    "pg_advisory_xact_lock(hashtext('hubd.events')), pg_advisory_lock(0), "
                    "pg_advisory_lock(0, 0), pg_advisory_lock(-1)"
                )
                for _ in range(3):
                    async with committing(dsn) as request:
                        assert await asyncio.wait_for(request, scaled(5))
                assert (await EventStore(db).feed_lock()).waiters == 0
            finally:
                await locker.close()


class TestTheWatch:
    """The watch's decisions, on readings made up here."""

    def test_within_the_alarm_nothing_is_wrong(self) -> None:
        lock = _reading(waiters=3, wait=4.9, pid=7)
        assert judge(lock, alarm=5, limit=30).problem is None
        assert judge(lock, alarm=5, limit=30).cut_off is None

    def test_past_the_alarm_readiness_names_the_holder(self) -> None:
        verdict = judge(_reading(waiters=2, wait=6.0, pid=4242), alarm=5, limit=30)
        assert verdict.problem is not None
        assert "2 commits wait" in verdict.problem
        assert "pid 4242 (role app_x, idle in transaction)" in verdict.problem
        assert verdict.cut_off is None

    def test_past_the_limit_another_roles_holder_is_cut_off(self) -> None:
        assert judge(_reading(waiters=1, wait=31, pid=9), alarm=5, limit=30).cut_off == 9

    @pytest.mark.parametrize(
        "holder",
        [
            None,
            FeedLockHolder(pid=None, role=None, state=None, own_role=False),
            FeedLockHolder(pid=9, role="hubd", state="active", own_role=True),
        ],
    )
    def test_nothing_it_may_not_end_is_cut_off(self, holder: FeedLockHolder | None) -> None:
        lock = FeedLock(waiters=1, longest_wait=600, holder=holder, own_role="hubd")
        verdict = judge(lock, alarm=5, limit=30)
        assert verdict.problem is not None
        assert verdict.cut_off is None

    async def test_one_warning_per_holder_one_error_per_refusal_and_a_retry_later(self) -> None:
        store = _Readings()
        now = [0.0]
        metrics = Metrics()
        watch = FeedLockWatch(store, metrics, alarm=5, limit=30, clock=lambda: now[0])
        with capture_logs() as logs:
            store.lock = _reading(waiters=1, wait=6, pid=7)
            await watch.check()
            await watch.check()
            assert watch.problem is not None
            assert "pid 7" in watch.problem
            store.lock = _reading(waiters=1, wait=31, pid=7)
            store.answer = Termination(Outcome.REFUSED, "permission denied to terminate process")
            await watch.check()
            await watch.check()
            assert store.asked == [7]
            now[0] += REFUSAL_RETRY
            await watch.check()
            assert store.asked == [7, 7]
            store.answer = Termination(Outcome.TERMINATED)
            store.lock = _reading(waiters=2, wait=31, pid=8)
            await watch.check()
            store.lock = _reading(waiters=0, wait=0, pid=None)
            await watch.check()
        events = [entry["event"] for entry in logs]
        assert events == [
            "feed_lock_commits_waiting",
            "feed_lock_holder_not_terminated",
            "feed_lock_commits_waiting",
            "feed_lock_holder_terminated",
            "feed_lock_wait_ended",
        ]
        refusal = logs[1]
        assert refusal["log_level"] == "error"
        assert "GRANT pg_signal_backend TO hubd" in refusal["hint"]
        assert watch.problem is None
        scraped = metrics.render().decode()
        assert metric_total(scraped, "hubd_feed_lock_holders_terminated_total") == 1
        assert metric_total(scraped, "hubd_feed_lock_waiters") == 0

    async def test_a_free_lock_is_read_once_an_alarm_a_held_one_every_second(
        self,
    ) -> None:
        """An idle daemon reads the lock every alarm, not every second; once a reading finds
        it held or waited for (which any wait needs first), every second again."""
        store = _Readings()
        watch = FeedLockWatch(store, Metrics(), alarm=5, limit=30)
        await watch.check()
        assert watch.interval == pytest.approx(5.0)
        store.lock = _reading(waiters=0, wait=0, pid=7)
        await watch.check()
        assert watch.interval == pytest.approx(1.0)
        store.lock = _reading(waiters=1, wait=0.5, pid=7)
        await watch.check()
        assert watch.interval == pytest.approx(1.0)
        store.lock = _reading(waiters=0, wait=0, pid=None)
        await watch.check()
        assert watch.interval == pytest.approx(5.0)
        short = FeedLockWatch(store, Metrics(), alarm=0.2, limit=1)
        await short.check()
        assert short.interval <= 0.2


class TestTheDaemon:
    async def test_a_holder_past_the_limit_is_ended_and_the_daemon_is_ready_again(
        self,
        database_url: str,
        marker: str,
        state_dir: Path,
        observer: AllocationStore,
    ) -> None:
        """A real daemon: an application holds the lock and idles, a request waits behind it;
        /readyz says who holds it and the metrics how long commits wait; past the hold limit the
        holder is ended, the waiting request commits and becomes ready, and so does the
        daemon."""
        if not await may_signal_others(database_url):
            pytest.skip("the test server's role may not end other roles' backends")
        alarm, limit = scaled(1), scaled(3)
        config = write_config(
            state_dir / "hubd.toml",
            database_url=database_url,
            state_dir=state_dir,
            marker=marker,
            extra=f'[events]\nlock_wait_alarm = "{alarm:g}s"\nlock_hold_limit = "{limit:g}s"\n',
        )
        daemon = DaemonProcess(config)
        await daemon.start()
        try:
            async with app_role(database_url) as dsn, holding(dsn) as holder:
                pid = holder.get_server_pid()
                async with committing(dsn, "SELECT id FROM hubd_v1.request('local')") as waiting:
                    seen: list[str] = []

                    async def not_ready_naming_the_holder() -> bool:
                        status, body = await http_get(daemon.admin_url + "/readyz")
                        seen.append(body)
                        return status == 503 and f"pid {pid}" in body

                    await eventually(
                        not_ready_naming_the_holder, within=30, every=0.1, what="/readyz"
                    )
                    assert "event feed: 1 commit waits for its lock" in seen[-1]
                    _, scraped = await http_get(daemon.admin_url + "/metrics")
                    assert metric_total(scraped, "hubd_feed_lock_waiters") == 1
                    assert metric_total(scraped, "hubd_feed_lock_wait_seconds") > alarm
                    made = await asyncio.wait_for(waiting, 60)
                warned = await daemon.wait_for_log("feed_lock_commits_waiting")
                assert warned["holder_pid"] == pid
                ended = await daemon.wait_for_log("feed_lock_holder_terminated")
                assert ended["holder_pid"] == pid
                assert ended["longest_wait"] > limit
                await eventually(lambda: _backend_gone(database_url, pid), what="the holder to end")

            async def ready_again() -> bool:
                return await http_get(daemon.admin_url + "/readyz") == (200, "ready\n")

            await eventually(ready_again, within=30, every=0.1, what="/readyz to pass")
            _, scraped = await http_get(daemon.admin_url + "/metrics")
            assert metric_total(scraped, "hubd_feed_lock_holders_terminated_total") == 1
            assert metric_total(scraped, "hubd_feed_lock_waiters") == 0
            await daemon.wait_for_log("feed_lock_wait_ended")
            assert [line["event"] for line in daemon.lines].count("feed_lock_commits_waiting") == 1

            # The daemon's own commits go through again: the request that waited is provisioned.
            async def made_ready() -> bool:
                return (await observer.get(made)).ready

            await eventually(made_ready, within=60, every=0.2, what="the allocation to be ready")
        finally:
            await daemon.signal(signal.SIGTERM)
            await daemon.wait()
            await daemon.kill()


async def _current_user(db: Database) -> str:
    async with db.connection("who") as conn:
        return str(await conn.fetchval("SELECT current_user"))


async def _backend_gone(dsn: str, pid: int) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return not await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", pid
        )
    finally:
        await conn.close()


async def _waiters_with_a_start(events: EventStore, count: int) -> bool:
    lock = await events.feed_lock()
    return lock.waiters == count and lock.longest_wait > 0


async def _waited_longer(events: EventStore, than: float) -> bool:
    return (await events.feed_lock()).longest_wait > than


def _reading(*, waiters: int, wait: float, pid: int | None) -> FeedLock:
    holder = (
        None
        if pid is None
        else FeedLockHolder(pid=pid, role="app_x", state="idle in transaction", own_role=False)
    )
    return FeedLock(waiters=waiters, longest_wait=wait, holder=holder, own_role="hubd")


class _Readings:
    """An EventStore that answers with the reading and termination the test sets."""

    def __init__(self) -> None:
        self.lock = FeedLock(waiters=0, longest_wait=0, holder=None, own_role="hubd")
        self.answer = Termination(Outcome.TERMINATED)
        self.asked: list[int] = []

    async def feed_lock(self) -> FeedLock:
        return self.lock

    async def terminate_feed_lock_holder(
        self, pid: int, *, waited: float | None = None
    ) -> Termination:
        self.asked.append(pid)
        return self.answer
