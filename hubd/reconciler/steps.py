"""The steps a claim takes, by status (architecture §1), over one :class:`ClaimRun`.

Each step does its I/O (plugin calls, hooks, readiness look-ups, waits for a connect) through
the claim, asks :mod:`hubd.reconciler.decisions` what the outcome means, and applies the write
it answers with. Nothing here decides a delay, a failure text or an expected status.
"""

from __future__ import annotations

import functools

from hubd.errors import LeaseLost, SidecarNotConnected
from hubd.plugins.protocol import (
    DestroyRequest,
    EnsureRequest,
    Provisioner,
    check_destroy_result,
    check_ensure_result,
)
from hubd.reconciler.claim import ClaimRun
from hubd.reconciler.decisions import (
    Proceed,
    Step,
    abandon_unsettled,
    after_acceptance,
    after_connect_window,
    after_destroy,
    after_ensure,
    after_on_ready,
    connect_remaining,
    connect_window,
    deadline_passed,
    not_called,
    step_for,
    unless_connected,
)
from hubd.reconciler.eligibility import provisioner_problem, provisioner_unavailable
from hubd.reconciler.executor import apply
from hubd.reconciler.faults import Boundary
from hubd.reconciler.settings import hook_call
from hubd.reconciler.writes import (
    AcceptAndPark,
    BeginInitialization,
    BindInitial,
    BindReplacement,
    MarkAllocated,
    MarkReady,
    MarkReleased,
    Retry,
)
from hubd.store.connection_values import Readiness
from hubd.store.rows import EffectRow, Status
from hubd.store.transitions import Effects
from hubd.tokens import hash_token

__all__ = ["reconcile"]


async def reconcile(run: ClaimRun) -> None:
    """Take the step the claimed status calls for (architecture §1)."""
    s, a = run.services, run.allocation
    automatic_recovery = s.settings.automatic_replacement_recovery
    s.router.fence(a.id, a.generation)
    if a.status.terminal:
        return
    if run.open_effects and a.status in (Status.PROVISIONING, Status.REPLACING, Status.RELEASING):
        settled = await run.op(s.ledger.settle_open_effects(run.fence), "settle open effects")
        if settled:
            run.log.warning("earlier_plugin_calls_without_outcome", count=settled)
    if a.status is Status.ALLOCATED and s.on_initialization_recovery is not None:
        recovery = hook_call(s.on_initialization_recovery, a)
        await run.with_lease("initialization recovery", recovery)

    problem = provisioner_problem(a, s.provisioners)
    if problem is not None:
        unavailable = provisioner_unavailable(a, problem)
        if isinstance(unavailable, Retry):
            run.log.warning("provisioner_unavailable_retrying", problem=problem)
        # The destroy the claim statement made due is not called: its intent is settled so.
        intent = run.claimed_intent()
        await apply(run, unavailable, () if intent is None else (not_called(intent, problem),))
        return
    provisioner = s.provisioners[a.provisioner_id]

    bound = run.claimed_ensure()
    if bound is not None:
        # The claim statement bound a new identity and wrote the ensure's intent: provisioning
        # under this lease, with nothing unsettled from before.
        intent, token = bound
        s.observer.transition(str(Status.PENDING), str(a.status))
        await _accept_ensure(run, provisioner, token, intent)
        return

    step = step_for(a.status, initialization_recorded=a.initialization_lease_id is not None)
    unsettled = abandon_unsettled(step, a, automatic_recovery=automatic_recovery)
    if unsettled is not None:
        await apply(run, unsettled)
    elif step is Step.BIND_AND_ENSURE:
        await _bind_and_ensure(run, provisioner, replacement=False)
    elif step is Step.WAIT_UNTIL_READY:
        await _wait_until_ready(run)
    elif step is Step.DESTROY_THEN_REBIND:
        destroyed = await _destroy_current(run, provisioner)
        if destroyed is not None:
            await _bind_and_ensure(run, provisioner, replacement=True, effects=destroyed)
    elif step is Step.DESTROY_THEN_RELEASE:
        destroyed = await _destroy_current(run, provisioner)
        if destroyed is not None:
            await apply(run, MarkReleased(), destroyed)


async def _bind_and_ensure(
    run: ClaimRun, provisioner: Provisioner, *, replacement: bool, effects: Effects = ()
) -> None:
    """Bind a new identity and call ensure. The bind carries the ensure's intent (and
    ``effects``, the outcome of the destroy before it): from this commit on, the status
    ``provisioning`` and the open intent say that an ensure may be under way."""
    s = run.services
    token = s.create_token()
    bind: BindInitial | BindReplacement
    if replacement:
        bind = BindReplacement(
            sidecar_id=s.create_sidecar_id(),
            token_hash=hash_token(token),
            connect_timeout=s.settings.connect_timeout,
        )
    else:
        bind = BindInitial(
            sidecar_id=s.create_sidecar_id(),
            token_hash=hash_token(token),
            connect_timeout=s.settings.connect_timeout,
            api_version=provisioner.api_version,
            binding_fingerprint=provisioner.binding_fingerprint,
            ready_when=s.settings.ready_when_of(run.allocation.provisioner_id),
        )
    intent = run.intend("ensure", Status.PROVISIONING)
    await apply(run, bind, (*effects, intent))
    await _accept_ensure(run, provisioner, token, intent)


