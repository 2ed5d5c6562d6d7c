"""vLLM's quantization methods that a push of unquantized weights can go into, one table each.

A method is listed here when it quantizes as it loads ("online", from an unquantized checkpoint), so that what a
reload makes of pushed weights is what loading the same weights from disk makes (checked bit for bit on the GPU:
tests/test_vllm_gpu.py). Each table names the method as vLLM's `quantization=` knows it and the classes of its
linear and fused-MoE layer methods. Everything that depends on the method reads it from here: `compat` refuses
every other method, the fast path rebuilds these methods' modules (`fastpath.trace`), streamsync quantizes their
linear layers in the engine where vLLM's own kernel agrees (`fastpath.direct.Direct`) and their experts with its
own kernel (`quant`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OnlineMethod:
    """One online quantization method. `names`: vLLM's names for it, the one a user passes first."""

    names: tuple[str, ...]
    linear: str  # the class of its linear layers' quant method
    moe: str  # ... and of its fused-MoE layers'


#: vLLM's online per-tensor fp8 ("fp8_per_tensor" is vLLM 0.32's name for it)
FP8_PER_TENSOR = OnlineMethod(("fp8", "fp8_per_tensor"), linear="Fp8PerTensorOnlineLinearMethod",
                              moe="Fp8PerTensorOnlineMoEMethod")

#: vLLM's online block-wise fp8: 128x128 blocks of a weight, one scale each (`weight_scale_inv`), the layout of
#: DeepSeek-V3's fp8 checkpoints; experts' sizes are padded up to whole blocks
FP8_PER_BLOCK = OnlineMethod(("fp8_per_block",), linear="Fp8PerBlockOnlineLinearMethod",
                             moe="Fp8PerBlockOnlineMoEMethod")

ONLINE = (FP8_PER_TENSOR, FP8_PER_BLOCK)
#: every name a push accepts
NAMES = tuple(n for m in ONLINE for n in m.names)
#: the layer method classes whose modules the fast path rebuilds through vLLM's processing
LAYER_METHODS = frozenset(c for m in ONLINE for c in (m.linear, m.moe))
