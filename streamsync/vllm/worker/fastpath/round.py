"""One round on the fast path: the copies of each received chunk, REBUILD modules filled and processed as they
complete, DERIVE layers derived again at the end."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ....receiver.base_copy import aliased
from .direct import Direct, Experts, _fp8_linear, _layout, _learn, _sourcing, resolve
from .plan import Plan, _Op
from .trace import _TB, Slots, Weights, Write, _expert_layout, _place, _tensors, materialize

if TYPE_CHECKING:
    from ..quant import Layout


@dataclass(slots=True)
class _Piece:
    """One write of a sourced module's quantized tensor: `src` (a view of the pushed chunk, or `owned`: a copy
    of one that outlives its chunk) into `dst` (a view of the live fp8 tensor), in group `group` of `tensor`."""

    src: torch.Tensor
    dst: torch.Tensor
    tensor: str
    group: int
    owned: bool = False
    layout: Layout | None = None  # `quant.layout(src, dst)`: where the kernel finds its runs


@dataclass
class _Pending:
    """A REBUILD module the round has started writing: its fresh tensors and how much of them arrived."""

    params: Slots
    buffers: Slots
    filled: int = 0
    #: a module quantized from the push's tensors where they lie (`quant.quantize_sourced`): the writes of its
    #: quantized tensors not yet quantized; None: those are written into fresh tensors
    pieces: list[_Piece] | None = None
    #: (tensor, group) -> elements of it arrived, for the groups not yet quantized
    groups: dict[tuple[str, int], int] = field(default_factory=dict)


#: elements of completed sourced modules after which a load quantizes them, not waiting for its end
SOURCED_BATCH = 1 << 29


def _by_group(owner: Direct | Experts, tensor: str, w: Write, src: torch.Tensor, dst: torch.Tensor, owned: bool
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, bool]]:
    """A sourced module's write that spans groups as (source, destination, group, owned) pieces, one per group: a
    contiguous write spanning groups (several experts' weights in one copy: a stacked checkpoint tensor, or
    copies the trace merged) is cut at the groups' boundaries (`direct.dense`)."""
    per = owner.group_numel(tensor)
    flat_dst = dst.reshape(-1)  # a view: the write is dense (`_sourcing` checked)
    flat = src.reshape(-1)
    owned = owned or flat.data_ptr() != src.data_ptr() or not src.is_contiguous()  # reshape copied it
    at = 0
    while at < w.numel:
        g = (w.offset + at) // per
        n = min(w.numel - at, (g + 1) * per - w.offset - at)
        yield flat[at:at + n], flat_dst[at:at + n], g, owned
        at += n


def _in_place_views(plan: Plan) -> dict[str, torch.Tensor]:
    """Per name, the live view its one whole copy writes, where a delta may be decoded into it (`in_place`)."""
    views: dict[str, torch.Tensor] = {}
    for name, ops in plan.ops.items():
        copies = [op for op in ops if op.write.src_offset is not None and op.write.numel]
        if len(copies) == 1 and copies[0].dst is not None and copies[0].whole and copies[0].dst.is_contiguous():
            views[name] = copies[0].dst
    fused = {n: v for n, v in views.items() if n in plan.fusions}
    shared = aliased({n: v for n, v in views.items() if n not in fused}) | aliased(fused)
    return {n: v for n, v in views.items() if n not in shared}


