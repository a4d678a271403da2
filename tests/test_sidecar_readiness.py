"""``hubd sidecar`` says ready only while its command serves, and lets the command publish at run
time: the rule over a check's outcomes, the checks against real sockets, what the client tells
the hub, and real ``hubd sidecar`` processes running real commands against a real hub."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from hubd.server.handshake import CloseCode
from hubd.sidecar.announcements import Announcements, Publication, Told
from hubd.sidecar.channel import parse_line
from hubd.sidecar.client import SidecarClient
from hubd.sidecar.command import add_arguments, options_from
from hubd.sidecar.readiness import COMMAND, ENDPOINT, Probe, ReadyGate, probe, probe_of
from hubd.sidecar.settings import SidecarSettings
from hubd.store import AllocationStore, Database
from tests.clikit import hubd_env
from tests.daemonkit import free_port
from tests.polling import eventually
from tests.test_sidecar import FAST
from tests.wskit import Hub, Sidecar, running_hub, sidecar_in

pytestmark = pytest.mark.timeout(120)


class TestReadyGate:
    def test_the_first_success_makes_it_ready(self) -> None:
        """Failures before the first success change nothing; the first success is ready."""
        gate = ReadyGate(not_ready_after=5)
        assert [gate.observe(False, t) for t in range(10)] == [None] * 10
        assert gate.observe(True, 10) is True
        assert gate.observe(True, 11) is None

    def test_not_ready_only_after_failing_long_enough(self) -> None:
        """Once ready, failures for less than not_ready_after change nothing, a success in
        between starts the count again, and a failure that long makes it not ready; the next
        success makes it ready again."""
        gate = ReadyGate(not_ready_after=3)
        gate.observe(True, 0)
        assert [gate.observe(False, t) for t in (1, 2, 3)] == [None, None, None]
        assert gate.observe(True, 3.5) is None
        assert [gate.observe(False, t) for t in (4, 5, 6)] == [None, None, None]
        assert gate.observe(False, 7) is False
        assert gate.observe(False, 8) is None
        assert gate.observe(True, 9) is True

    def test_zero_means_at_the_first_failure(self) -> None:
        """With not_ready_after 0, the first failure once ready is not ready."""
        gate = ReadyGate(not_ready_after=0)
        gate.observe(True, 0)
        assert gate.observe(False, 0.1) is False


class TestChecks:
    @pytest.mark.parametrize(
        ("address", "expected"),
        [
            ("tcp:127.0.0.1:80", Probe("tcp", host="127.0.0.1", port=80)),
            ("tcp://db:5432", Probe("tcp", host="db", port=5432)),
            ("redis://cache:6379/0", Probe("tcp", host="cache", port=6379)),
            ("10.0.0.5:8080", Probe("tcp", host="10.0.0.5", port=8080)),
            ("tcp:[::1]:9000", Probe("tcp", host="::1", port=9000)),
            ("http://127.0.0.1:8080/svc", Probe("http", url="http://127.0.0.1:8080/svc")),
            ("https://h/ready?x=1", Probe("http", url="https://h/ready?x=1")),
            ("unix:/run/s.sock", Probe("unix", path="/run/s.sock")),
            ("unix:///run/s.sock", Probe("unix", path="/run/s.sock")),
            ("tcp://nohost", None),
            ("grpc://h", None),
            ("unix:relative", None),
            ("tcp:h:99999", None),
            ("just words", None),
        ],
    )
    def test_what_an_address_checks(self, address: str, expected: Probe | None) -> None:
        """An address names a TCP connect, an HTTP GET or a Unix socket connect; one that
        names no port or no host names nothing to check."""
        assert probe_of(address) == expected

    def parse(self, *argv: str) -> Any:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return options_from(parser.parse_args(list(argv)))

    def test_options(self) -> None:
        """--ready-check and its timings land in the options; none means no check."""
        assert self.parse().ready_check is None
        options = self.parse(
            "--ready-check", "endpoint", "--ready-interval", "0.5", "--not-ready-after", "0"
        )
        assert options.ready_check.target == ENDPOINT
        assert options.ready_check.interval == 0.5
        assert options.ready_check.not_ready_after == 0
        assert self.parse("--ready-check", "command").ready_check.target == COMMAND
        check = self.parse("--ready-check", "tcp:h:1", "--", "true").ready_check
        assert check.target == Probe("tcp", host="h", port=1)

    @pytest.mark.parametrize(
        "argv",
        [
            ["--ready-check", "somewhere"],
            ["--ready-check", "endpoint", "--ready-interval", "0"],
            ["--ready-check", "endpoint", "--ready-timeout", "-1"],
            ["--ready-check", "endpoint", "--not-ready-after", "nan"],
        ],
    )
    def test_bad_options(self, argv: list[str]) -> None:
        """A check that names nothing, or a timing that is not a positive number, is refused
        with the option named."""
        with pytest.raises(ValueError, match="--"):
            self.parse(*argv)

    async def test_tcp_and_unix_probes(self, tmp_path: Path) -> None:
        """A TCP or Unix probe passes while something listens there, and fails once it
        stopped."""
        served = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = served.sockets[0].getsockname()[1]
        path = str(tmp_path / "s.sock")
        unix = await asyncio.start_unix_server(lambda r, w: w.close(), path)
        assert await probe(Probe("tcp", host="127.0.0.1", port=port), 1)
        assert await probe(Probe("unix", path=path), 1)
        for server in (served, unix):
            server.close()
            await server.wait_closed()
        assert not await probe(Probe("tcp", host="127.0.0.1", port=port), 1)
        assert not await probe(Probe("unix", path=path), 1)

    @pytest.mark.parametrize(
        ("status", "ok"), [(200, True), (204, True), (301, False), (404, False), (503, False)]
    )
    async def test_http_probe(self, status: int, ok: bool) -> None:
        """An HTTP probe passes on a 2xx answer to its GET, and only then."""
        requests: list[bytes] = []

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            requests.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: 0\r\n\r\n".encode())
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            url = f"http://127.0.0.1:{port}/healthz?deep=1"
            assert await probe(Probe("http", url=url), 2) is ok
        finally:
            server.close()
            await server.wait_closed()
        assert requests[0].startswith(b"GET /healthz?deep=1 HTTP/1.1\r\n")

    async def test_a_silent_peer_times_out(self) -> None:
        """A peer that accepts and never answers fails the probe at its timeout."""
        held: list[asyncio.StreamWriter] = []
        server = await asyncio.start_server(lambda r, w: held.append(w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            assert not await probe(Probe("http", url=f"http://127.0.0.1:{port}/"), 0.2)
        finally:
            for writer in held:
                writer.close()
            server.close()
            await server.wait_closed()


class TestAnnouncements:
    def test_publish_goes_before_ready_and_follows_changes(self) -> None:
        """A connection is told the whole publication, then ready; later it is told only
        what changed; readiness is told only where the allocation waits for it."""
        said = Announcements(Publication(endpoint="http://a", metadata={"k": "v"}), ready=True)
        told = Told()
        first = [json.loads(m) for m in said.due(told, declared=True, extra={"x": 1})]
        assert [m["type"] for m in first] == ["publish", "ready"]
        assert first[0]["endpoint"] == "http://a"
        assert first[0]["metadata"] == {"pid": os.getpid(), "x": 1, "k": "v"}
        assert said.due(told, declared=True, extra={}) == []
        assert said.set_ready(False)
        assert said.due(told, declared=True, extra={}) == ['{"type": "not_ready"}']
        assert not said.set_ready(False)
        assert said.due(Told(), declared=False, extra={})[0].startswith('{"type": "publish"')
        assert len(said.due(Told(), declared=False, extra={})) == 1
        # A new connection that cannot serve says so: a record it took over may say otherwise.
        assert said.due(Told(), declared=True, extra={})[1] == '{"type": "not_ready"}'

    def test_run_time_publishes_merge_and_are_told_again_after_a_reconnect(self) -> None:
        """A run-time publish replaces the endpoint and merges its keys over the options';
        a key it removes is sent as null to every later connection, so a hub that kept it
        from before removes it too."""
        said = Announcements(Publication(metadata={"k": "v", "gone": 1}), ready=False)
        assert said.publish(endpoint="http://127.0.0.1:4242", metadata={"gone": None, "n": 2})
        assert not said.publish(endpoint="http://127.0.0.1:4242")
        assert said.endpoint == "http://127.0.0.1:4242"
        (message,) = [json.loads(m) for m in said.due(Told(), declared=False, extra={})]
        assert message["endpoint"] == "http://127.0.0.1:4242"
        assert message["metadata"] == {"pid": os.getpid(), "k": "v", "gone": None, "n": 2}

    def test_a_bad_publish_is_refused_before_it_is_sent(self) -> None:
        """What the hub would refuse (a malformed endpoint, metadata that does not fit) is
        refused at once, and nothing changes."""
        said = Announcements()
        for bad in ({"endpoint": ""}, {"metadata": {"a": "x" * 17_000}}, {}):
            with pytest.raises(ValueError, match=r"endpoint|metadata|publish"):
                said.publish(**bad)
        said.publish(metadata={"a": "x" * 9000})
        with pytest.raises(ValueError, match="16384"):
            said.publish(metadata={"b": "y" * 9000})
        assert said.version == 1
        assert said.due(Told(), declared=False, extra={}) != []

    @pytest.mark.parametrize(
        ("line", "reason"),
        [
            (b"not json\n", "not a JSON object"),
            (b"[1]\n", "not a JSON object"),
            (b'{"type": "hello"}\n', "expected publish"),
            (b'{"type": "publish"}\n', "neither"),
            (b'{"type": "publish", "endpoint": "a\\u0000b"}\n', "endpoint"),
            (b'{"type": "publish", "metadata": [1]}\n', "metadata"),
        ],
    )
    def test_bad_lines(self, line: bytes, reason: str) -> None:
        """A line of the command that is not a message it may send is refused, saying why."""
        with pytest.raises(ValueError, match=reason):
            parse_line(line)

    def test_good_lines(self) -> None:
        """Publish, ready and not_ready lines say what they say."""
        said = parse_line(b'{"type": "publish", "endpoint": "tcp://h:1", "metadata": {"a": 1}}')
        assert (said.endpoint, said.metadata, said.ready) == ("tcp://h:1", {"a": 1}, None)
        assert parse_line(b'{"type": "ready"}').ready is True
        assert parse_line(b'{"type": "not_ready"}\n').ready is False


# -- against a real hub ----------------------------------------------------------------------


@pytest.fixture
async def hub(db: Database) -> AsyncIterator[Hub]:
    async with running_hub(db, ready_on_connect=True) as running:
        yield running


@pytest.fixture
async def declared(db: Database, store: AllocationStore) -> Sidecar:
    """An allocated allocation that is ready once its sidecar says so, parked waiting for it."""
    sidecar, _ = await sidecar_in(store, db)
    async with db.pool.acquire() as conn:
        await conn.execute(
            "UPDATE hubd_allocations SET ready_when = 'declared', lease_id = NULL, "
            "lease_expires_at = NULL WHERE id = $1",
            sidecar.allocation_id,
        )
    return sidecar


async def row(db: Database, allocation_id: str) -> dict[str, Any]:
    async with db.pool.acquire() as conn:
        found = await conn.fetchrow(
            "SELECT ready, endpoint, metadata FROM hubd_v1.allocations WHERE id = $1",
            allocation_id,
        )
    assert found is not None
    return dict(found)


def ready_is(db: Database, allocation_id: str, ready: bool) -> Callable[[], Any]:
    async def check() -> bool:
        return bool((await row(db, allocation_id))["ready"]) is ready

    return check


async def ready_events(db: Database, allocation_id: str) -> list[tuple[str, datetime, Any]]:
    """The feed's ready and not_ready events of the allocation: (event, at, endpoint)."""
    async with db.pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT event, at, endpoint FROM hubd_v1.events WHERE allocation_id = $1 "
            "AND event IN ('ready', 'not_ready') ORDER BY position",
            allocation_id,
        )
    return [(r["event"], r["at"], r["endpoint"]) for r in rows]


