"""From raw results to the one table: measure, baseline, hubd, ratio, target, met."""

from __future__ import annotations

import collections
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from bench import http, pools
from hubd.claimrules import DEFAULT_CLAIMS

__all__ = ["Measures", "profile_summary", "render", "round_ratios", "storm_ratios"]

_COMPARE: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le}


@attrs.frozen(kw_only=True)
class Target:
    """``on`` (``"ratio"`` or ``"hubd"``) compared by ``op`` with ``value``."""

    on: str
    op: str
    value: float

    def text(self) -> str:
        suffix = "x" if self.on == "ratio" else ""
        return f"{self.op} {self.value:g}{suffix}"

    def met(self, hubd: float, ratio: float | None) -> bool | None:
        subject = ratio if self.on == "ratio" else hubd
        return None if subject is None else _COMPARE[self.op](subject, self.value)


def _parts(row: Callable[..., None], results: dict[str, Any]) -> None:
    """The rows of the parts that report their own measures."""
    # The HTTP API (bench.http): HTTP's figures beside SQL's on one daemon; stream delivery
    # and the wait's answer from the feed's commit time; idle streams' memory.
    for key, label, ours, base, goal, unit in http.measures(results.get("http")):
        target = None if goal is None else Target(on="hubd", op="<=", value=goal)
        row(key, label, ours, base, target, unit)
    # Warm pools (bench.pools): warm beside cold on one daemon, bursts, the refill rate.
    for key, label, value, bound, unit in pools.measures(results.get("pools")):
        target = None if bound is None else Target(on="hubd", op=bound[0], value=bound[1])
        row(key, label, value, None, target, unit)


def _against_the_default(  # noqa: PLR0917 -- the rows' shared values, positionally
    row: Callable[..., None],
    results: dict[str, Any],
    n: int,
    floor: float | None,
    pgq: float | None,
    life16: float | None,
) -> None:
    """The lifecycle at the daemon's default claim count, as an operator gets it, against the
    two lifecycle baselines: issue 58's goal, half the hand floor, and the suite's own,
    PgQueuer's batch of one; and 16 claims against PgQueuer beside it."""
    default = _get(results, f"claims_{DEFAULT_CLAIMS}", "lifecycle", "lifecycle_rate")
    row(
        "lifecycle_rate_default",
        f"whole lifecycle, {DEFAULT_CLAIMS} claims (the default), N={n} (vs hand floor)",
        default,
        floor,
        Target(on="ratio", op=">=", value=0.5),
        "alloc/s",
    )
    row(
        "lifecycle_vs_pgqueuer",
        f"whole lifecycle, {DEFAULT_CLAIMS} claims (the default) (vs PgQueuer batch 1)",
        default,
        pgq,
        Target(on="ratio", op=">=", value=1),
        "alloc/s",
    )
    row(
        "lifecycle_vs_pgqueuer_16",
        "whole lifecycle, 16 claims (vs PgQueuer batch 1)",
        life16,
        pgq,
        unit="alloc/s",
    )


def _get(results: dict[str, Any], *path: str) -> Any:
    node: Any = results
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


