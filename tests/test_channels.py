"""NOTIFY channels: the SQL and the listener name the same channels, and the daemons' own
notifications name allocations by tags that only a daemon can turn back into ids."""

from __future__ import annotations

import asyncio
import re
from importlib import resources

import asyncpg

from hubd.client import follow
from hubd.routing import Arrivals, TagIndex, Target
from hubd.store import AllocationStore, Database
from hubd.store.channels import (
    CHANNELS,
    CONNECTED_CHANNEL,
    EVENTS_CHANNEL,
    HANDOVER_CHANNEL,
    SELFCHECK_CHANNEL,
    SOCKETS_CHANNEL,
    TAG_LENGTH,
    WAKE_CHANNEL,
    ConnectedNotice,
    NoticeKey,
    SocketControl,
    parse_connected_payload,
    parse_sockets_payload,
    read_notice_key,
)
from hubd.store.connections import ConnectionStore
from hubd.store.migrate import apply_migrations
from tests.conftest import PostgresServer, drop_database, fresh_database
from tests.polling import eventually
from tests.wskit import sidecar_in

_NOTIFY = re.compile(r"pg_notify\(\s*'([^']*)'", re.IGNORECASE)


def _sql_texts() -> dict[str, str]:
    root = resources.files("hubd.store")
    texts = {"schema.sql": root.joinpath("schema.sql").read_text(encoding="utf-8")}
    for folder in ("sql", "migrations"):
        for item in root.joinpath(folder).iterdir():
            if item.name.endswith(".sql"):
                texts[f"{folder}/{item.name}"] = item.read_text(encoding="utf-8")
    return texts


def _notified(text: str) -> set[str]:
    return set(_NOTIFY.findall(text))


class TestChannels:
    def test_every_channel_notified_in_sql_is_a_constant_the_listener_subscribes_to(self) -> None:
        """A channel spelled in a statement or a trigger is one of the channels the daemon
        listens on, or the applications' events channel: a typo there would be a notification
        nobody hears."""
        for name, text in _sql_texts().items():
            unknown = _notified(text) - {*CHANNELS, EVENTS_CHANNEL}
            assert not unknown, f"{name} notifies on {sorted(unknown)}, not in hubd.store.channels"

    def test_every_channel_the_sql_should_notify_on_is_used_there(self) -> None:
        """Each channel the database is meant to announce on appears in the SQL; only the
        self-check is sent from Python."""
        used = set().union(*(_notified(text) for text in _sql_texts().values()))
        assert used == {
            WAKE_CHANNEL,
            CONNECTED_CHANNEL,
            SOCKETS_CHANNEL,
            HANDOVER_CHANNEL,
            EVENTS_CHANNEL,
        }
        assert SELFCHECK_CHANNEL not in used

    def test_the_client_listens_on_the_events_channel(self) -> None:
        """The application client spells the channel itself (it imports nothing of the
        daemon's store); it must be the one the feed's trigger notifies on."""
        assert follow.CHANNEL == EVENTS_CHANNEL
        assert EVENTS_CHANNEL not in CHANNELS

    def test_channels_are_distinct(self) -> None:
        """No two constants name the same channel."""
        assert len(set(CHANNELS)) == len(CHANNELS)


