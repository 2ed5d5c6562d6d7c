"""Real megatron-core GPTModels on CPU over gloo, pushed into a receiver process.

Each case: HF weights (random, seeded) -> `load_hf_weights` into this rank's TP / PP / EP shards -> every rank
pushes (rank 0 into a ReceiverProcess, the others with no engines) -> the receiver's checksums must equal the
HF state's, bit for bit. Cases run in one launch per world size (2 and 4 processes) to pay megatron's import
once; each test then checks one behaviour on the recorded results.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import torch

from streamsync.models.megatron import TinyModel
from streamsync.models.synthetic import save_specs
from streamsync.testing.megatron import Case, launch, run_cases
from streamsync.testing.receiver import ReceiverProcess

pytestmark = pytest.mark.megatron

QWEN3 = TinyModel("qwen3", vocab=101)                       # vocab not divisible by TP: padded to 112
QWEN3_4L = TinyModel("qwen3", vocab=101, layers=4)
QWEN2_TIED = TinyModel("qwen2", vocab=99, tie=True)         # qkv bias, tied embeddings
LLAMA = TinyModel("llama", heads=8, kv_heads=8, head_dim=8)  # plain MHA: one head per query group
LLAMA_TIED_4L = TinyModel("llama", vocab=99, layers=4, tie=True)
MOE = TinyModel("qwen3-moe", vocab=101, experts=4)
MOE_4L = TinyModel("qwen3-moe", vocab=101, experts=4, layers=4)
# MLA with a query low rank, a dense first layer, routed + shared experts, the float32 expert bias, an MTP layer
DSV3 = TinyModel("deepseek-v3", vocab=101, experts=4, shared_ffn=32, first_dense=1, q_lora=32, mtp=1)
DSV3_4L = TinyModel("deepseek-v3", vocab=101, layers=4, experts=4, shared_ffn=32, first_dense=1, q_lora=32, mtp=1)
DSV3_NO_Q_LORA = TinyModel("deepseek-v3", vocab=101, experts=4, shared_ffn=32, first_dense=1, tie=True)
GLM4 = TinyModel("glm4", vocab=101)  # q/k/v biases, sandwich norms, the checkpoint's fused gate_up_proj
GLM4_MOE = TinyModel("glm4-moe", vocab=101, layers=3, experts=4, shared_ffn=32, first_dense=1, mtp=1)
MIMO = TinyModel("mimo", vocab=101, mtp=1)  # Qwen2 with an MTP layer of MiMo's naming, its input halves swapped

TWO = [
    Case("qwen3 tp2", QWEN3, tp=2, seed=1, pushes=2),
    Case("qwen2 tp2 tied", QWEN2_TIED, tp=2, seed=2),
    Case("llama tp2", LLAMA, tp=2, seed=3),
    Case("qwen3 pp2", QWEN3_4L, pp=2, seed=4),
    Case("qwen3-moe ep2", MOE, ep=2, seed=5),
    Case("qwen3-moe tp2 (expert tp2)", MOE, tp=2, seed=6),
    Case("qwen3 dp2 (unsharded)", QWEN3, seed=7),
    Case("qwen3 tp2 1 MiB chunks", QWEN3, tp=2, seed=8, chunk_bytes=1 << 20),
    Case("qwen3 tp2 1 MiB chunks per-parameter", QWEN3, tp=2, seed=9, chunk_bytes=1 << 20, bucket_bytes=1),
    Case("deepseek-v3 tp2 (the engine at v17)", DSV3, tp=2, seed=31, pushes=2, engine_version=17),
    Case("deepseek-v3 ep2", DSV3, ep=2, seed=32),
    Case("deepseek-v3 pp2 (MTP and a copy of the embedding on the last stage)", DSV3_4L, pp=2, seed=33),
    Case("deepseek-v3 no q low rank, tied, tp2", DSV3_NO_Q_LORA, tp=2, seed=34),
    Case("glm4 tp2", GLM4, tp=2, seed=35),
    Case("glm4-moe tp2 (expert tp2)", GLM4_MOE, tp=2, seed=36),
    Case("mimo tp2", MIMO, tp=2, seed=40),
    # BlockingWeightSync on every rank from a plain loop: three pushes, no anyio.run in the trainer
    Case("qwen3 tp2 blocking", QWEN3, tp=2, seed=10, pushes=3, blocking=True),
]
FOUR = [
    Case("qwen3 tp2 pp2", QWEN3_4L, tp=2, pp=2, seed=11),
    Case("llama tp2 pp2 tied", LLAMA_TIED_4L, tp=2, pp=2, seed=12),
    Case("qwen3-moe tp2 ep2 (expert tp2)", MOE, tp=2, ep=2, seed=13),
    Case("qwen3-moe ep2 pp2", MOE_4L, ep=2, pp=2, seed=14),
    Case("qwen3 tp2 pp2 vpp2", QWEN3_4L, tp=2, pp=2, vpp=2, seed=15),
    Case("qwen3 tp2 dp2", QWEN3, tp=2, seed=16),
    Case("glm4-moe tp2 ep2 (expert tp2)", GLM4_MOE, tp=2, ep=2, seed=37),
    Case("deepseek-v3 ep2 pp2", DSV3_4L, ep=2, pp=2, seed=38),
    Case("deepseek-v3 tp2 pp2 vpp2", DSV3_4L, tp=2, pp=2, vpp=2, seed=39),
]
CASES = {c.name: c for c in TWO + FOUR}


def _run(cases: list[Case], world: int) -> dict[str, list[dict]]:
    """Launch `world` ranks over `cases`; results[case name][rank]."""
    work = Path(tempfile.mkdtemp(prefix="streamsync-megatron-"))

    def start(i: int, c: Case) -> ReceiverProcess:
        # ten receivers start at once: on a loaded 2-core machine that took over a minute
        return ReceiverProcess(str(save_specs(c.model.hf_specs(), work / f"case{i}.json")), name=c.name,
                               start_timeout=180)

    with ThreadPoolExecutor(len(cases)) as pool:
        receivers = list(pool.map(start, range(len(cases)), cases))
    try:
        per_rank = launch(run_cases, world, cases, {r.name: (r.port, r.secret) for r in receivers}, timeout=150,
                          collective_timeout=60)
    finally:
        for r in receivers:
            r.stop()
    return {c.name: [per_rank[rank][i] for rank in range(world)] for i, c in enumerate(cases)}


@pytest.fixture(scope="module")
def two() -> dict[str, list[dict]]:
    return _run(TWO, 2)


@pytest.fixture(scope="module")
def four() -> dict[str, list[dict]]:
    return _run(FOUR, 4)


def _ranks(request: pytest.FixtureRequest, name: str) -> list[dict]:
    return request.getfixturevalue("four" if any(c.name == name for c in FOUR) else "two")[name]


def _expected_events(case: Case, plan: list[list]) -> Counter:
    """The sender's collectives as the issue states them: one per (group, dtype) per chunk. Tensors of stage
    0 split over TP / expert TP -> 'tp' / 'etp'; stage-0 experts with EP > 1 -> 'ep'; tensors of stage s > 0
    -> one point-to-point 'pp<s>' per chunk, in the receiver's dtype (bf16 here)."""
    want: Counter = Counter()
    for i, keys in enumerate(plan):
        groups = set()
        for _name, dtype, stage, expert, split in keys:
            if stage:  # in the dtype they are sent in: the float32 expert bias stays float32
                groups.add((f"pp{stage}", "float32" if _name.endswith("expert_bias") else "bfloat16"))
                continue
            if split:
                groups.add(("etp" if expert else "tp", dtype))
            if expert and case.ep > 1:
                groups.add(("ep", dtype))
        want.update((i, g, d) for g, d in groups)
    return want


