"""The trace viewer, as a user sees it: real pushes into receiver processes, their trace files, and the page
drawn by a real headless Chromium (installed by `ensure_chromium` where missing; skipped only where it
cannot be). Screenshots of the page go to a temporary directory; with STREAMSYNC_UPDATE_SCREENSHOTS=1 they
replace docs/img/, where the README shows them (a plain run never touches tracked files)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web

from streamsync import PushError, WeightSync
from streamsync.cli import main as cli
from streamsync.testing.browser import Browser, Page, ensure_chromium
from streamsync.testing.faults import inject
from streamsync.testing.receiver import ReceiverProcess
from streamsync.trace import STAGES, Trace, load
from streamsync.trace.summary import summarize
from streamsync.trace.viewer import make_app

CHUNK = 1 << 20
DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"


@pytest.fixture(scope="module")
def img(tmp_path_factory) -> Path:
    """Where screenshots go: docs/img/ only when STREAMSYNC_UPDATE_SCREENSHOTS=1 asks to refresh them."""
    return DOCS_IMG if os.environ.get("STREAMSYNC_UPDATE_SCREENSHOTS") == "1" else tmp_path_factory.mktemp("img")


async def _screenshot(page: Page, path: Path) -> None:
    shot = await page.screenshot(path)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{shot} is not a PNG"


class Pushes:
    """One trace directory: window 1 and window 4 into two receivers (rx-slow sleeps 40 ms per chunk), and a
    push that failed in send on chunk 2."""

    def __init__(self, root: Path) -> None:
        self.dir = root
        self.w1 = self.w4 = self.failed = Path()
        self.chunks = 0
        self.error = ""
        self.seconds: dict[str, float] = {}  # file name -> the report's seconds


@pytest.fixture(scope="module")
async def pushes(tmp_path_factory, qwen_specs_path, qwen_model) -> Pushes:
    p = Pushes(tmp_path_factory.mktemp("traces"))
    with (ReceiverProcess(str(qwen_specs_path), name="rx-fast", threads=1) as fast,
          ReceiverProcess(str(qwen_specs_path), name="rx-slow", threads=1, delay=0.04) as slow):
        sync = WeightSync([fast.engine(), slow.engine()], chunk_bytes=CHUNK, trace_dir=p.dir)
        r1 = await sync.push(qwen_model, max_inflight=1)
        r4 = await sync.push(qwen_model, max_inflight=4)
        p.w1, p.w4, p.chunks = Path(r1.trace_path), Path(r4.trace_path), r4.chunks
        p.seconds = {p.w1.name: r1.seconds, p.w4.name: r4.seconds}
        inject(sync, {"send": 2})
        with pytest.raises(PushError) as err:
            await sync.push(qwen_model)
        p.error = str(err.value)
        (p.failed,) = set(p.dir.glob("*.trace.json")) - {p.w1, p.w4}
        await sync.close()
    return p


@pytest.fixture(scope="module")
async def site(pushes):
    runner = web.AppRunner(make_app(pushes.dir))
    await runner.setup()
    tcp = web.TCPSite(runner, "127.0.0.1", 0)
    await tcp.start()
    yield f"http://127.0.0.1:{tcp._server.sockets[0].getsockname()[1]}"
    await runner.cleanup()


@pytest.fixture(scope="module")
async def browser():
    path, why = ensure_chromium()
    if path is None:
        pytest.skip(f"no headless Chromium: {why}")
    async with Browser(path, width=1200, height=700) as b:
        yield b


# -- the trace files --------------------------------------------------------------------------------------


async def test_trace_holds_the_reports_wall_time(pushes):
    for name, seconds in pushes.seconds.items():
        assert json.loads((pushes.dir / name).read_text())["otherData"]["wall_s"] == seconds


async def test_trace_timestamps_are_epoch_microseconds_of_this_process(pushes):
    data = json.loads(pushes.w4.read_text())
    events = [e for e in data["traceEvents"] if e["ph"] in "XC"]
    assert {e["pid"] for e in events} == {os.getpid()}  # merges with torch.profiler traces of the trainer
    start = data["otherData"]["epoch0"] * 1e6
    assert time.time() * 1e6 - 3600e6 < start <= min(e["ts"] for e in events) < time.time() * 1e6


async def test_flow_events_link_each_chunks_stages_from_gather_to_release(pushes):
    events = json.loads(pushes.w4.read_text())["traceEvents"]
    slices = {(e["tid"], e["ts"]): e["args"] for e in events if e["ph"] == "X"}
    flows: dict[int, list[dict]] = {}
    for e in events:
        if e["ph"] in "stf":
            flows.setdefault(e["id"], []).append(e)
    assert len(flows) == pushes.chunks
    for steps in flows.values():
        assert [e["ph"] for e in steps] == ["s", "t", "t", "t", "f"]
        bound = [slices[e["tid"], e["ts"]] for e in steps]  # each step sits on a stage span of its chunk
        assert [a["stage"] for a in bound] == list(STAGES)
        assert len({a["chunk"] for a in bound}) == 1


async def test_each_engine_gets_a_send_span_per_chunk(pushes):
    spans = load(pushes.w4).spans
    per_engine = Counter(s.receiver for s in spans if s.stage == "send" and s.receiver is not None)
    assert per_engine == {"rx-fast": pushes.chunks, "rx-slow": pushes.chunks}
    # and each engine's own lane: its prefix-cache reset after the round (stand-in receivers time no phases)
    assert Counter(s.receiver for s in spans if s.stage.startswith("engine.")) == {"rx-fast": 1, "rx-slow": 1}


async def test_a_failed_push_records_stage_chunk_and_message(pushes):
    error = json.loads(pushes.failed.read_text())["otherData"]["error"]
    assert error["stage"] == "send" and error["chunk"] == 2
    assert error["message"] == "InjectedFault: fault injected in send of chunk 2" and error["message"] in pushes.error


async def test_a_slow_engine_makes_send_the_bounding_stage(pushes):
    s = summarize(load(pushes.w4))
    assert s.bounding_stage == "send"
    assert s.critical_ms["send"] > s.wall_ms / 2


def _scheduled(ms: dict[str, float], chunks: int, window: int) -> Trace:
    """The spans of an ideal pipeline with these stage times: each span starts as soon as its chunk's previous
    stage, its stage's previous chunk and (for a gather) the credit from `window` chunks back allow."""
    tr = Trace("sched", t0=1.0)
    tr.meta["max_inflight"] = window
    end: dict[tuple[str, int], float] = {}
    for i in range(chunks):
        for k, st in enumerate(STAGES):
            ready = [end.get((STAGES[k - 1], i), 0.0) if k else 0.0, end.get((st, i - 1), 0.0)]
            if k == 0:
                ready.append(end.get(("release", i - window), 0.0))
            start = max(ready)
            end[st, i] = start + ms[st] / 1e3
            tr.add_span(st, i, start, end[st, i], 1 << 20)
    tr.wall = max(end.values())
    return tr


