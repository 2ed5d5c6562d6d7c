"""Transports: shared memory (CPU, colocated), CUDA IPC (GPU, colocated), collective broadcast (remote)."""

from .base import Receiver, SendBuffer, Transport, make_receiver, register_transport, transport_class

__all__ = ["Receiver", "SendBuffer", "Transport", "make_receiver", "register_transport", "transport_class"]