class Measures:
    def build(self, results: dict[str, Any], size: Any) -> dict[str, dict[str, Any]]:
        rows: dict[str, dict[str, Any]] = {}

        def row(  # noqa: PLR0917 -- one call per table row reads best positionally
            key: str,
            measure: str,
            hubd: Any,
            baseline: Any = None,
            target: Target | None = None,
            unit: str = "",
        ) -> None:
            number = float(hubd) if isinstance(hubd, int | float) else None
            base = float(baseline) if isinstance(baseline, int | float) else None
            ratio = number / base if number is not None and base else None
            rows[key] = {
                "measure": measure,
                "unit": unit,
                "baseline": base,
                "hubd": number,
                "ratio": ratio,
                "target": target.text() if target else "",
                "met": target.met(number, ratio) if target and number is not None else None,
            }

        n = size.lifecycle
        floor = _get(results, "floor", "rate")
        pgq = _get(results, "pgqueuer", "rate")
        ready16 = _get(results, "claims_16", "lifecycle", "ready_rate")
        life16 = _get(results, "claims_16", "lifecycle", "lifecycle_rate")
        row(
            "ready_rate_16",
            f"pending→ready, 16 claims, N={n} (vs hand floor)",
            ready16,
            floor,
            unit="alloc/s",
        )
        row(
            "lifecycle_rate_16",
            f"whole lifecycle, 16 claims, N={n} (vs hand floor)",
            life16,
            floor,
            Target(on="ratio", op=">=", value=0.33),
            "alloc/s",
        )
        _against_the_default(row, results, n, floor, pgq, life16)
        for claims, key in ((16, "ready_rate_one_source"), (256, "ready_rate_one_source_256")):
            row(
                key,
                f"pending→ready, {claims} claims, N={n}, every sidecar from one address "
                "(vs from 249)",
                _get(results, f"claims_{claims}", "one_source", "ready_rate"),
                _get(results, f"claims_{claims}", "lifecycle", "ready_rate"),
                Target(on="ratio", op=">=", value=0.9),
                "alloc/s",
            )
        for claims in (64, 256):
            ready = _get(results, f"claims_{claims}", "lifecycle", "ready_rate")
            life = _get(results, f"claims_{claims}", "lifecycle", "lifecycle_rate")
            row(
                f"ready_rate_{claims}",
                f"pending→ready, {claims} claims (vs 16 claims)",
                ready,
                ready16,
                Target(on="ratio", op=">=", value=1),
                "alloc/s",
            )
            row(
                f"lifecycle_rate_{claims}",
                f"whole lifecycle, {claims} claims (vs 16 claims)",
                life,
                life16,
                Target(on="ratio", op=">=", value=1),
                "alloc/s",
            )
        floor_commits = _get(results, "floor", "commits_per_lifecycle")
        for claims in (16, 64, 256):
            row(
                f"commits_per_lifecycle_{claims}",
                f"commits per lifecycle, {claims} claims (vs hand floor)",
                _get(results, f"claims_{claims}", "lifecycle", "commits_per_lifecycle"),
                floor_commits,
                Target(on="hubd", op="<=", value=8),
                "commits",
            )
        for claims in (16, 64, 256):
            # No target: what each transition writes (rows, ledger rows, index entries), read
            # exactly where rates move with the host.
            row(
                f"wal_per_lifecycle_{claims}",
                f"WAL bytes per lifecycle, {claims} claims",
                _get(results, f"claims_{claims}", "lifecycle", "wal_bytes_per_lifecycle"),
                unit="bytes",
            )
        for claims in (16, 64, 256):
            row(
                f"idle_commits_{claims}",
                f"idle commits/s, {claims} claims",
                _get(results, f"claims_{claims}", "idle", "rate"),
                None,
                Target(on="hubd", op="<=", value=1),
                "commits/s",
            )
        samples = size.latency
        row(
            "connect_ready_p50",
            f"welcome→ready p50, idle daemon, {samples} samples",
            _get(results, "claims_16", "latency", "p50_ms"),
            None,
            Target(on="hubd", op="<=", value=5),
            "ms",
        )
        row(
            "connect_ready_p99",
            f"welcome→ready p99, idle daemon, {samples} samples",
            _get(results, "claims_16", "latency", "p99_ms"),
            None,
            Target(on="hubd", op="<=", value=25),
            "ms",
        )
        for quantile, goal in (("p50", 5), ("p99", 25)):
            row(
                f"dial_ready_{quantile}",
                f"handshake start→ready {quantile}, idle daemon, {samples} samples",
                _get(results, "claims_16", "latency", f"dial_{quantile}_ms"),
                None,
                Target(on="hubd", op="<=", value=goal),
                "ms",
            )
        # Fair claiming (bench.fairness): tenant B's request → ready under tenant A's burst of
        # ten times as many requests, against B alone on the same daemon; the former FIFO
        # claim beside it, for scale (no target: it is what the fair claim replaced).
        b = _count(_get(results, "fairness", "load", "requests"))
        burst = _count(_get(results, "fairness", "load", "burst"))
        alone50 = _get(results, "fairness", "alone", "b_p50_ms")
        alone99 = _get(results, "fairness", "alone", "b_p99_ms")
        for quantile, alone in (("p50", alone50), ("p99", alone99)):
            row(
                f"fairness_alone_{quantile}",
                f"tenant B request→ready {quantile}, {b} alone",
                alone,
                unit="ms",
            )
        row(
            "fairness_fair_p50",
            f"tenant B request→ready p50, under tenant A's {burst} at once (vs alone)",
            _get(results, "fairness", "fair", "b_p50_ms"),
            alone50,
            unit="ms",
        )
        row(
            "fairness_fair_p99",
            f"tenant B request→ready p99, under tenant A's {burst} at once (vs alone)",
            _get(results, "fairness", "fair", "b_p99_ms"),
            alone99,
            Target(on="ratio", op="<=", value=2),
            "ms",
        )
        row(
            "fairness_fifo_p99",
            "tenant B request→ready p99, the same burst, former FIFO claim (vs alone)",
            _get(results, "fairness", "fifo", "b_p99_ms"),
            alone99,
            unit="ms",
        )
        row(
            "fairness_burst_rate",
            "tenant A's burst pending→ready, fair claim (vs FIFO claim)",
            _get(results, "fairness", "fair", "a_rate"),
            _get(results, "fairness", "fifo", "a_rate"),
            unit="alloc/s",
        )
        # Deadlines under load (bench.deadlines): how late a lifetime or an idle timeout ended
        # after its moment (its end's event on the database clock), one replica of two paused
        # in one round and killed and restarted in the other, the rounds pooled.
        for kind, quantile, goal in (
            ("expired", "p50", None),
            ("expired", "p99", 1000),
            ("expired", "max", None),
            ("idle", "p99", 1000),
        ):
            label = "lifetime" if kind == "expired" else "idle timeout"
            ends = _count(_get(results, "deadlines", kind, "n"))
            row(
                f"deadline_{kind}_{quantile}",
                f"{label} end, lateness {quantile}, {ends} under load, a replica paused, restarted",
                _get(results, "deadlines", kind, f"{quantile}_ms"),
                None,
                None if goal is None else Target(on="hubd", op="<=", value=goal),
                "ms",
            )
        for what in ("twice", "never"):
            counts = [_get(results, "deadlines", kind, what) for kind in ("expired", "idle")]
            row(
                f"deadline_{what}",
                f"deadlines that fired {what} (lifetimes and idle timeouts)",
                None if None in counts else sum(counts),
                None,
                Target(on="hubd", op="<=", value=0),
                "allocations",
            )
        _parts(row, results)
        small, large = size.small_rows, size.large_rows
        for name, label in (
            ("claim", "claim statement (16 slots)"),
            ("renewal", "lease renewal (16 leases)"),
            ("status_count", "active status count"),
            ("status_estimate", "terminal status estimate"),
            ("repair", "repair sweep (mark_unconnected)"),
            ("stale_sweep", "stale record sweep"),
            ("socket_check", "socket check (16 sockets)"),
            ("heartbeat", "instance heartbeat"),
            ("dead_instances", "dead instance deletion"),
        ):
            row(
                f"{name}_cost",
                f"{label}, {small:,} → {large:,} terminal rows",
                _get(results, "statements", "statements", name, "ms_large"),
                _get(results, "statements", "statements", name, "ms_small"),
                Target(on="ratio", op="<=", value=1.2),
                "ms",
            )
        for count in size.sockets:
            phase = f"sockets_{count}"
            row(
                f"rss_per_socket_{count}",
                f"RSS per idle socket, {count:,} (vs bare websockets)",
                _get(results, phase, "hubd", "kib_per_socket"),
                _get(results, phase, "bare", "kib_per_socket"),
                Target(on="ratio", op="<=", value=1.35),
                "KiB",
            )
            row(
                f"reconnect_storm_{count}",
                f"reconnect storm, {count:,}, 64 at a time (vs bare websockets)",
                _get(results, phase, "hubd", "storm_rate"),
                _get(results, phase, "bare", "storm_rate"),
                Target(on="ratio", op=">=", value=0.6),
                "handshakes/s",
            )
            row(
                f"loss_rate_{count}",
                f"losses recorded after all {count:,} sockets dropped",
                _get(results, phase, "hubd", "loss_rate"),
                None,
                unit="losses/s",
            )
            # Where the storm's CPU went, per handshake (medians over the storms): the daemon
            # and the farm against the bare server and the farm serving it, and PostgreSQL.
            for key, label, ours, theirs in (
                ("daemon", "daemon (vs bare server)", "daemon", "server"),
                ("farm", "sidecar farm (vs farm, bare)", "farm", "farm"),
                ("postgres", "PostgreSQL", "postgres", None),
                # Its bare figure (in the JSON) is a few microseconds: no ratio worth showing.
                ("bench", "the bench itself", "bench", None),
            ):
                row(
                    f"storm_cpu_{key}_{count}",
                    f"storm CPU per handshake, {count:,}: {label}",
                    _get(results, phase, "hubd", "storm_cpu_ms", ours),
                    None
                    if theirs is None
                    else _get(results, phase, "bare", "storm_cpu_ms", theirs),
                    unit="ms",
                )
        return rows


