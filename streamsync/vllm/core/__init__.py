"""What runs in vLLM's engine-core process, installed by the plugin's `register()` there: a round's end in one
call (rpc.py) and a prefix-cache reset that visits only the blocks holding a hash (prefix_cache.py)."""
