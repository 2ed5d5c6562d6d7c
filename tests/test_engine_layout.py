"""Engine layout: a receiver that says which of its tensors are fused gets each run of packed HF tensors that
makes one up as that one tensor (vLLM-style qkv_proj, gate_up_proj, stacked MoE experts w13/w2)."""

from __future__ import annotations

import pytest
import torch

from streamsync import WeightSync
from streamsync.checksum import device_digests, digests
from streamsync.models.megatron import TinyModel
from streamsync.models.synthetic import StateModule, perturb_, qwen3_specs, save_specs
from streamsync.pack import Fusion, Layout, TensorSpec, fuse_layout, fusions_from_json, plan_layout
from streamsync.plan.chunk import layout_key as _key
from streamsync.testing.fused import FusedModel
from streamsync.testing.receiver import ReceiverProcess

MOE = TinyModel(arch="qwen3-moe", vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128,
                experts=8, moe_ffn=32)


def _layout(*names_rows: tuple[str, int], cols: int = 64, dtype: torch.dtype = torch.bfloat16) -> Layout:
    return plan_layout([TensorSpec(n, dtype, (r, cols)) for n, r in names_rows])


QKV = Fusion("qkv_proj", ("q", "k", "v"), (16 + 8 + 8, 64))


def test_a_run_of_members_end_to_end_becomes_one_tensor():
    layout = _layout(("norm", 1), ("q", 16), ("k", 8), ("v", 8), ("o", 16))
    fused = fuse_layout(layout, {"q": QKV})
    assert [m.name for m in fused.metas] == ["norm", "qkv_proj", "o"]
    qkv = fused.metas[1]
    assert qkv.shape == (32, 64) and qkv.offset == layout.metas[1].offset and qkv.nbytes == 32 * 64 * 2
    assert fused.nbytes == layout.nbytes


@pytest.mark.parametrize("layout", [
    _layout(("q", 16), ("k", 8)),                            # a member missing
    _layout(("q", 16), ("v", 8), ("k", 8)),                  # out of order
    plan_layout([TensorSpec("q", torch.bfloat16, (16, 64)), TensorSpec("k", torch.float32, (8, 64)),
                 TensorSpec("v", torch.bfloat16, (8, 64))]),  # dtypes differ
    plan_layout([TensorSpec("q", torch.bfloat16, (16, 64)), TensorSpec("k", torch.bfloat16, (8, 64)),
                 TensorSpec("v", torch.bfloat16, (8, 64), part=(0, 16))]),  # a part of a split tensor
    _layout(("q", 1), ("k", 1), ("v", 1), cols=3),           # padding between members: not end to end
])
def test_runs_that_are_not_exactly_the_fused_tensor_stay_as_they_are(layout):
    fusions = {"q": Fusion("qkv_proj", ("q", "k", "v"), (sum(m.shape[0] for m in layout.metas),
                                                          layout.metas[0].shape[1]))}
    assert fuse_layout(layout, fusions) is None


def test_a_run_whose_bytes_are_not_the_fused_tensors_stays_as_it_is():
    assert fuse_layout(_layout(("q", 16), ("k", 8), ("v", 8), cols=48), {"q": QKV}) is None


def test_malformed_fused_layouts_are_refused():
    from streamsync.errors import ValidationError

    assert fusions_from_json({"qkv_proj": [["q", "k", "v"], [32, 64]]})["q"] == QKV
    for bad in ([], {"x": [["q"]]}, {"x": [[], [1]]}, {"x": [["q"], [-1]]}, {"x": "q"}):
        with pytest.raises(ValidationError):
            fusions_from_json(bad)


