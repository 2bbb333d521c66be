"""TP rank 0 of a stage decides; its TP peers replay the same actions in the same order.

Why: the policy is greedy on *which inputs have arrived when it decides*. TP peers of a stage receive
the same messages but at slightly different times, so each deciding for itself could pick different
actions -- and TP ranks must run identical actions, or their tensor-parallel collectives pair up
wrong and hang. A collective per decision would serialise the pipeline on a network round trip, so
instead TP rank 0 (the leader) publishes the k-th action of the step in slot k of a same-node
shared-memory array (TP groups never span nodes), and followers read slot k, then wait for that
action's inputs on their own links.

Each slot is ONE aligned 64-bit word holding (generation, op, chunk, microbatch): an aligned 8-byte
store is single-copy atomic on x86-64 and AArch64, so a reader sees either the old or the new word,
never half of one, and no memory-ordering fence between separate fields is needed. The generation
(step counter, never 0) tells this step's decision from the previous step's leftover.

The segment ``/dev/shm/mdpp-<job>-pp<stage>-dp<dp>-tpdecide`` (trainer.names.tp_decision_name; mode 0600) is unlinked as soon as all
peers have mapped it, so a crash later leaks nothing.
"""

from __future__ import annotations

import logging
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch.distributed as dist

from trainer.schedule.core import Action, Op

log = logging.getLogger(__name__)

_OPS = (Op.F, Op.B, Op.I, Op.W)
_GEN_BITS, _OP_BITS, _CHUNK_BITS, _MB_BITS = 20, 2, 8, 24
_GEN_MASK = (1 << _GEN_BITS) - 1


def encode(generation: int, action: Action) -> int:
    assert 0 < generation <= _GEN_MASK and action.chunk < 1 << _CHUNK_BITS and action.microbatch < 1 << _MB_BITS
    word = generation
    word = (word << _OP_BITS) | _OPS.index(action.op)
    word = (word << _CHUNK_BITS) | action.chunk
    return (word << _MB_BITS) | action.microbatch


def decode(word: int) -> tuple[int, Action]:
    microbatch = word & ((1 << _MB_BITS) - 1)
    word >>= _MB_BITS
    chunk = word & ((1 << _CHUNK_BITS) - 1)
    word >>= _CHUNK_BITS
    op = _OPS[word & ((1 << _OP_BITS) - 1)]
    return word >> _OP_BITS, Action(op, microbatch, chunk)


class TpDecisionTimeout(RuntimeError):
    """A follower waited too long for its leader's next decision."""


class TpDecisionChannel:
    """Shared decision log of one stage's TP group (leader writes, followers read)."""

    def __init__(self, name: str, capacity: int, is_leader: bool, group, description: str) -> None:
        """Collective over ``group`` (the TP group): every TP rank of the stage must construct it."""
        self.is_leader = is_leader
        self.capacity = capacity
        self.description = description
        self._generation = 0
        size = capacity * 8
        if is_leader:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        dist.barrier(group=group)  # leader's segment exists before followers open it
        if not is_leader:
            self._shm = shared_memory.SharedMemory(name=name)
            # Python < 3.13 registers opened segments with the resource tracker, which would
            # unlink (and warn about) a segment this process does not own at exit.
            resource_tracker.unregister(self._shm._name, "shared_memory")  # noqa: SLF001
        self._words = np.ndarray((capacity,), dtype=np.int64, buffer=self._shm.buf)
        if is_leader:
            self._words[:] = 0
        dist.barrier(group=group)  # everyone has mapped it: the name is no longer needed
        if is_leader:
            self._shm.unlink()

    def begin_step(self) -> None:
        """Advance the generation; every TP rank calls this once per forward_backward call."""
        self._generation = self._generation % _GEN_MASK + 1

    def publish(self, index: int, action: Action) -> None:
        assert self.is_leader and index < self.capacity
        self._words[index] = encode(self._generation, action)

    def read(self, index: int, timeout_s: float) -> Action:
        """The leader's ``index``-th action of this step, waiting (with backoff, not spinning) up to timeout_s."""
        assert not self.is_leader and index < self.capacity
        deadline = time.monotonic() + timeout_s
        pause = 0.0
        while True:
            generation, action = decode(int(self._words[index]))
            if generation == self._generation:
                return action
            if time.monotonic() > deadline:
                raise TpDecisionTimeout(
                    f"{self.description}: waited {timeout_s:.0f}s for TP rank 0's decision #{index} "
                    f"of step generation {self._generation}")
            time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 1e-3)

    def close(self) -> None:
        if self._shm is None:
            return
        del self._words  # the numpy view pins the buffer; drop it before closing
        self._shm.close()
        self._shm = None