@pytest.mark.parametrize("slow", STAGES)
def test_the_bounding_stage_is_the_one_that_sets_the_pace(slow):
    ms = {st: 3.0 if st == slow else 1.0 for st in STAGES}
    s = summarize(_scheduled(ms, chunks=12, window=4))
    assert s.bounding_stage == slow
    assert s.overlap > 0.5


def test_a_serial_schedule_overlaps_nothing_and_is_bound_by_its_longest_stage():
    s = summarize(_scheduled({"gather": 1, "convert": 1, "pack": 2, "send": 4, "release": 1}, chunks=6, window=1))
    assert s.overlap == 0.0 and s.bounding_stage == "send"
    assert s.critical_ms["send"] == pytest.approx(6 * 4)


async def test_window_1_overlaps_nothing_and_window_4_overlaps(pushes):
    assert summarize(load(pushes.w1)).overlap == 0.0
    assert summarize(load(pushes.w4)).overlap > 0.0


async def test_summary_command_prints_the_viewers_header(pushes, capsys):
    assert cli(["trace", "summary", str(pushes.w4)]) == 0
    out = capsys.readouterr().out
    assert summarize(load(pushes.w4)).header() in out
    assert "bound by send" in out


async def test_a_push_lines_up_inside_a_torch_profiler_trace_of_it(tmp_path, qwen_specs_path, qwen_model):
    from torch.profiler import ProfilerActivity, profile, record_function

    with ReceiverProcess(str(qwen_specs_path), name="rx-prof", threads=1) as rx:
        sync = WeightSync([rx.engine()], chunk_bytes=CHUNK, trace_dir=tmp_path)
        await sync.connect()
        with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("trainer push"):
            report = await sync.push(qwen_model)
        await sync.close()
    prof.export_chrome_trace(str(tmp_path / "profiler.json"))
    merged = tmp_path / "merged.json"
    assert cli(["trace", "merge", str(tmp_path / "profiler.json"), report.trace_path, "-o", str(merged)]) == 0
    events = json.loads(merged.read_text())["traceEvents"]
    (outer,) = [e for e in events if e.get("name") == "trainer push" and e.get("ph") == "X"]
    ours = [e for e in events if e.get("cat") == "streamsync"]
    engine = [e for e in ours if e["name"].startswith("engine.")]
    assert len(ours) - len(engine) == report.chunks * (len(STAGES) + 1) and len(engine) == 1  # its cache reset
    assert {e["pid"] for e in ours} == {outer["pid"]}
    # every stage span sits inside the trainer's profiler range around the push
    assert outer["ts"] <= min(e["ts"] for e in ours)
    assert max(e["ts"] + e["dur"] for e in ours) <= outer["ts"] + outer["dur"]


