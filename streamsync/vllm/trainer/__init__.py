"""What runs in the trainer's process beside vLLM's own trainer-side API: streamsync as a backend of vLLM's
weight-transfer trainer factory (native.py) and the digests an engine's parameters should have after a push,
computed without vLLM (digests.py). streamsync's own engine clients are `streamsync.engines.vllm`."""
