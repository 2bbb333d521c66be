"""The watchdog's error: which stage and rank is stuck, and on which inputs it waits."""

from __future__ import annotations

from trainer.schedule.core import Action, Op, StageState


class DppStallError(RuntimeError):
    """No action could run for the watchdog timeout; the message names stage, rank and awaited inputs."""


def awaited_inputs(state: StageState, limit: int = 6) -> list[str]:
    """Human-readable list of the inputs this stage still needs, oldest first."""
    shape, stage, out = state.shape, state.stage, []
    for c in range(shape.num_chunks):
        for m in range(shape.num_microbatches):
            if Action(Op.F, m, c) not in state.done and not shape.is_first_virtual(stage, c) \
                    and (m, c) not in state.activations_arrived:
                up = shape.upstream(stage, c)
                out.append(f"activation m{m}.c{c} from stage {up[0]} chunk {up[1]}")
            elif Action(Op.F, m, c) in state.done and not state.is_ready(Action(Op.B, m, c)) \
                    and Action(Op.B, m, c) not in state.done and (m, c) not in state.grads_arrived:
                down = shape.downstream(stage, c)
                out.append(f"gradient m{m}.c{c} from stage {down[0]} chunk {down[1]}")
    more = f" (+{len(out) - limit} more)" if len(out) > limit else ""
    return out[:limit] + ([more] if more else [])


def describe_wait(state: StageState, rank: int, timeout_s: float, what: str) -> str:
    done = len(state.done)
    return (f"DPP watchdog: stage {state.stage} (rank {rank}) ran no action for {timeout_s:.0f}s "
            f"waiting for {what}; {done}/{state.total_actions} actions done; awaited inputs: "
            + (", ".join(awaited_inputs(state)) or "none (policy chose to wait with nothing missing)"))
