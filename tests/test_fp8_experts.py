"""`streamsync.vllm.worker.quant`: vLLM's online fp8 of fused-MoE experts in batched tensor ops, element for element the
per-expert arithmetic of vLLM's `scaled_fp8_quant` (the GPU test checks the engine against vLLM's own kernel)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from streamsync.vllm.worker.quant import GROUP, quantize_experts, quantize_sourced

F8 = torch.float8_e4m3fn
#: Triton interprets its kernels (`test_the_sourced_rounds_run_their_kernels_in_tritons_interpreter` runs the round
#: tests so): the rounds' sourced pieces then go through the kernels on the CPU, as on a GPU
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _whole(w: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    """The reference for a round's experts: every expert of `w` quantized whole, by torch's passes; under Triton's
    interpreter by the sourced kernels over each whole expert (the interpreter rounds to fp8 its own way)."""
    if INTERPRETED:
        quantize_sourced([(w[x], out[x], x) for x in range(w.shape[0])], list(scales.view(-1, 1).unbind(0)))
    else:
        quantize_experts(w, out, scales)


def _sourced_here(device: str) -> bool:
    """Whether a round's pieces are read where they lie on `device` (else from copies, by torch's passes)."""
    return device == "cuda" or INTERPRETED


def _one_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-tensor fp8 of one tensor, written out: scale = amax / 448 (IEEE), q = w * (1 / scale)
    clamped with fminf/fmaxf semantics (NaN -> 448), rounded to nearest even."""
    amax = w.abs().float().amax().reshape(1)
    scale = amax / torch.full_like(amax, 448.0)
    x = w.float() * (torch.ones_like(scale) / scale)
    x = torch.fmax(torch.fmin(x, torch.full_like(x, 448.0)), torch.full_like(x, -448.0))
    return x.to(F8), scale


def test_experts_quantized_in_groups_equal_each_expert_quantized_alone():
    torch.manual_seed(0)
    experts = GROUP + 5  # crosses a group boundary
    w = (torch.randn(experts, 24, 40) * torch.logspace(-3, 1, experts)[:, None, None]).to(torch.bfloat16)
    w[3] = 0  # an all-zero expert: scale 0, every element 448 (the kernel's 0 * inf -> NaN -> fminf -> 448)
    w[4, 0, 0] = -0.0
    out = torch.empty(w.shape, dtype=F8)
    scales = torch.full((experts + 2,), -1.0)  # more slots than experts: the rest is left alone
    quantize_experts(w, out, scales)
    for e in range(experts):
        q, s = _one_expert(w[e])
        assert torch.equal(out[e].view(torch.uint8), q.view(torch.uint8)), e
        assert torch.equal(scales[e:e + 1], s), e
    assert torch.equal(scales[experts:], torch.full((2,), -1.0))
    assert scales[3] == 0 and bool((out[3].view(torch.uint8) == 0x7E).all())


