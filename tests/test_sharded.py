"""Sharded sending (`transport="p2p"`): every trainer rank sends its own slices to the engine workers that hold
them. Real processes: trainer ranks joined by gloo, engines of receiver processes that each hold one worker's
slices (vLLM's layout), bit-exact on every worker after every push."""

from __future__ import annotations

import statistics
import time

import anyio
import pytest
import torch

from streamsync import WeightSync
from streamsync.errors import StreamSyncError, ValidationError
from streamsync.models.megatron import TinyModel
from streamsync.models.synthetic import StateModule, perturb_, save_specs
from streamsync.pack import ALIGN
from streamsync.plan.shards import Box
from streamsync.testing.receiver import ReceiverProcess
from streamsync.testing.sharded import (
    EngineShape,
    ShardedCase,
    endpoints,
    run_fsdp_single_sender,
    run_sharded,
    start_engines,
)
from streamsync.testing.sliced import WorkerGroup, expected_slices, vllm_layout
from streamsync.transports.p2p import P2pTransport

megatron = pytest.importorskip("megatron.core")
from streamsync.testing.megatron import launch  # noqa: E402

QWEN3 = TinyModel("qwen3", vocab=512, layers=4)


def _run(case: ShardedCase, world: int, tmp_path) -> list[dict]:
    with start_engines(case, tmp_path) as procs:
        return launch(run_sharded, world, case, endpoints(procs), timeout=420, collective_timeout=case.timeout)


def _balanced(results: list[dict]) -> None:
    """Bytes sent per rank within 20 % of the mean, as planned and as each rank's transport counted them (whole
    segments: the pieces and the alignment gaps between them); each rank's extra memory within 1.2x of the
    others'."""
    plan = results[0]["sent_bytes"]
    sent = list(plan.values())
    assert len(sent) == len(results)
    mean = statistics.mean(sent)
    assert all(abs(b - mean) <= 0.2 * mean for b in sent), sent
    for r in results:  # a piece's gap before the next is under one alignment
        planned, gaps = plan[r["rank"]], ALIGN * r["sent_pieces"]
        assert all(planned <= m < planned + gaps for m in r["moved_bytes"]), (r["rank"], plan, r["moved_bytes"])
    moved = [r["moved_bytes"][0] for r in results]
    assert all(abs(b - statistics.mean(moved)) <= 0.2 * statistics.mean(moved) for b in moved), moved
    peaks = [max(r["peak_bytes"]) for r in results]
    assert max(peaks) / min(peaks) <= 1.2, peaks


def test_megatron_tp2_pp2_into_two_engines_of_tp2_workers(tmp_path):
    case = ShardedCase("tp2pp2", QWEN3, tp=2, pp=2, engines=(EngineShape("a"), EngineShape("b")))
    results = _run(case, 4, tmp_path)
    assert [r["error"] for r in results] == [None] * 4
    assert results[0]["exact"] == [True, True, True], results[0]["mismatched"][:5]
    assert all(r["paths"] == ["sharded"] * 3 and r["senders"] == 4 for r in results)
    assert results[0]["versions"] == [1, 2, 3]
    _balanced(results)


def test_megatron_ep2_moe_into_an_expert_parallel_engine(tmp_path):
    case = ShardedCase("ep2", TinyModel("qwen3-moe", vocab=256, layers=2, experts=4), ep=2,
                       engines=(EngineShape("moe", expert_parallel=True),))
    results = _run(case, 2, tmp_path)
    assert [r["error"] for r in results] == [None, None]
    assert results[0]["exact"] == [True, True, True], results[0]["mismatched"][:5]
    assert all(r["senders"] == 2 for r in results)
    _balanced(results)


def test_megatron_tp2_deepseek_v3_into_an_engine_of_tp2_workers(tmp_path):
    """MLA (q_b_proj / kv_b_proj by heads, the latent projections whole on every worker), dense then routed + shared
    experts, the float32 expert bias: every rank sends its own slices, with deltas after the first push."""
    model = TinyModel("deepseek-v3", vocab=256, layers=2, heads=4, experts=4, shared_ffn=32, first_dense=1,
                      q_lora=32)
    case = ShardedCase("dsv3", model, tp=2, engines=(EngineShape("mla"),), delta=True)
    results = _run(case, 2, tmp_path)
    assert [r["error"] for r in results] == [None, None]
    assert results[0]["exact"] == [True, True, True], results[0]["mismatched"][:5]
    assert all(r["paths"] == ["sharded"] * 3 and r["senders"] == 2 for r in results)


