"""Chunk planning: order, whole layers, big tensors split by rows, MoE experts never split."""

from __future__ import annotations

import itertools

import torch

from streamsync.models.synthetic import StateModule, qwen3_specs
from streamsync.plan.chunking import Item, plan_chunks
from streamsync.sources import ModuleSource


def _plan(budget: int, **shape):
    model = StateModule(qwen3_specs(**shape))
    return ModuleSource(model).plan(budget)


def test_embeddings_first_layers_in_order_norm_and_head_last():
    plans = _plan(1 << 30, layers=3)
    names = [n for p in plans for n in p.names]
    assert names[0] == "model.embed_tokens.weight"
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
    layers = [int(n.split(".")[2]) for n in names if ".layers." in n]
    assert layers == sorted(layers)


def test_each_decoder_layer_stays_in_one_chunk_when_it_fits():
    plans = _plan(3_000_000, layers=6, vocab=64)  # a layer is ~1.1 MB
    where: dict[int, set[int]] = {}
    for p in plans:
        for n in p.names:
            if ".layers." in n:
                where.setdefault(int(n.split(".")[2]), set()).add(p.index)
    assert all(len(chunks) == 1 for chunks in where.values())
    assert len(plans) > 2


def test_a_tensor_larger_than_the_budget_is_split_by_rows_into_chunks_that_fit():
    plans = _plan(100_000, layers=1, vocab=4096)  # embed is 2 MB: 4096 rows of 512 bytes
    parts = [s for p in plans for s in p.specs if s.name == "model.embed_tokens.weight"]
    assert len(parts) > 1 and all(s.part is not None for s in parts)
    rows = [(s.part[0], s.part[0] + s.shape[0]) for s in parts]
    assert rows[0][0] == 0 and rows[-1][1] == 4096 and all(a[1] == b[0] for a, b in itertools.pairwise(rows))
    assert max(p.nbytes for p in plans) <= 100_000


def test_atomic_groups_are_never_split_even_past_the_budget():
    items = [Item(f"e{i}", 100, unit="L0", atomic="experts") for i in range(10)]
    items += [Item("router", 10, unit="L0"), Item("next", 10, unit="L1")]
    chunks = plan_chunks(items, budget=250)
    (experts_chunk,) = [c for c in chunks if "e0" in c]
    assert all(f"e{i}" in experts_chunk for i in range(10))


def test_tied_weights_are_sent_once():
    m = torch.nn.Module()
    m.embed = torch.nn.Embedding(10, 4)
    m.lm_head = torch.nn.Linear(4, 10, bias=False)
    m.lm_head.weight = m.embed.weight
    names = [n for p in ModuleSource(m).plan(1 << 20) for n in p.names]
    assert names == ["embed.weight"]


def test_layers_split_across_chunks_are_marked_for_receivers_that_buffer_layers():
    from streamsync.plan.chunking import split_layers

    chunks = [["model.embed_tokens.weight", "model.layers.0.a"], ["model.layers.0.b", "model.layers.1.a"],
              ["model.layers.1.b", "model.layers.1.c", "model.norm.weight"]]
    assert split_layers(chunks) == {0: ["model.layers.0.a"], 1: ["model.layers.1.a"]}
