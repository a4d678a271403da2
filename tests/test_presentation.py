"""What operators read: the next step in words, and log redaction."""

from __future__ import annotations

import enum
import io
import json
import logging
from datetime import UTC, datetime, timedelta

import attrs
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from hubd.logs import configure_logging
from hubd.presentation import allocation_json, next_step
from hubd.redaction import _SECRETS, _URL_PASSWORD, scrub
from hubd.store import Allocation, Status

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


def allocation(**changes: object) -> Allocation:
    base = Allocation(
        id="al_" + "a" * 32,
        status=Status.PENDING,
        generation=1,
        provisioner_id="local",
        provisioner_api_version=None,
        provisioner_binding_fingerprint=None,
        tenant_id=None,
        session_id=None,
        spec={},
        sidecar_id=None,
        token_hash=None,
        external_ref=None,
        connect_deadline=None,
        connection_ready=False,
        connection_seq=0,
        initialization_lease_id=None,
        ensure_attempts=0,
        destroy_attempts=0,
        next_attempt_at=NOW,
        lease_id=None,
        lease_expires_at=None,
        failure_code=None,
        failure_message=None,
        created_at=NOW,
        updated_at=NOW,
        finished_at=None,
    )
    return attrs.evolve(base, **changes)  # type: ignore[arg-type]


class TestNextStep:
    @pytest.mark.parametrize("status", [Status.RELEASED, Status.FAILED])
    def test_forgotten(self, status: Status) -> None:
        """An allocation an operator forgot says so, with the reason, and that its sidecar was
        left for the operator, whichever terminal status it ended in."""
        a = allocation(
            status=status,
            sidecar_id="sc_1",
            next_attempt_at=None,
            failure_code="forgotten",
            failure_message="host wiped",
        )
        assert next_step(a, NOW) == (
            "nothing: forgotten by an operator (host wiped); whatever sidecar sc_1 left behind "
            "is the operator's to clean up"
        )

    def test_waiting_for_connect(self) -> None:
        """An allocated, parked allocation says until when it waits for its sidecar."""
        a = allocation(
            status=Status.ALLOCATED,
            connect_deadline=NOW + timedelta(minutes=3, seconds=41),
            next_attempt_at=NOW + timedelta(minutes=3, seconds=41),
        )
        assert next_step(a, NOW) == "waiting for the sidecar to connect until 12:03:41Z"

    def test_retrying_with_attempt_and_error(self) -> None:
        """A destroy retry names the time, the attempt and the last error."""
        a = allocation(
            status=Status.RELEASING,
            destroy_attempts=2,
            next_attempt_at=NOW + timedelta(seconds=4),
            failure_code="busy",
            failure_message="provider busy",
        )
        assert next_step(a, NOW) == (
            "retrying: destroying the sidecar at 12:00:04Z, attempt 3, last error busy: "
            "provider busy"
        )

    def test_terminal_and_ready(self) -> None:
        """Terminal and ready allocations say nothing is planned, and why."""
        assert next_step(allocation(status=Status.RELEASED, next_attempt_at=None), NOW) == (
            "nothing: released"
        )
        ready = allocation(status=Status.ALLOCATED, connection_ready=True, next_attempt_at=None)
        assert next_step(ready, NOW) == "nothing: ready, sidecar connected"
        assert allocation_json(ready)["ready"] is True
        assert next_step(
            allocation(
                status=Status.DESTROY_FAILED, failure_code="forbidden", failure_message="no"
            ),
            NOW,
        ).startswith("an operator must check for leaked infrastructure")


class TestLogRedaction:
    def test_tokens_headers_and_passwords_never_rendered(self) -> None:
        """The log processor hides token-shaped text, secret-named fields and DSN passwords."""
        canary = "hubd_sc_" + "c0ffee" * 10 + "abcd"
        out = io.StringIO()
        configure_logging(fmt="json", level="debug", stream=out)
        try:
            structlog.get_logger("t").info(
                f"saw {canary}",
                token=canary,
                authorization=f"Bearer {canary}",
                dsn="postgresql://hubd:pw-canary-1@db/hubd",
                nested={"headers": {"Authorization": f"Bearer {canary}"}},
                error=RuntimeError(f"boom {canary}"),
            )
        finally:
            structlog.reset_defaults()
        text = out.getvalue()
        assert canary not in text
        assert "pw-canary-1" not in text
        line = json.loads(text)
        assert line["token"] == "***"
        assert "postgresql://hubd:***@db/hubd" in line["dsn"]

    def test_no_daemon_alive(self) -> None:
        """Without a live daemon an active allocation's next step says one must start first;
        a terminal one does not."""
        pending = allocation(status=Status.PENDING, next_attempt_at=NOW)
        assert next_step(pending, NOW, daemon_alive=False) == (
            "no hubd daemon is running against this database (start `hubd run`); then: "
            "provisioning a sidecar now"
        )
        released = allocation(status=Status.RELEASED, next_attempt_at=None)
        assert next_step(released, NOW, daemon_alive=False) == "nothing: released"

    def test_stdlib_records_rendered_redacted_and_sampled(self) -> None:
        """asyncio's and other libraries' records come out as JSON through the same
        redaction, and a flood of one message is a few lines with a count."""
        canary = "hubd_sc_" + "d00d" * 16
        out = io.StringIO()
        configure_logging(fmt="json", level="info", stream=out)
        try:
            logging.getLogger("asyncio").error(
                "socket.accept() out of system resource",
                exc_info=OSError(f"accept failed near {canary}"),
            )
            for _ in range(500):
                logging.getLogger("asyncio").error("socket.accept() out of system resource")
            logging.getLogger("websockets.server").debug("> Authorization: Bearer %s", canary)
        finally:
            root = logging.getLogger()
            for handler in [h for h in root.handlers if h.get_name() == "hubd"]:
                root.removeHandler(handler)
            root.setLevel(logging.WARNING)
            structlog.reset_defaults()
        text = out.getvalue()
        assert canary not in text
        lines = [json.loads(line) for line in text.splitlines()]
        assert 1 <= len(lines) <= 10
        assert lines[0]["logger"] == "asyncio"
        assert lines[0]["level"] == "error"
        assert "OSError" in lines[0]["exception"]

    def test_bare_token_hex_in_any_field_hidden(self) -> None:
        """A token's 64 hex digits without their prefix (sent in the wrong header) are hidden
        wherever they appear; 32-hex ids are kept."""
        secret = "ab12" * 16
        allocation_id = "al_" + "0f" * 16
        out = io.StringIO()
        configure_logging(fmt="json", level="debug", stream=out)
        try:
            structlog.get_logger("t").info(
                "handshake_rejected", sidecar_id=secret, allocation_id=allocation_id
            )
        finally:
            structlog.reset_defaults()
        line = json.loads(out.getvalue())
        assert secret not in out.getvalue()
        assert line["allocation_id"] == allocation_id