def test_fsdp2_on_four_ranks_into_a_tp2_engine(tmp_path):
    case = ShardedCase("fsdp2", QWEN3, trainer="fsdp2", engines=(EngineShape("tp2"),))
    results = _run(case, 4, tmp_path)
    assert [r["error"] for r in results] == [None] * 4
    assert results[0]["exact"] == [True, True, True], results[0]["mismatched"][:5]
    _balanced(results)


def test_fsdp2_through_a_single_sender(tmp_path):
    """An FSDP2 model (DTensor parameters, no storage of their own) pushed the classic way: rank 0 sends what
    the gathers of every rank bring together."""
    tiny = TinyModel("qwen3", vocab=256, layers=2)
    specs = save_specs(tiny.hf_specs(), tmp_path / "s.json")
    with ReceiverProcess(str(specs), threads=1) as rp:
        out = launch(run_fsdp_single_sender, 2, tiny, rp.port, rp.secret, timeout=300)
    assert out[0]["exact"] == [True, True, True]


def test_fsdp1_on_two_ranks_through_its_full_state_dict(tmp_path):
    """An FSDP1 model (flat parameters, sharded across both ranks): every rank pushes, FSDP's full state dict
    gathers the tensors to rank 0, which sends them; bit-exact three times."""
    tiny = TinyModel("qwen3", vocab=256, layers=2)
    specs = save_specs(tiny.hf_specs(), tmp_path / "s.json")
    with ReceiverProcess(str(specs), threads=1) as rp:
        out = launch(run_fsdp_single_sender, 2, tiny, rp.port, rp.secret, 3, "fsdp1", timeout=300)
    assert out[0]["exact"] == [True, True, True]


def _small_deltas(results: list[dict], modes: list[str]) -> None:
    """Every rank pushed `modes`, and each delta put under a fifth of that rank's full push on the wire."""
    for r in results:
        assert r["delta_modes"] == modes, (r["rank"], r["delta_modes"], r["why_full"])
        full = r["wire_bytes"][0]
        assert all(b < 0.2 * full for b, m in zip(r["wire_bytes"], modes, strict=True) if m == "delta"), r["wire_bytes"]
        assert 0 < r["shadow_bytes"] == r["sent_bytes"][r["rank"]]  # a copy of what this rank sends, no more


def test_megatron_tp2_pp2_delta_pushes_into_two_engines_of_tp2_workers(tmp_path):
    """Every rank keeps the pieces it sends and sends each worker only what changed in them; after each step
    (about 1 % of the elements) every worker of both engines is bit-exact."""
    case = ShardedCase("tp2pp2-delta", QWEN3, tp=2, pp=2, engines=(EngineShape("a"), EngineShape("b")), delta=True)
    results = _run(case, 4, tmp_path)
    assert [r["error"] for r in results] == [None] * 4
    assert results[0]["exact"] == [True, True, True], results[0]["mismatched"][:5]
    assert all(r["paths"] == ["sharded"] * 3 for r in results)
    _small_deltas(results, ["full", "delta", "delta"])


def test_fsdp2_delta_pushes_and_a_refused_delta_goes_in_full_on_every_rank(tmp_path):
    """FSDP2 on two ranks into a TP2 engine with deltas. Before the third push trainer rank 0's shadow misses a
    change: the worker's box fails the sender's digest and refuses, and every rank pushes the same version in full
    (the group the failure broke is made anew); the fourth push is a delta again."""
    case = ShardedCase("fsdp2-delta", TinyModel("qwen3", vocab=256, layers=2), trainer="fsdp2",
                       engines=(EngineShape("tp2"),), pushes=4, delta=True, corrupt=2, timeout=15.0)
    results = _run(case, 2, tmp_path)
    assert [r["error"] for r in results] == [None] * 2
    assert results[0]["exact"] == [True] * 4, results[0]["mismatched"][:5]
    assert results[0]["versions"] == [1, 2, 3, 4]
    for r in results:
        assert r["delta_modes"] == ["full", "delta", "full", "delta"], (r["delta_modes"], r["why_full"])
        assert r["fallback"] == [False, False, True, False]
        assert "digest" in r["why_full"][2], r["why_full"]


