"""The sharded-sending planner: boxes of HF tensors held by trainer ranks and needed by engine workers."""

from __future__ import annotations

import pytest
import torch

from streamsync.convert.mappings import (
    COLUMN,
    QKV,
    ROW,
    Cast,
    Dims,
    GatedMLP,
    Rename,
    SwappedHalves,
    Vocab,
    tp_split,
)
from streamsync.errors import ValidationError
from streamsync.plan.shards import Box, EngineLayout, Have, Need, plan_transfers

DIMS = Dims(num_heads=8, num_query_groups=4, head_dim=4, vocab_size=30)


def _view(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (s, n) in enumerate(zip(box.start, box.size, strict=True)):
        t = t.narrow(d, s, n)
    return t


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("mapping, shape", [
    (Rename("w", "hf.w", tp=COLUMN), (16, 6)),
    (Rename("w", "hf.w", tp=ROW), (6, 16)),
    (Rename("n", "hf.n", tp=None), (6,)),
    (Cast("n", "hf.n"), (6,)),
    (Vocab("e", "hf.e"), (32, 6)),                                 # 2 padding rows beyond the vocabulary
    (GatedMLP("fc1", "hf.gate", "hf.up"), (16, 6)),
    (QKV("qkv", "hf.q", "hf.k", "hf.v"), ((8 + 2 * 4) * 4, 6)),
    (SwappedHalves("eh", "hf.input_proj", tp=COLUMN), (16, 6)),        # MiMo's MTP input projection
    (SwappedHalves("eh", "hf.input_proj", tp=None), (16, 6)),
])
def test_each_shards_parts_are_exactly_its_part_of_the_hf_tensors(mapping, shape, size):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    hf = mapping.to_hf(full, DIMS)
    covered = [torch.zeros(t.shape, dtype=torch.int32) for t in hf]
    for rank, shard in enumerate(tp_split(full, mapping.tp, size)):
        for part in mapping.shard_parts(tuple(shard.shape), DIMS, size, rank):
            assert part.box.size == part.local.size
            assert torch.equal(_view(hf[part.hf], part.box), _view(shard, part.local)), (rank, part)
            _view(covered[part.hf], part.box).add_(1)
    want = 1 if mapping.tp is not None and size > 1 else size  # replicated: every rank holds it all
    assert all(bool((c == want).all()) for c in covered)


def _tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    return {"model.embed_tokens.weight": ("bfloat16", (32, 8)),
            "model.layers.0.mlp.up_proj.weight": ("bfloat16", (16, 8)),
            "model.layers.0.input_layernorm.weight": ("bfloat16", (8,))}


def _tp2_engine(name: str = "e") -> EngineLayout:
    t = _tensors()
    needs = []
    for w in range(2):
        needs += [Need(name, w, "model.embed_tokens.weight", Box.rows(t["model.embed_tokens.weight"][1], 16 * w, 16)),
                  Need(name, w, "model.layers.0.mlp.up_proj.weight",
                       Box.rows(t["model.layers.0.mlp.up_proj.weight"][1], 8 * w, 8)),
                  Need(name, w, "model.layers.0.input_layernorm.weight", Box.whole((8,)))]
    return EngineLayout(name, 2, tuple(needs))


def _haves(tp: int) -> list[Have]:
    out = []
    for r in range(tp):
        out += [Have(r, "model.embed_tokens.weight", Box.rows((32, 8), 32 // tp * r, 32 // tp)),
                Have(r, "model.layers.0.mlp.up_proj.weight", Box.rows((16, 8), 16 // tp * r, 16 // tp)),
                Have(r, "model.layers.0.input_layernorm.weight", Box.whole((8,)))]
    return out


def test_every_byte_leaves_a_rank_that_holds_it_and_reaches_each_worker_once():
    itemsize = dict.fromkeys(_tensors(), 2)
    plan = plan_transfers(_haves(4), [_tp2_engine("a"), _tp2_engine("b")], _tensors(), bucket_bytes=1 << 20,
                          itemsize=itemsize)
    for (engine, worker), nbytes in plan.received_bytes.items():
        need = sum(n.box.numel * 2 for n in _tp2_engine(engine).needs if n.worker == worker)
        assert nbytes == need
    for p in plan.pieces:  # the sender holds what it sends
        assert any(h.rank == p.src and h.name == p.name and h.box.intersect(p.box) == p.box for h in _haves(4))
    # the norm, replicated on all four ranks, is sent by different ranks to the four workers
    norm_srcs = {p.src for p in plan.pieces if p.name.endswith("layernorm.weight")}
    assert len(norm_srcs) == 4
    assert plan.balance() < 1.2


def test_layouts_that_do_not_fit_are_refused_naming_the_tensor_and_the_worker():
    t = _tensors()
    good = _tp2_engine()
    itemsize = dict.fromkeys(t, 2)

    def refused(layout: EngineLayout, match: str) -> None:
        with pytest.raises(ValidationError, match=match):
            plan_transfers(_haves(2), [layout], t, bucket_bytes=1 << 20, itemsize=itemsize)

    out_of_range = (*good.needs[:-1], Need("e", 1, "model.layers.0.input_layernorm.weight", Box((4,), (8,))))
    refused(EngineLayout("e", 2, out_of_range), r"worker 1: slice \[4:12\] of 'model.layers.0.input_layernorm")
    refused(EngineLayout("e", 3, good.needs), r"worker\(s\) \[2\] hold nothing")
    overlap = (*good.needs, Need("e", 1, "model.embed_tokens.weight", Box.rows((32, 8), 8, 16)))
    refused(EngineLayout("e", 2, overlap), "claim overlapping slices")
    partial = tuple(n for n in good.needs if not (n.worker == 1 and n.name == "model.embed_tokens.weight"))
    refused(EngineLayout("e", 2, partial), "does not hold all of 'model.embed_tokens.weight'")
    with pytest.raises(ValidationError, match="held by no trainer rank"):
        plan_transfers([h for h in _haves(2) if not (h.rank == 1 and "up_proj" in h.name)], [good], t,
                       bucket_bytes=1 << 20, itemsize=itemsize)


def test_buckets_keep_layers_whole_and_each_rank_within_the_budget():
    t = _tensors()
    plan = plan_transfers(_haves(2), [_tp2_engine()], t, bucket_bytes=300, itemsize=dict.fromkeys(t, 2))
    assert len(plan.buckets) >= 2
    for b in range(len(plan.buckets)):
        for r in (0, 1):
            assert plan.bucket_bytes(b, r) <= 300
    layers = [{plan.pieces[i].name.split(".")[2] if ".layers." in plan.pieces[i].name else "embed"
               for i in bucket} for bucket in plan.buckets]
    assert layers[0] == {"embed"}


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4", "glm4_moe", "qwen3_moe"])
@pytest.mark.parametrize("tp, expert_parallel", [(2, False), (2, True), (4, False)])
def test_the_engine_layout_read_from_the_arch_tables_splits_as_vllms_layers_do(model_type, tp, expert_parallel):
    """`plan.vllm_layout` takes each tensor's split from its mapping (`Mapping.engine_splits`): split tensors cover
    each element once over the workers, whole ones are on every worker (experts under expert parallelism on one),
    and the splits are vLLM's: MLA's down projections and the router whole, its up projections by rows, o_proj and
    down_proj by columns, GLM-4's fused gate_up_proj by the rows of each half."""
    from streamsync.models.megatron import _tiny_from_config
    from streamsync.models.tiny import TINY
    from streamsync.plan.vllm_layout import engine_split, vllm_layout

    cfg = TINY[model_type]
    specs = [tuple(s) for s in _tiny_from_config({"model_type": model_type, **cfg}).hf_specs()]
    heads, kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    lay = vllm_layout(specs, tp, heads=heads, kv_heads=kv, head_dim=int(cfg.get("head_dim", 0) or 1),
                      expert_parallel=expert_parallel)
    for name, _, shape in specs:
        held = [torch.zeros(shape, dtype=torch.int32) for _ in range(tp)]
        for w in range(tp):
            for n, box in lay[w]:
                if n == name:
                    _view(held[w], box).add_(1)
        count = sum(held)
        split = engine_split(name)
        if ".experts." in name and expert_parallel:
            assert count.eq(1).all(), name  # one worker holds each expert
        elif split is None:
            assert all(h.eq(1).all() for h in held), name  # whole on every worker
        elif split == "kv_heads" and tp > kv:
            assert count.eq(tp // kv).all(), name  # each query group on tp / kv workers
        else:
            assert count.eq(1).all(), (name, split)
    names = {n for n, _, _ in specs}
    if model_type == "deepseek_v3":
        assert engine_split("model.layers.1.self_attn.kv_a_proj_with_mqa.weight") is None
        assert engine_split("model.layers.1.self_attn.q_a_proj.weight") is None
        assert engine_split("model.layers.1.self_attn.kv_b_proj.weight") == COLUMN
        assert engine_split("model.layers.1.mlp.gate.weight") is None
        assert engine_split("model.layers.1.self_attn.o_proj.weight") == ROW
    if model_type == "glm4":
        assert "model.layers.0.mlp.gate_up_proj.weight" in names
        rows = [b for n, b in lay[1] if n == "model.layers.0.mlp.gate_up_proj.weight"]
        half = dict((n, s) for n, _, s in specs)["model.layers.0.mlp.gate_up_proj.weight"][0] // 2
        assert [(b.start[0], b.size[0]) for b in rows] == [(half // tp, half // tp), (half + half // tp, half // tp)]