@pytest.mark.parametrize("name", [c.name for c in CASES.values() if c.tp * c.pp * c.ep > 1])
def test_one_push_has_one_version_on_every_rank(request: pytest.FixtureRequest, name: str) -> None:
    """Ranks without engines cannot know what the engines hold: every rank reports the sender's version."""
    ranks = _ranks(request, name)
    assert len({tuple(r["versions"]) for r in ranks}) == 1, [r["versions"] for r in ranks]
    first = CASES[name].engine_version + 1
    assert ranks[0]["versions"] == list(range(first, first + CASES[name].pushes))


@pytest.mark.parametrize("name", list(CASES))
def test_receiver_holds_the_hf_weights_bit_for_bit(request: pytest.FixtureRequest, name: str) -> None:
    sender = _ranks(request, name)[0]
    assert sender["is_sender"]
    assert sender["exact"], f"{len(sender['mismatched'])} tensors differ, e.g. {sender['mismatched'][:5]}"
    assert sender["export_exact"]  # export_hf(model): the same gathers and conversions, without a receiver
    assert all(not r["is_sender"] for r in _ranks(request, name)[1:])


@pytest.mark.parametrize("name", [c.name for c in TWO + FOUR
                                  if c.bucket_bytes is None and (c.tp, c.pp, c.ep) != (1, 1, 1)])
