"""Predicting a sharded push at scale: the plan `plan_transfers` makes for a model shape, a trainer layout and
engine layouts, and the time its busiest link needs (`streamsync plan`).

* The trainer's declarations are what `MegatronSource.shards` / `ModuleSource.shards` declare, built from
  shapes alone: megatron-core TP (whole query groups: q, k and v rows per group; gate/up rows; o_proj and
  down_proj columns; the vocabulary padded to 128 x TP), PP (layers split evenly, the first stages one more
  where they do not divide; embeddings on the first, norm and head on the last), EP/ETP (experts
  `E / EP` per expert rank, rank order tp-cp-ep-dp-pp), data-parallel replicas (the planner spreads their
  sends); or FSDP2 (every tensor's dim 0 chunked over the ranks, torch.chunk sizes).
* The engines' layouts are `testing.sliced.vllm_layout`'s, which mirror vLLM's loaders: TP slices for the
  dense parts; with EP > 1 whole experts over `EP` workers (EP = DP x TP, attention replicated over the DP
  groups), else every expert TP-split.
* Layer repetition: layers of one kind (dense or MoE) on one pipeline stage have identical pieces between the
  same ranks and workers, so one layer of each (kind, stage) is planned (together with the embeddings and
  head, in one `plan_transfers` call) and its bytes counted once per layer it stands for. The only difference
  from planning every layer is where replicas (DP copies, norms on every TP rank) break ties: the replica
  choice of the stand-in layer repeats instead of rotating, which `full=True` avoids.

The time model: every rank and worker has a NIC (`nic_gbit`, per direction), a GPU's NVLink (`nvlink_gbyte`
per direction) carries pieces between GPUs of one node, a piece between a trainer rank and the worker on its
own GPU (colocated) is a device copy (`copy_gbyte`), and `host_gbyte`, when set, caps everything one node's
processes move together (a CPU host, where the processes share the cores and memory). The predicted push time
is the largest bytes / rate over all of these (they run concurrently: every sender sends at once, the
pipeline overlaps packing with sending), plus `bucket_latency_us` per bucket and `push_latency_ms` per push, and
before it the finite check every rank runs on what it holds (`check_gbyte`). On a CPU host (`cpu_cores`) the
processes' CPU time is a resource too: per node, the CPU time of its processes (per byte sent or received, per
push, per bucket and per piece, `Links.cpu_*`) over its cores, or one process's own.
`lockstep_seconds` is the other bound: buckets strictly one after another, each taking its own busiest link's
time (a sender with nothing in a bucket waits); the pipeline's window lets ranks run ahead, so a push lands
between the two.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..errors import ValidationError
from .chunking import layer_index
from .shapes import Shape, Spec
from .shards import Box, EngineLayout, Have, Need, ShardPlan, plan_transfers

GB = 1e9


def _parse_kv(text: str, what: str, keys: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, eq, v = item.partition("=")
        if not eq or k not in keys or not v.isdigit() or int(v) < 1:
            raise ValidationError(f"{what} {text!r}: each item must be KEY=N (N >= 1) with KEY one of "
                                  f"{', '.join(keys)}; got {item!r}")
        out[k] = int(v)
    return out


@dataclass(frozen=True)
class Trainer:
    """megatron-core TP x PP x DP with EP x ETP for experts, or FSDP2 over `fsdp` ranks; `per_node` GPUs a node."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    fsdp: int = 0
    per_node: int = 8

    @staticmethod
    def parse(text: str, per_node: int = 8) -> Trainer:
        """'tp=8,pp=4,ep=8,dp=8' or 'fsdp=256' (`ranks=N` instead of dp: dp = N / (tp * pp))."""
        kv = _parse_kv(text, "trainer layout", ("tp", "pp", "dp", "ep", "etp", "fsdp", "ranks"))
        if "fsdp" in kv:
            if set(kv) - {"fsdp"}:
                raise ValidationError(f"trainer layout {text!r}: fsdp=N takes no other keys")
            return Trainer(fsdp=kv["fsdp"], per_node=per_node)
        tp, pp = kv.get("tp", 1), kv.get("pp", 1)
        dp = kv.get("dp", 1)
        if "ranks" in kv:
            if "dp" in kv or kv["ranks"] % (tp * pp):
                raise ValidationError(f"trainer layout {text!r}: ranks={kv['ranks']} must be a multiple of tp x pp "
                                      f"= {tp * pp} (and dp not given too)")
            dp = kv["ranks"] // (tp * pp)
        return Trainer(tp, pp, dp, kv.get("ep", 1), kv.get("etp", 1), 0, per_node)

    @property
    def world(self) -> int:
        return self.fsdp or self.tp * self.pp * self.dp

    def describe(self) -> str:
        if self.fsdp:
            return f"FSDP2 x{self.fsdp}"
        return f"TP{self.tp} PP{self.pp} DP{self.dp} EP{self.ep} ETP{self.etp} ({self.world} ranks)"


