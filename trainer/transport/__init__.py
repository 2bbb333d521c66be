"""Stage-to-stage transport: per-edge channels over shared memory (same node) or gloo/NCCL."""

from trainer.transport.base import Header, Message, StageLinks, TransportError, TransportTimeout

__all__ = ["Header", "Message", "StageLinks", "TransportError", "TransportTimeout"]