# -- the page -------------------------------------------------------------------------------------------

BARS = "Object.fromEntries([...new Set([...document.querySelectorAll('rect.bar')].map(r => r.dataset.lane))]" \
       ".map(l => [l, document.querySelectorAll(`.trace:nth-of-type(${N}) rect.bar[data-lane='${l}']`).length]))"


def _bars(n: int = 1) -> str:
    return BARS.replace("${N}", str(n))


def _field(name: str, n: int = 1) -> str:
    return f"document.querySelector('.trace:nth-of-type({n}) [data-field={name}]')"


async def test_page_draws_a_bar_per_chunk_on_every_lane_and_the_jsons_numbers(pushes, site, browser):
    page = await browser.page()
    await page.goto(f"{site}/view?f={pushes.w4.name}")
    want = {lane: pushes.chunks for lane in [*STAGES, "send → rx-fast", "send → rx-slow"]}
    want |= {"engine rx-fast": 1, "engine rx-slow": 1}  # each engine's cache reset, on its own lane
    assert await page.eval(_bars()) == want
    # everything the page loaded came from the viewer itself: it works on machines without a network
    assert await page.eval("performance.getEntriesByType('resource').every(e => e.name.startsWith(location.origin))")
    wall = json.loads(pushes.w4.read_text())["otherData"]["wall_s"] * 1e3
    assert float(await page.eval(_field("wall") + ".dataset.value")) == wall
    assert await page.eval(_field("wall") + ".textContent") == f"{wall:.1f} ms"
    s = summarize(load(pushes.w4))
    assert await page.eval(_field("bound") + ".textContent") == s.bounding_stage
    assert await page.eval(_field("gbps") + ".textContent") == f"{s.gbps:.2f}"
    percent = math.floor(100 * s.overlap + 0.5)  # as JS Math.round
    assert await page.eval(_field("overlap") + ".textContent") == f"{percent}% of ideal"
    # counters are drawn, not just recorded
    drawn = await page.eval("[...document.querySelectorAll('path.counter')].map(p => p.dataset.counter)")
    assert {"chunks_alive", "bytes_alive", "__gbps"} <= set(drawn) and any(c.startswith("queue") for c in drawn)