@dataclass
class FastRound:
    """One round's state on the fast path: REBUILD modules being filled, and what went which way."""

    plan: Plan
    rebuilt: int = 0  # modules processed this round
    direct: int = 0  # of those, quantized without vLLM's processing (`Direct`, fp8 experts)
    sourced: int = 0  # of those, quantized from the pushed tensors (no fresh bf16 weight)
    copied: int = 0  # bytes of those modules' pieces copied out of their chunk first (`_Piece.owned`)
    pending: dict[int, _Pending] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    #: sourced modules complete in this `load`, finished together before it returns (their sources are the chunk's)
    ready: list[int] = field(default_factory=list)
    ready_numel: int = 0  # their elements
    temps: int = 0  # copies of sources `writes` made (a graph of the load would read them after they are freed)

    def __post_init__(self) -> None:
        resolve(self.plan)  # what the last round's first processing by vLLM showed
        _sourcing(self.plan)

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

    def in_place(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The live tensor that holds `name` (of HF `shape`) whole and as it is, which a delta may be decoded into
        in place (`Loader.direct`): its one copy goes into a module whose kernels read what is loaded (COPY),
        contiguous, every element, sharing no byte with another name's (a fused name's members aside: a sender
        sends one or the other). A TP-sharded, rebuilt, quantized or layerwise tensor has none."""
        views = self.plan.in_place
        if views is None:
            views = self.plan.in_place = _in_place_views(self.plan)
        d = views.get(name)
        return d if d is not None and d.numel() == math.prod(shape) else None

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
        self.quantize_ready()
        return complete

    def quantize_ready(self, final: bool = True) -> None:
        """Quantize every group of the sourced modules complete so far, all at once, while their sources are still
        mapped. `final` (the chunk's load ends, its copies queued): also finish the modules completed, and copy the
        pieces of a group still missing some elements out of the chunk (its buffer is reused once `load` returns)
        to wait for the rest. Before that, `writes` calls it every `SOURCED_BATCH` elements of completed modules,
        so that the kernels run while the host walks the rest of the chunk."""
        from ..quant import quantize_sourced

        pieces, scales, layouts = self.take_ready(final)
        quantize_sourced(pieces, scales, layouts=layouts)

    def take_ready(self, final: bool = True) -> tuple[list[tuple[torch.Tensor, torch.Tensor, int]],
                                                      list[torch.Tensor], list[Layout | None]]:
        """`quantize_ready` up to its launch: the complete groups' pieces, scales and layouts, for
        `quant.quantize_sourced` (or a graph of it: `captured.CapturedLoads`)."""
        from ..quant import layout

        pieces: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        layouts: list[Layout | None] = []
        scales: list[torch.Tensor] = []
        for i, pend in list(self.pending.items()):
            if pend.pieces is None:
                continue
            r = self.plan.rebuilt[i]
            owner = r.direct
            sizes = {n: owner.group_numel(n) for n in owner.outs}
            full = {key for key, n in pend.groups.items() if n == sizes[key[0]]}
            index: dict[tuple[str, int], int] = {}  # a group -> its scale's place in `scales`
            waiting: list[_Piece] = []
            for p in pend.pieces:
                key = (p.tensor, p.group)
                if key in full:
                    j = index.get(key)
                    if j is None:
                        j = index[key] = len(scales)
                        scales.append(owner.scale_of(p.tensor, p.group))
                    pieces.append((p.src, p.dst, j))
                    layouts.append(p.layout)
                elif final and not p.owned:
                    self.copied += p.src.numel() * p.src.element_size()
                    src = p.src.clone()
                    waiting.append(_Piece(src, p.dst, p.tensor, p.group, True, layout(src, p.dst)))
                else:
                    waiting.append(p)
            pend.pieces = waiting
            for key in full:
                del pend.groups[key]
        if final:  # the load's copies are queued (a module's other tensors come from its fresh ones)
            for i in self.ready:
                pend = self.pending.pop(i)
                assert not pend.pieces and not pend.groups
                self.plan.rebuilt[i].direct.apply(pend.params, quantized=True)
                self.done.add(i)
            self.rebuilt += len(self.ready)
            self.direct += len(self.ready)
            self.sourced += len(self.ready)
            self.ready.clear()
        self.ready_numel = 0
        return pieces, scales, layouts

    def writes(self, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]], complete: list[int], batch: bool = True
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, float]]:
        """Each copy as (destination view, source view, 0) and each constant fill as (destination, None, value),
        REBUILD modules' fresh tensors made on first write; appends to `complete` the modules it completes. A
        sourced module's weight writes are kept as its pieces instead (`_Pending.pieces`) and the module, once
        complete, goes to `ready` (quantized every `SOURCED_BATCH` elements where `batch`, else left to the caller).
        Every copy of a source it makes (a contiguous one, an owned piece) counts in `temps`.

        A piece its kernel cannot read (`quant.sourceable`) is read from a contiguous copy of it.

        A source may come *blocked* (`pack.fits`: Q as a (groups, rows, hidden) view of megatron's interleaved
        QKV, the same row-major order as its HF shape): a whole write into a contiguous destination reads it as
        it is, so no reshaped copy of it is ever made; any other write reads a contiguous copy."""
        from ..quant import layout, sourced_layout

        for ops, src in fast:
            flat: torch.Tensor | None = src if src.is_contiguous() else None
            for op in ops:
                w = op.write
                n = w.numel
                if n == 0:  # a loader's empty write (no padding rows on this rank): nothing to do
                    continue
                piece = False
                if op.dst is not None:
                    dst = op.dst
                else:
                    pend = self._pending(op.module)
                    owner = self.plan.rebuilt[op.module].direct
                    piece = pend.pieces is not None and op.tensor in owner.outs
                    t = owner.outs[op.tensor] if piece else self._fresh(op.module, op.tensor)
                    dst = t.as_strided(w.size, w.stride, t.storage_offset() + w.offset)
                if w.src_offset is None:
                    pair: tuple[torch.Tensor, torch.Tensor | None] = (dst, None)
                elif op.whole and src.numel() != n:  # the source's first rows only (a TP rank's slice)
                    if flat is None:
                        flat = self._contiguous(src)
                    pair = dst, flat.view(-1)[:n].view(w.size)
                elif op.whole and flat is not None:
                    pair = dst, flat.view(w.size)
                elif op.whole and dst.is_contiguous():
                    pair = dst.view(src.shape), src
                else:
                    if flat is None:
                        flat = self._contiguous(src)
                    pair = dst, flat.as_strided(w.size, w.src_stride, flat.storage_offset() + w.src_offset)
                if piece:
                    into, part = pair
                    assert pend.pieces is not None and part is not None
                    where = sourced_layout(part, into)
                    owned = where is None
                    if owned:  # in the dtype the fresh tensor would hold it in, as that path would quantize it
                        part = torch.empty(into.shape, dtype=self._fresh_dtype(op.module, op.tensor),
                                           device=into.device).copy_(part, non_blocking=True)
                        self.copied += part.numel() * part.element_size()
                        self.temps += 1
                        where = layout(part, into)
                    owner = self.plan.rebuilt[op.module].direct
                    g = owner.group(op.tensor, w.offset, w.size, w.stride)
                    if g is not None:  # the usual write: one weight or expert
                        pend.pieces.append(_Piece(part, into, op.tensor, g, owned, where))
                        pend.groups[(op.tensor, g)] = pend.groups.get((op.tensor, g), 0) + n
                    else:
                        for a, b, g, own in _by_group(owner, op.tensor, w, part, into, owned):
                            pend.pieces.append(_Piece(a, b, op.tensor, g, own, layout(a, b)))
                            pend.groups[(op.tensor, g)] = pend.groups.get((op.tensor, g), 0) + a.numel()
                        self.temps += own and not owned  # reshaped into a copy
                if op.dst is None:
                    pend.filled += n
                    if pend.filled == self.plan.rebuilt[op.module].numel:
                        if pend.pieces is None:
                            complete.append(op.module)
                        else:
                            self.ready.append(op.module)
                            self.ready_numel += pend.filled
                            if batch and self.ready_numel >= SOURCED_BATCH:  # each module once: then 0 again
                                self.quantize_ready(final=False)
                if not piece:
                    yield pair[0], pair[1], w.value

    def replayable(self, modules: Sequence[int]) -> bool:
        """Whether none of `modules` was started or finished this round (a graph of their loads may replay)."""
        return not any(i in self.pending or i in self.done or i in self.ready for i in modules)

    def replayed(self, modules: Sequence[int]) -> None:
        """Count sourced `modules` whose whole load a graph replayed as finished (`captured.CapturedLoads`)."""
        for i in modules:
            self.plan.rebuilt[i].direct.apply({}, quantized=True)  # host work only (no fresh tensors)
            self.done.add(i)
        self.rebuilt += len(modules)
        self.direct += len(modules)
        self.sourced += len(modules)

    def _contiguous(self, src: torch.Tensor) -> torch.Tensor:
        if not src.is_contiguous():
            self.temps += 1
        return src.contiguous()

    def _pending(self, i: int) -> _Pending:
        pend = self.pending.get(i)
        if pend is None:
            if i in self.done or i in self.ready:
                raise RuntimeError(f"module {self.plan.rebuilt[i].name!r} was written twice in one round")
            r = self.plan.rebuilt[i]
            if r.fresh is not None:
                # a sourced module's quantized tensors are quantized from their pieces: no fresh tensors for them
                outs = r.direct.outs if r.direct is not None and r.sourceable else {}
                pend = _Pending({n: None if n in outs else torch.empty_strided(shape, stride, dtype=dt, device=dev)
                                 for n, (shape, stride, dt, dev) in r.fresh.items()}, {},
                                pieces=[] if outs else None)
            else:
                pend = _Pending(*materialize(r.layer))
            self.pending[i] = pend
        return pend

    def _fresh_dtype(self, i: int, name: str) -> torch.dtype:
        fresh = self.plan.rebuilt[i].fresh
        assert fresh is not None
        return fresh[name][2]

    def _fresh(self, i: int, name: str) -> torch.Tensor:
        pend = self.pending[i]
        t = pend.params.get(name)
        t = pend.buffers[name] if t is None else t
        assert t is not None  # a traced target: a tensor in the module's load format
        return t

    @torch.no_grad()
    def process(self, modules: Sequence[int]) -> None:
        """Process each completed REBUILD module with its own `process_weights_after_loading` and copy the result
        into the tensors its kernels hold (their addresses stay). A fused-MoE layer under vLLM's online fp8 is
        quantized by `quant.rebuild_fp8_experts` (the same arithmetic over many experts at once) instead, and
        from its next round on is an `Experts` module."""
        from ..quant import fp8_experts_rebuildable, rebuild_fp8_experts

        for i in modules:
            pend = self.pending.pop(i)
            r = self.plan.rebuilt[i]
            layer = r.layer
            if r.direct is not None:
                r.direct.apply(pend.params)
                self.done.add(i)
                self.rebuilt += 1
                self.direct += 1
                continue
            kernel_params, kernel_buffers, non_persistent = _tensors(layer)
            if fp8_experts_rebuildable(layer):
                rebuild_fp8_experts(layer, pend.params, kernel_params)
                if r.fresh is None and not any(b is not None for b in pend.buffers.values()):
                    r.fresh = _layout(pend.params)
                    r.direct, r.sourceable = Experts.of(layer, kernel_params), None
                self.done.add(i)
                self.rebuilt += 1
                self.direct += 1
                continue
            learn = not r.learned and _fp8_linear(layer)
            r.learned = True
            _place(layer, pend.params, pend.buffers, non_persistent)
            try:
                if hasattr(layer, "_already_called_process_weights_after_loading"):
                    delattr(layer, "_already_called_process_weights_after_loading")
                layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
                _expert_layout(layer)
                update: Any = getattr(layer, "update_param_tp_status", None)
                if update is not None:  # processing may have made new Parameters: vLLM reconciles their TP state
                    update()
                if learn:
                    r.candidate = _learn(layer, pend.params, pend.buffers, kernel_params, kernel_buffers)
                live: dict[int, torch.Tensor] = {}  # a processed tensor's address -> the live tensor it lands in
                for name, p in kernel_params.items():
                    if p is not None:
                        new = getattr(layer, name)
                        if p.numel() == 0 and new.numel():  # a weight its module's user released (AMX MLA's
                            kernel_params[name] = new  # kv_b_proj): the processed one is held as it is
                            continue
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
        """End the round: REBUILD modules not completely written keep their old weights (but the groups of a sourced
        one quantized as they came); returns their names."""
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