def _count(value: Any) -> str:
    """A count for a row's label; ``N`` when the part did not run."""
    return f"{value:,}" if isinstance(value, int) else "N"


def _number(value: float | None) -> str:
    if value is None:
        return "—"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


# The table's ratio rows whose two sides both run once per round: (label, hubd's part and rate,
# the baseline's part and rate).
_PAIRED = (
    ("lifecycle, 16 claims / hand floor", "claims_16", "lifecycle_rate", "floor", "rate"),
    ("lifecycle, 16 claims / PgQueuer", "claims_16", "lifecycle_rate", "pgqueuer", "rate"),
    (
        "lifecycle, 64 claims (the default) / hand floor",
        "claims_64",
        "lifecycle_rate",
        "floor",
        "rate",
    ),
    (
        "lifecycle, 64 claims (the default) / PgQueuer",
        "claims_64",
        "lifecycle_rate",
        "pgqueuer",
        "rate",
    ),
    ("lifecycle, 64 / 16 claims", "claims_64", "lifecycle_rate", "claims_16", "lifecycle_rate"),
    ("lifecycle, 256 / 16 claims", "claims_256", "lifecycle_rate", "claims_16", "lifecycle_rate"),
    ("pending→ready, 64 / 16 claims", "claims_64", "ready_rate", "claims_16", "ready_rate"),
    ("pending→ready, 256 / 16 claims", "claims_256", "ready_rate", "claims_16", "ready_rate"),
    (
        "pending→ready, one address / spread",
        "claims_16",
        "one_source_ready_rate",
        "claims_16",
        "ready_rate",
    ),
    (
        "pending→ready, one address / spread, 256 claims",
        "claims_256",
        "one_source_ready_rate",
        "claims_256",
        "ready_rate",
    ),
)