def test_mismatched_shapes_are_refused_before_anything_is_written():
    w = torch.randn(2, 4, 8).to(torch.bfloat16)
    out = torch.zeros(2, 4, 9, dtype=F8)
    with pytest.raises(ValueError, match="fp8 experts"):
        quantize_experts(w, out, torch.zeros(2))
    with pytest.raises(ValueError, match="fp8 experts"):
        quantize_experts(w, torch.zeros(2, 4, 8, dtype=F8), torch.zeros(1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_weights_quantized_from_their_pieces_equal_each_weight_quantized_whole(device):
    """`quantize_sourced`: a merged q/k/v weight whose pieces are views of a pushed chunk (one a blocked view of an
    interleaved tensor, as megatron's QKV arrives), a gate/up weight, an all-zero weight and one with a NaN, each
    quantized straight into its rows of a live fp8 weight, equal to vLLM's arithmetic on the whole weight; then a
    weight whose rows are not whole 16-byte runs, alone. On CUDA the Triton kernels run (two launches a call)."""
    from streamsync.vllm.worker import quant

    torch.manual_seed(1)
    cols, groups = 64, 4
    # megatron's interleaved QKV of `groups` KV groups: per group 2 Q rows, 1 K row, 1 V row (times 8)
    inter = (torch.randn(groups, 4 * 8, cols) * 0.05).to(torch.bfloat16).to(device)
    q_src, k_src, v_src = inter[:, :16], inter[:, 16:24], inter[:, 24:]  # (groups, rows, cols) views
    gate = (torch.randn(48, cols) * 3.0).to(torch.bfloat16).to(device)
    up = (torch.randn(48, cols) * 0.001).to(torch.bfloat16).to(device)
    zero = torch.zeros(8, cols, dtype=torch.bfloat16, device=device)
    nan = torch.randn(8, cols).to(torch.bfloat16).to(device)
    nan[0, 3] = float("nan")
    odd = torch.randn(6, 33).to(torch.bfloat16).to(device)
    wholes = [torch.cat([q_src.reshape(-1, cols), k_src.reshape(-1, cols), v_src.reshape(-1, cols)]),
              torch.cat([gate, up]), zero, nan, odd]
    lives = [torch.empty(w.shape, dtype=F8, device=device) for w in wholes]
    scales = [torch.full((1,), -1.0, device=device) for _ in wholes]
    qkv = lives[0]
    pieces = [(q_src, qkv[:64].view(groups, 16, cols), 0), (k_src, qkv[64:96].view(groups, 8, cols), 0),
              (v_src, qkv[96:].view(groups, 8, cols), 0), (gate, lives[1][:48], 1), (up, lives[1][48:], 1),
              (zero, lives[2], 2), (nan, lives[3], 3)]
    assert all(quant.sourceable(s, d) for s, d, _ in pieces) == (device == "cuda")
    quant.quantize_sourced(pieces, scales[:4])
    quant.quantize_sourced([(odd[1:], lives[4][1:], 0), (odd[:1], lives[4][:1], 0)], scales[4:])
    if device == "cuda":
        assert not quant._broken, quant._broken
    for j, w in enumerate(wholes):
        want_q, want_s = _one_expert(w.cpu())
        if j == 3:  # vLLM's fmaxf passes the NaN over in the amax; the NaN itself becomes 448
            want_q, want_s = _one_expert(torch.nan_to_num(w.cpu(), nan=0.0))
            want_q.view(torch.uint8)[0, 3] = 0x7E
        assert torch.equal(scales[j].cpu(), want_s), j
        assert torch.equal(lives[j].cpu().view(torch.uint8), want_q.view(torch.uint8)), j


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_experts_quantized_from_their_pieces_as_each_expert_arrives_equal_the_whole_layer_quantized(device):
    """`fastpath.direct.Experts`: each write into a fused-MoE layer's experts falls in the expert it writes (one
    that spans two is refused, so that layer takes the fresh tensors' way); the experts' gate, up and down pieces,
    quantized expert by expert in two calls as their chunks complete them, equal `quantize_experts` of the whole
    stacked layer."""
    from streamsync.vllm.worker import quant
    from streamsync.vllm.worker.fastpath.direct import Experts

    torch.manual_seed(2)
    e, inter, hidden = 4, 6, 16
    gate = (torch.randn(e, inter, hidden) * 0.1).to(device).bfloat16()
    up = torch.randn(e, inter, hidden).to(device).bfloat16()
    down = (torch.randn(e, hidden, inter) * torch.logspace(-2, 1, e)[:, None, None]).to(device).bfloat16()
    live = {"w13_weight": torch.empty(e, 2 * inter, hidden, dtype=F8, device=device),
            "w13_weight_scale": torch.full((e,), -1.0, device=device),
            "w2_weight": torch.empty(e, hidden, inter, dtype=F8, device=device),
            "w2_weight_scale": torch.full((e,), -1.0, device=device)}
    experts = Experts.of(torch.nn.Module(), live)
    assert experts is not None
    per = 2 * inter * hidden
    assert experts.group("w13_weight", 2 * per + inter * hidden, (inter, hidden), (hidden, 1)) == 2  # expert 2's up
    assert experts.group("w13_weight", per + inter * hidden, (2 * inter, hidden), (hidden, 1)) is None
    assert experts.group_numel("w13_weight") == per and experts.group_numel("w2_weight") == hidden * inter
    assert experts.scale_of("w2_weight", 3).data_ptr() == live["w2_weight_scale"][3:].data_ptr()
    assert Experts.of(torch.nn.Module(), dict(live, w2_weight=live["w2_weight"].transpose(1, 2))) is None

    w13, w2 = live["w13_weight"], live["w2_weight"]
    pieces = [(gate[x], w13[x, :inter], x) for x in range(e)] + [(up[x], w13[x, inter:], x) for x in range(e)]
    pieces += [(down[x], w2[x], e + x) for x in range(e)]
    scales = [experts.scale_of("w13_weight", x) for x in range(e)] + [experts.scale_of("w2_weight", x)
                                                                       for x in range(e)]
    first = [p for p in pieces if p[2] in (0, 1, e)]  # the experts one chunk completed; the rest in the next
    quant.quantize_sourced([(s, d, [0, 1, e].index(j)) for s, d, j in first], [scales[0], scales[1], scales[e]])
    rest = [p for p in pieces if p[2] not in (0, 1, e)]
    order = sorted({j for _, _, j in rest})
    quant.quantize_sourced([(s, d, order.index(j)) for s, d, j in rest], [scales[j] for j in order])
    if device == "cuda":
        assert not quant._broken, quant._broken
    want13, want2 = torch.empty(w13.shape, dtype=F8), torch.empty(w2.shape, dtype=F8)
    s13, s2 = torch.empty(e), torch.empty(e)
    quantize_experts(torch.cat([gate, up], dim=1).cpu(), want13, s13)
    quantize_experts(down.cpu(), want2, s2)
    assert torch.equal(w13.cpu().view(torch.uint8), want13.view(torch.uint8))
    assert torch.equal(w2.cpu().view(torch.uint8), want2.view(torch.uint8))
    assert torch.equal(live["w13_weight_scale"].cpu(), s13) and torch.equal(live["w2_weight_scale"].cpu(), s2)


def _experts_module(e: int, inter: int, hidden: int, device: str, sourceable: bool | None):
    """A fused-MoE layer's live fp8 experts (zeros), as `Experts` and as a plan's module of them."""
    from streamsync.vllm.worker.fastpath.direct import Experts
    from streamsync.vllm.worker.fastpath.plan import _Rebuilt

    live = {"w13_weight": torch.zeros(e, 2 * inter, hidden, dtype=F8, device=device),
            "w13_weight_scale": torch.zeros(e, device=device),
            "w2_weight": torch.zeros(e, hidden, inter, dtype=F8, device=device),
            "w2_weight_scale": torch.zeros(e, device=device)}
    experts = Experts.of(torch.nn.Module(), live)
    assert experts is not None
    fresh = {n: (tuple(t.shape), tuple(t.stride()), torch.bfloat16, t.device) for n, t in live.items() if t.dim() == 3}
    numel = sum(t.numel() for t in live.values() if t.dim() == 3)
    return live, experts, _Rebuilt("mlp.experts", experts.layer, numel, fresh=fresh, direct=experts,
                                   sourceable=sourceable)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("batch", [None, 1], ids=["at-load-end", "as-completed"])
def test_a_round_quantizes_each_expert_once_its_last_piece_arrived_even_when_chunks_split_it(device, batch,
                                                                                              monkeypatch):
    """`FastRound` over a fused-MoE layer taken as `Experts`: the first chunk completes expert 0 and brings half of
    expert 1's w13; that half is kept in a copy (the chunk's buffer is then overwritten, as a reused buffer is)
    and expert 1 is quantized when the second chunk brings the rest. The live experts and scales equal the whole
    layer quantized at once, and the module is reported quantized from the pushed tensors. (On the CPU every piece
    is read from a copy; on CUDA the kernel reads them where they lie.)"""
    from streamsync.vllm.worker.fastpath import round as fast_round
    from streamsync.vllm.worker.fastpath.plan import Plan, _Op
    from streamsync.vllm.worker.fastpath.round import FastRound
    from streamsync.vllm.worker.fastpath.trace import Write

    if batch is not None:  # quantized as soon as modules complete, mid-load (`SOURCED_BATCH`)
        monkeypatch.setattr(fast_round, "SOURCED_BATCH", batch)
    torch.manual_seed(3)
    e, inter, hidden = 3, 4, 16
    gate, up = torch.randn(e, inter, hidden).bfloat16().to(device), torch.randn(e, inter, hidden).bfloat16().to(device)
    down = torch.randn(e, hidden, inter).bfloat16().to(device)
    live, _, r = _experts_module(e, inter, hidden, device, sourceable=True)
    per13, per2 = 2 * inter * hidden, hidden * inter
    ops: dict[str, tuple[_Op, ...]] = {}
    for x in range(e):
        ops[f"e{x}.gate"] = (_Op(None, 0, "w13_weight", Write(0, x * per13, (inter, hidden), (hidden, 1), 0), True),)
        ops[f"e{x}.up"] = (_Op(None, 0, "w13_weight",
                                Write(0, x * per13 + inter * hidden, (inter, hidden), (hidden, 1), 0), True),)
        ops[f"e{x}.down"] = (_Op(None, 0, "w2_weight", Write(1, x * per2, (hidden, inter), (inter, 1), 0), True),)
    plan = Plan(ops, {}, [r], [], frozenset(), {}, {}, [], [], {}, frozenset({"mlp.experts"}))
    tensors = {f"e{x}.{p}": t[x] for x in range(e) for p, t in (("gate", gate), ("up", up), ("down", down))}
    rnd = FastRound(plan)

    def load(names: list[str]) -> None:
        buffer = torch.cat([tensors[n].reshape(-1) for n in names])  # the chunk, its tensors views of it
        views, at = [], 0
        for n in names:
            views.append((ops[n], buffer[at:at + tensors[n].numel()].view(tensors[n].shape)))
            at += tensors[n].numel()
        assert rnd.load(views) == []  # nothing for vLLM's processing
        buffer.fill_(float("nan"))  # the buffer is reused once the chunk's load returned

    load(["e0.gate", "e0.up", "e0.down", "e1.gate"])
    want13, want2 = torch.empty(e, 2 * inter, hidden, dtype=F8), torch.empty(e, hidden, inter, dtype=F8)
    s13, s2 = torch.empty(e), torch.empty(e)
    _whole(torch.cat([gate, up], dim=1).cpu(), want13, s13)
    _whole(down.cpu(), want2, s2)
    assert torch.equal(live["w13_weight"][0].cpu().view(torch.uint8), want13[0].view(torch.uint8))
    assert bool((live["w13_weight"][1:].view(torch.uint8) == 0).all())  # expert 1 waits for its up rows
    assert rnd.sourced == 0 and list(rnd.pending) == [0]
    load(["e1.up", "e1.down", "e2.gate", "e2.up", "e2.down"])
    assert torch.equal(live["w13_weight"].cpu().view(torch.uint8), want13.view(torch.uint8))
    assert torch.equal(live["w2_weight"].cpu().view(torch.uint8), want2.view(torch.uint8))
    assert torch.equal(live["w13_weight_scale"].cpu(), s13) and torch.equal(live["w2_weight_scale"].cpu(), s2)
    assert (rnd.rebuilt, rnd.direct, rnd.sourced, rnd.pending, rnd.done) == (1, 1, 1, {}, {0})
    # copied out of a chunk first: on CUDA only expert 1's gate rows (their chunk did not complete expert 1);
    # on the CPU every piece (torch's passes read copies)
    everything = sum(t.numel() * 2 for t in tensors.values())
    assert rnd.copied == (inter * hidden * 2 if _sourced_here(device) else everything), rnd.copied


def test_experts_sharded_across_ranks_are_left_to_vllm_where_it_takes_their_amax_over_every_rank():
    """An expert quantized by streamsync takes its scale from the rank's own shard. A vLLM that reduces a
    tensor-sharded expert's amax over its ranks (`amax_for_moe_weight_quant`) makes another scale there, so such a
    layer keeps vLLM's own processing; one rank per expert (or a vLLM without the reduction) does not."""
    from types import SimpleNamespace

    from streamsync.vllm.quantizations import FP8_PER_TENSOR
    from streamsync.vllm.worker import quant

    method_cls = type(FP8_PER_TENSOR.moe, (), {})

    def layer(tp: int) -> torch.nn.Module:
        m = torch.nn.Module()
        method = method_cls()
        method.fp8_backend = SimpleNamespace(name="TRITON")
        method.moe = SimpleNamespace(tp_size=tp)
        m.quant_method = method
        return m

    reduces = quant._amax_across_ranks()
    assert quant.fp8_experts_rebuildable(layer(1))
    assert quant.fp8_experts_rebuildable(layer(2)) is not reduces
    try:
        from vllm.model_executor.layers.quantization.utils.quant_utils import amax_for_moe_weight_quant  # noqa: F401
    except ImportError:
        assert not reduces
    else:
        assert reduces


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("batch", [None, 1], ids=["at-load-end", "as-completed"])
def test_a_write_of_stacked_experts_is_cut_at_each_experts_boundary(device, batch, monkeypatch):
    """One write may cover several experts: a stacked checkpoint tensor ([E, 2I, H] gate and up, [E, H, I] down,
    as transformers' fused experts hold them) or per-expert copies the trace merged into one run. Such a write is
    cut into one piece per expert, so the layer is still quantized from the pushed tensors, expert by expert: here
    the stacked down projection is split across two chunks 1.5 experts in, and expert 1 waits for its rest. A
    write spanning experts that is not one run (a strided one) is left to the fresh tensors' way."""
    from streamsync.vllm.worker.fastpath import round as fast_round
    from streamsync.vllm.worker.fastpath.direct import _sourcing, dense
    from streamsync.vllm.worker.fastpath.plan import Plan, _Op, _Rebuilt
    from streamsync.vllm.worker.fastpath.round import FastRound
    from streamsync.vllm.worker.fastpath.trace import Write

    if batch is not None:
        monkeypatch.setattr(fast_round, "SOURCED_BATCH", batch)
    torch.manual_seed(4)
    cuda = device == "cuda"
    e, inter, hidden = 3, 4, 16
    gate_up = torch.randn(e, 2 * inter, hidden).bfloat16().to(device)
    down = (torch.randn(e, hidden, inter) * torch.logspace(-1, 1, e)[:, None, None]).bfloat16().to(device)

    def round_over(ops: dict[str, tuple[_Op, ...]]) -> tuple[FastRound, dict[str, torch.Tensor], _Rebuilt]:
        live, _, r = _experts_module(e, inter, hidden, device, sourceable=None if cuda else True)
        plan = Plan(ops, {}, [r], [], frozenset(), {}, {}, [], [], {}, frozenset({"mlp.experts"}))
        _sourcing(plan)  # the kernel's checks: CUDA only (on the CPU the pieces are quantized by torch's passes)
        return FastRound(plan), live, r

    per2 = hidden * inter
    cut = per2 + per2 // 2
    ops = {"gate_up": (_Op(None, 0, "w13_weight", Write(0, 0, (e, 2 * inter, hidden),
                                                          (2 * inter * hidden, hidden, 1), 0), True),),
           "down.0": (_Op(None, 0, "w2_weight", Write(1, 0, (cut,), (1,), 0), True),),
           "down.1": (_Op(None, 0, "w2_weight", Write(1, cut, (e * per2 - cut,), (1,), 0), True),)}
    tensors = {"gate_up": gate_up, "down.0": down.reshape(-1)[:cut], "down.1": down.reshape(-1)[cut:]}
    assert dense((e, 2 * inter, hidden), (2 * inter * hidden, hidden, 1)) and dense((5,), (1,))
    assert not dense((2, 3), (4, 1)) and dense((1, 3), (7, 1))
    rnd, live, r = round_over(ops)
    assert r.sourceable is True

    def load(names: list[str]) -> None:
        buffer = torch.cat([tensors[n].reshape(-1) for n in names])
        views, at = [], 0
        for n in names:
            views.append((ops[n], buffer[at:at + tensors[n].numel()].view(tensors[n].shape)))
            at += tensors[n].numel()
        assert rnd.load(views) == []
        buffer.fill_(float("nan"))  # the chunk's buffer is reused once its load returned

    want13, want2 = torch.empty(e, 2 * inter, hidden, dtype=F8), torch.empty(e, hidden, inter, dtype=F8)
    s13, s2 = torch.empty(e), torch.empty(e)
    _whole(gate_up.cpu(), want13, s13)
    _whole(down.cpu(), want2, s2)
    load(["gate_up", "down.0"])
    assert torch.equal(live["w13_weight"].cpu().view(torch.uint8), want13.view(torch.uint8))
    assert torch.equal(live["w2_weight"][0].cpu().view(torch.uint8), want2[0].view(torch.uint8))
    assert bool((live["w2_weight"][1:].view(torch.uint8) == 0).all())  # expert 1 waits for the rest of its rows
    load(["down.1"])
    assert torch.equal(live["w2_weight"].cpu().view(torch.uint8), want2.view(torch.uint8))
    assert torch.equal(live["w13_weight_scale"].cpu(), s13) and torch.equal(live["w2_weight_scale"].cpu(), s2)
    assert (rnd.rebuilt, rnd.direct, rnd.sourced, rnd.pending) == (1, 1, 1, {})

    if cuda:
        strided = {"down": (_Op(None, 0, "w2_weight", Write(1, 0, (e, hidden), (per2, inter), 0), True),)}
        assert round_over(strided)[2].sourceable is False  # one column of every expert: not one run


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("bias_last", [False, True])
def test_a_linear_layer_quantized_mid_load_gets_its_other_tensors_once_the_loads_copies_are_queued(
        device, bias_last, monkeypatch):
    """A sourced linear layer (`Direct`) with a bias, in a round that quantizes modules as they complete
    (`SOURCED_BATCH` 1): its weight is quantized mid-load from its piece, and its bias, copied into a fresh tensor
    by the load's batched copies, reaches the live bias only after those copies are queued (whichever of the two
    arrives last)."""
    from streamsync.vllm.worker import quant
    from streamsync.vllm.worker.fastpath import round as fast_round
    from streamsync.vllm.worker.fastpath.direct import Direct
    from streamsync.vllm.worker.fastpath.plan import Plan, _Op, _Rebuilt
    from streamsync.vllm.worker.fastpath.round import FastRound
    from streamsync.vllm.worker.fastpath.trace import Write

    monkeypatch.setattr(fast_round, "SOURCED_BATCH", 1)
    torch.manual_seed(6)
    rows, cols = 8, 32
    weight = (torch.randn(rows, cols) * 0.1).bfloat16().to(device)
    bias = torch.randn(rows).bfloat16().to(device)
    out = torch.zeros(rows, cols, dtype=F8, device=device)
    scale = torch.zeros((), device=device)
    live_bias = torch.zeros(rows, dtype=torch.bfloat16, device=device)
    direct = Direct(out, scale, (("bias", live_bias),))
    fresh = {"weight": ((rows, cols), (cols, 1), torch.bfloat16, torch.device(device)),
             "bias": ((rows,), (1,), torch.bfloat16, torch.device(device))}
    r = _Rebuilt("proj", torch.nn.Module(), rows * cols + rows, fresh=fresh, direct=direct, sourceable=True)
    ops = {"w": (_Op(None, 0, "weight", Write(0, 0, (rows, cols), (cols, 1), 0), True),),
           "b": (_Op(None, 0, "bias", Write(1, 0, (rows,), (1,), 0), True),)}
    plan = Plan(ops, {}, [r], [], frozenset(), {}, {}, [], [], {}, frozenset({"proj"}))
    rnd = FastRound(plan)
    order = ["w", "b"] if bias_last else ["b", "w"]
    tensors = {"w": weight, "b": bias}
    assert rnd.load([(ops[n], tensors[n].clone()) for n in order]) == []
    want, want_scale = torch.empty(rows, cols, dtype=F8, device=device), torch.empty(1, device=device)
    quant.quantize_sourced([(weight.contiguous(), want, 0)], [want_scale], kernel=INTERPRETED)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scale.view(1), want_scale)
    assert torch.equal(live_bias, bias)
    assert (rnd.rebuilt, rnd.direct, rnd.sourced, rnd.pending, rnd.done) == (1, 1, 1, {}, {0})


@pytest.mark.timeout(300)
def test_the_sourced_rounds_run_their_kernels_in_tritons_interpreter():
    """The round tests above again, with Triton interpreting its kernels (`TRITON_INTERPRET=1`): on the CPU every
    piece is then read where it lies by the sourced kernels, as on a GPU (experts split across chunks, stacked
    experts cut at their boundaries, a linear layer quantized mid-load), each against the same kernels over the
    whole weights; without a GPU this is the only run of the kernels' table and grouping through a round."""
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "round_quantizes or stacked or linear_layer"], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "6 passed" in out.stdout, out.stdout[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("primed", [False, True], ids=["captured-at-second-push", "primed-at-connect"])
@pytest.mark.parametrize("split", [False, True], ids=["one-chunk", "experts-split-across-chunks"])
def test_a_chunk_of_sourced_modules_loads_by_one_graph_from_then_on_and_each_push_stays_exact(primed, split):
    """`CapturedLoads` over chunks whose rebuilt modules are quantized from their pieces (fused-MoE experts and a
    linear layer, beside a COPY tensor): the second push (or, primed as at connect, the first) records a chunk's
    copies and quantization kernels as one CUDA graph, and every later push replays it. Split across two chunks,
    the experts are loaded plainly beside the first chunk's graph (and the second chunk, all experts, plainly).
    The chunks' buffers are reused with new values every push (scales change too), and after each push every fp8
    weight, scale and copied tensor equals the weights quantized whole, and the round counts the modules
    quantized from the pushed tensors."""
    from streamsync.vllm.worker import quant
    from streamsync.vllm.worker.fastpath.captured import CapturedLoads
    from streamsync.vllm.worker.fastpath.direct import Direct
    from streamsync.vllm.worker.fastpath.plan import Plan, _Op, _Rebuilt
    from streamsync.vllm.worker.fastpath.round import FastRound
    from streamsync.vllm.worker.fastpath.trace import Write

    dev = "cuda"
    torch.manual_seed(7)
    e, inter, hidden, rows = 4, 32, 64, 48
    live, _, rx = _experts_module(e, inter, hidden, dev, sourceable=True)
    out, scale = torch.zeros(rows, hidden, dtype=F8, device=dev), torch.zeros((), device=dev)
    rl = _Rebuilt("proj", torch.nn.Module(), rows * hidden,
                  fresh={"weight": ((rows, hidden), (hidden, 1), torch.bfloat16, torch.device(dev))},
                  direct=Direct(out, scale, ()), sourceable=True)
    norm = torch.zeros(hidden, dtype=torch.bfloat16, device=dev)
    per13, per2 = 2 * inter * hidden, hidden * inter
    ops: dict[str, tuple[_Op, ...]] = {}
    shapes: dict[str, tuple[int, ...]] = {"norm": (hidden,), "proj": (rows, hidden)}
    ops["norm"] = (_Op(norm, 0, "", Write(0, 0, (hidden,), (1,), 0), True),)
    ops["proj"] = (_Op(None, 1, "weight", Write(0, 0, (rows, hidden), (hidden, 1), 0), True),)
    for x in range(e):
        ops[f"e{x}.gate"] = (_Op(None, 0, "w13_weight", Write(0, x * per13, (inter, hidden), (hidden, 1), 0), True),)
        ops[f"e{x}.up"] = (_Op(None, 0, "w13_weight",
                                Write(0, x * per13 + inter * hidden, (inter, hidden), (hidden, 1), 0), True),)
        ops[f"e{x}.down"] = (_Op(None, 0, "w2_weight", Write(1, x * per2, (hidden, inter), (inter, 1), 0), True),)
        shapes |= {f"e{x}.gate": (inter, hidden), f"e{x}.up": (inter, hidden), f"e{x}.down": (hidden, inter)}
    plan = Plan(ops, {}, [rx, rl], [], frozenset(), {}, {}, [], [], {}, frozenset({"mlp.experts", "proj"}))
    names = list(shapes)
    cut = names.index("e2.gate") if split else len(names)
    chunks = []  # (key, weights): views of one buffer each, at the same addresses every push
    for c, part in enumerate((names[:cut], names[cut:])):
        if not part:
            continue
        buffer = torch.empty(sum(math.prod(shapes[n]) for n in part), dtype=torch.bfloat16, device=dev)
        weights, at = [], 0
        for n in part:
            weights.append((n, buffer[at:at + math.prod(shapes[n])].view(shapes[n])))
            at += math.prod(shapes[n])
        # keyed as the worker keys a reference set's views (with their serial number): replayed by the key alone
        chunks.append((("refs", f"chunk-{c}", c), weights))
    graphs = CapturedLoads()
    if primed:
        for key, weights in chunks:
            graphs.prime(key, FastRound(plan), FastRound(plan).split(weights)[0])
        assert graphs.captured == 1 and torch.equal(norm, torch.zeros_like(norm))  # priming loads nothing

    for push in range(4):
        values = {n: torch.randn(s, device=dev).bfloat16() * (push + 1) for n, s in shapes.items()}
        values["proj"][0, 0] = float("nan")  # passed over by the amax, 448 where it lands
        rnd = FastRound(plan)
        for key, weights in chunks:
            for (n, t) in weights:
                t.copy_(values[n])
            ready = graphs.ready(key, rnd, weights)  # as the worker loads a chunk's part
            rest = weights
            if ready is not None:
                graphs.replay(ready, rnd)
                rest = [weights[k] for k in ready.rest]
            fast, slow = rnd.split(rest)
            assert not slow
            if fast and (ready is not None or not graphs.load(key, rnd, fast)):
                assert rnd.load(fast) == []
            torch.cuda.synchronize()
            for _, t in weights:  # the buffer is reused once the chunk's load returned
                t.fill_(float("nan"))
        assert rnd.drop() == [] and (rnd.rebuilt, rnd.direct, rnd.sourced) == (2, 2, 2), push
        torch.cuda.synchronize()
        cpu = {n: v.cpu() for n, v in values.items()}
        want13, want2 = torch.empty(e, 2 * inter, hidden, dtype=F8), torch.empty(e, hidden, inter, dtype=F8)
        s13, s2 = torch.empty(e), torch.empty(e)
        _whole(torch.stack([torch.cat([cpu[f"e{x}.gate"], cpu[f"e{x}.up"]]) for x in range(e)]), want13, s13)
        _whole(torch.stack([cpu[f"e{x}.down"] for x in range(e)]), want2, s2)
        want, want_scale = torch.empty(rows, hidden, dtype=F8), torch.empty(1)
        quant.quantize_sourced([(cpu["proj"], want, 0)], [want_scale], kernel=False)
        assert torch.equal(live["w13_weight"].cpu().view(torch.uint8), want13.view(torch.uint8)), push
        assert torch.equal(live["w2_weight"].cpu().view(torch.uint8), want2.view(torch.uint8)), push
        assert torch.equal(live["w13_weight_scale"].cpu(), s13) and torch.equal(live["w2_weight_scale"].cpu(), s2)
        assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8)), push
        assert torch.equal(scale.view(1).cpu(), want_scale) and torch.equal(norm.cpu(), cpu["norm"]), push
    assert (graphs.captured, graphs.replayed) == ((1, 4) if primed else (1, 2)), (graphs.captured, graphs.replayed)