def test_one_collective_per_group_dtype_and_chunk(request: pytest.FixtureRequest, name: str) -> None:
    case = CASES[name]
    ranks = _ranks(request, name)
    sender = ranks[0]
    assert Counter(map(tuple, sender["events"])) == _expected_events(case, sender["plan"])
    for r in ranks:  # every rank: never two collectives for one (chunk, group, dtype)
        assert max(Counter(map(tuple, r["events"])).values(), default=1) == 1
    gathered = sum(1 for keys in sender["plan"] for k in keys if k[2] or k[4] or (k[3] and case.ep > 1))
    assert sender["collectives"][0] < gathered  # fewer than one per gathered parameter


def test_no_collective_when_nothing_is_sharded(two: dict[str, list[dict]]) -> None:
    for r in two["qwen3 dp2 (unsharded)"]:
        assert r["collectives"] == [0] and r["setup_collectives"] == [0] and r["events"] == []
        assert r["trace_collectives"] == 0


def test_coalescing_turns_one_gather_per_tensor_into_one_per_chunk(two: dict[str, list[dict]]) -> None:
    per_param = two["qwen3 tp2 1 MiB chunks per-parameter"][0]
    coalesced = two["qwen3 tp2 1 MiB chunks"][0]
    assert per_param["chunks"] == coalesced["chunks"] == 1
    assert per_param["collectives"] == [per_param["tp_params"]] == [10]  # embedding, output, 2 x (qkv, proj, fc1, fc2)
    assert coalesced["collectives"] == [1]


def test_report_and_trace_count_the_collectives(request: pytest.FixtureRequest) -> None:
    for name in ("qwen3 tp2", "qwen3 tp2 pp2", "qwen3-moe tp2 ep2 (expert tp2)"):
        for r in _ranks(request, name):
            assert r["collectives"][0] == r["trace_collectives"] == len(r["events"])


def test_ranks_of_a_group_issue_the_same_collectives_in_the_same_order(request: pytest.FixtureRequest) -> None:
    tp2 = _ranks(request, "qwen3 tp2")
    assert tp2[0]["events"] == tp2[1]["events"]
    tp2pp2 = _ranks(request, "qwen3 tp2 pp2")  # ranks 0,1: stage 0; ranks 2,3: stage 1
    tp_only = [[e for e in r["events"] if e[1] == "tp"] for r in tp2pp2]
    assert tp_only[0] == tp_only[1] and tp_only[2] == tp_only[3]
    assert [e for e in tp2pp2[0]["events"] if e[1] == "pp1"] == [e for e in tp2pp2[2]["events"] if e[1] == "pp1"]
    assert not any(e[1] == "pp1" for e in tp2pp2[1]["events"] + tp2pp2[3]["events"])  # only stage leaders


def test_metadata_is_exchanged_once_per_model(two: dict[str, list[dict]]) -> None:
    for r in two["qwen3 tp2"]:
        assert r["setup_collectives"] == [1, 0]
        assert r["collectives"][0] == r["collectives"][1]


@pytest.mark.parametrize("name", ["qwen3-moe ep2", "qwen3-moe ep2 pp2", "qwen3-moe tp2 ep2 (expert tp2)"])
def test_all_experts_of_a_layer_travel_in_one_chunk(request: pytest.FixtureRequest, name: str) -> None:
    plan = _ranks(request, name)[0]["plan"]
    chunks_of_layer: dict[str, set[int]] = {}
    for i, keys in enumerate(plan):
        for k in keys:
            if k[3]:
                chunks_of_layer.setdefault(k[0].split(".mlp.")[0], set()).add(i)
    assert chunks_of_layer and all(len(c) == 1 for c in chunks_of_layer.values())
    assert sum(1 for keys in plan for k in keys if k[3]) == CASES[name].model.layers * 4 * 2


def test_data_parallel_replicas_issue_nothing(four: dict[str, list[dict]]) -> None:
    ranks = four["qwen3 tp2 dp2"]
    assert ranks[0]["events"] == ranks[1]["events"] and ranks[0]["events"]
    assert ranks[2]["events"] == ranks[3]["events"] == []


# Colocated engines (one per trainer GPU, each loading full tensors, as vLLM TP workers do): every rank sends
# what the same one set of all-gathers brought it. On CPU the transport is shared memory; tests/test_cuda_ipc.py's
# two-GPU benchmark runs the same with CUDA IPC on NCCL.
COLOCATED = [
    Case("qwen3 tp2 every rank sends", QWEN3_4L, tp=2, seed=21, pushes=2, every_rank_sends=True),
    Case("qwen3-moe tp2 ep2 every rank sends", MOE, tp=2, ep=2, etp=1, seed=22, every_rank_sends=True),
]


