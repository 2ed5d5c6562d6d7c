"""Megatron-core helpers: HF -> Megatron loading, tiny CPU models, and a gloo process launcher.

* `load_hf_weights(model, hf_state)` fills a (sharded) megatron-core GPTModel with an HF state dict: each
  rank takes its TP / PP / EP shard. It is how tests build models holding known weights, and how an HF
  checkpoint is imported. `export_hf(model)` is the other way: the full HF state dict on rank 0, through
  the same gathers and conversions as a push.
* `TinyModel` describes a small model of one architecture: its HF checkpoint specs and the matching
  megatron-core `GPTModel` (local layer spec, `use_cpu_initialization`, bf16 parameters), built by
  `build_model` under the current `parallel_state`.
* `launch(fn, world_size, ...)` runs `fn` in that many spawned processes joined by gloo, with timeouts
  everywhere; `run_cases` is the worker the multi-process tests use (build, load, push, compare).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..convert import Dims, canonical_arch, detect_arch, get_converter, tp_split
from ..errors import StreamSyncError, ValidationError
from ..sources.megatron import global_parameters, topology, unwrap_chunks
from .models import Spec, StateModule

# ------------------------------------------------------------------------------------------ HF -> Megatron


def load_hf_weights(model: object, hf_state: Mapping[str, torch.Tensor], *, arch: str | None = None,
                    vocab_size: int | None = None) -> int:
    """Copy `hf_state` (full HF tensors, checkpoint names) into this rank's shards of `model`.

    Every parameter of the model must be found (ValidationError otherwise); the vocabulary is padded with
    zero rows to megatron's size; norms become float32 where megatron keeps them so. Issues no collective.
    Returns the number of parameters written.
    """
    chunks = unwrap_chunks(model)
    first = chunks[0]
    cfg = first.config
    tied = bool(getattr(first, "share_embeddings_and_output_weights", False))
    conv = get_converter(canonical_arch(arch) if arch else detect_arch(cfg), tied=tied)
    vocab = vocab_size or hf_state["model.embed_tokens.weight"].shape[0]
    dims = Dims(cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, cfg.kv_channels, vocab)
    coords, groups = topology(first)
    n = 0
    with torch.no_grad():
        for name, p, expert in global_parameters(chunks):
            size, rank = (groups.etp_size, coords.etp) if expert else (groups.tp_size, coords.tp)
            layout = None
            if size > 1 and getattr(p, "tensor_model_parallel", False):
                r = conv.resolve(name)
                if r.mapping.tp is None or (p.partition_dim, p.partition_stride) != (r.mapping.tp.dim,
                                                                                      r.mapping.tp.stride):
                    raise ValidationError(f"{name!r}: megatron splits dim {p.partition_dim} stride "
                                          f"{p.partition_stride}, the table says {r.mapping.tp}")
                layout = r.mapping.tp
            full_shape = list(p.shape)
            if layout is not None:
                full_shape[layout.dim] *= size
            full = conv.to_megatron(name, hf_state, dims, tuple(full_shape))
            shard = tp_split(full, layout, size)[rank]
            if tuple(shard.shape) != tuple(p.shape):
                raise ValidationError(f"{name!r}: HF gives a {tuple(shard.shape)} shard, megatron holds "
                                      f"{tuple(p.shape)}")
            p.data.copy_(shard)
            n += 1
    return n


async def export_hf_async(model: object, *, chunk_bytes: int = 256 << 20,
                          **options: Any) -> dict[str, torch.Tensor] | None:
    """The full HF state dict of a (sharded) megatron model, through the same gathers and conversions as a push.

    Collective: every rank of the default group calls it. Returns the tensors (copies, on the model's device)
    on the sender, global rank 0, and None elsewhere. `options` go to MegatronSource (arch, dtype,
    hf_config, vocab_size, ...).
    """
    from ..sources.megatron import MegatronSource

    source = MegatronSource(model, **options)
    out: dict[str, torch.Tensor] = {}
    for plan in source.plan(chunk_bytes):
        gathered = await source.gather(plan)
        if source.is_sender:
            tensors = await source.convert(plan, gathered)
            out.update((s.name, t.reshape(s.shape).clone()) for s, t in zip(plan.specs, tensors, strict=True))
    return out if source.is_sender else None


def export_hf(model: object, **options: Any) -> dict[str, torch.Tensor] | None:
    """`export_hf_async` for code outside an event loop."""
    import functools

    import anyio

    return anyio.run(functools.partial(export_hf_async, model, **options))


# ------------------------------------------------------------------------------------------ tiny models


@dataclass(frozen=True)
class TinyModel:
    """A small model of one architecture, on both sides: HF checkpoint specs and a megatron GPTModel."""

    arch: str = "qwen3"
    vocab: int = 128
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    experts: int = 0
    moe_ffn: int = 32
    tie: bool = False
    dtype: str = "bfloat16"

    def hf_specs(self) -> list[Spec]:
        """HF checkpoint names, dtypes and shapes (per-expert MoE tensors, as vLLM loads them)."""
        arch = canonical_arch(self.arch)
        d, h, hd = self.dtype, self.hidden, self.head_dim
        s: list[Spec] = [("model.embed_tokens.weight", d, (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            s += [(p + "input_layernorm.weight", d, (h,)),
                  (p + "self_attn.q_proj.weight", d, (self.heads * hd, h)),
                  (p + "self_attn.k_proj.weight", d, (self.kv_heads * hd, h)),
                  (p + "self_attn.v_proj.weight", d, (self.kv_heads * hd, h))]
            if arch == "qwen2":
                s += [(p + "self_attn.q_proj.bias", d, (self.heads * hd,)),
                      (p + "self_attn.k_proj.bias", d, (self.kv_heads * hd,)),
                      (p + "self_attn.v_proj.bias", d, (self.kv_heads * hd,))]
            if arch in ("qwen3", "qwen3-moe"):
                s += [(p + "self_attn.q_norm.weight", d, (hd,)), (p + "self_attn.k_norm.weight", d, (hd,))]
            s += [(p + "self_attn.o_proj.weight", d, (h, self.heads * hd)),
                  (p + "post_attention_layernorm.weight", d, (h,))]
            if arch == "qwen3-moe":
                s.append((p + "mlp.gate.weight", d, (self.experts, h)))
                for e in range(self.experts):
                    q = f"{p}mlp.experts.{e}."
                    s += [(q + "gate_proj.weight", d, (self.moe_ffn, h)), (q + "up_proj.weight", d, (self.moe_ffn, h)),
                          (q + "down_proj.weight", d, (h, self.moe_ffn))]
            else:
                s += [(p + "mlp.gate_proj.weight", d, (self.ffn, h)), (p + "mlp.up_proj.weight", d, (self.ffn, h)),
                      (p + "mlp.down_proj.weight", d, (h, self.ffn))]
        s.append(("model.norm.weight", d, (h,)))
        if not self.tie:
            s.append(("lm_head.weight", d, (self.vocab, h)))
        return s

    def hf_state(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random HF weights, the same in every process for the same seed."""
        return dict(StateModule(self.hf_specs(), fill="random", seed=seed).state_dict())

    def hf_config(self) -> dict[str, Any]:
        """The HF config fields MegatronSource reads (`hf_config=` accepts a dict or a transformers config)."""
        model_type = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3-moe": "qwen3_moe"}
        return {"model_type": model_type[canonical_arch(self.arch)], "vocab_size": self.vocab,
                "tie_word_embeddings": self.tie, "dtype": self.dtype}

    def padded_vocab(self, tp: int, divisible_by: int = 8) -> int:
        """Megatron's vocabulary: rounded up to a multiple of divisible_by x TP (as Megatron-LM pads it)."""
        m = divisible_by * tp
        return (self.vocab + m - 1) // m * m

    def transformer_config(self, **overrides: Any) -> Any:
        """The megatron-core TransformerConfig, with the parallel sizes of the current parallel_state."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_config import TransformerConfig

        arch = canonical_arch(self.arch)
        dtype = getattr(torch, self.dtype)
        kw: dict[str, Any] = dict(
            num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
            num_query_groups=self.kv_heads, kv_channels=self.head_dim, ffn_hidden_size=self.ffn,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, add_qkv_bias=arch == "qwen2", qk_layernorm=arch in ("qwen3", "qwen3-moe"),
            use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        )
        if arch == "qwen3-moe":
            kw.update(num_moe_experts=self.experts, moe_ffn_hidden_size=self.moe_ffn, moe_router_topk=2,
                      moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")
        kw.update(overrides)
        return TransformerConfig(**kw)


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, vpp: int | None = None) -> None:
    """(Re)initialize megatron's parallel_state on the already-initialized default process group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp, create_gloo_process_groups=False)


def build_model(tiny: TinyModel, *, divisible_by: int = 8, **config: Any) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks (one per virtual pipeline stage) under the current parallel_state.
    `config` overrides TransformerConfig fields (e.g. `use_cpu_initialization=False` to build on the GPU)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = tiny.transformer_config(**config)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for v in range(vpp or 1):
        stage = v if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        # Tied embeddings over PP: megatron copies the embedding to the last stage with an all-reduce that
        # moves it to CUDA first. On CPU skip that; load_hf_weights fills both copies anyway.
        orig = LanguageModule._is_in_embd_group
        LanguageModule._is_in_embd_group = lambda self: False  # type: ignore[method-assign]
        try:
            chunks.append(GPTModel(cfg, spec, vocab_size=tiny.padded_vocab(cfg.tensor_model_parallel_size,
                                                                            divisible_by),
                                   max_sequence_length=256, pre_process=pre, post_process=post,
                                   share_embeddings_and_output_weights=tiny.tie, position_embedding_type="rope",
                                   vp_stage=stage))
        finally:
            LanguageModule._is_in_embd_group = orig  # type: ignore[method-assign]
    return chunks


# ------------------------------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, timeout: float, fn: Callable[..., Any], args: tuple,
            results: Any, backend: str = "gloo") -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
           collective_timeout: float = 60.0, backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes joined by gloo (or NCCL, rank r on
    GPU r); results by rank.

    `fn` must be importable (module level). Raises StreamSyncError with the workers' tracebacks if any
    failed, or after `timeout` seconds (the workers are killed). Collectives time out after
    `collective_timeout`, so a rank that dies cannot hang the others forever.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, collective_timeout, fn, args, results, backend),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StreamSyncError(f"workers did not finish within {timeout:.0f}s "
                                      f"({len(out)} of {world_size} reported)" + "".join(errors))
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: check for workers that died without reporting
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and len(out) + len(errors) < world_size and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        raise StreamSyncError(f"worker(s) died: exit codes {[p.exitcode for p in procs]}"
                                              + "".join(errors)) from None
                continue
            if ok:
                out[rank] = value
            else:
                errors.append(f"\n--- rank {rank} ---\n{value}")
        if errors:
            raise StreamSyncError("worker(s) failed:" + "".join(errors))
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)


