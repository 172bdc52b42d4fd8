"""Prometheus metrics of the daemon, on a registry of its own (several daemons can live in one test process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ckpt_engine.server.decisions.receivers import STATES
from ckpt_engine.server.decisions.views import ReceiverRow

STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._receiver_gauges: ReceiverGauges | None = None
        self.versions = Counter("ckpt_engine_versions", "versions by outcome", ["outcome"], registry=self.registry)
        self.bytes_sent = Counter("ckpt_engine_bytes_sent", "bytes broadcast for committed and failed versions",
                                  registry=self.registry)
        self.stage_seconds = Histogram("ckpt_engine_stage_seconds", "seconds per stage of a version", ["stage"],
                                       buckets=STAGE_BUCKETS, registry=self.registry)
        self.receivers = Gauge("ckpt_engine_receivers", "registered receivers", registry=self.registry)
        self.trainers = Gauge("ckpt_engine_trainers", "registered trainer agents", registry=self.registry)
        self.cache_bytes = Gauge("ckpt_engine_cache_bytes", "bytes held by the trainer ranks' version caches "
                                 "(every rank's share, summed)", registry=self.registry)
        self.in_flight = Gauge("ckpt_engine_in_flight", "1 while a version is in flight", registry=self.registry)
        self.storage_degraded = Gauge("ckpt_engine_storage_degraded",
                                      "1 while the history cannot be written (new versions refused)",
                                      registry=self.registry)
        self.torn_receivers = Gauge("ckpt_engine_torn_receivers", "receivers whose model a failed apply left torn",
                                    registry=self.registry)
        self.refused = Counter("ckpt_engine_refused", "control-plane requests refused, by reason (HTTP: 401 "
                               "unauthorized, 403 forbidden...; ZMQ: the error replied)", ["reason"],
                               registry=self.registry)
        self.connections_closed = Counter("ckpt_engine_connections_closed", "HTTP and ZMQ connections the daemon "
                                          "closed to protect itself (slow or idle clients, over the connection "
                                          "limit), by plane and reason", ["plane", "reason"], registry=self.registry)

    def watch_receivers(self, rows: Callable[[], list[ReceiverRow]]) -> None:
        """Per-receiver gauges, read from ``rows`` at each scrape (nothing to keep in step between scrapes)."""
        if self._receiver_gauges is not None:  # a second controller on these metrics: the newest one is shown
            self.registry.unregister(self._receiver_gauges)
        self._receiver_gauges = ReceiverGauges(rows)
        self.registry.register(self._receiver_gauges)

    def version_done(self, outcome: str, nbytes: int, stages: dict[str, float]) -> None:
        self.versions.labels(outcome=outcome).inc()
        self.bytes_sent.inc(nbytes)
        for stage, seconds in stages.items():
            self.stage_seconds.labels(stage=stage).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ReceiverGauges(Collector):
    """Per-receiver gauges, labelled by agent id and engine. ``ckpt_engine_receiver_state`` is 1 for the state
    a receiver is in and 0 for the others, so ``sum by (state)`` counts receivers per state. Also
    ``ckpt_engine_receiver_serving_version`` and ``ckpt_engine_receiver_lag_versions`` (committed versions newer
    than the one it serves)."""

    def __init__(self, rows: Callable[[], list[ReceiverRow]]) -> None:
        self.rows = rows

    def describe(self) -> list[Metric]:
        return list(self._families([]))  # registering must not call into the controller

    def collect(self) -> Iterator[Metric]:
        return self._families(self.rows())

    @staticmethod
    def _families(rows: list[ReceiverRow]) -> Iterator[Metric]:
        labels = ["agent", "engine"]
        state = GaugeMetricFamily("ckpt_engine_receiver_state", "1 for the state each receiver is in",
                                  labels=[*labels, "state"])
        serving = GaugeMetricFamily("ckpt_engine_receiver_serving_version", "version each receiver serves "
                                    "(absent while it serves none)", labels=labels)
        lag = GaugeMetricFamily("ckpt_engine_receiver_lag_versions", "committed versions newer than the one each "
                                "receiver serves (absent while it serves none)", labels=labels)
        for row in rows:
            names = [row.agent_id, row.engine or ""]
            for name in STATES:
                state.add_metric([*names, name], float(row.state == name))
            if row.serving is not None:
                serving.add_metric(names, float(row.serving))
            if row.lag is not None:
                lag.add_metric(names, float(row.lag))
        yield from (state, serving, lag)
