"""Models made locally from a list of (name, dtype, shape): for receivers, tests and benchmarks.

No hub downloads: a `StateModule` has exactly the named parameters it is given, nested like HF modules
(`model.layers.0.self_attn.q_proj.weight`), so its state dict uses HF names.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..pack import dtype_from_name, dtype_name

Spec = tuple[str, str, tuple[int, ...]]


class StateModule(torch.nn.Module):
    def __init__(self, specs: Iterable[Spec], *, fill: str = "zeros", seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for name, dtype_s, shape in specs:
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            dtype = dtype_from_name(dtype_s)
            t = torch.empty(tuple(shape), dtype=dtype, device=device)
            if fill == "random":
                fill_random(t, gen)
            elif fill == "zeros":
                t.zero_()
            mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))

    def specs(self) -> list[Spec]:
        return [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in self.state_dict().items()]


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bits for every dtype: floats from a normal, everything else from raw random bytes."""
    if t.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
    else:
        raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen, dtype=torch.uint8)
        if t.dtype == torch.bool:
            raw = raw & 1
        elif t.is_floating_point():  # fp8: avoid NaN bit patterns so equality checks stay meaningful
            raw = raw & 0x77
        t.view(-1).view(torch.uint8).copy_(raw) if t.numel() else None


def perturb_(module: torch.nn.Module, step: int = 1) -> None:
    """What a training step does to the weights: every floating tensor changes."""
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for t in module.state_dict().values():
            if t.is_floating_point() and t.element_size() >= 2:
                t.add_(torch.randn(t.shape, generator=gen).to(t.dtype) * 0.01)


def qwen3_specs(*, vocab: int = 1024, hidden: int = 256, layers: int = 4, heads: int = 8, kv_heads: int = 2,
                head_dim: int = 32, intermediate: int = 512, dtype: str = "bfloat16",
                tie: bool = False) -> list[Spec]:
    """HF Qwen3ForCausalLM parameter names and shapes."""
    s: list[Spec] = [("model.embed_tokens.weight", dtype, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        s += [
            (p + "self_attn.q_proj.weight", dtype, (heads * head_dim, hidden)),
            (p + "self_attn.k_proj.weight", dtype, (kv_heads * head_dim, hidden)),
            (p + "self_attn.v_proj.weight", dtype, (kv_heads * head_dim, hidden)),
            (p + "self_attn.o_proj.weight", dtype, (hidden, heads * head_dim)),
            (p + "self_attn.q_norm.weight", dtype, (head_dim,)),
            (p + "self_attn.k_norm.weight", dtype, (head_dim,)),
            (p + "mlp.gate_proj.weight", dtype, (intermediate, hidden)),
            (p + "mlp.up_proj.weight", dtype, (intermediate, hidden)),
            (p + "mlp.down_proj.weight", dtype, (hidden, intermediate)),
            (p + "input_layernorm.weight", dtype, (hidden,)),
            (p + "post_attention_layernorm.weight", dtype, (hidden,)),
        ]
    s.append(("model.norm.weight", dtype, (hidden,)))
    if not tie:
        s.append(("lm_head.weight", dtype, (vocab, hidden)))
    return s


def mixed_specs() -> list[Spec]:
    """Odd shapes and every dtype models use: the bit-exactness torture set."""
    dtypes = ["bfloat16", "float16", "float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]
    for extra in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, extra):
            dtypes.append(extra)
    specs: list[Spec] = [("model.embed_tokens.weight", "bfloat16", (97, 13))]
    shapes: Sequence[tuple[int, ...]] = [(7, 3), (1,), (5, 1, 3), (0, 4), (), (31,), (2, 3, 5, 7)]
    for i, dt in enumerate(dtypes):
        specs.append((f"model.layers.{i % 3}.blk{i}.weight", dt, shapes[i % len(shapes)]))
    specs.sort(key=lambda s: s[0])
    specs.append(("model.norm.weight", "float32", (13,)))
    specs.append(("lm_head.weight", "bfloat16", (97, 13)))
    return specs


def save_specs(specs: Sequence[Spec], path: str | Path) -> Path:
    p = Path(path)
    p.write_text(json.dumps([[n, d, list(s)] for n, d, s in specs]))
    return p


def load_specs(path: str | Path) -> list[Spec]:
    return [(n, d, tuple(s)) for n, d, s in json.loads(Path(path).read_text())]
