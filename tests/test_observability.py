"""What a trainer can plug into: hooks, Prometheus metrics, profiler ranges and log events of each push."""

from __future__ import annotations

import re

import pytest
import structlog
import torch
from prometheus_client import CollectorRegistry

from streamsync import ChunkDone, PushReport, WeightSync
from streamsync.log import _timestamp, configure, quiet_logger
from streamsync.metrics import Metrics
from streamsync.testing.faults import inject
from streamsync.trace import STAGES

# Without engines a push still runs all five stages (packing into shared memory, sending to nobody).


async def test_on_chunk_sees_every_chunk_once_in_order_and_on_push_the_report(mixed_model):
    chunks: list[ChunkDone] = []
    reports: list[PushReport] = []
    sync = WeightSync([], chunk_bytes=2048, on_chunk=chunks.append, on_push=reports.append, metrics=None)
    report = await sync.push(mixed_model, version=3)
    assert [c.chunk for c in chunks] == list(range(report.chunks))
    assert {(c.push_id, c.version, c.chunks) for c in chunks} == {(report.push_id, 3, report.chunks)}
    assert sum(c.bytes for c in chunks) == report.bytes
    assert reports == [report]
    await sync.close()  # frees its shared-memory pool (the memfd checks of later tests count them)


async def test_a_garbage_collection_during_a_push_is_in_its_report(mixed_model):
    # A full collection in a trainer holding many objects pauses the push (~0.2 s with megatron loaded); the
    # report and the trace say how long, so a slow push is not left unexplained. Here one is forced mid-push.
    import gc

    def collect(c: ChunkDone) -> None:
        if c.chunk == 0:
            gc.collect()

    sync = WeightSync([], chunk_bytes=2048, on_chunk=collect, metrics=None)
    report = await sync.push(mixed_model)
    assert report.gc_ms > 0 and report.trace is not None and report.trace.counts.get("gc_gen2", 0) >= 1
    was = gc.isenabled()
    gc.disable()
    other = WeightSync([], chunk_bytes=2048, metrics=None)
    try:  # no collection at all: nothing reported
        quiet = await other.push(mixed_model)
    finally:
        if was:
            gc.enable()
    assert quiet.gc_ms == 0 and quiet.trace is not None and "gc_us" not in quiet.trace.counts
    await sync.close()
    await other.close()