class TestClient:
    async def test_readiness_and_publishes_follow_the_client_across_reconnects(
        self, db: Database, hub: Hub, declared: Sidecar
    ) -> None:
        """A client that cannot serve yet publishes and does not declare; set_ready and a
        run-time publish reach the hub at once, not_ready drops the allocation's readiness,
        and after a reconnect the hub is told all of it again."""
        settings = SidecarSettings.from_env(declared.env(hub.server.url))
        client = SidecarClient(
            settings, backoff=FAST, publication=Publication(metadata={"k": "v"}), ready=False
        )
        running = asyncio.create_task(client.run())
        try:
            await eventually(lambda: client.published == 1, what="the first publish")
            assert not (await row(db, declared.allocation_id))["ready"]
            client.set_ready(True)
            await eventually(ready_is(db, declared.allocation_id, True), what="ready")
            client.publish(endpoint="http://127.0.0.1:4242/", metadata={"k": None, "n": 1})
            await eventually(lambda: client.published == 2, what="the run-time publish")
            client.set_ready(False)
            await eventually(ready_is(db, declared.allocation_id, False), what="not ready")
            # The first not_ready followed the welcome (it wrote nothing: nothing was declared).
            # The hub answers once its write committed, so the row can be read before the
            # client has read the answer.
            await eventually(lambda: client.withdrawn == 2, what="the second not_ready answered")
            client.set_ready(True)
            await eventually(ready_is(db, declared.allocation_id, True), what="ready again")
            (entry,) = hub.router.sockets(declared.allocation_id)
            hub.router.close_socket(entry, CloseCode.INTERNAL_ERROR)
            await eventually(lambda: client.welcomes == 2, what="the reconnect")
            await eventually(lambda: client.declared == 3, what="ready after the reconnect")
            found = await row(db, declared.allocation_id)
        finally:
            client.stop()
            await running
        assert found["ready"]
        assert found["endpoint"] == "http://127.0.0.1:4242/"
        assert found["metadata"] == {"pid": os.getpid(), "n": 1}