def _step(ticks: list[str]) -> float:
    return float(ticks[1].split()[0]) - float(ticks[0].split()[0])


async def test_zoom_and_pan_move_the_time_axis(pushes, site, browser):
    page = await browser.page()
    await page.goto(f"{site}/view?f={pushes.w4.name}")
    ticks = "[...document.querySelectorAll('text.tick')].map(t => t.textContent)"
    whole = await page.eval(ticks)
    assert whole[0] == "0 ms"
    await page.eval("document.querySelector('#zin').click(); document.querySelector('#zin').click()")
    assert _step(await page.eval(ticks)) < _step(whole)
    await page.eval("document.querySelector('#zreset').click()")
    assert await page.eval(ticks) == whole
    await page.eval("document.querySelector('svg').dispatchEvent(new WheelEvent('wheel', "
                    "{deltaY: -600, clientX: 700, clientY: 200, bubbles: true, cancelable: true}))")
    zoomed = await page.eval(ticks)
    assert _step(zoomed) < _step(whole)
    await page.eval("""(() => { const s = document.querySelector('svg');
        s.dispatchEvent(new MouseEvent('mousedown', {clientX: 700, clientY: 200, bubbles: true}));
        window.dispatchEvent(new MouseEvent('mousemove', {clientX: 400, clientY: 200}));
        window.dispatchEvent(new MouseEvent('mouseup', {clientX: 400, clientY: 200})); })()""")
    panned = await page.eval(ticks)  # dragged left: later times come into view
    assert float(panned[0].split()[0]) > float(zoomed[0].split()[0])


async def test_compare_draws_window_1_and_4_on_one_time_scale(pushes, site, browser, img):
    page = await browser.page()
    await page.goto(f"{site}/view?f={pushes.w1.name}&f={pushes.w4.name}")
    assert await page.eval("document.querySelectorAll('.trace').length") == 2
    # the same ms sits at the same x in both: equal axes, and each push's last bar ends where its time says
    axes = await page.eval("[...document.querySelectorAll('svg')].map(s => [...s.querySelectorAll('text.tick')]"
                           ".map(t => [t.textContent, t.getAttribute('x')]))")
    assert axes[0] == axes[1]
    ends = await page.eval("[...document.querySelectorAll('svg')].map(s => Math.max(...[...s.querySelectorAll("
                           "'rect.bar')].map(r => +r.getAttribute('x') + +r.getAttribute('width'))))")
    last = [max(sp.end for sp in load(p).spans) for p in (pushes.w1, pushes.w4)]
    px_per_s = [(e - 150) / t for e, t in zip(ends, last, strict=True)]  # 150: the lane-name gutter
    assert px_per_s[0] == pytest.approx(px_per_s[1], rel=0.02)
    await _screenshot(page, img / "viewer-compare.png")


async def test_index_lists_every_push_with_its_failures(pushes, site, browser, img):
    page = await browser.page()
    await page.goto(f"{site}/")
    rows = await page.eval("[...document.querySelectorAll('#pushes tr')].slice(1).map(r => [r.className, "
                           "r.querySelector('a').textContent, r.textContent])")
    assert sorted(r[1] for r in rows) == sorted(p.name for p in (pushes.w1, pushes.w4, pushes.failed))
    failed = [r for r in rows if r[0] == "failed"]
    assert [r[1] for r in failed] == [pushes.failed.name] and "failed in send" in failed[0][2]
    assert await page.eval("document.querySelectorAll('#history rect').length") == 3
    await _screenshot(page, img / "viewer-index.png")