def test_a_collection_that_starts_while_the_trace_is_being_written_does_not_deadlock():
    """A garbage collection can start inside any allocation, also one made while the trace holds its lock (adding
    an engine's phases, say); its callback counts into the same trace from the same thread. With a plain lock
    that thread waited on itself forever (seen: a push hung in `Trace.engine_phases`)."""
    import threading

    from streamsync import trace as tracing

    trace = tracing.Trace("p")
    done = threading.Event()

    def write() -> None:
        with trace._lock:  # a span being added when a collection starts and ends (the callback's calls, made here)
            tracing._on_gc("start", {"generation": 2})
            tracing._on_gc("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
        done.set()

    tracing._gc_traces.append(trace)  # as `watching_gc` registers a running push's trace
    try:
        threading.Thread(target=write, daemon=True).start()
        ok = done.wait(10)
    finally:  # a deadlocked thread keeps the lock: no later collection may count into this trace
        tracing._gc_traces.remove(trace)
    assert ok, "the trace's own lock deadlocked the collection's callback"
    assert trace.counts.get("gc_gen2", 0) >= 1 and "gc_us" in trace.counts


async def test_a_failing_hook_is_logged_once_per_push_and_does_not_fail_the_push(mixed_model):
    def broken(_: object) -> None:
        raise RuntimeError("dashboard down")

    sync = WeightSync([], chunk_bytes=2048, on_chunk=broken, on_push=broken, metrics=None)
    for version in (1, 2):
        with structlog.testing.capture_logs() as logs:
            report = await sync.push(mixed_model)
        assert report.version == version and report.chunks > 2
        warned = [e for e in logs if e["log_level"] == "warning"]
        events = [e["event"] for e in warned]
        # the error once, then how many chunks it failed for; the push hook's own
        assert events.count("on_chunk hook failed") == 1 and "on_push hook failed" in events
        (summary,) = [e for e in warned if e["event"] == "on_chunk hook failed for several chunks of this push"]
        assert summary["chunks"] == summary["of"] == report.chunks
    await sync.close()


async def test_metrics_count_pushes_bytes_chunks_and_stage_time(mixed_model):
    metrics = Metrics(CollectorRegistry())
    sync = WeightSync([], chunk_bytes=2048, metrics=metrics)
    r1 = await sync.push(mixed_model)
    r2 = await sync.push(mixed_model)
    get = metrics.registry.get_sample_value
    assert get("streamsync_pushes_total") == 2
    assert get("streamsync_push_bytes_total") == r1.bytes + r2.bytes
    assert get("streamsync_push_chunks_total") == r1.chunks + r2.chunks
    assert get("streamsync_push_seconds_count") == 2
    for stage in STAGES:
        assert get("streamsync_stage_busy_seconds_total", {"stage": stage}) > 0
    await sync.close()


async def test_metrics_record_failures_by_stage_and_each_engines_version(receiver, mixed_model):
    metrics = Metrics(CollectorRegistry())
    sync = WeightSync([receiver.engine()], chunk_bytes=2048, metrics=metrics)
    faults = inject(sync, {"pack": 1})
    with pytest.raises(Exception, match="stage=pack"):
        await sync.push(mixed_model, version=1)
    faults.clear()
    await sync.push(mixed_model, version=2)
    get = metrics.registry.get_sample_value
    assert get("streamsync_push_failures_total", {"stage": "pack"}) == 1
    assert get("streamsync_engine_version", {"engine": sync.engines[0].name}) == 2
    await sync.close()


async def test_each_stage_and_chunk_is_a_range_in_the_torch_profiler(mixed_model):
    sync = WeightSync([], chunk_bytes=2048, metrics=None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        report = await sync.push(mixed_model, version=5)
    names = {e.name for e in prof.events()}
    assert "streamsync.push v5" in names
    for stage in STAGES:
        assert {f"streamsync.{stage} #{i}" for i in range(report.chunks)} <= names
    await sync.close()


async def test_push_done_carries_bytes_throughput_and_stage_times(mixed_model):
    configure("info")  # the test command runs with STREAMSYNC_LOG=warning, which drops info events
    try:
        sync = WeightSync([], chunk_bytes=2048, metrics=None)
        with structlog.testing.capture_logs() as logs:
            report = await sync.push(mixed_model)
    finally:
        configure()
    done = next(e for e in logs if e["event"] == "push done")
    assert done["chunks"] == report.chunks and done["mib"] == round(report.bytes / (1 << 20), 1)
    assert done["gbps"] >= 0 and set(done["stage_ms"]) == set(STAGES)
    await sync.close()


def test_log_timestamps_are_iso_8601_with_milliseconds():
    stamp = _timestamp(None, "info", {})["timestamp"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d", stamp), stamp


def test_the_quiet_logger_of_non_sender_ranks_keeps_warnings_only():
    with structlog.testing.capture_logs() as logs:
        quiet_logger().info("push start")
        quiet_logger().warning("abort failed")
    assert [e["event"] for e in logs] == ["abort failed"]


# An application's own process: the logging set-up is process-wide, and pytest's log capture sits on the root
# logger of this one.
_APP = """
import json, logging, sys
import anyio
from streamsync import WeightSync
from streamsync.models.synthetic import StateModule, mixed_specs

records = []


class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)


async def main():
    sync = WeightSync([], chunk_bytes=2048, metrics=None)  # its logger exists before logging is set up
    if sys.argv[1] == "configured":
        logging.basicConfig(level=logging.INFO, handlers=[Keep()])
    report = await sync.push(StateModule(mixed_specs(), fill="random", seed=7))
    await sync.close()
    print(json.dumps({"chunks": report.chunks, "records": [
        {"name": r.name, "level": r.levelname, "message": r.getMessage(), "fields": r.streamsync,
         "where": f"{r.filename}:{r.funcName}"} for r in records]}))


anyio.run(main)
"""


def _app(mode: str, **env: str) -> tuple[dict, str]:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", _APP, mode], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_an_applications_logging_handler_gets_push_done_as_a_record_on_the_streamsync_logger():
    out, err = _app("configured")
    done = [r for r in out["records"] if r["message"].startswith("push done ")]
    assert len(done) == 1, out["records"]
    (rec,) = done
    assert rec["name"] == "streamsync" and rec["level"] == "INFO"
    assert rec["fields"]["event"] == "push done" and rec["fields"]["chunks"] == out["chunks"]
    assert f"chunks={out['chunks']}" in rec["message"]
    assert rec["where"] == "outcome.py:succeeded"  # the line that logged, not structlog's frames
    assert "push done" not in err  # nothing bypassed the application's handler


def test_log_json_renders_the_records_message_as_json():
    import json

    out, _ = _app("configured", STREAMSYNC_LOG_JSON="1")
    (rec,) = [r for r in out["records"] if '"push done"' in r["message"]]
    assert json.loads(rec["message"])["chunks"] == out["chunks"]


def test_without_logging_set_up_events_go_to_stderr_as_before_and_streamsync_log_filters_them():
    out, err = _app("plain")
    assert out["records"] == []
    line = next(ln for ln in err.splitlines() if "push done" in ln)
    assert re.match(r"\d{4}-\d\d-\d\dT[\d:.]+[+-]\d\d:\d\d \[info\s*\] push done ", line), line
    _, quiet = _app("plain", STREAMSYNC_LOG="warning")
    assert "push done" not in quiet
