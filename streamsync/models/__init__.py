"""Models streamsync makes itself: synthetic state modules from tensor specs, the tiny local Qwen3, and
megatron-core models from HF checkpoints."""

