"""Checks of a push before any byte moves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..convert import same_family
from ..errors import ValidationError
from ..pack import dtype_name
from .chunk import ChunkPlan

if TYPE_CHECKING:  # the engines' package imports the plan's (`layer_index`)
    from ..engines.base import Declined

#: HF name -> (dtype name, shape): what an engine holds and a push must carry
Expected = Mapping[str, tuple[str, tuple[int, ...]]]


VOCAB_NAMES = ("embed_tokens.weight", "lm_head.weight")


def vocab_hint(plans: Sequence[ChunkPlan], expected: Expected) -> str:
    """Megatron pads its vocabulary (to a multiple of `make_vocab_size_divisible_by` x TP): when only
    the row count of an embedding or lm_head differs, say which option drops the padding rows."""
    for p in plans:
        for s in p.specs:
            exp = expected.get(s.name)
            shape = s.full_shape
            if (s.name.endswith(VOCAB_NAMES) and exp is not None and len(exp[1]) == 2 and len(shape) == 2
                    and exp[1][1] == shape[1] and exp[1][0] != shape[0]):
                return (f". {s.name} has {shape[0]} rows, the engine {exp[1][0]}: a Megatron model pads its "
                        "vocabulary; pass WeightSync(..., source_options={'hf_config': <the served model's config>})"
                        f" (or {{'vocab_size': {exp[1][0]}}}) so the padding rows are dropped")
    return ""


def dtype_casts(plans: Sequence[ChunkPlan], expected: Mapping[str, Expected]) -> dict[str, str] | None:
    """HF name -> the dtype every engine holds it in, for each floating tensor of the plan that an engine holds
    in another floating dtype with the same shape: what a push casts, as vLLM's own loaders cast a checkpoint.
    None where engines disagree on a tensor's dtype (no one cast serves them all)."""
    floating = ("bfloat16", "float16", "float32", "float64")
    out: dict[str, str] = {}
    for holds in expected.values():
        for p in plans:
            for s in p.specs:
                exp = holds.get(s.name)
                have = dtype_name(s.dtype)
                if exp is None or exp[0] == have or tuple(exp[1]) != tuple(s.full_shape):
                    continue
                if exp[0] not in floating or have not in floating:
                    continue
                if out.setdefault(s.name, exp[0]) != exp[0]:
                    return None
    return out


def check_family(trainer: Sequence[str], engines: Mapping[str, Sequence[str]]) -> None:
    """Refuse a trainer of one model family pushed into an engine serving another (a DeepSeek-V3 trainer into a
    Qwen3 engine), naming both, where both say what they are (`Source.architectures`, `Family.architectures`)."""
    if not trainer:
        return
    for engine, served in engines.items():
        if served and not same_family(trainer, served):
            raise ValidationError(f"model does not match engine {engine!r}: the trainer is a {'/'.join(trainer)} "
                                  f"model, the engine serves {'/'.join(served)}")


def check_plan(plans: Sequence[ChunkPlan], expected: Mapping[str, Expected], *, once: bool = True,
               declined: Mapping[str, Declined] | None = None) -> None:
    """Refuse a plan that names a tensor twice, or that does not match what an engine holds (`expected`, by
    engine name): unknown names, dtype or shape mismatches, missing tensors, each named with its chunk.
    `once=False`: a tensor may be in several chunks (a sharded push sends each worker's slices of it in the
    bucket that worker's layer falls in). `declined`: by engine, what of its checkpoint a push need not carry
    (`Declined`: MTP layers it does not load, or loads into its draft model if they come): neither unknown nor
    missing there when left out, and checked like any tensor when they come to an engine that loads them."""
    if not plans:
        raise ValidationError("nothing to push: the source planned no chunks")
    seen: dict[str, int] = {}
    parts: set[tuple[str, int]] = set()
    for p in plans:
        for s in p.specs:
            if s.part is not None and s.part[0] > 0 and (s.name, s.part[0]) not in parts:
                parts.add((s.name, s.part[0]))  # a later part of a tensor split by rows
                continue
            if s.name in seen and once:
                raise ValidationError(f"tensor {s.name!r} appears in chunks {seen[s.name]} and {p.index}")
            seen.setdefault(s.name, p.index)
    for engine, holds in expected.items():
        problems = []
        cast_to = None  # the engine's dtype where only dtypes differ
        skip = (declined or {}).get(engine)
        for p in plans:
            for s in p.specs:
                if skip is not None and skip.declines(s.name):
                    continue
                exp = holds.get(s.name)
                if exp is None:
                    problems.append(f"unknown parameter {s.name!r} (chunk {p.index})")
                elif exp != (dtype_name(s.dtype), s.full_shape):
                    if exp[0] != dtype_name(s.dtype) and tuple(exp[1]) == tuple(s.full_shape) and cast_to is None:
                        cast_to = exp[0]
                    problems.append(f"parameter {s.name!r} (chunk {p.index}) is {dtype_name(s.dtype)}"
                                    f"{s.full_shape}, engine holds {exp[0]}{exp[1]}")
        missing = sorted(n for n in set(holds) - set(seen) if skip is None or not skip.may_omit(n))
        if missing:
            problems.append(f"{len(missing)} parameter(s) missing from the push, e.g. {missing[:3]}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            cast = (f"; to cast while pushing, pass source_options={{'dtype': '{cast_to}'}} to WeightSync (a torch "
                    "dtype or its name)") if cast_to else ""
            raise ValidationError(f"model does not match engine {engine!r}: " + "; ".join(problems[:5]) + more
                                  + cast + vocab_hint(plans, holds))

