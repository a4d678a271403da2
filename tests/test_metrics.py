"""The daemon's metrics as the reconciler reports to them, read back as Prometheus text."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from hubd.daemon.metrics import Metrics
from hubd.server.wire import ServerStats


def _value(metrics: Metrics, line_start: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {line_start!r}")


def test_transitions_and_plugin_calls_count_per_label_set() -> None:
    """Each report lands on the series of its own labels, however often a label set
    repeats (the children are kept between reports)."""
    metrics = Metrics()
    for _ in range(3):
        metrics.transition("provisioning", "allocated")
    metrics.transition("releasing", "released")
    for seconds in (0.01, 0.02):
        metrics.plugin_call("k8s", "ensure", seconds, "Accepted")
    metrics.plugin_call("k8s", "ensure", 0.5, "Rejected")
    metrics.plugin_call("local", "destroy", 0.1, "Destroyed")

    transitions = 'hubd_transitions_total{from_status="provisioning",to_status="allocated"}'
    assert _value(metrics, transitions) == 3
    assert _value(metrics, 'hubd_transitions_total{from_status="releasing"') == 1
    outcomes = 'hubd_plugin_outcomes_total{operation="ensure",outcome="Accepted",provisioner="k8s"}'
    assert _value(metrics, outcomes) == 2
    rejected = 'hubd_plugin_outcomes_total{operation="ensure",outcome="Rejected",provisioner="k8s"}'
    assert _value(metrics, rejected) == 1
    ensure_count = 'hubd_plugin_call_seconds_count{operation="ensure",provisioner="k8s"}'
    assert _value(metrics, ensure_count) == 3
    ensure_sum = 'hubd_plugin_call_seconds_sum{operation="ensure",provisioner="k8s"}'
    assert abs(_value(metrics, ensure_sum) - 0.53) < 1e-9
    destroy_count = 'hubd_plugin_call_seconds_count{operation="destroy",provisioner="local"}'
    assert _value(metrics, destroy_count) == 1


def test_every_metric_is_in_the_operations_guide() -> None:
    """docs/operations.md names every metric family a daemon exports, so an operator can look
    up what a series means."""
    metrics = Metrics()
    metrics.bind_gauges(
        active_claims=lambda: 0, queue_depth=lambda: 0, connected_sidecars=lambda: 0
    )
    metrics.bind_listener(ServerStats(), _Slots())
    metrics.bind_batchers(list)
    metrics.set_allocation_counts({"pending": 1}, ["pending"])
    families = {family.name for family in text_string_to_metric_families(metrics.render().decode())}
    assert len(families) > 30
    guide = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    assert sorted(name for name in families if f"`{name}" not in guide) == []


class _Slots:
    handshakes = 0
    waiting = 0