class TestTags:
    async def test_the_daemon_makes_the_tags_the_database_makes(
        self, db: Database, notice_key: NoticeKey
    ) -> None:
        """hubd_notice_tag (in SQL) and NoticeKey.tag (in the daemon) give every id the same
        tag: 32 hex digits of sha256 over the key and the id's UTF-8. hubd_notice, which makes
        the notifications, tags with it and signs what it made as NoticeKey checks."""
        ids = ["al_" + "0" * 32, "al_" + "0" * 31 + "1", "al_x", "\u00e9\u2026\U0001f642", ""]
        async with db.pool.acquire() as conn:
            for each in ids:
                assert await conn.fetchval("SELECT hubd_notice_tag($1)", each) == notice_key.tag(
                    each
                )
                for fields in ("3:retire", "1:2:cn_\u00e9", ""):
                    made = await conn.fetchval("SELECT hubd_notice($1, $2)", each, fields)
                    assert made == notice_key.notice(f"{notice_key.tag(each)}:{fields}")
                    assert notice_key.open(made) == f"{notice_key.tag(each)}:{fields}"
        tags = {notice_key.tag(each) for each in ids}
        assert len(tags) == len(ids)
        assert all(len(tag) == TAG_LENGTH and int(tag, 16) >= 0 for tag in tags)

    async def test_every_migrated_database_has_a_random_key_of_its_own(
        self, postgres_server: PostgresServer, db: Database, notice_key: NoticeKey
    ) -> None:
        """The migration makes the key from the server's random source: another database
        tags the same allocation differently, so a tag heard in one says nothing in another."""
        dsn = await fresh_database(postgres_server, "hubd_notice_key_other")
        try:
            conn = await asyncpg.connect(dsn)
            try:
                await apply_migrations(conn)
                other = NoticeKey(bytes(await conn.fetchval("SELECT key FROM hubd_notice_key")))
                assert await conn.fetchval("SELECT count(*) FROM hubd_notice_key") == 1
            finally:
                await conn.close()
        finally:
            await drop_database(postgres_server, "hubd_notice_key_other")
        assert len(notice_key.secret) == len(other.secret) == 32
        assert other.secret != notice_key.secret
        assert other.tag("al_x") != notice_key.tag("al_x")
        assert await read_notice_key(db) == notice_key

    async def test_the_notifications_name_the_tag_the_parsers_read(
        self, db: Database, store: AllocationStore, notice_key: NoticeKey, database_url: str
    ) -> None:
        """A connection record and a release announce the allocation by its tag, with the
        generation, the record's number and the connection id, signed with the key; the id
        appears nowhere."""
        sidecar, _ = await sidecar_in(store, db)
        heard: dict[str, list[str]] = {CONNECTED_CHANNEL: [], SOCKETS_CHANNEL: []}
        listener = await asyncpg.connect(database_url)
        try:
            for channel, payloads in heard.items():
                await listener.add_listener(
                    channel, lambda *args, into=payloads: into.append(args[3])
                )
            record = await ConnectionStore(db, instance_id="in_test").record(
                "cn_tagged", sidecar.target, sidecar.sidecar_id
            )
            await store.release(sidecar.allocation_id)
            await eventually(lambda: all(heard.values()), what="both notifications")
        finally:
            await listener.close()
        tag = notice_key.tag(sidecar.allocation_id)
        assert [parse_connected_payload(p, notice_key) for p in heard[CONNECTED_CHANNEL]] == [
            ConnectedNotice(tag, sidecar.generation, record.seq or 0, "cn_tagged")
        ]
        assert [parse_sockets_payload(p, notice_key) for p in heard[SOCKETS_CHANNEL]] == [
            SocketControl(tag, sidecar.generation + 1, retire=False)
        ]
        assert heard[SOCKETS_CHANNEL] == [
            notice_key.notice(f"{tag}:{sidecar.generation + 1}:fence")
        ]
        payloads = heard[CONNECTED_CHANNEL] + heard[SOCKETS_CHANNEL]
        assert not any(sidecar.allocation_id in p for p in payloads)


class TestTagIndex:
    def test_a_tag_names_an_allocation_only_while_it_is_held(self) -> None:
        """Tags are made when an allocation starts being held and forgotten when it no longer
        is; a tag of anything else names nothing, and no tag is made for a look-up."""
        made: list[str] = []

        def tag_of(allocation_id: str) -> str:
            made.append(allocation_id)
            return f"t-{allocation_id}"

        index = TagIndex(tag_of)
        index.track("al_a", held=True)
        index.track("al_a", held=True)
        assert index.allocation("t-al_a") == "al_a"
        assert index.allocation("t-al_b") is None
        assert index.allocation("al_a") is None
        index.track("al_a", held=False)
        index.track("al_b", held=False)
        assert index.allocation("t-al_a") is None
        assert made == ["al_a"]
        assert len(index) == 0

    async def test_arrivals_hold_a_tag_while_any_generation_is_waited_for(self) -> None:
        """Waiters of two generations of one allocation keep its tag until the last leaves;
        without a tagging rule (the reconciler's MemoryRouter) no tag names anything."""
        arrivals = Arrivals(tag_of=lambda allocation_id: f"t-{allocation_id}")
        first, second = Target("al_a", 1), Target("al_a", 2)
        with arrivals.expect(first) as one:
            with arrivals.expect(second) as two:
                assert arrivals.allocation("t-al_a") == "al_a"
                arrivals.arrived(Target("al_a", 2))
                assert two.done()
                assert not one.done()
            assert arrivals.allocation("t-al_a") == "al_a"
        assert arrivals.allocation("t-al_a") is None
        assert len(arrivals) == 0
        untagged = Arrivals()
        with untagged.expect(first) as waiter:
            assert untagged.allocation("t-al_a") is None
            untagged.arrived(first)
            await asyncio.wait_for(waiter, 1)
