"""Tensors larger than the chunk budget are split by rows across chunks, so the sender's extra memory stays
within window x chunk_bytes; receivers reassemble them bit for bit before loading."""

from __future__ import annotations

import itertools

import pytest
import torch

from streamsync import WeightSync
from streamsync.checksum import digests
from streamsync.errors import ValidationError
from streamsync.models.synthetic import StateModule, perturb_, qwen3_specs, save_specs
from streamsync.pack import Layout, TensorSpec, plan_layout
from streamsync.plan.chunking import row_parts
from streamsync.testing.receiver import ReceiverProcess

MiB = 1 << 20
CHUNK = 1 * MiB
# A 4 MiB embedding and lm_head (vocab 8192 x 256, bf16) against 1 MiB chunks; layers fit whole.
SPECS = qwen3_specs(vocab=8192, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512)


@pytest.fixture(scope="module")
def big_receiver(tmp_path_factory):
    with ReceiverProcess(str(save_specs(SPECS, tmp_path_factory.mktemp("split") / "specs.json")), threads=1) as rp:
        yield rp


@pytest.mark.parametrize("window", [1, 2, 4])
async def test_the_senders_memory_stays_within_window_times_chunk_bytes(big_receiver, window):
    model = StateModule(SPECS, fill="random", seed=window)
    perturb_(model, window)
    sync = WeightSync([big_receiver.engine()], chunk_bytes=CHUNK, max_inflight=window, metrics=None)
    report = await sync.push(model)
    embed = model.state_dict()["model.embed_tokens.weight"]
    assert embed.numel() * embed.element_size() == 4 * CHUNK  # the case the bound used to break
    assert max(p.nbytes for p in sync.plan(model)[1]) <= CHUNK
    assert report.peak_bytes_inflight <= window * CHUNK
    assert sync.transport.pool.nbytes <= window * CHUNK  # shared memory actually held, pooled for the next push
    assert await sync.engines[0].checksums() == digests(model.state_dict().items())
    await sync.close()


def test_parts_cover_every_row_once_and_each_fits_the_budget():
    parts = row_parts((1000, 300), 2, 64 << 10)
    assert parts[0][0] == 0 and parts[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    assert all((r1 - r0) * 300 * 2 <= 64 << 10 for r0, r1 in parts)
    assert row_parts((10, 10), 2, 64 << 10) == [(0, 10)]          # fits whole
    assert row_parts((2, 1 << 20), 2, 64 << 10) == [(0, 2)]       # one row exceeds the budget: not split


def test_a_part_travels_in_the_layout_and_must_lie_inside_its_tensor():
    layout = plan_layout([TensorSpec("w", torch.bfloat16, (3, 4), part=(6, 9))])
    assert Layout.from_json(layout.to_json()).metas[0].part == (6, 9)
    bad = layout.to_json()
    bad["tensors"][0][5] = [7, 9]  # rows 7..10 of a 9-row tensor
    with pytest.raises(ValidationError, match="does not lie inside"):
        Layout.from_json(bad)