@pytest.fixture(scope="module")
def colocated() -> dict[str, list[dict]]:
    work = Path(tempfile.mkdtemp(prefix="streamsync-megatron-colocated-"))
    keys = [(c, r) for c in COLOCATED for r in range(2)]

    def start(i: int) -> ReceiverProcess:
        c, r = keys[i]
        return ReceiverProcess(str(save_specs(c.model.hf_specs(), work / f"case{i}.json")), name=f"{c.name}@{r}")

    with ThreadPoolExecutor(len(keys)) as pool:
        receivers = list(pool.map(start, range(len(keys))))
    try:
        per_rank = launch(run_cases, 2, COLOCATED, {r.name: (r.port, r.secret) for r in receivers}, timeout=150,
                          collective_timeout=60)
    finally:
        for r in receivers:
            r.stop()
    return {c.name: [per_rank[rank][i] for rank in range(2)] for i, c in enumerate(COLOCATED)}


@pytest.mark.parametrize("name", [c.name for c in COLOCATED])
def test_every_rank_sends_full_tensors_to_its_own_receiver_after_one_set_of_gathers(colocated, name):
    ranks = colocated[name]
    for r in ranks:
        assert r["is_sender"]
        assert r["exact"], f"rank {r['rank']}: {len(r['mismatched'])} tensors differ, e.g. {r['mismatched'][:5]}"
    assert ranks[0]["events"] == ranks[1]["events"]  # the same collectives, issued once per (chunk, group, dtype)
    assert max(Counter(map(tuple, ranks[0]["events"])).values()) == 1


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_megatron_ddp_trainer_is_sent_by_reference_from_its_parameter_buffers(tmp_path, arch):
    # Megatron's DDP with the distributed optimizer moves every parameter into a few contiguous buffers: a
    # one-copy push exports those few storages (not one per parameter) and every push is exact.
    pytest.importorskip("megatron.core")
    from streamsync.models.megatron import TinyModel
    from streamsync.testing.megatron import ddp_one_copy_pushes, launch

    tiny = TinyModel("qwen3", vocab=1024, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=256)
    if arch == "moe":
        tiny = TinyModel("qwen3-moe", vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8,
                         moe_ffn=32)
    with ReceiverProcess(str(save_specs(tiny.hf_specs(), tmp_path / "ddp.json")), device="cuda", fused=True) as rp:
        out = launch(ddp_one_copy_pushes, 1, tiny, rp.port, rp.secret, timeout=300)[0]
    assert out["exact"] == [True, True, True], out
    # (a parameter whose HF tensor is cast, or not sent, is not referenced: its storage is not exported)
    assert out["referenced"] > 0 and 1 <= out["exports"] <= out["storages"] < out["params"], out


_FROM_HF = """
import sys
import torch
from safetensors.torch import load_file
from streamsync.models.megatron import export_hf, hf_config, megatron_from_hf
d = sys.argv[1]
state = export_hf(megatron_from_hf(d), dtype=torch.bfloat16, hf_config=hf_config(d))
want = load_file(d + "/model.safetensors")
assert set(state) == set(want), sorted(set(state) ^ set(want))[:5]
bad = [k for k in want if not torch.equal(state[k], want[k])]
assert not bad, bad[:5]
print("exact", len(state))
"""


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_megatron_from_hf_builds_a_trainer_holding_the_checkpoint(tmp_path, arch):
    # the trainer the CLI's --trainer megatron and the GPU tests build from an HF checkpoint, dense and MoE: its
    # HF export is the checkpoint, bit for bit (a world of one in its own process, as those callers run it)
    import subprocess
    import sys

    from streamsync.models.tiny import make_tiny_qwen3, make_tiny_qwen3_moe

    model_dir = (make_tiny_qwen3 if arch == "dense" else make_tiny_qwen3_moe)(tmp_path, tie_word_embeddings=True)
    out = subprocess.run([sys.executable, "-c", _FROM_HF, str(model_dir)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "exact", out.stdout


def test_megatron_from_hf_names_what_its_builder_cannot_make(tmp_path):
    from streamsync.models.megatron import _tiny_from_config

    with pytest.raises(ValueError, match="num_experts_per_tok=8"):
        _tiny_from_config({"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8})
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        _tiny_from_config({"model_type": "gpt2"})