def test_a_worker_that_dies_fails_the_push_on_every_rank_within_the_timeout(tmp_path):
    case = ShardedCase("kill", TinyModel("qwen3", vocab=256, layers=2), tp=2, engines=(EngineShape("k"),),
                       pushes=2, timeout=10.0, kill=(0, 1))
    t0 = time.monotonic()
    results = _run(case, 2, tmp_path)
    assert results[0]["exact"] == [True]  # the first push landed
    assert all(r["error"] is not None for r in results), [r["error"] for r in results]
    assert "'k'" in results[0]["error"] and "worker 1" in results[1]["error"], [r["error"] for r in results]
    assert time.monotonic() - t0 < 300


# ------------------------------------------------------------------------------------------ one trainer rank


SPECS = TinyModel("qwen3", vocab=1000, layers=2).hf_specs()


def _workers(tmp_path, holds_per_worker, name="e"):
    path = save_specs(SPECS, tmp_path / "specs.json")
    return [ReceiverProcess(str(path), holds=h, name=f"{name}.w{w}", threads=1) for w, h in enumerate(holds_per_worker)]


def _stop(procs):
    for p in procs:
        p.stop()


def test_one_trainer_rank_into_a_tp2_engine_and_a_whole_tensor_engine(tmp_path):
    """A plain module (one rank holds it all): each TP worker receives only its slices, a receiver without a
    layout takes whole tensors."""
    model = StateModule(SPECS, fill="random", seed=1)
    lay = vllm_layout(SPECS, 2, heads=4, kv_heads=2, head_dim=16)
    procs = _workers(tmp_path, lay)
    plain = ReceiverProcess(str(tmp_path / "specs.json"), name="whole", threads=1)

    async def main():
        tp2 = WorkerGroup([p.engine() for p in procs], "tp2")
        async with WeightSync([tp2, plain.engine()], transport="p2p", chunk_bytes=48 << 10, timeout=30) as sync:
            for i in range(3):
                if i:
                    perturb_(model, i)
                report = await sync.push(model)
                assert report.path == "sharded" and report.senders == 1
                hf = model.state_dict()
                got = await tp2.checksums()
                assert [got[w] == expected_slices(hf, lay[w]) for w in range(2)] == [True, True]
                assert await sync.engines[1].holds(hf)
            # each TP worker received its slices only (bf16: 2 bytes an element), the plain receiver everything
            whole = sum(t.numel() * t.element_size() for t in hf.values())
            sliced = sum(torch.Size(b.size).numel() * 2 for h in lay for _, b in h)
            assert sync.plan(model)[0].sent_bytes == whole + sliced

    try:
        anyio.run(main)
    finally:
        _stop([*procs, plain])


@pytest.mark.parametrize("bad, message", [
    ("missing", "hold nothing"),
    ("overlap", "overlapping"),
    ("uncovered", "does not hold all of"),
])
def test_a_layout_that_does_not_fit_is_refused_before_any_byte_moves(tmp_path, bad, message):
    lay = vllm_layout(SPECS, 2, heads=4, kv_heads=2, head_dim=16)
    name = "model.layers.0.mlp.gate_proj.weight"
    shape = dict((n, s) for n, _, s in SPECS)[name]
    if bad == "missing":
        lay[1] = []
    elif bad == "overlap":  # worker 1 claims rows worker 0 holds too
        lay[1] = [(n, Box.rows(shape, 32, 96)) if n == name else (n, b) for n, b in lay[1]]
    else:  # nobody holds the second half of one tensor
        lay[1] = [(n, b) for n, b in lay[1] if n != name]
    procs = _workers(tmp_path, lay)
    model = StateModule(SPECS, fill="random", seed=2)

    async def main():
        tp2 = WorkerGroup([p.engine() for p in procs], "tp2")
        async with WeightSync([tp2], transport="p2p", timeout=30) as sync:
            with pytest.raises(ValidationError, match=message) as err:
                await sync.push(model)
            assert "tp2" in str(err.value)
            if bad != "missing":
                assert name in str(err.value)
            state = await tp2.state()
            assert state.version is None and not state.mixed  # nothing was sent
            assert [(await m.call("status"))["dirty"] for m in tp2.members] == [False, False]

    try:
        anyio.run(main)
    finally:
        _stop(procs)


def test_p2p_needs_the_engines_on_trainer_rank_zero():
    async def main():
        sync = WeightSync([], transport=P2pTransport(), timeout=5)
        with pytest.raises(StreamSyncError, match="rank 0 must hold the engines"):
            await sync.connect()

    anyio.run(main)
