"""Engine clients: the control plane to an inference engine (vLLM in-process, vLLM over HTTP, a receiver
process). Engine classes import lazily so `import streamsync` never imports vLLM."""

from .base import Engine

__all__ = ["Engine"]