def test_which_modules_of_a_chunk_a_graph_may_quantize_and_which_tensors_it_leaves_to_a_plain_load():
    """`captured._sourced_modules`, the rule a chunk's graph is recorded by (`CapturedLoads`): the sourced fp8
    modules whole within the chunk and not started this round go into the graph; the tensors of a module split
    across chunks are left out (loaded plainly beside it); a chunk with none whole may be recorded in a later
    round, one whose module has other tensors (a bias) or is not settled never or not yet."""
    from streamsync.vllm.worker.fastpath.captured import _sourced_modules
    from streamsync.vllm.worker.fastpath.direct import Direct
    from streamsync.vllm.worker.fastpath.plan import Plan, _Op, _Rebuilt
    from streamsync.vllm.worker.fastpath.round import FastRound
    from streamsync.vllm.worker.fastpath.trace import Write

    e, inter, hidden, rows = 4, 4, 16, 8
    _, _, rx = _experts_module(e, inter, hidden, "cpu", sourceable=True)
    out, scale = torch.zeros(rows, hidden, dtype=F8), torch.zeros(())
    weight = ((rows, hidden), (hidden, 1), torch.bfloat16, torch.device("cpu"))
    rl = _Rebuilt("proj", torch.nn.Module(), rows * hidden, fresh={"weight": weight}, direct=Direct(out, scale, ()),
                  sourceable=True)
    per13, per2 = 2 * inter * hidden, hidden * inter
    ops: dict[str, tuple[_Op, ...]] = {
        "norm": (_Op(torch.zeros(hidden, dtype=torch.bfloat16), 0, "", Write(0, 0, (hidden,), (1,), 0), True),),
        "proj": (_Op(None, 1, "weight", Write(0, 0, (rows, hidden), (hidden, 1), 0), True),)}
    for x in range(e):
        ops[f"e{x}.gate"] = (_Op(None, 0, "w13_weight", Write(0, x * per13, (inter, hidden), (hidden, 1), 0), True),)
        ops[f"e{x}.up"] = (_Op(None, 0, "w13_weight",
                                Write(0, x * per13 + inter * hidden, (inter, hidden), (hidden, 1), 0), True),)
        ops[f"e{x}.down"] = (_Op(None, 0, "w2_weight", Write(1, x * per2, (hidden, inter), (inter, 1), 0), True),)
    plan = Plan(ops, {}, [rx, rl], [], frozenset(), {}, {}, [], [], {}, frozenset({"mlp.experts", "proj"}))
    shape = {"norm": (hidden,), "proj": (rows, hidden)} | {
        f"e{x}.{p}": (hidden, inter) if p == "down" else (inter, hidden)
        for x in range(e) for p in ("gate", "up", "down")}

    def chunk(names: list[str]) -> list[tuple[tuple[_Op, ...], torch.Tensor]]:
        return [(ops[n], torch.randn(shape[n]).bfloat16()) for n in names]

    first = ["norm", "proj"] + [f"e{x}.{p}" for x in range(2) for p in ("gate", "up", "down")]
    second = [f"e{x}.{p}" for x in range(2, e) for p in ("gate", "up", "down")]
    rnd = FastRound(plan)
    assert _sourced_modules(rnd, chunk(first + second)) == ([0, 1], [])  # every module whole: all in the graph
    assert _sourced_modules(rnd, chunk(first)) == ([1], list(range(2, 8)))  # the experts' first half left out
    assert _sourced_modules(rnd, chunk(second)) is True  # none whole here: a later round may differ
    rnd = FastRound(plan)
    assert rnd.load(chunk(["e0.gate", "e0.up", "e0.down"])) == [] and list(rnd.pending) == [0]  # experts started
    rest = ["norm", "proj", "e1.gate", "e1.up", "e1.down", *second]
    assert _sourced_modules(rnd, chunk(rest)) == ([1], list(range(2, 11)))  # ... so they load plainly
    rl.direct, rl.sourceable = None, None  # not settled yet (learned by its first round)
    assert _sourced_modules(FastRound(plan), chunk(first)) is True
    rl.direct, rl.sourceable = Direct(out, scale, ()), True
    rl.fresh = {"weight": weight, "bias": ((rows,), (1,), torch.bfloat16, torch.device("cpu"))}  # other tensors
    assert _sourced_modules(FastRound(plan), chunk(first)) is False
