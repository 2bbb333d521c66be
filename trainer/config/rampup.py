"""Megatron-LM's ``--rampup-batch-size START INCREMENT SAMPLES``: the global batch size as a function of
the samples consumed so far.

Megatron-LM's meaning (megatron-core's RampupBatchsizeNumMicroBatchesCalculator): the batch starts at
START and grows by INCREMENT each time another SAMPLES / ((GBS - START) / INCREMENT) samples have been
consumed, reaching --global-batch-size once more than SAMPLES samples have been consumed. The size of
iteration i is decided from the samples consumed *before* it, so a resumed run (which restores the
consumed-samples count) continues the ramp where it stopped. Pure: no torch, no process group.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRampup:
    """The three values of --rampup-batch-size and the --global-batch-size they ramp to."""

    start: int
    increment: int
    samples: int
    global_batch_size: int

    def problems(self) -> list[str]:
        """Megatron-LM's assertions, as messages naming the flag and the value."""
        flag = f"--rampup-batch-size {self.start} {self.increment} {self.samples}"
        p = []
        if self.start < 1:
            p.append(f"{flag}: the start batch size ({self.start}) must be >= 1")
        if self.increment < 1:
            p.append(f"{flag}: the batch size increment ({self.increment}) must be >= 1")
        if self.samples < 0:
            p.append(f"{flag}: the ramp-up samples ({self.samples}) must be >= 0")
        if p:
            return p
        diff = self.global_batch_size - self.start
        if diff <= 0:
            # Megatron-LM divides by the increment count, so equal sizes fail there with a
            # ZeroDivisionError; a ramp that does not grow is a mistake either way.
            p.append(f"{flag}: the start batch size must be below --global-batch-size={self.global_batch_size}, "
                     "the size it ramps up to")
        elif diff % self.increment:
            p.append(f"{flag}: --global-batch-size={self.global_batch_size} minus the start ({diff}) is not a "
                     f"multiple of the increment {self.increment}")
        return p

    @property
    def samples_per_increment(self) -> float:
        """Samples consumed between two increments (a float, as Megatron-LM's)."""
        return self.samples / ((self.global_batch_size - self.start) // self.increment)

    def batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size of the iteration that starts after ``consumed_samples`` samples."""
        if consumed_samples > self.samples:
            return self.global_batch_size
        steps = int(consumed_samples / self.samples_per_increment)
        return min(self.start + steps * self.increment, self.global_batch_size)

    def sizes(self) -> tuple[int, ...]:
        """Every global batch size the ramp passes through, START to --global-batch-size."""
        return tuple(range(self.start, self.global_batch_size + 1, self.increment))

    def train_iters(self, train_samples: int) -> int:
        """Iterations of --train-samples under the ramp (Megatron-LM's update_train_iters): whole
        batches only, a partial last batch dropped."""
        iterations = consumed = 0
        while consumed <= self.samples:  # the ramp, one iteration at a time
            size = self.batch_size_at(consumed)
            if consumed + size > train_samples:
                return iterations
            consumed += size
            iterations += 1
        return iterations + (train_samples - consumed) // self.global_batch_size
