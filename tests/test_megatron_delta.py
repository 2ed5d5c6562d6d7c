"""Delta pushes from real megatron-core GPTModels on CPU over gloo (TP=2, PP=2), into receiver processes: one full
push, then two deltas after steps that move about 1 % of every tensor's elements; the receiver's checksums must
equal the HF state's bit for bit, and the deltas must carry a small share of the bytes."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from streamsync.models.megatron import TinyModel
from streamsync.models.synthetic import save_specs
from streamsync.testing.megatron import Case, launch, run_cases
from streamsync.testing.receiver import ReceiverProcess

pytestmark = pytest.mark.megatron

CASES = [
    Case("qwen3 tp2 delta", TinyModel("qwen3", vocab=101), tp=2, seed=21, pushes=3, delta=True),
    Case("qwen3 pp2 delta", TinyModel("qwen3", vocab=101, layers=4), pp=2, seed=22, pushes=3, delta=True),
    # MLA, dense then routed + shared experts, the float32 expert bias (a buffer), over EP
    Case("deepseek-v3 ep2 delta", TinyModel("deepseek-v3", vocab=101, experts=4, shared_ffn=32, first_dense=1,
                                            q_lora=32), ep=2, seed=23, pushes=3, delta=True),
]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    work = Path(tempfile.mkdtemp(prefix="streamsync-megatron-delta-"))
    receivers = [ReceiverProcess(str(save_specs(c.model.hf_specs(), work / f"case{i}.json")), name=c.name,
                                 start_timeout=180) for i, c in enumerate(CASES)]
    try:
        per_rank = launch(run_cases, 2, CASES, {r.name: (r.port, r.secret) for r in receivers}, timeout=300,
                          collective_timeout=60)
    finally:
        for r in receivers:
            r.stop()
    return {c.name: [per_rank[rank][i] for rank in range(2)] for i, c in enumerate(CASES)}


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_megatron_delta_pushes_are_bit_exact_and_small(results, name):
    sender, other = results[name]
    assert sender["is_sender"] and not other["is_sender"]
    assert sender["exact"], f"{len(sender['mismatched'])} tensors differ, e.g. {sender['mismatched'][:5]}"
    assert sender["delta_modes"] == ["full", "delta", "delta"]
    full = sender["wire_bytes"][0]
    assert all(b < 0.2 * full for b in sender["wire_bytes"][1:]), sender["wire_bytes"]
    assert other["delta_modes"] == [None, None, None]  # a rank that only gathers keeps no shadow