def round_ratios(results: dict[str, Any]) -> list[tuple[str, list[float]]]:
    """The table's ratios taken within each round: a round's hubd rate over the same round's
    baseline. The table compares medians taken separately; these pairs show how far the machine
    moved the verdict from round to round. Rows whose sides did not both run every round (a
    part left out, PgQueuer skipped, a failed part) are left out."""
    paired = []
    for label, part, key, base_part, base_key in _PAIRED:
        ours = _get(results, part, "rounds") or []
        theirs = _get(results, base_part, "rounds") or []
        values = [a.get(key) for a in ours]
        if None in values:
            continue  # not measured in every round (an older run, a failed part)
        ratios = _pairwise(values, [b.get(base_key) or 0.0 for b in theirs])
        if ratios:
            paired.append((label, ratios))
    return paired


def _pairwise(ours: list[float], theirs: list[float]) -> list[float]:
    """Each of ``ours`` over the baseline taken beside it; empty when the two sides did not
    run the same number of times or a baseline is missing or zero."""
    if not ours or len(ours) != len(theirs) or not all(theirs):
        return []
    return [a / b for a, b in zip(ours, theirs, strict=True)]


def storm_ratios(results: dict[str, Any]) -> list[tuple[int, list[float]]]:
    """Each socket count's storms taken in pairs: hubd's storm over the bare server's storm
    run just before it. The table compares the two medians; these pairs show how far the
    machine moved between one pair and the next. Socket counts whose two sides did not run the
    same number of storms are left out."""
    paired = []
    for part, result in results.items():
        if not part.startswith("sockets_"):
            continue
        ours = _get(results, part, "hubd", "storm_rates") or []
        theirs = _get(results, part, "bare", "storm_rates") or []
        ratios = _pairwise(ours, theirs)
        if ratios:
            paired.append((int(result["hubd"]["n"]), ratios))
    return sorted(paired)


