"""The ``container`` provisioner's ``sidecar_output`` against each real engine (see
``tests/containerkit.py``): a sidecar container's stdout and stderr, its last lines or all of
them, followed until it stops, never its token; nothing for a sidecar it has no container of."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import aiodocker
import pytest

from hubd.plugins.container import ContainerProvisioner, create
from hubd.plugins.container.output import MAX_LINE, Lines
from hubd.plugins.container.spec import container_name, create_body
from hubd.plugins.protocol import Accepted, EnsureRequest
from tests import containerkit
from tests import test_container_provisioner as kit
from tests.reconcilerkit import poll_until
from tests.test_container_provisioner import ensure_request, provisioner

engine = kit.engine
deployment = kit.deployment
cleanup = kit.cleanup

pytestmark = [pytest.mark.timeout(180)]

# A line on stderr, five on stdout and the token, then waits for SIGTERM and says goodbye.
# Neither engine keeps the order of lines written to stdout and stderr within moments of each
# other (each is read from its own pipe): the second passes between them.
WRITES = [
    "sh", "-c",
    'echo oops >&2; sleep 1; for i in 1 2 3 4 5; do echo "line $i"; done; '
    'echo "token $HUBD_TOKEN"; trap "echo bye; exit 0" TERM; while :; do sleep 0.1; done',
]  # fmt: skip
WRITTEN = ["oops", "line 1", "line 2", "line 3", "line 4", "line 5", "token ***"]


async def output(
    made: ContainerProvisioner,
    request: EnsureRequest,
    ref: str | None,
    *,
    tail: int | None,
    follow: bool = False,
) -> str:
    return "".join(
        [
            chunk
            async for chunk in made.sidecar_output(
                request.sidecar_id, ref, tail=tail, follow=follow
            )
        ]
    )


async def running(made: ContainerProvisioner) -> tuple[EnsureRequest, str | None]:
    """A sidecar that has written everything it writes before waiting: its request and
    reference."""
    request = ensure_request()
    result = await made.ensure(request)
    assert isinstance(result, Accepted), result

    async def written() -> bool:
        text = await output(made, request, result.external_ref, tail=None)
        return text.count("\n") >= len(WRITTEN)

    await poll_until(written, within=30, every=0.1)
    return request, result.external_ref


@pytest.mark.usefixtures("cleanup")
class TestSidecarOutput:
    async def test_tail_and_all(self, engine: containerkit.Engine, deployment: str) -> None:
        """All of the output, stdout and stderr in order, or its last lines; the token the
        sidecar printed is hidden; found by the recorded reference or, without one, by the
        sidecar's name."""
        made = provisioner(engine, deployment, command=WRITES)
        request, ref = await running(made)
        everything = await output(made, request, ref, tail=None)
        assert everything.splitlines() == WRITTEN
        assert request.token not in everything
        assert await output(made, request, ref, tail=2) == "line 5\ntoken ***\n"
        assert await output(made, request, None, tail=1) == "token ***\n"
        assert await output(made, request, ref, tail=0) == ""

    async def test_follow_until_it_stops(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """Following, the last lines come first, then what the sidecar writes as it writes it,
        and the output ends when the container stops."""
        made = provisioner(engine, deployment, command=WRITES)
        request, ref = await running(made)
        chunks: asyncio.Queue[str | None] = asyncio.Queue()

        async def follow() -> None:
            async for chunk in made.sidecar_output(request.sidecar_id, ref, tail=1, follow=True):
                chunks.put_nowait(chunk)
            chunks.put_nowait(None)

        task = asyncio.create_task(follow())
        try:
            async with asyncio.timeout(30):
                assert await chunks.get() == "token ***\n"
                async with aiodocker.Docker(url=engine.socket) as docker:
                    await docker.containers.container(container_name(request.sidecar_id)).kill(
                        signal="SIGTERM"
                    )
                rest = []
                while (chunk := await chunks.get()) is not None:
                    rest.append(chunk)
                assert "".join(rest) == "bye\n"
                await task
        finally:
            task.cancel()

    async def test_cancelled_follow_closes(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """A reader that stops reading a followed output (closes it) ends it at once."""
        made = provisioner(engine, deployment, command=WRITES)
        request, ref = await running(made)
        followed = made.sidecar_output(request.sidecar_id, ref, tail=1, follow=True)
        try:
            async with asyncio.timeout(10):
                assert await anext(followed) == "token ***\n"
        finally:
            async with asyncio.timeout(10):
                await followed.aclose()

    async def test_no_container_is_a_lookup_error(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """A sidecar the engine has no container of, or only one under its name that is not
        this deployment's, raises LookupError."""
        made = provisioner(engine, deployment, command=["sleep", "300"])
        with pytest.raises(LookupError):
            await output(made, ensure_request(), "container:0123456789ab", tail=None)
        foreign = ensure_request()
        other = create(
            id="container",
            options=containerkit.options(engine, deployment=f"other-{uuid.uuid4().hex[:6]}"),
            state_dir=Path("/nonexistent"),
        )
        async with aiodocker.Docker(url=engine.socket) as docker:
            made_elsewhere = await docker.containers.create(
                create_body(other.options, other.id, foreign),
                name=container_name(foreign.sidecar_id),
            )
        try:
            with pytest.raises(LookupError):
                await output(made, foreign, None, tail=None)
        finally:
            async with aiodocker.Docker(url=engine.socket) as docker:
                await docker.containers.container(made_elsewhere.id).delete(force=True)


class TestLines:
    def test_whole_lines_scrubbed(self) -> None:
        """Lines are passed on whole, across reads and a multi-byte character cut in two, each
        scrubbed of the secret and of token shapes; what is left at the end is passed on."""
        secret = "s3cr3t-value-xyz"
        lines = Lines(secret)
        assert lines.feed(b"one\ntw") == "one\n"
        assert lines.feed("o é".encode()[:-1]) == ""
        assert lines.feed("é".encode()[-1:] + f" {secret}\n".encode()) == "two é ***\n"
        assert lines.feed(b"hubd_sc_" + b"a" * 40 + b"\nend") == "***\n"
        assert lines.end() == "end"

    def test_a_line_without_end_is_passed_on_in_pieces(self) -> None:
        lines = Lines(None)
        assert lines.feed(b"x" * (MAX_LINE + 1)) == "x" * (MAX_LINE + 1)
        assert lines.end() == ""
