"""A megatron-core trainer from a local HF checkpoint, in this one process (TP=PP=EP=1, gloo).

Used by the embedded default; the same code path a real trainer takes (build a GPTModel, import an HF
checkpoint into its shards, push through MegatronSource).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .megatron import TinyModel, build_model, export_hf_async, free_port, init_parallel, load_hf_weights

__all__ = ["export_hf_async", "hf_config", "megatron_from_hf"]


def hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _tiny_from_config(cfg: dict[str, Any]) -> TinyModel:
    arch = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "mistral": "llama"}.get(cfg["model_type"])
    if arch is None:
        raise ValueError(f"no megatron builder for model_type {cfg['model_type']!r}")
    heads = cfg["num_attention_heads"]
    return TinyModel(arch=arch, vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                     heads=heads, kv_heads=cfg.get("num_key_value_heads", heads),
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn=cfg["intermediate_size"],
                     tie=bool(cfg.get("tie_word_embeddings", False)), dtype="bfloat16")


def megatron_from_hf(model_dir: str | os.PathLike) -> list[torch.nn.Module]:
    """Build a megatron-core GPTModel shaped like `model_dir`'s config and load its weights."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    init_parallel(1)
    tiny = _tiny_from_config(hf_config(model_dir))
    model = build_model(tiny)
    load_hf_weights(model, load_file(str(Path(model_dir) / "model.safetensors")))
    return model
