"""Prometheus metrics of the daemon, on a registry of its own (several daemons can live in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.versions = Counter("ckpt_engine_versions", "versions by outcome", ["outcome"], registry=self.registry)
        self.bytes_sent = Counter("ckpt_engine_bytes_sent", "bytes broadcast for committed and failed versions",
                                  registry=self.registry)
        self.stage_seconds = Histogram("ckpt_engine_stage_seconds", "seconds per stage of a version", ["stage"],
                                       buckets=STAGE_BUCKETS, registry=self.registry)
        self.receivers = Gauge("ckpt_engine_receivers", "registered receivers", registry=self.registry)
        self.trainers = Gauge("ckpt_engine_trainers", "registered trainer agents", registry=self.registry)
        self.cache_bytes = Gauge("ckpt_engine_cache_bytes", "bytes held by the trainer's version cache",
                                 registry=self.registry)
        self.in_flight = Gauge("ckpt_engine_in_flight", "1 while a version is in flight", registry=self.registry)
        self.storage_degraded = Gauge("ckpt_engine_storage_degraded",
                                      "1 while the history cannot be written (new versions refused)",
                                      registry=self.registry)
        self.torn_receivers = Gauge("ckpt_engine_torn_receivers", "receivers whose model a failed apply left torn",
                                    registry=self.registry)
        self.refused = Counter("ckpt_engine_refused", "control-plane requests refused, by reason", ["reason"],
                               registry=self.registry)

    def version_done(self, outcome: str, nbytes: int, stages: dict[str, float]) -> None:
        self.versions.labels(outcome=outcome).inc()
        self.bytes_sent.inc(nbytes)
        for stage, seconds in stages.items():
            self.stage_seconds.labels(stage=stage).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
