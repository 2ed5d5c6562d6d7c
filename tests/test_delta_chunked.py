"""The chunked shadow: a chunk's delta in a few launches per chunk, decoded by the per-tensor codec, checked by
wsum64; the same code on the CPU here and on the trainer's GPU (the gpu-marked test)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from streamsync.delta.chunked import ChunkShadow
from streamsync.delta.codec import PIECES, check_digest, decode_into, digest
from streamsync.delta.shadow import Shadow
from streamsync.delta.wsum import BLOCK, wsum64
from streamsync.errors import ValidationError
from streamsync.pack import TensorSpec, dtype_name
from streamsync.plan.chunk import ChunkPlan

# sizes around the block and the mask's byte boundaries; dtypes of every element width a chunk mixes
SPECS = [("a", torch.bfloat16, (3, 5)), ("b", torch.bfloat16, (BLOCK + 7,)), ("c", torch.float32, (129, 1000)),
         ("d", torch.bfloat16, (0,)), ("e", torch.float16, (2 * BLOCK,)), ("f", torch.float8_e4m3fn, (1000,)),
         ("g", torch.bfloat16, (300, 700)), ("h", torch.bool, (77,)), ("i", torch.float64, (5000,))]


def _plan() -> ChunkPlan:
    specs = tuple(TensorSpec(n, d, s) for n, d, s in SPECS)
    return ChunkPlan(0, specs, tuple(s.name for s in specs))


def _tensors(gen: torch.Generator, device: str) -> list[torch.Tensor]:
    out = []
    for _, dtype, shape in SPECS:
        t = torch.randn(shape, generator=gen) * 0.02
        out.append((t > 0 if dtype == torch.bool else t.to(dtype)).to(device))
    return out


def _step(ts: list[torch.Tensor], density: float, gen: torch.Generator) -> list[torch.Tensor]:
    """Each tensor with about `density` of its elements given new bits (a NaN among them)."""
    out = []
    for t in ts:
        new = t.clone()
        if t.numel():
            m = (torch.rand(t.shape, generator=gen) < density).to(t.device)
            if t.dtype == torch.bool:
                new[m] = ~new[m]
            else:
                new[m] = (new[m].float() + 0.25).to(t.dtype)
                if m.any() and t.dtype.is_floating_point and t.dtype.itemsize > 1:
                    new.view(-1)[int(m.view(-1).nonzero()[0])] = float("nan")
        out.append(new)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _round_trip(device: str, fused: bool | None = None) -> None:
    gen = torch.Generator().manual_seed(7)
    plan = _plan()
    shadow = ChunkShadow(plan, torch.device(device), fused=fused)
    held = _tensors(gen, device)  # what the receiver holds
    shadow.seed(held)
    encodings = set()
    for density in (0.0, 1e-3, 0.03, 0.3, 1.0):
        new = _step(held, density, gen)
        out = shadow.encode(new, verify=True)
        for i, ((e, dig), t) in enumerate(zip(out, new, strict=True)):
            encodings.add(e.enc)
            made = held[i].clone()
            decode_into(made.view(-1), e.enc, e.changed, dict(zip(PIECES[e.enc], e.pieces, strict=True)))
            assert _same_bits(made, t), (SPECS[i], density, e.enc)
            assert _same_bits(shadow.view(i), t), (SPECS[i], density, "the shadow holds the new tensor")
            if shadow.fused:
                assert dig == digest(t, "wsum64") == f"wsum64:{wsum64(made):016x}"
            check_digest(made, dig, SPECS[i][0])
        held = new
    assert encodings == {"same", "idx16", "mask", "full"}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "tensor-by-tensor"])
def test_a_chunk_delta_decodes_bit_for_bit_at_every_density_and_element_width(fused):
    _round_trip("cpu", fused)


@pytest.mark.gpu
def test_a_chunk_delta_on_the_gpu_decodes_bit_for_bit_at_every_density_and_element_width():
    _round_trip("cuda")


def test_wsum64_changes_with_any_one_element_and_with_two_that_trade_places():
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(3 * BLOCK + 11, generator=gen).to(torch.bfloat16)
    h = wsum64(t)
    for pos in (0, 1, BLOCK - 1, BLOCK, 2 * BLOCK + 5, t.numel() - 1):
        u = t.clone()
        u.view(torch.int16)[pos] ^= 1  # one bit of one element
        assert wsum64(u) != h, pos
    u = t.clone()
    u[[10, BLOCK + 3]] = t[[BLOCK + 3, 10]]
    assert not torch.equal(u, t) and wsum64(u) != h
    assert wsum64(t.view(1, -1)) == h  # bytes only: the receiver checks dtype and shape itself


def test_a_digest_that_does_not_match_is_refused_naming_the_tensor():
    t = torch.arange(100, dtype=torch.float32)
    dig = digest(t, "wsum64")
    t[50] = float("nan")
    with pytest.raises(ValidationError, match=r"'w\.q' made from the delta does not match"):
        check_digest(t, dig, "w.q")


def test_a_cpu_trainer_keeps_its_shadow_on_the_host_and_a_changed_plan_makes_it_anew():
    plan = _plan()
    sh = Shadow()
    assert sh.prepare([plan], torch.device("cpu")) and sh.where == "host"
    assert not sh.prepare([plan], torch.device("cpu"))
    # the served tensors, each rounded up to whole blocks (a group of one element size takes one block at least)
    rounded = sum(-(-math.prod(s.shape) // BLOCK) * BLOCK * s.dtype.itemsize for s in plan.specs)
    assert rounded <= sh.nbytes <= rounded + 8 * BLOCK and set(sh.tensors) == {n for n, _, _ in SPECS}
    other = ChunkPlan(0, plan.specs[:-1], plan.keys[:-1])
    assert sh.prepare([other], torch.device("cpu")) and sh.held is None


@pytest.mark.gpu
def test_a_gpu_trainer_keeps_its_shadow_on_its_gpu_unless_the_bound_says_host():
    plan = _plan()
    sh = Shadow()
    assert sh.prepare([plan], torch.device("cuda", 0)) and sh.where == "cuda:0"
    assert all(g.buf.is_cuda for c in sh.chunks.values() for g in c.groups)
    bounded = Shadow(device_bytes=0)
    assert bounded.prepare([plan], torch.device("cuda", 0))
    assert bounded.where.startswith("host (pinned)") and "shadow_device_bytes=0" in bounded.where
    assert all(g.buf.is_pinned() for c in bounded.chunks.values() for g in c.groups)


_KERNEL = """
import torch
from streamsync.delta import wsum

