"""deploy/grafana-dashboard.json charts only what the daemon exports (server/metrics.py), and every panel
charts something; deploy/prometheus.yml scrapes /metrics with a bearer token."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ckpt_engine.server.decisions.views import ReceiverRow
from ckpt_engine.server.metrics import Metrics
from tests.daemon_harness import ROOT

DASHBOARD = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",)}
ROWS = [ReceiverRow("a1", "e0", "serving", 7, 0, None), ReceiverRow("a2", None, "torn", None, None, "v8: boom")]


def exported() -> set[str]:
    """Every series name the daemon's metrics can have (also those with no sample yet)."""
    metrics = Metrics()
    metrics.watch_receivers(lambda: ROWS)
    return {family.name + suffix for family in metrics.registry.collect() for suffix in SUFFIXES[family.type]}


def exprs() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in DASHBOARD["panels"] for target in panel["targets"]]


@pytest.mark.parametrize("title, expr", exprs())
def test_each_panel_charts_only_exported_metrics(title: str, expr: str) -> None:
    used = set(re.findall(r"\bckpt_engine_\w+", expr))
    assert used, f"{title}: charts no ckpt-engine metric"
    assert used <= exported(), f"{title}: {sorted(used - exported())} are not exported"


def test_the_dashboard_uses_the_per_receiver_and_stage_metrics() -> None:
    used = {name for _, expr in exprs() for name in re.findall(r"\bckpt_engine_\w+", expr)}
    assert {"ckpt_engine_stage_seconds_bucket", "ckpt_engine_receiver_state", "ckpt_engine_receiver_lag_versions",
            "ckpt_engine_storage_degraded"} <= used


@pytest.mark.parametrize("row, state, lag", [(ROWS[0], "serving", 0.0), (ROWS[1], "torn", None)])
def test_receiver_gauges_say_state_and_lag(row: ReceiverRow, state: str, lag: float | None) -> None:
    metrics = Metrics()
    metrics.watch_receivers(lambda: ROWS)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    labels = (("agent", row.agent_id), ("engine", row.engine or ""))
    ones = [k for k, v in samples.items() if k[0] == "ckpt_engine_receiver_state" and dict(k[1])["agent"] ==
            row.agent_id and v == 1.0]
    assert [dict(k[1])["state"] for k in ones] == [state]
    assert samples.get(("ckpt_engine_receiver_lag_versions", labels)) == lag


def test_a_second_controller_on_the_same_metrics_replaces_the_gauges() -> None:
    metrics = Metrics()
    metrics.watch_receivers(lambda: ROWS)
    metrics.watch_receivers(lambda: ROWS[:1])  # would raise 'Duplicated timeseries' if both were registered
    assert b'agent="a2"' not in metrics.render()


def test_prometheus_scrapes_metrics_with_a_bearer_token_from_a_file() -> None:
    job = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"
    assert "credentials_file" in job["authorization"] and "credentials" not in job["authorization"]
