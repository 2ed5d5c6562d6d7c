"""What runs in `vllm serve`'s API-server process: the API key on every route (auth.py), bounded waits for a
paused engine (paused.py), and both as the one middleware given to vLLM by its import path (middleware.py,
`streamsync.vllm.MIDDLEWARE`)."""