gen = torch.Generator().manual_seed(5)
for dtype in (torch.int16, torch.int8, torch.int32, torch.int64):
    info = torch.iinfo(dtype)
    words = torch.randint(info.min, info.max, (3 * wsum.BLOCK,), generator=gen, dtype=torch.int64).to(dtype)
    words[:8] = info.max  # the extremes: products and sums wrap the same way on both paths
    words[8:16] = info.min
    words = words.to(DEV)
    got = wsum.block_sums(words)
    assert not wsum._broken, wsum._broken
    wsum._broken.append("compare with torch's products")
    want = wsum.block_sums(words)
    wsum._broken.clear()
    assert all((g == w).all() for g, w in zip(got, want)), dtype
    part = wsum.block_sums(words, slice(1, 3))
    assert (part[0] == want[0][1:]).all() and (part[1] == want[1][1:]).all()
print("sums equal")
"""


@pytest.mark.timeout(300)
def test_the_wsum64_kernel_sums_blocks_as_torch_does_in_the_interpreter():
    pytest.importorskip("triton")
    assert "sums equal" in _run_fresh("DEV = 'cpu'\n" + textwrap.dedent(_KERNEL), interpret=True)


@pytest.mark.gpu
def test_the_wsum64_kernel_sums_blocks_as_torch_does_compiled():
    pytest.importorskip("triton")
    assert "sums equal" in _run_fresh("DEV = 'cuda'\n" + textwrap.dedent(_KERNEL), interpret=False)


def _run_fresh(code: str, interpret: bool) -> str:
    """Run `code` in a fresh Python (Triton reads TRITON_INTERPRET at import); its stdout, once it exited 0."""
    env = {**os.environ, "TRITON_INTERPRET": "1"} if interpret else None
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_pieces_that_do_not_fit_the_tensor_are_refused_before_anything_is_written():
    n = BLOCK + 10
    base = torch.zeros(n, dtype=torch.bfloat16)
    val = torch.ones(2, dtype=torch.bfloat16)
    pos = torch.tensor([3, 5], dtype=torch.int16)
    bad = {
        "block counts sum to 1": ("idx16", 2, {"counts": torch.tensor([1, 0], dtype=torch.int32), "pos": pos,
                                               "val": val}),
        "least -1": ("idx16", 2, {"counts": torch.tensor([3, -1], dtype=torch.int32), "pos": pos, "val": val}),
        f"position {BLOCK + 11} outside": ("idx16", 2, {"counts": torch.tensor([1, 1], dtype=torch.int32),
                                                        "pos": torch.tensor([3, 11], dtype=torch.int16),
                                                        "val": val}),
        "carries 2 values": ("idx16", 3, {"counts": torch.tensor([3, 0], dtype=torch.int32), "pos": pos,
                                          "val": val}),
        "marks 1 elements": ("mask", 2, {"mask": torch.zeros(-(-n // 8), dtype=torch.uint8).index_fill_(0,
                                                                                    torch.tensor([0]), 1),
                                         "val": val}),
        "needs pieces": ("mask", 2, {"val": val}),
        "full delta of 2 elements": ("full", 2, {"val": val}),
    }
    for why, (enc, changed, pieces) in bad.items():
        with pytest.raises(ValidationError, match=why):
            decode_into(base, enc, changed, pieces)
        assert not base.any(), why


@pytest.mark.gpu
def test_a_receiver_on_a_gpu_keeps_its_base_there_where_it_fits_and_decodes_a_delta_there():
    from streamsync.receiver.base_copy import BaseCopy

    plan = _plan()
    gen = torch.Generator().manual_seed(11)
    held = _tensors(gen, "cuda")
    need = sum(t.numel() * t.element_size() for t in held)
    for engine_base, on in (("host", "cpu"), ("auto", "cuda")):
        base = BaseCopy("cuda")
        info = {"version": 1, "push_id": "p1", "chunk": 0}
        base.note(info, {"chunks": 1, "keep": True, "bytes": need, "engine_base": engine_base})
        list(base.tee(zip((s.name for s in plan.specs), held, strict=True)))
        base.end_round(finished=True)
        assert base.held == (1, "p1") and base.on.type == on and all(t.device.type == on for t in base.tensors.values())
    shadow = ChunkShadow(plan, torch.device("cuda"))
    shadow.seed(held)
    new = _step(held, 0.03, gen)
    entries, views = [], []
    for s, (e, dig) in zip(plan.specs, shadow.encode(new, verify=True), strict=True):
        entries.append([s.name, dtype_name(s.dtype), list(s.shape), None, e.enc, e.changed, dig])
        views += [(f"{s.name}#{p}", t) for p, t in zip(PIECES[e.enc], e.pieces, strict=True)]
    base.note({"version": 2, "push_id": "p2", "chunk": 0}, {"chunks": 1, "base": [1, "p1"], "entries": entries})
    made = dict(base.apply(views, {"entries": entries}))
    for s, t in zip(plan.specs, new, strict=True):
        assert made[s.name].is_cuda and _same_bits(made[s.name], t), s.name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_delta_is_decoded_in_place_into_tensors_the_loader_holds_as_sent_row_parts_included(device):
    """Where the loader holds a tensor as sent (`Loader.direct`), a full push keeps no copy of it and a delta is
    decoded straight into it, bit for bit, a tensor sent in row parts over two chunks too; a tensor changed there
    since refuses the delta before any byte of the chunk is written; the others keep their copy."""
    from streamsync.delta.codec import DeltaRefused
    from streamsync.receiver.base_copy import BaseCopy

    gen = torch.Generator().manual_seed(13)
    plan = _plan()
    held = _tensors(gen, device)
    own = {s.name: t.clone() for s, t in zip(plan.specs, held, strict=True) if s.name != "c"}  # "c": no direct view

    def loaded(weights) -> None:  # what the loader does with what it is handed: copies into its own tensors
        for n, t in weights:
            own[n].copy_(t) if n in own else None

    base = BaseCopy(device)
    base.note({"version": 1, "push_id": "p1", "chunk": 0}, {"chunks": 1, "keep": True})
    loaded(base.tee(zip((s.name for s in plan.specs), held, strict=True), own.get))
    base.end_round(finished=True)
    assert set(base.tensors) == {"c"} and set(base.own) == set(own)
    assert base.in_place_bytes == sum(t.numel() * t.element_size() for t in own.values())

    shadow = ChunkShadow(plan, torch.device(device))
    shadow.seed(held)
    for version in (2, 3):
        new = _step(held, 0.03, gen)
        rows: list[list[list]] = [[[], []], [[], []]]  # two chunks: "g" in row parts, the rest in the first
        for s, (e, dig) in zip(plan.specs, shadow.encode(new, verify=True), strict=True):
            pieces = dict(zip(PIECES[e.enc], e.pieces, strict=True))
            if s.name != "g":
                rows[0][0].append([s.name, dtype_name(s.dtype), list(s.shape), None, e.enc, e.changed, dig])
                rows[0][1].extend((f"{s.name}#{p}", t) for p, t in pieces.items())
                continue
            t, old = new[plan.specs.index(s)], held[plan.specs.index(s)]
            for k, (a, b) in enumerate(((0, 100), (100, 300))):  # each part its own full-row delta
                rows[k][0].append([s.name, dtype_name(s.dtype), [b - a, 700], [a, 300], "full", (b - a) * 700,
                                   digest(t[a:b], "wsum64")])
                rows[k][1].append((f"{s.name}#val", t[a:b].reshape(-1)))
                assert not _same_bits(old[a:b], t[a:b])
        for k, (entries, views) in enumerate(rows):
            base.note({"version": version, "push_id": f"p{version}", "chunk": k},
                      {"chunks": 2, "base": [version - 1, f"p{version - 1}"], "entries": entries})
            handed = base.apply(views, {"entries": entries}, direct=own.get)
            loaded(handed)
            assert [n for n, _ in handed] == (["c"] if k == 0 else [])
            assert {n for n, _ in base.placed} == ({s.name for s in plan.specs} - {"c", "g"} if k == 0 else {"g"})
        base.end_round(finished=True)
        for s, t in zip(plan.specs, new, strict=True):
            got = own[s.name] if s.name in own else base.tensors[s.name].to(device)  # the copy: on the host
            assert _same_bits(got, t), (version, s.name)
        held = new
    assert base.held == (3, "p3")

    own["b"].view(torch.int16).view(-1)[5] ^= 1  # written behind the receiver's back
    new = _step(held, 0.03, gen)
    entries, views = [], []
    for s, (e, dig) in zip(plan.specs, shadow.encode(new, verify=True), strict=True):
        entries.append([s.name, dtype_name(s.dtype), list(s.shape), None, e.enc, e.changed, dig])
        views += [(f"{s.name}#{p}", t) for p, t in zip(PIECES[e.enc], e.pieces, strict=True)]
    before = {n: t.clone() for n, t in own.items()}
    base.note({"version": 4, "push_id": "p4", "chunk": 0}, {"chunks": 1, "base": [3, "p3"], "entries": entries})
    with pytest.raises(DeltaRefused, match=r"'b'.*own copy"):
        base.apply(views, {"entries": entries}, direct=own.get)
    assert all(_same_bits(own[n], before[n]) for n in own)  # nothing of the chunk was written


def test_tied_tensors_are_never_held_in_place_since_a_delta_into_one_would_change_the_other():
    from streamsync.receiver.loaders import ModuleLoader

    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False),
                                 "norm": torch.nn.LayerNorm(4)})
    model["head"].weight = model["embed"].weight
    loader = ModuleLoader(model)
    assert loader.direct("embed.weight") is None and loader.direct("head.weight") is None
    assert loader.direct("norm.weight").data_ptr() == model["norm"].weight.data_ptr()


def test_a_tensor_sent_as_a_blocked_view_is_held_in_place_and_takes_its_next_delta():
    """A full push may hand the loader a blocked view (Q as rows of megatron's interleaved QKV: its HF tensor's
    row-major order in another shape, not contiguous); the in-place fingerprint is of the elements in that order,
    so the next delta finds the loader's tensor unchanged."""
    from streamsync.receiver.base_copy import BaseCopy

    qkv = torch.randn(2, 5, 4).to(torch.bfloat16)
    q = qkv[:, :3, :]  # the two groups' 3 Q rows: 6 rows of the HF tensor
    own = {"q": torch.empty(6, 4, dtype=torch.bfloat16)}
    base = BaseCopy("cpu")
    base.note({"version": 1, "push_id": "p1", "chunk": 0}, {"chunks": 1, "keep": True})
    for n, t in base.tee([("q", q)], own.get):
        own[n].copy_(t.reshape(6, 4))
    base.end_round(finished=True)
    new = own["q"].clone()
    new[2, 1] = 7.0
    entry = ["q", "bfloat16", [6, 4], None, "full", 24, digest(new)]
    base.note({"version": 2, "push_id": "p2", "chunk": 0}, {"chunks": 1, "base": [1, "p1"], "entries": [entry]})
    assert base.apply([("q#val", new.reshape(-1))], {"entries": [entry]}, direct=own.get) == []
    assert _same_bits(own["q"], new) and [n for n, _ in base.placed] == ["q"]