async def test_a_failed_push_shows_a_red_banner_and_a_red_bar(pushes, site, browser, img):
    page = await browser.page()
    await page.goto(f"{site}/view?f={pushes.failed.name}")
    banner = await page.eval("document.querySelector('.banner').textContent")
    assert banner == "push failed in send · chunk 2: InjectedFault: fault injected in send of chunk 2"
    red = await page.eval("[...document.querySelectorAll('rect.err')].map(r => [r.dataset.lane, +r.dataset.chunk, "
                          "getComputedStyle(r).fill])")
    assert ["send", 2, "rgb(211, 47, 47)"] in red
    await _screenshot(page, img / "viewer-failed.png")


async def test_live_page_follows_a_push_while_it_runs(browser, qwen_specs_path, qwen_model, img):
    with ReceiverProcess(str(qwen_specs_path), name="rx-live", threads=1, delay=0.1) as rx:
        sync = WeightSync([rx.engine()], chunk_bytes=CHUNK, trace_live="127.0.0.1:0")
        await sync.connect()
        page = await browser.page()
        await page.goto(sync.viewer_url)  # the page is subscribed once it says it waits
        assert await page.eval("document.body.dataset.state") == "waiting"
        chunks = len(sync.plan(qwen_model)[1])
        push = asyncio.ensure_future(sync.push(qwen_model))
        count = "document.querySelectorAll('rect.bar').length"
        # a third of the bars (each chunk has six): a few chunks sent, most still to go (100 ms each)
        mid = await page.wait_for(f"document.body.dataset.state === 'running' && {count} >= {2 * chunks} && {count}")
        assert not push.done()  # drawn while the push runs
        await _screenshot(page, img / "viewer-live.png")
        report = await push
        await page.wait_for("document.body.dataset.state === 'done'")
        final = await page.eval(count)
        assert mid < final == report.chunks * (len(STAGES) + 1) + 1  # and the engine's cache reset
        assert float(await page.eval(_field("wall") + ".dataset.value")) == report.seconds * 1e3
        # and it stays listed (with no trace_dir: from memory), to open and compare later
        await page.goto(sync.viewer_url.replace("/live", "/"))
        assert await page.eval("[...document.querySelectorAll('#pushes a')].map(a => a.textContent)") == [
            f"live:{report.push_id}"]
        await page.goto(sync.viewer_url.replace("/live", f"/view?f=live:{report.push_id}"))
        assert await page.eval(count) == final
        await sync.close()


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_vllm_push_draws_the_engine_send_lane(llm, model_dir, browser, tmp_path, img):
    pytest.importorskip("vllm")
    from streamsync.engines.vllm import VllmEngine
    from streamsync.testing.vllm import trainer_from

    sync = WeightSync([VllmEngine(llm, name="llm")], chunk_bytes=CHUNK, trace_dir=tmp_path)
    report = await sync.push(trainer_from(model_dir, step=3))
    runner = web.AppRunner(make_app(report.trace_path))
    await runner.setup()
    tcp = web.TCPSite(runner, "127.0.0.1", 0)
    await tcp.start()
    try:
        page = await browser.page()
        await page.goto(f"http://127.0.0.1:{tcp._server.sockets[0].getsockname()[1]}/view?f="
                        f"{Path(report.trace_path).name}")
        engine = report.trace.engine_spans()  # what the worker timed itself (per chunk: map, load, ...)
        assert {s.stage for s in engine} >= {"engine.map", "engine.load", "engine.finish", "engine.cache_reset"}
        calls = [s for s in engine if s.stage == "engine.call"]  # the round's opening and ending calls, whole
        assert len(calls) == 2
        assert await page.eval(_bars()) == {**{lane: report.chunks for lane in [*STAGES, "send → llm"]},
                                            "engine llm": len(engine) - 2, "engine llm calls": 2}
        assert float(await page.eval(_field("wall") + ".dataset.value")) == report.seconds * 1e3
        # a legend says what each phase on the engine's lanes is, one entry per phase drawn
        legend = await page.eval("[...document.querySelectorAll('.legend .item')].map(e => e.dataset.phase)")
        assert set(legend) == {s.stage for s in engine}
        await _screenshot(page, img / "viewer-vllm.png")
    finally:
        await runner.cleanup()
        await sync.close()