async def _accept_ensure(
    run: ClaimRun, provisioner: Provisioner, token: str, intent: EffectRow
) -> None:
    s, a = run.services, run.allocation
    assert a.sidecar_id is not None
    request = EnsureRequest(
        allocation_id=a.id,
        generation=a.generation,
        tenant_id=a.tenant_id,
        session_id=a.session_id,
        spec=a.spec,
        sidecar_id=a.sidecar_id,
        token=token,
        hub_ws_url=s.hub_ws_url,
        ownership=run.ownership(),
    )
    outcome, record = await run.call_plugin(
        intent, functools.partial(provisioner.ensure, request), check_ensure_result
    )
    accepted = after_ensure(
        outcome, a, automatic_recovery=s.settings.automatic_replacement_recovery
    )
    # Rather than hold a claim slot for the whole connect timeout, park until the connect
    # deadline; the sidecar's connect (recorded on any replica) wakes the allocation, or
    # makes it ready itself, and one recorded since the look makes the park itself fall
    # through to "due now". With no hook to run, the acceptance, the ensure's outcome, the
    # look and the park (or ready) are one statement.
    park_or_ready = after_acceptance(
        run.allocation,
        has_on_ready=s.on_ready is not None,
        instance_ttl=s.settings.instance_ttl,
    )
    if isinstance(accepted, MarkAllocated) and park_or_ready is not None:
        await apply(run, AcceptAndPark(accepted=accepted, park=park_or_ready), (record,))
        return
    await apply(run, accepted, (record,))
    if not isinstance(accepted, MarkAllocated):
        return
    readiness = await _readiness(run)
    park = unless_connected(readiness)
    if park is None:
        await _wait_until_ready(run, readiness)
    else:
        await apply(run, park)


async def _readiness(run: ClaimRun) -> Readiness:
    s = run.services
    await run.boundary(Boundary.BEFORE_READINESS, "readiness")
    readiness = await run.op(
        s.connections.readiness(run.target, s.settings.instance_ttl), "readiness check"
    )
    await run.boundary(Boundary.AFTER_READINESS, "readiness")
    return readiness


async def _wait_for_connect(run: ClaimRun, window: float) -> str | None:
    """Wait up to ``window`` seconds for the sidecar's connect notification; how the wait
    missed it, or ``None`` when one came."""
    router, target = run.services.router, run.target
    try:
        await run.with_lease(
            "sidecar connection",
            lambda _context: router.wait_ready(target, window),
            limit=window + run.services.settings.operation_timeout,
        )
    except SidecarNotConnected as exc:
        return str(exc)
    return None


async def _wait_until_ready(run: ClaimRun, seen: Readiness | None = None) -> None:
    s, a = run.services, run.allocation
    automatic_recovery = s.settings.automatic_replacement_recovery
    # A readiness look-up that fails is not evidence the sidecar missed its deadline: the
    # error propagates and the allocation is retried without giving up the generation.
    readiness = seen or await _readiness(run)
    if not readiness.connected:
        remaining = connect_remaining(readiness, connect_timeout=s.settings.connect_timeout)
        window = connect_window(remaining, s.settings.operation_timeout)
        if window > 0:
            missed = await _wait_for_connect(run, window)
        else:
            # The look-up just before said "not connected" and no time is left to wait.
            missed = deadline_passed(remaining)
        if missed is not None:
            missed_write = after_connect_window(
                a,
                remaining=remaining,
                window=window,
                seen=readiness,
                missed=missed,
                automatic_recovery=automatic_recovery,
            )
            await apply(run, missed_write)
            return
        # A notification is a hint: what counts is the record, and its number.
        readiness = await _readiness(run)
        park = unless_connected(readiness)
        if park is not None:
            await apply(run, park)
            return

    if s.on_ready is not None:
        # The marker is durable before the hook runs: a crash inside the hook leaves it for
        # the next claim, which then knows the initialization's outcome is uncertain.
        await apply(run, BeginInitialization())
        try:
            await run.with_lease("on_ready", hook_call(s.on_ready, run.allocation))
        except LeaseLost:
            raise
        except Exception as exc:  # noqa: BLE001 -- any failure of a hook is an outcome
            failed = after_on_ready(exc, run.allocation, automatic_recovery=automatic_recovery)
            if isinstance(failed, Retry) and failed.failure is not None:
                run.log.warning("on_ready_hook_failed", error=failed.failure.message)
            await apply(run, failed)
            return

    # Fenced on the connection number seen above: a connect that landed during
    # initialization, on any replica, may be a restarted sidecar whose takeover hid the
    # disconnect, so the write becomes an immediate follow-up instead of "ready".
    await apply(run, MarkReady(readiness.connection_seq))


async def _destroy_current(run: ClaimRun, provisioner: Provisioner) -> Effects | None:
    """Destroy the bound sidecar. When it is gone and the claim may go on: the destroy's
    outcome row, for the next write to carry; ``None`` when the claim stops here."""
    a = run.allocation
    if a.sidecar_id is None:
        return ()
    request = DestroyRequest(
        allocation_id=a.id,
        generation=a.generation,
        sidecar_id=a.sidecar_id,
        external_ref=a.external_ref,
        ownership=run.ownership(),
    )
    intent = run.claimed_intent()
    if intent is None:
        intent = run.intend("destroy", a.status)
        await run.record_intent(intent)
    outcome, record = await run.call_plugin(
        intent, functools.partial(provisioner.destroy, request), check_destroy_result
    )
    destroyed = after_destroy(outcome, a)
    if isinstance(destroyed, Proceed):
        return (record,)
    await apply(run, destroyed, (record,))
    return None
