"""NOTIFY channels: the SQL and the listener name the same channels."""

from __future__ import annotations

import re
from importlib import resources

from hubd.client import follow
from hubd.store.channels import (
    CHANNELS,
    CONNECTED_CHANNEL,
    EVENTS_CHANNEL,
    SELFCHECK_CHANNEL,
    SOCKETS_CHANNEL,
    WAKE_CHANNEL,
)

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
        assert used == {WAKE_CHANNEL, CONNECTED_CHANNEL, SOCKETS_CHANNEL, EVENTS_CHANNEL}
        assert SELFCHECK_CHANNEL not in used

    def test_the_client_listens_on_the_events_channel(self) -> None:
        """The application client spells the channel itself (it imports nothing of the
        daemon's store); it must be the one the feed's trigger notifies on."""
        assert follow.CHANNEL == EVENTS_CHANNEL
        assert EVENTS_CHANNEL not in CHANNELS

    def test_channels_are_distinct(self) -> None:
        """No two constants name the same channel."""
        assert len(set(CHANNELS)) == len(CHANNELS)
