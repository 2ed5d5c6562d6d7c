"""The plan a trace makes: per HF name the copies into the engine's tensors, per module its path, the fusions a
sender may send whole, and the key that tells whether the model is still the one traced."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ....plan.chunking import layer_index
from .trace import _TB, Mode, Target, Traced, Write, _contiguous_strides, _quant_method, module_mode


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
    #: name -> (shape, stride, dtype, device) of its load format's tensors, once it is processed without vLLM's
    #: help (`direct.Direct`, `direct.Experts`): rounds make them with `torch.empty_strided`, not vLLM's reload
    fresh: dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]] | None = None
    direct: Any = None  # `direct.Direct` (learned from its first processing by vLLM) or `direct.Experts`
    #: whether a round may quantize it from the pushed tensors where they lie (`direct._sourcing`): every
    #: write of a quantized tensor a copy that falls in one group; None: not yet looked at for this `direct`
    sourceable: bool | None = None
    candidate: Any = None  # `round._Candidate`: that first processing's comparison, until a round settles it
    learned: bool = False  # that first processing was looked at


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
    #: name -> the live tensor a delta may be decoded into (`FastRound.in_place`), made on first ask
    in_place: dict[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)
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
        # an empty tensor is no copy's destination (a CPU linear's weight moved into its packed kernel, a kv_b_proj
        # weight AMX MLA released and replaces every round): kept out of the key
        if now is not None and now.numel() and modes[t.module][0] is not Mode.LAYERWISE:
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
