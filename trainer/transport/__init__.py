"""Stage-to-stage transport: per-edge channels over shared memory (same node) or gloo/NCCL.

Entry point: :func:`make_stage_links` (collective over all ranks); see docs/transport.md.
"""

from trainer.transport.base import Header, Message, StageLinks, TransportError, TransportTimeout
from trainer.transport.factory import LinkOptions, make_stage_links, plan_channels

__all__ = [
    "Header",
    "LinkOptions",
    "Message",
    "StageLinks",
    "TransportError",
    "TransportTimeout",
    "make_stage_links",
    "plan_channels",
]