def render(report: dict[str, Any]) -> str:
    rows = report["measures"]
    head = ("measure", "unit", "baseline", "hubd", "ratio", "target", "met")
    lines = [
        [
            r["measure"],
            r["unit"],
            _number(r["baseline"]),
            _number(r["hubd"]),
            "—" if r["ratio"] is None else f"{r['ratio']:.2f}x",
            r["target"],
            {True: "yes", False: "NO", None: ""}[r["met"]],
        ]
        for r in rows.values()
    ]
    widths = [max(len(str(x)) for x in column) for column in zip(head, *lines, strict=True)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    for line in lines:
        cells = [line[0].ljust(widths[0]), line[1].ljust(widths[1])]
        cells += [cell.rjust(w) for cell, w in zip(line[2:5], widths[2:5], strict=True)]
        cells += [line[5].ljust(widths[5]), line[6]]
        out.append("  ".join(cells).rstrip())
    machine = report["machine"]
    out.append("")
    out.append(
        f"size {report['size']}; {machine['nproc']} cores ({machine['cpu']}), {machine['memory']}; "
        f"load average before {_load(machine['load_average_before'])}, "
        f"after {_load(machine['load_average'])}; PostgreSQL {machine.get('postgresql', '?')}; "
        f"sidecar farm on {report.get('farm_loop', 'asyncio')}"
    )
    rounds = report.get("parameters", {}).get("rounds", 1)
    if rounds > 1:
        out.append(
            f"lifecycle rates, commits and the floor's and PgQueuer's rates: medians of {rounds} "
            "rounds run in turn; idle commits: the rounds' windows pooled"
        )
        paired = round_ratios(report["results"])
        if paired:
            out.append(
                "the same ratios within each round (hubd's rate over that round's baseline):"
            )
            width = max(len(label) for label, _ in paired)
            out.extend(
                f"  {label.ljust(width)}  " + " / ".join(f"{ratio:.2f}x" for ratio in ratios)
                for label, ratios in paired
            )
    storms = [(n, ratios) for n, ratios in storm_ratios(report["results"]) if len(ratios) > 1]
    if storms:
        out.append(
            "each reconnect storm over the bare server's storm run just before it "
            "(the table's storm ratio is of the medians):"
        )
        out.extend(
            f"  {n:,} sockets  " + " / ".join(f"{ratio:.2f}x" for ratio in ratios)
            for n, ratios in storms
        )
    errors = {k: v["error"] for k, v in report["results"].items() if "error" in v}
    for claims in (16, 256):
        burst_error = _get(report["results"], f"claims_{claims}", "one_source", "error")
        if burst_error:
            errors[f"claims_{claims} one-address burst"] = burst_error
    for name, error in errors.items():
        out.append(f"FAILED {name}: {error}")
    skipped = report["results"].get("pgqueuer", {}).get("skipped")
    if skipped:
        out.append(f"PgQueuer skipped: {skipped}")
    profile = report.get("profile")
    if profile and profile["samples"]:
        out.append("")
        out.append(
            f"daemon profile, {DEFAULT_CLAIMS}-claim lifecycle ({profile['samples']} samples):"
        )
        for title, key in (
            ("running", "own"),
            ("innermost hubd function", "nearest_hubd"),
            ("hubd function on the stack", "hubd"),
        ):
            out.append(f"  {title}:")
            out.extend(f"    {share:6.1%}  {name}" for name, share in profile.get(key, [])[:10])
    return "\n".join(out)


def _load(values: Any) -> str:
    return " ".join(f"{v:.2f}" for v in values)


_FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _frame_name(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    file = match.group("file")
    for marker in ("site-packages/", "lib/python3"):
        if marker in file:
            file = file.split(marker, 1)[1]
    if "/hubd/" in file:
        file = "hubd/" + file.split("/hubd/", 1)[1]
    return f"{match.group('function')} ({file})"


def profile_summary(path: Path, top: int = 15) -> dict[str, Any]:
    """Top frames of a py-spy raw profile (collapsed stacks, idle threads left out), as shares
    of all samples: ``own``, the frame that was running; ``hubd``, hubd's own functions on the
    stack (inclusive); ``nearest_hubd``, the innermost hubd function of each sample, which says
    what hubd code the time in libraries was spent for."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    nearest: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame_name(f) for f in stack.split(";") if f.strip()]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        ours = [name for name in frames if "(hubd/" in name and "(hubd/cli.py)" not in name]
        for name in set(ours):
            inclusive[name] += count
        nearest[ours[-1] if ours else "(outside hubd: event loop, libraries)"] += count
    if total == 0:
        return {"samples": 0, "own": [], "hubd": [], "nearest_hubd": []}
    return {
        "samples": total,
        "own": [[name, count / total] for name, count in own.most_common(top)],
        "hubd": [[name, count / total] for name, count in inclusive.most_common(top)],
        "nearest_hubd": [[name, count / total] for name, count in nearest.most_common(top)],
    }