def _rendered(fmt: str, **fields: object) -> str:
    """One info line with ``fields``, as the configured logger writes it."""
    out = io.StringIO()
    configure_logging(fmt=fmt, level="info", stream=out)
    try:
        structlog.get_logger("t").bind(bound=fields.pop("bound", None)).info("e", **fields)
    finally:
        structlog.reset_defaults()
    return out.getvalue()


@attrs.frozen
class _Request:
    allocation_id: str
    token: str


class _Kind(enum.StrEnum):
    SECRET = "hubd_sc_" + "5ec" * 22


TOKEN = "hubd_sc_" + "feed" * 16
SECRET = "hubd_rs_" + "beef" * 16
BARE = "0123456789abcdef" * 4


class TestRedactionOfEveryKindOfValue:
    """Values skip the patterns only where they cannot hold a secret; each of these shows a
    secret in one kind of value (or of text) is still hidden."""

    @pytest.mark.parametrize("fmt", ["json", "console"])
    @pytest.mark.parametrize(
        ("value", "canary"),
        [
            (TOKEN, TOKEN),
            (SECRET, SECRET),
            (BARE, BARE),
            ("Bearer x7", "x7"),  # short, but a credential after "bearer" and a space
            ("bearer\tq", "\\tq"),
            ("a://u:pw9@h", "pw9"),  # a short DSN
            (f"see {TOKEN} here", TOKEN),
            (_Kind.SECRET, _Kind.SECRET.value),  # a str subclass
            ({"headers": {"Authorization": "tk1"}}, "tk1"),  # secret-named key in a mapping
            ({"inner": [TOKEN]}, TOKEN),
            ([TOKEN, 1], TOKEN),
            ((BARE, None), BARE),
            ({TOKEN}, TOKEN),  # a set: rendered through its repr
            (_Request(allocation_id="al_1", token=TOKEN), TOKEN),  # an attrs record's repr
            (RuntimeError(f"boom {SECRET}"), SECRET),
            (b"hubd_sc_" + b"ab" * 32, "ab" * 32),  # bytes: their repr
        ],
    )
    def test_secret_in_a_value_hidden(self, fmt: str, value: object, canary: str) -> None:
        """A secret in a field of any type is hidden in both output formats."""
        assert canary not in _rendered(fmt, field=value)
        assert canary not in _rendered(fmt, bound=value)

    @pytest.mark.parametrize("value", [4002, True, None, 1.5, "x", TOKEN])
    def test_secret_named_field_hidden_whatever_its_type(self, value: object) -> None:
        """A field named like a secret is replaced whatever its value's type, numbers too."""
        line = json.loads(_rendered("json", token=value, Secret=value, password=value))
        assert line["token"] == line["Secret"] == line["password"] == "***"

    def test_plain_values_kept(self) -> None:
        """Ids, numbers, booleans and names reach the line as they are."""
        line = json.loads(
            _rendered(
                "json",
                allocation_id="al_" + "0f" * 16,
                remote="127.0.0.1:5000",
                generation=3,
                ready=True,
                seq=None,
                duration_ms=0.5,
                status=_Kind.SECRET.__class__.__name__,
            )
        )
        assert line["allocation_id"] == "al_" + "0f" * 16
        assert line["remote"] == "127.0.0.1:5000"
        assert (line["generation"], line["ready"], line["seq"]) == (3, True, None)
        assert line["duration_ms"] == 0.5
        assert line["level"] == "info"
        assert line["timestamp"].endswith("Z")

    @settings(max_examples=500, deadline=None)
    @given(
        st.lists(
            st.sampled_from(
                [
                    "hubd_",
                    "sc_",
                    "rs_",
                    "Bearer",
                    "bEaReR",
                    " ",
                    "\t",
                    "\n",
                    "\u2003",
                    "\u00a0",
                    "\x0b",
                    "\u2028",
                    "://",
                    ":",
                    "@",
                    "/",
                    "0f",
                    "AB",
                    "9",
                    "z",
                    "_",
                    "é",
                    "pass",
                ]
            ),
            max_size=40,
        ).map("".join)
    )
    def test_shortcut_agrees_with_the_patterns(self, text: str) -> None:
        """Text the scrub returns without running its patterns is text they would not change."""
        assert scrub(text) == _URL_PASSWORD.sub(r"\1:***", _SECRETS.sub("***", text))