@contextlib.asynccontextmanager
async def sidecar_process(
    hub: Hub, sidecar: Sidecar, tmp_path: Path, *args: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``hubd sidecar ARGS...`` as a child process (its output in ``tmp_path/sidecar.log``),
    ended after the test's block."""
    log = (tmp_path / "sidecar.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hubd.cli",
        "sidecar",
        *args,
        env=hubd_env(sidecar.env(hub.server.url)),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(30):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        log.close()


FAST_CHECK = ("--ready-interval", "0.05", "--ready-timeout", "1", "--not-ready-after", "0.3")

HEALTH_SERVER = """
import http.server, os, sys
state, port = sys.argv[1], int(sys.argv[2])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(state + ".hits", "a") as hits:
            hits.write("x")
        self.send_response(200 if os.path.exists(state + ".ok") else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class TestProcess:
    async def test_ready_follows_an_http_check(
        self, db: Database, hub: Hub, declared: Sidecar, tmp_path: Path
    ) -> None:
        """With ``--ready-check http://…`` the allocation is not ready while the command
        answers 503, ready once it answers 200, not ready again (an event says so) when it
        answers 503 for longer than --not-ready-after, and ready again after that."""
        port, state = free_port(), tmp_path / "state"
        (tmp_path / "health.py").write_text(HEALTH_SERVER)
        url = f"http://127.0.0.1:{port}/healthz"
        command = (sys.executable, str(tmp_path / "health.py"), str(state), str(port))
        async with sidecar_process(
            hub, declared, tmp_path, "--ready-check", url, *FAST_CHECK, "--", *command
        ):
            hits = Path(str(state) + ".hits")
            await eventually(
                lambda: hits.exists() and len(hits.read_text()) >= 3, within=30, what="checks"
            )
            assert not (await row(db, declared.allocation_id))["ready"]
            (tmp_path / "state.ok").touch()
            await eventually(ready_is(db, declared.allocation_id, True), within=30)
            (tmp_path / "state.ok").unlink()
            await eventually(ready_is(db, declared.allocation_id, False), within=30)
            (tmp_path / "state.ok").touch()
            await eventually(ready_is(db, declared.allocation_id, True), within=30)
        events = [event for event, _, _ in await ready_events(db, declared.allocation_id)]
        assert events[:3] == ["ready", "not_ready", "ready"]

    async def test_ready_never_comes_before_the_command_listens(
        self, db: Database, hub: Hub, declared: Sidecar, tmp_path: Path
    ) -> None:
        """With ``--ready-check tcp:…`` and a command that takes a while to listen, the
        allocation becomes ready only after the command listens (the issue measured ready
        with nothing listening)."""
        port, listening = free_port(), tmp_path / "listening"
        server = (
            "import socket, time; time.sleep(1); "
            f"s = socket.create_server(('127.0.0.1', {port})); "
            f"open({str(listening)!r}, 'w').write(repr(time.time())); "
            "while True: s.accept()[0].close()"
        )
        server = server.replace("; while", "\nwhile")
        async with sidecar_process(
            hub,
            declared,
            tmp_path,
            "--ready-check",
            f"tcp:127.0.0.1:{port}",
            *FAST_CHECK,
            "--",
            sys.executable,
            "-c",
            server,
        ):
            await eventually(ready_is(db, declared.allocation_id, True), within=30)
        listened_at = datetime.fromtimestamp(float(listening.read_text()), UTC)
        event, at, _ = (await ready_events(db, declared.allocation_id))[0]
        assert event == "ready"
        assert at >= listened_at

    async def test_a_shell_command_publishes_and_declares(
        self, db: Database, hub: Hub, declared: Sidecar, tmp_path: Path
    ) -> None:
        """A shell command (docs/plugins.md's example) publishes its endpoint and metadata on
        HUBD_PUBLISH_FD and says ready there (``--ready-check command``); a line the hub would
        refuse is dropped without costing the connection; its ``not_ready`` drops the
        allocation's readiness."""
        script = (
            'fd="$HUBD_PUBLISH_FD"; '
            'printf \'{"type":"publish","endpoint":"http://127.0.0.1:%s/","metadata":'
            '{"port":%s}}\\n\' 4242 4242 >&"$fd"; '
            'echo \'{"type":"publish","endpoint":""}\' >&"$fd"; '
            'echo \'{"type":"ready"}\' >&"$fd"; '
            'while [ ! -e "$1/stop" ]; do '
            'if [ -e "$1/down" ]; then rm "$1/down"; echo \'{"type":"not_ready"}\' >&"$fd"; fi; '
            "sleep 0.05; done"
        )
        async with sidecar_process(
            hub,
            declared,
            tmp_path,
            "--ready-check",
            "command",
            "--",
            "sh",
            "-c",
            script,
            "sh",
            str(tmp_path),
        ) as process:
            await eventually(ready_is(db, declared.allocation_id, True), within=30)
            found = await row(db, declared.allocation_id)
            assert found["endpoint"] == "http://127.0.0.1:4242/"
            assert found["metadata"]["port"] == 4242
            assert found["metadata"]["pid"] == process.pid
            assert isinstance(found["metadata"]["command_pid"], int)
            (tmp_path / "down").touch()
            await eventually(ready_is(db, declared.allocation_id, False), within=30)
            (tmp_path / "stop").touch()
            async with asyncio.timeout(30):
                assert await process.wait() == 0
        assert b"sidecar_command_line_dropped" in (tmp_path / "sidecar.log").read_bytes()
        assert hub.server.stats.protocol_errors == 0

    async def test_an_endpoint_picked_at_run_time_is_published_then_checked(
        self, db: Database, hub: Hub, declared: Sidecar, tmp_path: Path
    ) -> None:
        """A command that listens on a port it picks at run time publishes its endpoint on
        HUBD_PUBLISH_FD; ``--ready-check endpoint`` checks that endpoint, so the ready event
        already carries it."""
        server = (
            "import http.server, json, os\n"
            "class Ok(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.send_header('Content-Length', '0')\n"
            "        self.end_headers()\n"
            "    def log_message(self, *args): pass\n"
            "httpd = http.server.HTTPServer(('127.0.0.1', 0), Ok)\n"
            "url = 'http://127.0.0.1:%d/' % httpd.server_address[1]\n"
            "line = json.dumps({'type': 'publish', 'endpoint': url}) + '\\n'\n"
            "os.write(int(os.environ['HUBD_PUBLISH_FD']), line.encode())\n"
            "httpd.serve_forever()\n"
        )
        async with sidecar_process(
            hub,
            declared,
            tmp_path,
            "--ready-check",
            "endpoint",
            *FAST_CHECK,
            "--",
            sys.executable,
            "-c",
            server,
        ):
            await eventually(ready_is(db, declared.allocation_id, True), within=30)
        event, _, endpoint = (await ready_events(db, declared.allocation_id))[0]
        assert event == "ready"
        assert endpoint is not None
        assert endpoint.startswith("http://127.0.0.1:")
