"""``hubd check-config``'s look at the provisioners: every plugin found and its options checked
by the plugin's own parser (:func:`~hubd.plugins.registry.check_options`); with ``--probe``,
every provisioner built as ``hubd run`` builds it, then asked (where its plugin can answer,
:class:`~hubd.plugins.protocol.Probes`) whether it can make sidecars here: its engine answers,
its image or command is there. Nothing is created."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs

from hubd.config import ProvisionerConfig
from hubd.errors import PluginError, PluginLoadError
from hubd.plugins.protocol import Probes, Provisioner
from hubd.plugins.registry import check_options, load_provisioners
from hubd.redaction import scrub

__all__ = ["PROBE_TIMEOUT", "ProbeOutcome", "preflight", "probe_provisioners"]

PROBE_TIMEOUT: Final = 30.0
"""How long one provisioner's probe may take: an engine that does not answer within it is a
problem as real as one that refuses."""
_MAX_TEXT: Final = 500


@attrs.frozen(kw_only=True)
class ProbeOutcome:
    provisioner_id: str
    ok: bool
    text: str
    """What was found, or the problem: one line, scrubbed."""


def preflight(
    configs: Sequence[ProvisionerConfig], *, state_dir: Path, probe: bool = False
) -> list[str]:
    """Check every provisioner's options (and with ``probe``, probe it): the comment lines
    ``hubd check-config`` prints. A refused option, or any probe that found a problem, is one
    :class:`PluginLoadError` naming each provisioner and problem (exit 2)."""
    checked = check_options(configs)
    lines = []
    for verdict, ids in (
        ("checked by their plugin", [pid for pid, done in checked.items() if done]),
        (
            "not checked (their plugin has no check_options)",
            [pid for pid, done in checked.items() if not done],
        ),
    ):
        if ids:
            lines.append(f"# provisioner options {verdict}: {', '.join(ids)}")
    if not probe:
        return lines
    outcomes = asyncio.run(probe_provisioners(configs, state_dir=state_dir))
    failed = [f"provisioner {o.provisioner_id!r}: probe: {o.text}" for o in outcomes if not o.ok]
    if failed:
        raise PluginLoadError("; ".join(failed))
    return lines + [f"# probe {o.provisioner_id}: {o.text}" for o in outcomes]


async def probe_provisioners(
    configs: Sequence[ProvisionerConfig], *, state_dir: Path, within: float = PROBE_TIMEOUT
) -> list[ProbeOutcome]:
    """Build every provisioner (raises :class:`~hubd.errors.PluginLoadError` as ``hubd run``
    would) and probe those that can be probed, all at once; one outcome per provisioner, in
    the configured order."""
    built = load_provisioners(configs, state_dir=state_dir)
    return list(await asyncio.gather(*(_probe(pid, made, within) for pid, made in built.items())))


async def _probe(provisioner_id: str, provisioner: Provisioner, within: float) -> ProbeOutcome:
    def outcome(ok: bool, text: str) -> ProbeOutcome:
        text = " ".join(text.split()) or "(no message)"
        if len(text) > _MAX_TEXT:
            text = text[: _MAX_TEXT - 1] + "…"
        return ProbeOutcome(provisioner_id=provisioner_id, ok=ok, text=scrub(text))

    if not isinstance(provisioner, Probes):
        return outcome(True, "not probed: its plugin has no probe")
    try:
        async with asyncio.timeout(within):
            found = await provisioner.probe()
    except TimeoutError:
        return outcome(False, f"the probe did not finish within {within:g}s")
    except PluginError as exc:
        return outcome(False, str(exc))
    except Exception as exc:  # noqa: BLE001 -- a plugin's probe is code hubd does not control
        # Whatever it raised is its answer, shown as the problem rather than a traceback.
        return outcome(False, f"the probe raised {type(exc).__name__}: {exc}")
    if not isinstance(found, str):
        return outcome(False, f"the probe returned {type(found).__name__}, not a string")
    return outcome(True, found)