@dataclass(frozen=True)
class Engines:
    """`count` engines of `max(tp, ep)` workers each (vLLM: EP = DP x TP), `per_node` GPUs a node. With
    `Links.colocated` the workers are on the trainer's GPUs from `first_gpu` on (0: worker g on rank g's GPU;
    e.g. 4: four trainer GPUs and four engine GPUs in one node of eight)."""

    count: int = 1
    tp: int = 1
    ep: int = 1
    per_node: int = 8
    first_gpu: int = 0

    @property
    def workers(self) -> int:
        return max(self.tp, self.ep)

    def describe(self) -> str:
        ep = f" EP{self.ep}" if self.ep > 1 else ""
        return f"{self.count} x TP{self.tp}{ep} ({self.count * self.workers} workers)"


@dataclass(frozen=True)
class Links:
    """Link rates (module doc). colocated: engine worker g (counting over all engines) on trainer rank g's GPU.
    one_host: every trainer rank and engine worker on one machine (no NIC between them: NVLink between GPUs, or
    on a CPU host the host itself, `host_gbyte` and `cpu_cores`)."""

    nic_gbit: float = 400.0
    nvlink_gbyte: float = 450.0
    copy_gbyte: float = 1000.0
    host_gbyte: float | None = None
    bucket_latency_us: float = 0.0
    colocated: bool = False
    one_host: bool = False
    #: a CPU host (gloo on shared cores): every process of a node shares `cpu_cores`, and each costs CPU time per
    #: byte it sends (`cpu_tx_ns`: its pack copy and its side of the wire) or receives (`cpu_rx_ns`: its side of
    #: the wire, assembling, loading); a trainer rank per push whatever it sends (`cpu_push_us`: the pipeline's
    #: tasks and threads, the ranks' agreement), per bucket it takes part in (`cpu_bucket_us`) and per piece it
    #: sends (`cpu_piece_us`: a view, a copy call, a source's per-tensor lookups); an engine worker the same
    #: (`cpu_rx_push_us`, `cpu_rx_bucket_us`, `cpu_rx_piece_us`); the rank holding the engines (rank 0) per
    #: bucket per worker taking part (`cpu_control_us`: the round's messages)
    cpu_cores: int | None = None
    cpu_tx_ns: float = 0.0
    cpu_rx_ns: float = 0.0
    cpu_push_us: float = 0.0
    cpu_bucket_us: float = 0.0
    cpu_piece_us: float = 0.0
    cpu_rx_push_us: float = 0.0
    cpu_rx_bucket_us: float = 0.0
    cpu_rx_piece_us: float = 0.0
    cpu_control_us: float = 0.0
    #: a fixed cost per push (the rounds' opening and closing calls, the ranks' agreement to push), added once
    push_latency_ms: float = 0.0
    #: the trainer ranks' agreement before a sharded push (one exchange over the default group), per rank beyond
    #: the first
    agree_ms: float = 0.0
    #: each trainer rank's NaN/inf scan of the weights it holds (`check_finite`, on by default), GB/s per
    #: process: it runs before any byte moves, so its time adds to the push's; 0: not counted
    check_gbyte: float = 0.0


