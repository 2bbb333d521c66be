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

Followers do not poll: the slots live in a word log of the C++ shared-memory extension
(``_shm_ring.WordLog``, csrc/shm_ring.cpp), whose every publish bumps a futex word. A follower spins
100 us on its slot (the leader is usually about to publish: TP ranks run in lockstep), then sleeps on
that word; between sleeps of at most _LEADER_CHECK_S it checks that the leader's pid still lives
(same test as the transport rings: gone, zombie or reused), so a killed leader is reported within a
fraction of a second, naming the stage, this TP rank, the leader and the decision awaited, instead of
surfacing as a watchdog timeout (docs/transport.md#transports, "Dead peers").

The segment ``/dev/shm/mdpp-<job>-pp<stage>-dp<dp>-tpdecide`` (trainer.names.tp_decision_name; mode 0600) is unlinked as soon as all
peers have mapped it, so a crash later leaks nothing.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from trainer.schedule.core import Action, Op
from trainer.transport import _shm_ring

log = logging.getLogger(__name__)

_OPS = (Op.F, Op.B, Op.I, Op.W)
_GEN_BITS, _OP_BITS, _CHUNK_BITS, _MB_BITS = 20, 2, 8, 24
_GEN_MASK = (1 << _GEN_BITS) - 1
_GEN_SHIFT = _OP_BITS + _CHUNK_BITS + _MB_BITS  # a word's generation: word >> _GEN_SHIFT
# A waiting follower checks its leader's pid at least this often: a dead leader is noticed this fast.
_LEADER_CHECK_S = 0.1


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


class TpDecisionError(RuntimeError):
    """A follower could not get its leader's next decision."""


class TpDecisionTimeout(TpDecisionError):
    """A follower waited too long for its leader's next decision."""


class TpLeaderDied(TpDecisionError):
    """The leader's process died while a follower waited for its next decision."""


class TpDecisionChannel:
    """Shared decision log of one stage's TP group (leader writes, followers read)."""

    def __init__(self, name: str, capacity: int, is_leader: bool, group, description: str) -> None:
        """Collective over ``group`` (the TP group): every TP rank of the stage must construct it.

        ``name`` as trainer.names.tp_decision_name spells it (no leading ``/``)."""
        self.is_leader = is_leader
        self.capacity = capacity
        self.description = description
        self._generation = 0
        path = "/" + name
        if is_leader:
            self._log = _shm_ring.WordLog.create(path, capacity, dist.get_rank())
        dist.barrier(group=group)  # leader's segment exists before followers open it
        if not is_leader:
            self._log = _shm_ring.WordLog.attach(path)
            if not self._log.pid_checks_possible:
                log.warning("%s: TP rank 0 (rank %d) is in another pid namespace: its death is noticed "
                            "only by timeout", description, self._log.writer_rank)
        dist.barrier(group=group)  # everyone has mapped it: the name is no longer needed
        if is_leader:
            self._log.unlink()

    def begin_step(self) -> None:
        """Advance the generation; every TP rank calls this once per forward_backward call."""
        self._generation = self._generation % _GEN_MASK + 1

    def publish(self, index: int, action: Action) -> None:
        """Write the ``index``-th action of this step and wake the followers waiting for it."""
        assert self.is_leader and index < self.capacity
        self._log.publish(index, encode(self._generation, action))

    def read(self, index: int, timeout_s: float) -> Action:
        """The leader's ``index``-th action of this step, sleeping on the log's futex word up to
        timeout_s; TpLeaderDied as soon as the leader's process is gone."""
        assert not self.is_leader and index < self.capacity
        word = self._log.wait_tag(index, self._generation, _GEN_SHIFT, timeout_s, _LEADER_CHECK_S)
        if word >= 0:
            return decode(word)[1]
        leader = f"TP rank 0 (rank {self._log.writer_rank}, pid {self._log.writer_pid})"
        if word == _shm_ring.PEER_DEAD:
            raise TpLeaderDied(f"{self.description}: {leader} died while this rank waited for its decision "
                               f"#{index} of step generation {self._generation}")
        raise TpDecisionTimeout(f"{self.description}: waited {timeout_s:.0f}s for {leader}'s decision #{index} "
                                f"of step generation {self._generation}")

    def close(self) -> None:
        self._log = None  # unmaps (the name was unlinked at set-up)
