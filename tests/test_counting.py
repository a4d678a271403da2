"""The allocations-by-status gauges are counted when a scrape asks, at most once per max age."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from hubd.daemon.counting import AllocationCounts
from hubd.errors import DatabaseUnavailable
from hubd.store import AllocationStore, Database, Status
from hubd.store.counts import status_counts
from tests.polling import TIME_SCALE


class Counted:
    """``status_counts`` on the test database, with every count and every publication kept;
    ``fail`` makes the next counts raise, ``hold`` keeps them waiting until set."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.counts = 0
        self.published: list[Mapping[str, int]] = []
        self.fail = False
        self.hold = asyncio.Event()
        self.hold.set()
        self.started = asyncio.Event()

    async def count(self) -> Mapping[Status, int]:
        self.counts += 1
        self.started.set()
        await self.hold.wait()
        if self.fail:
            raise DatabaseUnavailable("count allocations: database unavailable (OSError)")
        return await status_counts(self.db)

    def publish(self, counts: Mapping[str, int]) -> None:
        self.published.append(dict(counts))


def counter(counted: Counted, now: list[float], *, timeout: float = 30.0) -> AllocationCounts:
    return AllocationCounts(
        count=counted.count,
        publish=counted.publish,
        max_age=5.0,
        timeout=timeout,
        clock=lambda: now[0],
    )


async def test_counts_once_per_max_age(db: Database, store: AllocationStore) -> None:
    """The first scrape counts; one within the max age reuses the answer (a row requested
    meanwhile is not seen); the first after it counts again and sees the row."""
    counted, now = Counted(db), [100.0]
    counts = counter(counted, now)
    await counts.refresh()
    assert counted.counts == 1
    assert counted.published[-1]["pending"] == 0
    await store.request(provisioner_id="nobody-serves-this", spec={})
    now[0] += 4.9
    await counts.refresh()
    assert counted.counts == 1
    assert len(counted.published) == 1
    now[0] += 0.2
    await counts.refresh()
    assert counted.counts == 2
    assert counted.published[-1]["pending"] == 1
    assert set(counted.published[-1]) == {str(status) for status in Status}


async def test_scrapes_during_a_count_share_it(db: Database) -> None:
    """Scrapes that arrive while a count runs wait for it and reuse its answer."""
    counted, now = Counted(db), [0.0]
    counts = counter(counted, now)
    counted.hold.clear()
    first = asyncio.create_task(counts.refresh())
    await counted.started.wait()
    others = [asyncio.create_task(counts.refresh()) for _ in range(5)]
    counted.hold.set()
    await asyncio.gather(first, *others)
    assert counted.counts == 1
    assert len(counted.published) == 1


async def test_a_failed_count_keeps_the_last_values_and_is_retried(db: Database) -> None:
    """A count the database cannot answer publishes nothing (the gauges keep their last
    values) and is not remembered as an answer: the next scrape counts again."""
    counted, now = Counted(db), [0.0]
    counts = counter(counted, now)
    await counts.refresh()
    now[0] += 10
    counted.fail = True
    await counts.refresh()
    assert counted.counts == 2
    assert len(counted.published) == 1
    counted.fail = False
    await counts.refresh()
    assert counted.counts == 3
    assert len(counted.published) == 2


@pytest.mark.timeout(30)
async def test_a_count_slower_than_its_timeout_does_not_hold_the_scrape(db: Database) -> None:
    """A count that does not answer within the timeout is given up: the scrape goes on with
    the last values, and the next one counts again."""
    counted, now = Counted(db), [0.0]
    # The daemon's own budget: the held count waits it out, and the real count that follows
    # must fit in it on a loaded machine (50 ms did not, once, on CI).
    counts = counter(counted, now, timeout=2.0 * TIME_SCALE)
    counted.hold.clear()
    await counts.refresh()
    assert counted.counts == 1
    assert counted.published == []
    counted.hold.set()
    await counts.refresh()
    assert counted.counts == 2
    assert len(counted.published) == 1
