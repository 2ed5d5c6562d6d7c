"""Stand-ins for tests, benchmarks and the demo: spec-built models, a tiny local Qwen3, a vLLM-style fused
receiver model, Megatron helpers and a receiver process. Nothing in the library imports from here."""