@pytest.mark.parametrize("engine_layout", [True, False])
async def test_moe_experts_arrive_stacked_and_bit_exact(tmp_path, engine_layout):
    specs = MOE.hf_specs()
    model = StateModule(specs, fill="random", seed=3)
    with ReceiverProcess(str(save_specs(specs, tmp_path / "moe.json")), threads=1, fused=True) as rp:
        engine = rp.engine()
        layouts = []  # the layouts the engine received
        update = engine.update

        async def recorded(message):
            layouts.append(message.layout_json)
            await update(message)

        engine.update = recorded
        sync = WeightSync([engine], chunk_bytes=1 << 20, engine_layout=engine_layout)
        for step in range(2):
            perturb_(model, step)
            await sync.push(model)
            assert await engine.checksums() == digests(model.state_dict().items())
        plan_keys = {p.layout_key for p in sync.plan(model)[1]}
        fused = {_key(js): js for js in layouts if _key(js) not in plan_keys}.values()  # converted, each once
        names = {t[0].rsplit(".", 1)[-1] if "experts" in t[0] else t[0].split(".")[-2]
                 for js in fused for t in js["tensors"]}
        if engine_layout:
            # every layer's experts as w13 [E, 2I, H] and w2 [E, H, I]; attention as qkv_proj
            assert {"w13_weight", "w2_weight", "qkv_proj"} <= names
            # per layer: 2 norms, qkv_proj, q/k norms, o_proj, the router, w13, w2; and embed, norm, lm_head
            assert sum(len(js["tensors"]) for js in fused) == 3 + 9 * MOE.layers < len(specs) // 3
        else:
            assert not fused
        await sync.close()


@pytest.mark.megatron
@pytest.mark.slow
def test_megatron_moe_pushes_in_the_engine_layout_bit_exact(tmp_path):
    """A megatron-core MoE GPTModel (gloo, CPU) through the GPU benchmark's own code in its CPU smoke mode: a
    layer's experts are reordered (every fc1, then every fc2) so that they lie as w13 and w2, the fused
    receiver gets them stacked, and its weights equal the trainer's HF export bit for bit on every path."""
    import json
    import subprocess
    import sys

    pytest.importorskip("megatron.core")
    out = tmp_path / "smoke.json"
    subprocess.run([sys.executable, "-m", "benchmarks.cuda", "--smoke", "--models", "tiny-moe", "--repeat", "2",
                    "--warmup", "1", "--sweep-mib=", "--ref-sweep-mib=", "--gpu-chunk-mib", "1", "--json", str(out)],
                   check=True, timeout=300, capture_output=True)
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"packed:plain", "engine_layout", "engine_layout:plain"}
    assert all(r["bit_exact"] for r in rows.values())


def test_fused_model_maps_hf_names_into_fused_slices_like_vllm():
    specs = qwen3_specs(layers=1)
    src = StateModule(specs, fill="random", seed=1)
    fused = FusedModel(specs)
    names = dict(fused.named_parameters())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    fused.load_weights(src.state_dict().items())
    assert digests(fused.hf_tensors()) == digests(src.state_dict().items())
    assert device_digests(fused.hf_tensors()) == device_digests(src.state_dict().items())


def test_fused_model_stacks_moe_experts():
    from streamsync.models.megatron import TinyModel

    specs = TinyModel(arch="qwen3-moe", experts=4, layers=1).hf_specs()
    src = StateModule(specs, fill="random", seed=2)
    fused = FusedModel(specs)
    w13 = dict(fused.named_parameters())["model.layers.0.mlp.experts.w13_weight"]
    assert tuple(w13.shape) == (4, 64, 64)
    fused.load_weights(src.state_dict().items())
    assert digests(fused.hf_tensors()) == digests(src.state_dict().items())


async def test_engine_layout_may_be_turned_off_between_pushes(tmp_path):
    specs = MOE.hf_specs()
    model = StateModule(specs, fill="random", seed=4)
    with ReceiverProcess(str(save_specs(specs, tmp_path / "moe.json")), threads=1, fused=True) as rp:
        engine = rp.engine()
        keys: list[str] = []
        update = engine.update

        async def recorded(message):
            keys.append(message.layout_key)
            await update(message)

        engine.update = recorded
        sync = WeightSync([engine], chunk_bytes=1 << 20)
        plan_keys = {p.layout_key for p in sync.plan(model)[1]}
        await sync.push(model)
        fused = len(keys)
        assert not set(keys) & plan_keys  # the engine's fused layout
        sync.engine_layout = False
        perturb_(model, 1)
        await sync.push(model)
        assert set(keys[fused:]) <= plan_keys  # HF names from now on
        assert await engine.checksums() == digests(model.state_dict().items())
        await sync.close()
