"""The API server's middleware at the path `vllm serve --middleware` is given (`streamsync.vllm.MIDDLEWARE`); its
code is the server's (`server/middleware.py`)."""

from .server.middleware import Serve

__all__ = ["Serve"]
