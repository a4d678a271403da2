"""A conformance kit for provisioner plugins: the checks docs/plugins.md asks of every
provisioner, as reusable coroutines and as a test class to subclass.

A plugin author describes the plugin under test with a :class:`Subject` (how to build an
instance, and optionally how to tell that a sidecar exists) and either subclasses
:class:`ProvisionerConformance` in a pytest module (with pytest-asyncio) and provides a
``subject`` fixture, or awaits :func:`run_checks` from any test runner::

    from hubd.plugins.testing import ProvisionerConformance, Subject

    class TestMyPlugin(ProvisionerConformance):
        @pytest.fixture
        def subject(self, tmp_path):
            return Subject(make=lambda: my_plugin.create(id="p", options={...},
                                                         state_dir=tmp_path))

Every check creates sidecars under fresh sidecar ids, destroys what it created, and fails
with an :class:`AssertionError` that says which rule was broken. The existence oracle is
``Subject.exists`` when given, else the plugin's ``list_sidecars()``; a plugin with neither
only gets the checks that need no oracle.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import attrs

from hubd.plugins.protocol import (
    Accepted,
    Destroyed,
    DestroyRejected,
    DestroyRequest,
    EnsureRequest,
    ListsSidecars,
    Ownership,
    Provisioner,
    Rejected,
    check_destroy_result,
    check_ensure_result,
)

__all__ = [
    "CHECKS",
    "ProvisionerConformance",
    "Subject",
    "check_cancellation_mid_call",
    "check_destroy_is_idempotent",
    "check_destroy_of_unknown_sidecar",
    "check_ensure_is_idempotent",
    "check_inventory",
    "check_lost_ownership_is_honoured",
    "check_results_are_valid",
    "check_token_stays_private",
    "lost_ownership",
    "run_checks",
]

CANCEL_AFTER_STEPS: Final = (0, 1, 2, 3, 5, 8, 13, 21, 34, 55)
"""Event-loop iterations after which :func:`check_cancellation_mid_call` cancels an ensure:
spread so that the cancellation lands at different awaits of a typical plugin."""
CANCEL_AFTER_SECONDS: Final = (0.01, 0.03, 0.1, 0.3)
"""And delays after which it cancels one, for the awaits that wait on the outside world."""


@attrs.frozen(kw_only=True)
class Subject:
    """The plugin under test.

    ``make`` builds an instance; it is called more than once, and every instance must see the
    same sidecars (same options, same state directory, same external system), as a restarted
    hubd would. ``exists`` (optional) answers whether the sidecar with that id exists;
    without it the plugin's ``list_sidecars()`` is the oracle. ``spec`` is the request's spec.
    ``hub_ws_url`` is what sidecars are told to dial (nothing needs to listen there).
    """

    make: Callable[[], Provisioner]
    exists: Callable[[Provisioner, str], Awaitable[bool]] | None = None
    spec: Mapping[str, Any] = attrs.field(factory=dict)
    hub_ws_url: str = "ws://127.0.0.1:9"

    def request(self, *, ownership: Ownership | None = None, **overrides: Any) -> EnsureRequest:
        """A fresh ensure request: new allocation id and sidecar id, a token-shaped token."""
        values: dict[str, Any] = {
            "allocation_id": f"al_{uuid.uuid4().hex}",
            "generation": 1,
            "tenant_id": None,
            "session_id": None,
            "spec": dict(self.spec),
            "sidecar_id": f"sc_{uuid.uuid4().hex}",
            "token": f"hubd_sc_{secrets.token_hex(32)}",
            "hub_ws_url": self.hub_ws_url,
            "ownership": ownership or Ownership.unbounded(),
            **overrides,
        }
        return EnsureRequest(**values)

    async def has_oracle(self, provisioner: Provisioner) -> bool:
        return self.exists is not None or isinstance(provisioner, ListsSidecars)

    async def sidecar_exists(self, provisioner: Provisioner, sidecar_id: str) -> bool:
        if self.exists is not None:
            return await self.exists(provisioner, sidecar_id)
        if isinstance(provisioner, ListsSidecars):
            listed = await provisioner.list_sidecars()
            return any(sidecar.sidecar_id == sidecar_id for sidecar in listed)
        raise AssertionError("no way to tell whether a sidecar exists: give Subject.exists")


def destroy_request(
    request: EnsureRequest, ref: str | None, *, ownership: Ownership | None = None
) -> DestroyRequest:
    """The destroy hubd sends for ``request``'s sidecar (one generation later, as a release
    or a replacement does)."""
    return DestroyRequest(
        allocation_id=request.allocation_id,
        generation=request.generation + 1,
        sidecar_id=request.sidecar_id,
        external_ref=ref,
        ownership=ownership or Ownership.unbounded(),
    )


def lost_ownership() -> Ownership:
    """An ownership whose claim was lost a second ago, as a daemon resumed from a pause sees
    it."""
    lost_at = time.monotonic() - 1.0
    lost_at_utc = datetime.now(UTC) - timedelta(seconds=1)
    return Ownership(
        still_owned=lambda: False, deadline=lambda: lost_at, deadline_utc=lambda: lost_at_utc
    )


async def _accepted(provisioner: Provisioner, request: EnsureRequest) -> Accepted:
    result = check_ensure_result(await provisioner.ensure(request))
    assert isinstance(result, Accepted), f"ensure of a fresh sidecar was not accepted: {result}"
    return result


async def _destroyed(provisioner: Provisioner, request: DestroyRequest, what: str) -> None:
    result = check_destroy_result(await provisioner.destroy(request))
    assert isinstance(result, Destroyed), f"{what}: destroy answered {result}"


async def _cleanup(provisioner: Provisioner, requests: Iterable[EnsureRequest]) -> None:
    for request in requests:
        await provisioner.destroy(destroy_request(request, None))


async def check_ensure_is_idempotent(subject: Subject) -> None:
    """Two ensures of one sidecar id, from two instances, answer the same external_ref and
    leave one sidecar, which a destroy removes."""
    first, second = subject.make(), subject.make()
    request = subject.request()
    try:
        accepted = await _accepted(first, request)
        again = await _accepted(second, request)
        assert again.external_ref == accepted.external_ref, (
            f"a retried ensure answered {again.external_ref!r}, the first {accepted.external_ref!r}"
        )
        if await subject.has_oracle(first):
            assert await subject.sidecar_exists(first, request.sidecar_id)
            if isinstance(first, ListsSidecars):
                listed = [
                    s for s in await first.list_sidecars() if s.sidecar_id == request.sidecar_id
                ]
                assert len(listed) == 1, f"one sidecar id, {len(listed)} sidecars: {listed}"
        await _destroyed(second, destroy_request(request, accepted.external_ref), "destroy")
        if await subject.has_oracle(first):
            assert not await subject.sidecar_exists(first, request.sidecar_id), (
                "the sidecar still exists after Destroyed"
            )
    finally:
        await _cleanup(first, [request])


async def check_destroy_is_idempotent(subject: Subject) -> None:
    """A destroy repeated after success, by another instance, with or without the
    external_ref, answers Destroyed again."""
    provisioner = subject.make()
    request = subject.request()
    try:
        accepted = await _accepted(provisioner, request)
        gone = destroy_request(request, accepted.external_ref)
        await _destroyed(provisioner, gone, "first destroy")
        await _destroyed(provisioner, gone, "a repeated destroy")
        await _destroyed(subject.make(), destroy_request(request, None), "a destroy without ref")
    finally:
        await _cleanup(provisioner, [request])


async def check_destroy_of_unknown_sidecar(subject: Subject) -> None:
    """A destroy of a sidecar id that never existed answers Destroyed."""
    provisioner = subject.make()
    request = subject.request()
    await _destroyed(provisioner, destroy_request(request, None), "destroy of an unknown id")


async def check_results_are_valid(subject: Subject) -> None:
    """ensure answers Accepted or Rejected (well-formed: bounded external_ref, valid endpoint
    and metadata), destroy Destroyed or DestroyRejected; a rejection has a code, a message
    and a bool ``retryable``."""
    provisioner = subject.make()
    request = subject.request()
    try:
        result = check_ensure_result(await provisioner.ensure(request))
        assert isinstance(result, Accepted), f"ensure of a fresh sidecar was rejected: {result}"
        check_destroy_result(
            await provisioner.destroy(destroy_request(request, result.external_ref))
        )
    finally:
        await _cleanup(provisioner, [request])


async def check_cancellation_mid_call(
    subject: Subject,
    steps: Sequence[int] = CANCEL_AFTER_STEPS,
    delays: Sequence[float] = CANCEL_AFTER_SECONDS,
) -> None:
    """An ensure cancelled at various points lets CancelledError through (or finished
    first), and the destroy that follows (hubd's next step) removes whatever it created."""
    provisioner = subject.make()
    oracle = await subject.has_oracle(provisioner)
    requests: list[EnsureRequest] = []
    try:
        points = [(f"{count} steps", count, 0.0) for count in steps]
        points += [(f"{delay:g}s", 0, delay) for delay in delays]
        for after, count, delay in points:
            request = subject.request()
            requests.append(request)
            task = asyncio.create_task(provisioner.ensure(request), name="conformance ensure")
            for _ in range(count):
                await asyncio.sleep(0)
            if delay:
                await asyncio.wait({task}, timeout=delay)
            requested = task.cancel()  # False: it had finished already
            try:
                result = check_ensure_result(await task)
                assert not requested, (
                    f"an ensure cancelled after {after} returned {result} instead of "
                    f"letting CancelledError through"
                )
            except asyncio.CancelledError:
                # Our cancel, reported as such: what a plugin must do. A CancelledError of our
                # own task would mean the test itself was cancelled.
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            await _destroyed(
                subject.make(),
                destroy_request(request, None),
                f"destroy after an ensure cancelled after {after}",
            )
            if oracle:
                assert not await subject.sidecar_exists(provisioner, request.sidecar_id), (
                    f"an ensure cancelled after {after} left a sidecar its destroy missed"
                )
    finally:
        await _cleanup(provisioner, requests)


async def check_lost_ownership_is_honoured(subject: Subject) -> None:
    """With the claim lost (``still_owned()`` false, the deadline past), ensure creates
    nothing and answers a retryable rejection; destroy removes nothing and answers a
    retryable DestroyRejected, and the sidecar is still there for the next owner."""
    provisioner = subject.make()
    oracle = await subject.has_oracle(provisioner)
    stale = subject.request(ownership=lost_ownership())
    owned = subject.request()
    try:
        result = check_ensure_result(await provisioner.ensure(stale))
        what = f"ensure after the claim was lost answered {result}, not a retryable Rejected"
        assert isinstance(result, Rejected), what
        assert result.retryable, what
        if oracle:
            assert not await subject.sidecar_exists(provisioner, stale.sidecar_id), (
                "ensure created a sidecar after the claim was lost"
            )
        accepted = await _accepted(provisioner, owned)
        refused = check_destroy_result(
            await provisioner.destroy(
                destroy_request(owned, accepted.external_ref, ownership=lost_ownership())
            )
        )
        if oracle:
            still = await subject.sidecar_exists(provisioner, owned.sidecar_id)
            assert still, "destroy removed a sidecar after the claim was lost"
            what = f"destroy after the claim was lost answered {refused}, not a retryable one"
            assert isinstance(refused, DestroyRejected), what
            assert refused.retryable, what
    finally:
        await _cleanup(provisioner, [stale, owned])


async def check_inventory(subject: Subject) -> None:
    """``list_sidecars()`` (where implemented) names every sidecar this provisioner runs,
    with the allocation id and generation it was created for, from any instance; a
    destroyed one is no longer listed."""
    provisioner = subject.make()
    if not isinstance(provisioner, ListsSidecars):
        return
    requests = [subject.request(), subject.request(generation=3)]
    try:
        for request in requests:
            await _accepted(provisioner, request)
        other = subject.make()
        assert isinstance(other, ListsSidecars)
        listed = {s.sidecar_id: s for s in await other.list_sidecars()}
        for request in requests:
            sidecar = listed.get(request.sidecar_id)
            assert sidecar is not None, f"{request.sidecar_id} is running but not listed"
            assert sidecar.allocation_id in (None, request.allocation_id), sidecar
            assert sidecar.generation in (None, request.generation), sidecar
        await _destroyed(other, destroy_request(requests[0], None), "destroy")
        remaining = {s.sidecar_id for s in await provisioner.list_sidecars()}
        assert requests[0].sidecar_id not in remaining, "a destroyed sidecar is still listed"
        assert requests[1].sidecar_id in remaining
    finally:
        await _cleanup(provisioner, requests)


async def check_token_stays_private(subject: Subject) -> None:
    """The token appears in nothing the plugin hands back: not the external_ref, the
    endpoint, the metadata, a rejection's message or the inventory."""
    provisioner = subject.make()
    request = subject.request()
    secret = request.token
    bare = secret.removeprefix("hubd_sc_")
    try:
        result = check_ensure_result(await provisioner.ensure(request))
        shown = [repr(result)]
        if isinstance(provisioner, ListsSidecars):
            shown.append(repr(await provisioner.list_sidecars()))
        shown.append(repr(await provisioner.destroy(destroy_request(request, None))))
        for text in shown:
            assert secret not in text, f"the token leaked: {text[:200]}"
            assert bare not in text, f"the token's secret part leaked: {text[:200]}"
    finally:
        await _cleanup(provisioner, [request])


CHECKS: Final[Mapping[str, Callable[[Subject], Awaitable[None]]]] = {
    "ensure_is_idempotent": check_ensure_is_idempotent,
    "destroy_is_idempotent": check_destroy_is_idempotent,
    "destroy_of_unknown_sidecar": check_destroy_of_unknown_sidecar,
    "results_are_valid": check_results_are_valid,
    "cancellation_mid_call": check_cancellation_mid_call,
    "lost_ownership_is_honoured": check_lost_ownership_is_honoured,
    "inventory": check_inventory,
    "token_stays_private": check_token_stays_private,
}
"""Every check, by name."""


async def run_checks(subject: Subject, names: Iterable[str] | None = None) -> None:
    """Run the named checks (all by default), in order; the first failure raises."""
    for name in names if names is not None else CHECKS:
        await CHECKS[name](subject)


class ProvisionerConformance:
    """Subclass in a pytest module (pytest-asyncio in auto mode, or mark the class) and give
    it a ``subject`` fixture returning a :class:`Subject`; each check becomes a test."""

    async def test_ensure_is_idempotent(self, subject: Subject) -> None:
        await check_ensure_is_idempotent(subject)

    async def test_destroy_is_idempotent(self, subject: Subject) -> None:
        await check_destroy_is_idempotent(subject)

    async def test_destroy_of_unknown_sidecar(self, subject: Subject) -> None:
        await check_destroy_of_unknown_sidecar(subject)

    async def test_results_are_valid(self, subject: Subject) -> None:
        await check_results_are_valid(subject)

    async def test_cancellation_mid_call(self, subject: Subject) -> None:
        await check_cancellation_mid_call(subject)

    async def test_lost_ownership_is_honoured(self, subject: Subject) -> None:
        await check_lost_ownership_is_honoured(subject)

    async def test_inventory(self, subject: Subject) -> None:
        await check_inventory(subject)

    async def test_token_stays_private(self, subject: Subject) -> None:
        await check_token_stays_private(subject)