# ------------------------------------------------------------------------------------------ test cases


@dataclass(frozen=True)
class Case:
    """One multi-process push: a tiny model under one parallel layout, into one receiver."""

    name: str
    model: TinyModel
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    seed: int = 0
    chunk_bytes: int = 32 << 10
    coalesce: bool = True
    pushes: int = 1
    every_rank_sends: bool = False  # each rank pushes into its own receiver (`receivers[f"{name}@{rank}"]`)
    blocking: bool = False  # push through BlockingWeightSync from plain Python (no anyio.run) on every rank


@dataclass
class CaseResult:
    name: str
    rank: int
    exact: bool | None = None            # sender only: receiver checksums == HF state's
    export_exact: bool | None = None     # sender only: export_hf(model) == HF state, bit for bit
    mismatched: list[str] = field(default_factory=list)
    collectives: list[int] = field(default_factory=list)   # per push
    setup_collectives: list[int] = field(default_factory=list)
    events: list[tuple[int, str, str]] = field(default_factory=list)  # of the first push
    chunks: int = 0
    params: int = 0                      # Megatron parameters in the plan
    tp_params: int = 0                   # of which split over TP / expert TP
    trace_collectives: int | None = None
    #: the first push's plan: per chunk, [global name, dtype, stage, expert, split over (expert-)TP] per key
    plan: list[list[tuple[str, str, int, bool, bool]]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    is_sender: bool = False


def run_cases(rank: int, world_size: int, cases: Sequence[Case],
              receivers: Mapping[str, tuple[int, str]]) -> list[dict]:
    """Worker: for each case, set up parallel_state, build the model, load its HF weights, push (the sender into
    the receiver at `receivers[case.name]`, the other ranks with no engines; with `every_rank_sends` each rank
    into the receiver at `receivers[f"{case.name}@{rank}"]`; each a (port, secret)) and report (`CaseResult`
    dicts)."""
    import anyio
    import torch.distributed as dist

    from ..blocking import BlockingWeightSync
    from ..checksum import digests
    from ..engines.process import ReceiverEngine
    from ..sources.megatron import MegatronSource
    from ..sync import PushReport, WeightSync

    out = []
    for case in cases:
        init_parallel(case.tp, case.pp, case.ep, case.etp, case.vpp)
        model = build_model(case.model)
        hf = case.model.hf_state(seed=case.seed)
        load_hf_weights(model, hf)
        res = CaseResult(case.name, rank)
        if case.every_rank_sends:
            target = receivers.get(f"{case.name}@{rank}")
        else:
            target = receivers[case.name] if rank == 0 else None
        engines = ([ReceiverEngine("127.0.0.1", target[0], secret=target[1], timeout=60)]
                   if target is not None else [])
        options = {"hf_config": case.model.hf_config(), "coalesce": case.coalesce,
                   "every_rank_sends": case.every_rank_sends}

        def record(i: int, report: PushReport, source: MegatronSource, case: Case = case,
                   res: CaseResult = res) -> None:
            res.collectives.append(report.collectives)
            res.setup_collectives.append(source.setup_collectives)
            res.seconds.append(report.seconds)
            if i == 0:
                res.events = list(source.events)
                res.chunks = report.chunks
                res.params = len(source.sent)
                res.tp_params = sum(1 for x in source.table.values() if x.tp is not None)
                res.is_sender = source.is_sender
                assert report.trace is not None
                res.trace_collectives = report.trace.counts.get("collectives")
                res.plan = [[(k, str(source.table[k].dtype).removeprefix("torch."), source.table[k].stage,
                              source.table[k].expert, source.table[k].tp is not None) for k in p.keys]
                            for p in source.plan(case.chunk_bytes)]

        def step(i: int, case: Case = case, model: list = model) -> dict[str, torch.Tensor]:
            """A training step: new weights, so a push that skipped a tensor would show."""
            hf = case.model.hf_state(seed=case.seed + 1000 * i)
            load_hf_weights(model, hf)
            return hf

        def check(got: dict[str, str], hf: dict[str, torch.Tensor], res: CaseResult = res) -> None:
            want = digests(hf.items())
            res.mismatched = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
            res.exact = not res.mismatched

        async def main(case: Case = case, model: list = model, hf: dict[str, torch.Tensor] = hf,
                       engines: list = engines, options: dict = options) -> dict[str, torch.Tensor]:
            sync = WeightSync(engines, chunk_bytes=case.chunk_bytes, timeout=60, source_options=options)
            for i in range(case.pushes):
                # first push: an explicit MegatronSource (to read its counters); later ones: the model itself,
                # as trainers call it (as_source -> MegatronSource, metadata from the cache)
                if i:
                    hf = step(i)
                source = MegatronSource(model, **options)
                record(i, await sync.push(source if i == 0 else model), source)
            if engines:
                check(await engines[0].checksums(), hf)
            await sync.close()
            return hf

        def blocking(case: Case = case, model: list = model, hf: dict[str, torch.Tensor] = hf,
                     engines: list = engines, options: dict = options) -> dict[str, torch.Tensor]:
            """The same pushes from a plain synchronous loop, as Megatron-style trainers are written."""
            with BlockingWeightSync(engines, chunk_bytes=case.chunk_bytes, timeout=60,
                                    source_options=options) as sync:
                for i in range(case.pushes):
                    if i:
                        hf = step(i)
                    source = MegatronSource(model, **options)
                    record(i, sync.push(source if i == 0 else model), source)
                if engines:
                    check(sync.call(engines[0].checksums), hf)
            return hf

        hf = blocking() if case.blocking else anyio.run(main)
        exported = export_hf(model, hf_config=case.model.hf_config())
        if exported is not None:
            res.export_exact = digests(exported.items()) == digests(hf.items())
        out.append(asdict(res))
        dist.barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return out


__all__ = ["Case", "CaseResult", "TinyModel", "build_model", "export_hf", "export_hf_async", "free_port",
           "init_parallel", "launch", "load_hf_weights", "run_cases"]


def ddp_one_copy_pushes(rank: int, world_size: int, tiny: TinyModel, port: int, secret: str, pushes: int = 3
                        ) -> dict[str, Any]:
    """A `launch` worker (GPU tests): `tiny` as a megatron-core GPTModel on this rank's GPU, wrapped in Megatron's
    DDP with the distributed optimizer (every parameter becomes a view of one contiguous buffer per dtype),
    pushed `pushes` times over CUDA IPC into the receiver at `port`, every weight changed between pushes.
    Returns the parameter and storage counts, the sender's exports and references, and per push whether the
    receiver's checksums equal the trainer's HF export."""
    import anyio
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from ..checksum import device_digests
    from ..engines.process import ReceiverEngine
    from ..sync import WeightSync
    from ..transports.cuda_ipc import CudaIpcTransport

    init_parallel(tp=1)
    model = build_model(tiny)[0].cuda()
    load_hf_weights(model, tiny.hf_state(seed=3))
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                    model)
    params = list(model.parameters())
    out: dict[str, Any] = {"params": len(params), "storages": len({p.untyped_storage().data_ptr() for p in params}),
                           "exact": []}

    async def main() -> None:
        engine = ReceiverEngine("127.0.0.1", port, secret=secret, timeout=120)
        transport = CudaIpcTransport()
        sync = WeightSync([engine], transport=transport, chunk_bytes=1 << 20)
        for step in range(pushes):
            if step:
                torch.manual_seed(step)
                with torch.no_grad():
                    for p in params:
                        p.add_(torch.randn_like(p), alpha=0.01)
            await sync.push(model)
            hf = await export_hf_async(model)
            assert hf is not None
            out["exact"].append(await engine.checksums(device=True) == device_digests(hf.items()))
        out["exports"] = int(transport.ref_stats["exports"])
        out["referenced"] = int(transport.ref_stats["referenced"])
        await sync.close()

    anyio.run(main)
    return out