# ------------------------------------------------------------------------------------------- trainer


def _stages(layers: int, pp: int) -> list[int]:
    """Stage of each layer: even split, the first `layers % pp` stages one layer more."""
    base, rem = divmod(layers, pp)
    out: list[int] = []
    for s in range(pp):
        out += [s] * (base + (s < rem))
    return out


_REPL = re.compile(r"(layernorm|_norm|\.norm)\.weight$|\.gate\.weight$|e_score_correction_bias$|"
                   r"\.(q_a_proj|kv_a_proj_with_mqa)\.weight$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def check_trainer(shape: Shape, t: Trainer) -> None:
    """What megatron-core (or FSDP2) refuses, named before planning."""
    if t.fsdp:
        return
    if shape.mla:
        if shape.heads % t.tp:
            raise ValidationError(f"trainer tp={t.tp} does not divide the {shape.heads} attention heads")
    elif shape.kv_heads % t.tp:
        raise ValidationError(f"trainer tp={t.tp} does not divide the {shape.kv_heads} kv heads (megatron splits "
                              "whole query groups over TP)")
    if shape.ffn % t.tp:
        raise ValidationError(f"trainer tp={t.tp} does not divide intermediate_size {shape.ffn}")
    if t.pp > shape.layers:
        raise ValidationError(f"trainer pp={t.pp} exceeds the {shape.layers} layers")
    if shape.experts:
        if shape.experts % t.ep:
            raise ValidationError(f"trainer ep={t.ep} does not divide the {shape.experts} experts")
        if (t.tp * t.dp) % (t.ep * t.etp):
            raise ValidationError(f"trainer ep x etp = {t.ep * t.etp} does not divide tp x dp = {t.tp * t.dp} (the "
                                  "ranks of one pipeline stage)")
        if shape.moe_ffn % t.etp:
            raise ValidationError(f"trainer etp={t.etp} does not divide moe_intermediate_size {shape.moe_ffn}")
        if shape.shared and (shape.moe_ffn * shape.shared) % t.tp:
            raise ValidationError(f"trainer tp={t.tp} does not divide the shared expert's {shape.moe_ffn} rows")
    elif t.ep > 1 or t.etp > 1:
        raise ValidationError(f"trainer ep={t.ep} / etp={t.etp} given for a model without experts")


def trainer_haves(shape: Shape, specs: Iterable[Spec], t: Trainer) -> list[Have]:
    """What every trainer rank declares (module doc) for the tensors `specs`."""
    check_trainer(shape, t)
    out: list[Have] = []
    if t.fsdp:
        for name, _, shp in specs:
            c = -(-shp[0] // t.fsdp)
            for r in range(t.fsdp):
                a, b = min(r * c, shp[0]), min((r + 1) * c, shp[0])
                if b > a:
                    out.append(Have(r, name, Box.rows(shp, a, b - a)))
        return out
    stage_of = _stages(shape.layers, t.pp)
    stride = t.tp * t.dp  # ranks per stage

    def dense(stage: int, tp_rank: int) -> list[int]:
        return [tp_rank + t.tp * d + stride * stage for d in range(t.dp)]

    edp = stride // (t.ep * t.etp)

    def expert(stage: int, ep_rank: int, etp_rank: int) -> list[int]:
        return [etp_rank + t.etp * (ep_rank + t.ep * d) + stride * stage for d in range(edp)]

    for name, _, shp in specs:
        li = layer_index(name)
        outer = 0 if name == "model.embed_tokens.weight" else t.pp - 1  # embeddings first stage, the rest last
        stage = stage_of[li] if li is not None else outer
        e = _EXPERT.search(name)
        if e is not None:
            per = shape.experts // t.ep
            epr, size = int(e.group(1)) // per, t.etp
            for r in range(size):
                out += [Have(k, name, _split(name, shp, size, r)) for k in expert(stage, epr, r)]
            continue
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            n = -(-shp[0] // (128 * t.tp)) * 128  # megatron-lm pads the vocabulary to 128 x TP
            for r in range(t.tp):
                a, b = min(r * n, shp[0]), min((r + 1) * n, shp[0])
                if b > a:
                    out += [Have(k, name, Box.rows(shp, a, b - a)) for k in dense(stage, r)]
            continue
        for r in range(t.tp):
            for box in _megatron_boxes(shape, name, shp, t.tp, r):
                out += [Have(k, name, box) for k in dense(stage, r)]
    return out


def _split(name: str, shp: tuple[int, ...], size: int, r: int) -> Box:
    """Column (rows of dim 0) or row (dim 1) parallel slice `r` of `size`; down/o_proj split dim 1."""
    dim = 1 if name.endswith((".down_proj.weight", ".o_proj.weight")) else 0
    n = shp[dim] // size
    return Box.rows(shp, r * n, n, dim)


def _halves(shp: tuple[int, ...], size: int, r: int) -> list[Box]:
    """Slice `r` of `size` of each half of a fused [gate; up] tensor (its rows)."""
    n = shp[0] // 2 // size
    return [Box.rows(shp, r * n, n), Box.rows(shp, shp[0] // 2 + r * n, n)]


def _megatron_boxes(shape: Shape, name: str, shp: tuple[int, ...], tp: int, r: int) -> list[Box]:
    if tp == 1 or _REPL.search(name):
        return [Box.whole(shp)]
    if name.endswith(".gate_up_proj.weight"):  # GLM-4's fused [gate; up]: rank r holds gate_r and up_r
        return _halves(shp, tp, r)
    m = re.search(r"\.([qkv])_proj\.(weight|bias)$", name)
    if m is not None and not shape.mla:  # megatron's QKV shard: whole query groups, one box per group
        hd, g = shape.head_dim, shape.kv_heads
        rows = (shape.heads // g) * hd if m.group(1) == "q" else hd
        return [Box.rows(shp, grp * rows, rows) for grp in range(r * (g // tp), (r + 1) * (g // tp))]
    return [_split(name, shp, tp, r)]


# ------------------------------------------------------------------------------------------- engines


def engine_layouts(shape: Shape, specs: Sequence[Spec], e: Engines) -> list[EngineLayout]:
    """The engines' layouts (module doc)."""
    from .vllm_layout import vllm_layout

    if e.ep > 1 and e.ep % e.tp:
        raise ValidationError(f"engine ep={e.ep} is not a multiple of engine tp={e.tp} (vLLM: EP = DP x TP)")
    if e.ep > 1 and not shape.experts:
        raise ValidationError(f"engine ep={e.ep} given for a model without experts")
    if e.ep > 1 and shape.experts < e.ep:
        raise ValidationError(f"engine ep={e.ep} exceeds the {shape.experts} experts")
    if shape.ffn % e.tp or (shape.moe_ffn and e.ep == 1 and shape.moe_ffn % e.tp):
        raise ValidationError(f"engine tp={e.tp} does not divide the MLP's rows ({shape.ffn}, {shape.moe_ffn})")
    if e.ep > 1:
        plain = [s for s in specs if not _EXPERT.search(s[0])]
        experts = [s for s in specs if _EXPERT.search(s[0])]
        dense = vllm_layout(plain, e.tp, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim)
        # expert-only specs: no attention tensors, so the head counts only need to split over ep
        moe = vllm_layout(experts, e.ep, heads=e.ep, kv_heads=e.ep, head_dim=1, expert_parallel=True)
        per_worker = [dense[w % e.tp] + moe[w] for w in range(e.workers)]
    else:
        per_worker = vllm_layout(specs, e.tp, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim)
    out = []
    for i in range(e.count):
        name = f"e{i}"
        out.append(EngineLayout(name, e.workers, tuple(Need(name, w, n, b) for w, holds in enumerate(per_worker)
                                                      for n, b in holds)))
    return out


# ------------------------------------------------------------------------------------------- prediction


@dataclass
class Prediction:
    shape: str
    trainer: str
    engines: str
    model_bytes: int
    plan_bytes: int                     # every piece's bytes (model bytes x engines)
    sent: dict[int, int]                # trainer rank -> bytes
    received: dict[str, int]            # "engine.wWORKER" -> bytes
    link_bytes: dict[str, int]          # link class -> bytes
    bound: dict[str, object]            # the bounding resource
    seconds: float
    transfer_seconds: float
    buckets: float
    pieces: int
    planned_layers: int
    layers: int
    links: dict[str, float] = field(default_factory=dict)
    world: int = 0
    lockstep_seconds: float = 0.0      # buckets strictly one after another
    check_seconds: float = 0.0         # the finite check before any byte moves (in `seconds`)
    held: dict[int, int] = field(default_factory=dict)  # trainer rank -> bytes it holds
    #: "trainer rank R" / "engine E worker W" -> node, bytes sent and received, buckets and pieces taken part in
    processes: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        def mmm(v: Iterable[int]) -> dict[str, float]:
            vals = list(v)
            return {"max": max(vals), "mean": sum(vals) / len(vals), "min": min(vals)} if vals else {}
        return {"shape": self.shape, "trainer": self.trainer, "engines": self.engines,
                "model_bytes": self.model_bytes, "plan_bytes": self.plan_bytes,
                "sent_per_rank": mmm(self.sent.get(r, 0) for r in range(self.world)),
                "received_per_worker": mmm(self.received.values()), "link_bytes": self.link_bytes,
                "bound": self.bound, "predicted_s": self.seconds, "transfer_s": self.transfer_seconds,
                "lockstep_s": self.lockstep_seconds, "check_s": self.check_seconds,
                "held_per_rank": mmm(self.held.get(r, 0) for r in range(self.world)),
                "buckets": self.buckets, "pieces_planned": self.pieces, "layers_planned": self.planned_layers,
                "layers": self.layers, "links": self.links}


def predict(shape: Shape, trainer: Trainer, engines: Engines, links: Links, *, name: str = "model",
            bucket_bytes: int = 256 << 20, full: bool = False) -> Prediction:
    """Plan the push (module doc) and predict its time."""
    if engines.count < 1 or engines.tp < 1 or engines.ep < 1:
        raise ValidationError("engines, engine tp and engine ep must be at least 1")
    if engines.first_gpu < 0:
        raise ValidationError(f"engines' first GPU must not be negative, got {engines.first_gpu}")
    if links.cpu_cores is not None and links.cpu_cores < 1:
        raise ValidationError(f"cpu cores must be at least 1 (or unset: no CPU bound), got {links.cpu_cores}")
    if min(links.cpu_tx_ns, links.cpu_rx_ns, links.cpu_bucket_us, links.push_latency_ms, links.check_gbyte,
           links.cpu_piece_us, links.cpu_push_us, links.cpu_rx_push_us, links.cpu_rx_bucket_us,
           links.cpu_rx_piece_us, links.cpu_control_us, links.agree_ms) < 0:
        raise ValidationError("CPU costs and latencies must not be negative")
    check_trainer(shape, trainer)
    stage_of = [0] * shape.layers if trainer.fsdp else _stages(shape.layers, trainer.pp)
    groups: dict[tuple[str, int], list[int]] = {}
    for i in range(shape.layers):
        groups.setdefault((shape.kind(i), stage_of[i]), []).append(i)
    reps = sorted(range(shape.layers)) if full else sorted(g[0] for g in groups.values())
    count = {i: 1 for i in range(shape.layers)} if full else {g[0]: len(g) for g in groups.values()}
    specs = shape.specs(reps)
    tensors = {n: (d, s) for n, d, s in specs}
    itemsize = {n: _itemsize(d) for n, d, _ in specs}
    haves = trainer_haves(shape, specs, trainer)
    layouts = engine_layouts(shape, specs, engines)
    plan = plan_transfers(haves, layouts, tensors, bucket_bytes=bucket_bytes, itemsize=itemsize)
    held: dict[int, int] = {}  # trainer rank -> bytes it holds (what its finite check reads)
    for h in haves:
        li = layer_index(h.name)
        held[h.rank] = held.get(h.rank, 0) + h.box.numel * itemsize[h.name] * (count[li] if li is not None else 1)
    return _time(plan, shape, name, trainer, engines, links, count, len(reps), held)


def _itemsize(dtype: str) -> int:
    sizes = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "float64": 8}
    if dtype not in sizes:
        raise ValidationError(f"dtype {dtype!r}: the planner knows {', '.join(sizes)}")
    return sizes[dtype]


def _check_seconds(links: Links, held: dict[int, int], node_of_rank: Callable[[int], int]) -> float:
    """The finite check before a push: every rank scans what it holds at once, each at `check_gbyte`; on a CPU
    host a node's ranks share its cores."""
    if not links.check_gbyte:
        return 0.0
    own = {r: b / (links.check_gbyte * GB) for r, b in held.items()}
    out = max(own.values(), default=0.0)
    if links.cpu_cores:
        per_node: dict[int, float] = {}
        for r, t in own.items():
            per_node[node_of_rank(r)] = per_node.get(node_of_rank(r), 0.0) + t
        out = max(out, max(per_node.values(), default=0.0) / links.cpu_cores)
    return out


def _time(plan: ShardPlan, shape: Shape, name: str, trainer: Trainer, engines: Engines, links: Links,
          count: dict[int, int], planned: int, held: dict[int, int]) -> Prediction:
    per_engine = engines.workers
    t_nodes = -(-trainer.world // trainer.per_node)

    def gpu_of_worker(engine: str, worker: int) -> int:
        return engines.first_gpu + int(engine[1:]) * per_engine + worker

    def node_of_rank(r: int) -> int:
        return 0 if links.one_host else r // trainer.per_node

    def node_of_worker(g: int) -> int:
        if links.one_host:
            return 0
        return g // engines.per_node if links.colocated else t_nodes + g // engines.per_node

    nic, nvl, cpy = links.nic_gbit * GB / 8, links.nvlink_gbyte * GB, links.copy_gbyte * GB
    load: dict[tuple[str, str], float] = {}  # (resource kind, owner) -> bytes
    sent: dict[int, int] = {}
    received: dict[str, int] = {}
    pieces: dict[str, int] = {}  # process ("trainer rank R" / "engine E worker W") -> pieces it sends or receives
    classes = {"same-gpu": 0, "intra-node": 0, "inter-node": 0}
    host: dict[int, float] = {}
    total = 0

    def add(key: tuple[str, str], b: int) -> None:
        load[key] = load.get(key, 0) + b

    for p in plan.pieces:
        li = layer_index(p.name)
        b = p.nbytes * (count[li] if li is not None else 1)
        total += b
        g = gpu_of_worker(p.engine, p.worker)
        sent[p.src] = sent.get(p.src, 0) + b
        wname = f"{p.engine}.w{p.worker}"
        received[wname] = received.get(wname, 0) + b
        n = count[li] if li is not None else 1
        for who in (f"trainer rank {p.src}", f"engine {p.engine} worker {p.worker}"):
            pieces[who] = pieces.get(who, 0) + n
        sn, dn = node_of_rank(p.src), node_of_worker(g)
        host[sn] = host.get(sn, 0) + b
        if dn != sn:
            host[dn] = host.get(dn, 0) + b
        if links.colocated and g == p.src:
            classes["same-gpu"] += b
            add(("copy", f"gpu {g}"), b)
        elif sn == dn:
            classes["intra-node"] += b
            add(("nvlink-tx", f"trainer rank {p.src}"), b)
            add(("nvlink-rx", f"engine {p.engine} worker {p.worker}"), b)
        else:
            classes["inter-node"] += b
            add(("nic-tx", f"trainer rank {p.src}"), b)
            add(("nic-rx", f"engine {p.engine} worker {p.worker}"), b)
    rate = {"copy": cpy, "nvlink-tx": nvl, "nvlink-rx": nvl, "nic-tx": nic, "nic-rx": nic}
    times = [(b / rate[k], k, who, b) for (k, who), b in load.items()]
    if links.host_gbyte is not None:
        times += [(b / (links.host_gbyte * GB), "host", f"node {n}", int(b)) for n, b in host.items()]
    secs, kind, who, nbytes = max(times) if times else (0.0, "none", "", 0)
    # buckets of the whole push: each planned bucket stands for the layers its pieces are from
    # lock step: a bucket takes its own busiest link's time, buckets one after another
    buckets = lockstep = 0.0
    part: dict[tuple[int, str], float] = {}  # (node, process) -> buckets it takes part in
    for idx in plan.buckets:
        layers = {layer_index(plan.pieces[i].name) for i in idx}
        weight = sum(count[li] if li is not None else 1 for li in layers) / len(layers)
        buckets += weight
        for proc in {(node_of_rank(plan.pieces[i].src), f"trainer rank {plan.pieces[i].src}") for i in idx} | {
                (node_of_worker(gpu_of_worker(plan.pieces[i].engine, plan.pieces[i].worker)),
                 f"engine {plan.pieces[i].engine} worker {plan.pieces[i].worker}") for i in idx}:
            part[proc] = part.get(proc, 0.0) + weight
        per: dict[tuple[str, str], int] = {}
        nodes: dict[int, int] = {}
        for i in idx:
            p = plan.pieces[i]
            g = gpu_of_worker(p.engine, p.worker)
            sn, dn = node_of_rank(p.src), node_of_worker(g)
            k = "copy" if links.colocated and g == p.src else "nvlink" if sn == dn else "nic"
            for key in ((k + "-tx" if k != "copy" else k, f"r{p.src}"), (k + "-rx", f"{p.engine}.{p.worker}")):
                if key[0] in rate:
                    per[key] = per.get(key, 0) + p.nbytes
            nodes[sn] = nodes.get(sn, 0) + p.nbytes
            if dn != sn:
                nodes[dn] = nodes.get(dn, 0) + p.nbytes
        t = max(b / rate[k] for (k, _), b in per.items())
        if links.host_gbyte is not None:
            t = max(t, max(nodes.values()) / (links.host_gbyte * GB))
        lockstep += weight * t
    procs = _processes(trainer.world, part, pieces, sent, received, node_of_rank,
                       lambda e, w: node_of_worker(gpu_of_worker(e, w)))
    if links.cpu_cores:
        cpu = _cpu_bound(links, procs)
        if cpu[0] > secs:
            secs, kind, who, nbytes = cpu
    check = _check_seconds(links, held, node_of_rank)
    latency = (buckets * links.bucket_latency_us * 1e-6 + links.push_latency_ms * 1e-3 + check
               + links.agree_ms * 1e-3 * max(trainer.world - 1, 0))
    model_bytes = shape.parameters() * _itemsize(shape.dtype)
    pred = Prediction(name, trainer.describe(), engines.describe(), model_bytes, total, sent, received, classes,
                      {"kind": kind, "who": who, "bytes": int(nbytes), "seconds": secs}, secs + latency, secs,
                      round(buckets, 1), len(plan.pieces), planned, shape.layers,
                      {"nic_GBps": nic / GB, "nvlink_GBps": nvl / GB, "copy_GBps": cpy / GB,
                       "host_GBps": links.host_gbyte or 0.0, "bucket_latency_us": links.bucket_latency_us,
                       "cpu_cores": links.cpu_cores or 0, "cpu_tx_ns": links.cpu_tx_ns, "cpu_rx_ns": links.cpu_rx_ns,
                       "cpu_bucket_us": links.cpu_bucket_us, "push_latency_ms": links.push_latency_ms,
                       "check_GBps": links.check_gbyte, "cpu_piece_us": links.cpu_piece_us,
                       "cpu_push_us": links.cpu_push_us, "cpu_rx_push_us": links.cpu_rx_push_us,
                       "cpu_rx_bucket_us": links.cpu_rx_bucket_us, "cpu_rx_piece_us": links.cpu_rx_piece_us,
                       "cpu_control_us": links.cpu_control_us, "agree_ms": links.agree_ms})
    pred.world = trainer.world
    pred.check_seconds = check
    pred.held = held
    pred.processes = procs
    pred.lockstep_seconds = max(lockstep, secs) + latency  # never below the all-at-once bound (CPU time counts)
    return pred


def _processes(world: int, part: dict[tuple[int, str], float], pieces: dict[str, int], sent: dict[int, int],
               received: dict[str, int], node_of_rank: Callable[[int], int],
               node_of_worker: Callable[[str, int], int]) -> dict[str, dict[str, float]]:
    """What each process does in a push: its node, bytes sent and received, buckets and pieces it takes part in
    (every trainer rank, also one that sends nothing, and every engine worker)."""
    out: dict[str, dict[str, float]] = {}
    for r in range(world):
        who = f"trainer rank {r}"
        node = node_of_rank(r)
        out[who] = {"node": node, "tx": sent.get(r, 0), "rx": 0, "buckets": part.get((node, who), 0.0),
                    "pieces": pieces.get(who, 0), "control": 0.0}
    control = 0.0
    for w, b in received.items():
        engine, _, worker = w.rpartition(".w")
        who = f"engine {engine} worker {worker}"
        node = node_of_worker(engine, int(worker))
        out[who] = {"node": node, "tx": 0, "rx": b, "buckets": part.get((node, who), 0.0),
                    "pieces": pieces.get(who, 0), "control": 0.0}
        control += out[who]["buckets"]
    if world:
        out["trainer rank 0"]["control"] = control
    return out


def cpu_seconds(links: Links, proc: dict[str, float]) -> float:
    """One process's CPU time in a push by the cpu model (`Links.cpu_*`)."""
    if proc["rx"]:
        return (proc["rx"] * links.cpu_rx_ns * 1e-9 + links.cpu_rx_push_us * 1e-6
                + proc["buckets"] * links.cpu_rx_bucket_us * 1e-6 + proc["pieces"] * links.cpu_rx_piece_us * 1e-6)
    return (proc["tx"] * links.cpu_tx_ns * 1e-9 + links.cpu_push_us * 1e-6
            + proc["buckets"] * links.cpu_bucket_us * 1e-6 + proc["pieces"] * links.cpu_piece_us * 1e-6
            + proc["control"] * links.cpu_control_us * 1e-6)


def _cpu_bound(links: Links, procs: dict[str, dict[str, float]]) -> tuple[float, str, str, int]:
    """(seconds, kind, who, bytes) of the CPU bound: per node, its processes' CPU time over its cores, or one
    process's own time where that is longer (a process runs on one core at a time)."""
    assert links.cpu_cores
    per_node: dict[int, float] = {}
    nbytes: dict[int, int] = {}
    out: list[tuple[float, str, str, int]] = []
    for who, p in procs.items():
        t, b, node = cpu_seconds(links, p), int(p["tx"] + p["rx"]), int(p["node"])
        per_node[node] = per_node.get(node, 0.0) + t
        nbytes[node] = nbytes.get(node, 0) + b
        out.append((t, "cpu-process", who, b))
    out += [(t / min(links.cpu_cores, sum(1 for p in procs.values() if p["node"] == n)), "cpu", f"node {n}",
             nbytes[n]) for n, t in per_node.items()]
    return max(out)
