"""The packed format: bit-exact for every dtype, zero-copy unpack, validated metadata."""

from __future__ import annotations

import pytest
import torch

from streamsync.errors import ValidationError
from streamsync.models.synthetic import StateModule, mixed_specs
from streamsync.pack import ALIGN, Layout, TensorSpec, pack_into, plan_layout, unpack


def _pack(named: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Layout]:
    layout = plan_layout(TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in named.items())
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_into(buf, layout, list(named.values()))
    return buf, layout


def test_every_dtype_round_trips_bit_exactly():
    named = StateModule(mixed_specs(), fill="random", seed=1).state_dict()
    buf, layout = _pack(named)
    out = dict(unpack(buf, layout))
    assert list(out) == list(named)
    for name, t in named.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name].reshape(-1).view(torch.uint8) if t.numel() else out[name],
                           t.reshape(-1).view(torch.uint8) if t.numel() else t), name


def test_offsets_are_aligned():
    layout = plan_layout([TensorSpec("a", torch.bfloat16, (3,)), TensorSpec("b", torch.float64, (5,))])
    assert [m.offset % ALIGN for m in layout.metas] == [0, 0]
    assert layout.nbytes % ALIGN == 0


def test_non_contiguous_inputs_are_packed_through_their_strides():
    base = torch.randn(6, 8).to(torch.bfloat16)
    named = {"t": base.t(), "s": base[:, ::2], "e": base.expand(2, 6, 8)[1]}
    buf, layout = _pack(named)
    out = dict(unpack(buf, layout))
    for name, t in named.items():
        assert torch.equal(out[name], t), name


def test_unpack_returns_views_of_the_buffer():
    buf, layout = _pack({"w": torch.ones(4, 4)})
    (_, view), = unpack(buf, layout)
    buf.zero_()
    assert view.sum().item() == 0  # it aliases the buffer: no copy was made


def test_layout_survives_json_and_rejects_bad_metadata():
    _, layout = _pack({"w": torch.ones(4, 4), "b": torch.zeros(3, dtype=torch.int8)})
    assert Layout.from_json(layout.to_json()) == layout
    bad = layout.to_json()
    bad["tensors"][0][3] = bad["nbytes"]  # offset past the end
    with pytest.raises(ValidationError, match="outside"):
        Layout.from_json(bad)
    bad = layout.to_json()
    bad["tensors"][0][1] = "float128"
    with pytest.raises(ValidationError, match="float128"):
        Layout.from_json(bad)
    with pytest.raises(ValidationError, match="malformed"):
        Layout.from_json({"tensors": "nope"})


def test_pack_rejects_tensors_that_do_not_match_the_layout():
    layout = plan_layout([TensorSpec("w", torch.float32, (2, 2))])
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValidationError, match="'w'"):
        pack_into(buf, layout, [torch.ones(2, 3)])


def test_blocked_views_pack_as_their_hf_tensor_without_a_copy():
    # q rows of a fused QKV with 2 query groups: a (groups, rows, hidden) view, not a 2D tensor
    fused = torch.randn(2, 6, 4).to(torch.bfloat16)  # per group: 4 q rows, 1 k row, 1 v row
    q_view = fused[:, :4]
    q_hf = q_view.reshape(8, 4)  # what the receiver must see
    layout = plan_layout([TensorSpec("q", torch.bfloat16, (8, 4))])
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_into(buf, layout, [q_view])
    (_, got), = unpack(buf, layout)
    assert torch.equal(got, q_hf)
    with pytest.raises(ValidationError):
        pack_into(buf, layout, [fused[:, :3]])  # wrong number of elements


def test_pack_casts_floating_tensors_like_to_and_refuses_other_casts():
    src = torch.randn(33, 7, dtype=torch.float32) * 1e3
    layout = plan_layout([TensorSpec("w", torch.bfloat16, (33, 7))])
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    pack_into(buf, layout, [src])
    (_, got), = unpack(buf, layout)
    assert torch.equal(got.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))  # same rounding, bit for bit
    with pytest.raises(ValidationError, match="layout expects bfloat16"):
        pack_into(buf, layout, [torch.ones(33, 7, dtype=torch.int32)])


def test_the_buffer_pool_hands_buffers_out_in_creation_order_every_push():
    from streamsync.transports.pool import BufferPool

    pool = BufferPool(torch.device("cpu"))
    pool.begin(64)
    a, b, c = pool.take(64), pool.take(64), pool.take(64)
    for buf in (c, a, b):  # released in another order than taken
        pool.give(buf)
    pool.end()
    pool.begin(64)
    assert [pool.take(64).token for _ in range(3)] == [a.token, b.token, c.token]


def test_coalesce_merges_only_runs_that_continue_each_other_on_both_sides() -> None:
    """An MoE expert's gate and up rows are one block of fc1 and one of w13: one copy, not two. Pairs that are
    adjacent on one side only, or adjacent addresses in different storages, stay apart; results are exact."""
    from streamsync.pack import coalesce

    fc1 = [torch.randn(6, 4) for _ in range(3)]
    w13 = torch.zeros(3, 6, 4)
    dsts = [t for e in range(3) for t in (w13[e, :3], w13[e, 3:])]
    srcs = [t for e in range(3) for t in (fc1[e][:3], fc1[e][3:])]
    d, s = coalesce(dsts, srcs)
    assert len(d) == 3 and all(x.shape == (24,) for x in d)
    for a, b in zip(d, s, strict=True):
        a.copy_(b)
    assert all(torch.equal(w13[e], fc1[e]) for e in range(3))
    # the destination continues, the source does not (another expert's gate): two copies
    d, s = coalesce([w13[0, :3], w13[0, 3:]], [fc1[0][:3], fc1[1][:3]])
    assert len(d) == 2
    # a cast or a strided pair is never merged
    d, s = coalesce([w13[0, :3], w13[0, 3:]], [fc1[0][:3].double(), fc1[0][3:].double()])
    assert len(d) == 2
    d, s = coalesce([w13[0, :, :2], w13[0, :, 2:]], [fc1[0][:, :2], fc1[0][:, 2:]])
    assert len(d) == 2
