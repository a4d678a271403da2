"""The admin listener on its own thread: probes answer while the daemon's loop is blocked, and
metrics are rendered on the daemon's loop."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import pytest

from hubd.daemon.admin import AdminServer


def get(url: str) -> tuple[int, str]:
    """A blocking GET, for a thread of the test's own."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 -- loopback
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Probe:
    """A GET made on a thread of its own; ``answered`` is set when the response arrived."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answered = threading.Event()
        self.result: tuple[int, str] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.result = get(self.url)
        self.answered.set()

    async def done(self) -> tuple[int, str]:
        await asyncio.to_thread(self._thread.join, 30)
        assert self.result is not None
        return self.result


@pytest.fixture
async def admin() -> AsyncIterator[tuple[AdminServer, list[str | None], list[str]]]:
    """An admin listener whose readiness answer and metrics rendering the test controls; the
    second list records the thread each metrics rendering ran on."""
    problem: list[str | None] = [None]
    rendered_on: list[str] = []

    async def metrics() -> bytes:
        rendered_on.append(threading.current_thread().name)
        return b"hubd_up 1\n"

    server = AdminServer(host="127.0.0.1", port=0, readiness=lambda: problem[0], metrics=metrics)
    await server.start()
    try:
        yield server, problem, rendered_on
    finally:
        await server.close()


async def _no_metrics() -> bytes:
    return b""


def url(server: AdminServer, path: str) -> str:
    return f"http://127.0.0.1:{server.port}{path}"


class TestProbes:
    @pytest.mark.parametrize("path", ["/readyz", "/healthz"])
    async def test_answered_while_the_daemons_loop_is_blocked(
        self, admin: tuple[AdminServer, list[str | None], list[str]], path: str
    ) -> None:
        """The probe is answered while this loop (the daemon's) is blocked outright: the
        loop waits, synchronously, for the answer itself."""
        server, _, _ = admin
        probe = Probe(url(server, path))
        # A blocked loop, not a slow one: nothing on it runs until the probe is answered.
        answered_while_blocked = probe.answered.wait(timeout=30)
        assert answered_while_blocked
        assert (await probe.done())[0] == 200

    async def test_readiness_says_what_is_missing(
        self, admin: tuple[AdminServer, list[str | None], list[str]]
    ) -> None:
        server, problem, _ = admin
        assert await asyncio.to_thread(get, url(server, "/readyz")) == (200, "ready\n")
        problem[0] = "database unreachable"
        assert await asyncio.to_thread(get, url(server, "/readyz")) == (
            503,
            "not ready: database unreachable\n",
        )

    async def test_metrics_rendered_on_the_daemons_loop(
        self, admin: tuple[AdminServer, list[str | None], list[str]]
    ) -> None:
        """Metrics read values the daemon's loop writes: they are rendered there."""
        server, _, rendered_on = admin
        assert await asyncio.to_thread(get, url(server, "/metrics")) == (200, "hubd_up 1\n")
        assert rendered_on == [threading.current_thread().name]

    @pytest.mark.parametrize(
        ("method", "path", "status"), [("GET", "/nope", 404), ("POST", "/readyz", 405)]
    )
    async def test_other_requests(
        self,
        admin: tuple[AdminServer, list[str | None], list[str]],
        method: str,
        path: str,
        status: int,
    ) -> None:
        server, _, _ = admin

        def request() -> int:
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                return int(sock.makefile("rb").readline().split()[1])

        assert await asyncio.to_thread(request) == status


class TestLifetime:
    async def test_a_port_in_use_is_raised_by_start(self) -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            server = AdminServer(
                host="127.0.0.1", port=port, readiness=lambda: None, metrics=_no_metrics
            )
            with pytest.raises(OSError, match="in use"):
                await server.start()
            await server.close()

    async def test_closed_listener_refuses_and_leaves_no_thread(self) -> None:
        server = AdminServer(host="127.0.0.1", port=0, readiness=lambda: None, metrics=_no_metrics)
        await server.start()
        port = server.port
        await server.close()
        assert not [t for t in threading.enumerate() if t.name == "hubd-admin"]
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 5)
