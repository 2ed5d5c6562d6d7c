"""What runs in each vLLM worker process: the `streamsync` WeightTransferEngine that receives a push
(backend.py), the read-back extension named by `worker_extension_cls` (extension.py), received tensors copied
straight into the engine's tensors (fastpath/), online fp8 of fused-MoE experts (quant.py), what vLLM's layerwise
reload leaves to the worker (reload.py), the loaded checkpoint and its MTP layers (checkpoint.py) and the draft
model they go into (draft.py), each round's phases and memory (stats.py)."""
