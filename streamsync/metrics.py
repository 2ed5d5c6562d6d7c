"""Prometheus metrics of pushes, in a registry a trainer can expose.

Every `WeightSync` records into `DEFAULT` (its own `CollectorRegistry`, `REGISTRY`) unless given
`metrics=Metrics(registry=...)` (e.g. `prometheus_client.REGISTRY`, which the trainer may already serve):

    from prometheus_client import start_http_server
    from streamsync.metrics import REGISTRY
    start_http_server(9400, registry=REGISTRY)

Names (prefix `streamsync_`): `push_seconds` (histogram), `pushes_total`, `push_bytes_total`,
`push_chunks_total`, `push_failures_total{stage}`, `stage_busy_seconds_total{stage}`,
`engine_version{engine}`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from .report import PushReport

# A push takes milliseconds on a GPU and seconds over the network or on CPU.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The push metrics, registered once in `registry`."""

    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "streamsync") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, prefix
        self.push_seconds = Histogram(f"{p}_push_seconds", "Wall time of successful pushes", buckets=_BUCKETS,
                                      registry=r)
        self.pushes = Counter(f"{p}_pushes", "Successful pushes", registry=r)
        self.bytes = Counter(f"{p}_push_bytes", "Packed bytes delivered by successful pushes", registry=r)
        self.chunks = Counter(f"{p}_push_chunks", "Chunks delivered by successful pushes", registry=r)
        self.failures = Counter(f"{p}_push_failures", "Failed pushes, by the stage that failed", ["stage"],
                                registry=r)
        self.stage_busy = Counter(f"{p}_stage_busy_seconds", "Time each stage spent working on chunks",
                                  ["stage"], registry=r)
        self.engine_version = Gauge(f"{p}_engine_version", "Weight version each engine reports", ["engine"],
                                    registry=r)

    def observe_push(self, report: PushReport) -> None:
        self.push_seconds.observe(report.seconds)
        self.pushes.inc()
        self.bytes.inc(report.bytes)
        self.chunks.inc(report.chunks)
        for stage, seconds in report.stage_seconds.items():
            self.stage_busy.labels(stage=stage).inc(seconds)
        for engine in report.engines:
            self.engine_version.labels(engine=engine).set(report.version)

    def observe_failure(self, stage: str) -> None:
        self.failures.labels(stage=stage).inc()


DEFAULT = Metrics()
REGISTRY = DEFAULT.registry
