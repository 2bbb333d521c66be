"""``python -m tests.dist.train_harness [harness flags] -- <trainer.train flags>``: one rank of a test run.

It runs the real ``trainer.train.main`` with hooks that make pipelined runs comparable with a
single-process reference:

* ``--save-init FILE`` (reference run, PP=TP=1): write the freshly built full model's parameters.
* ``--load-init FILE``: overwrite this rank's freshly built chunks with FILE's parameters, mapped by
  *global layer index* -- a chunk's ``decoder.layers.{i}`` (``encoder.`` for BERT) is the full model's
  ``decoder.layers.{layer_number - 1}`` where ``layer_number`` is the global, 1-based index megatron
  gives each layer; embeddings live on virtual stage 0, final norm/head on the last one, and with tied
  embeddings the last stage's ``output_layer.weight`` is a copy of ``embedding.word_embeddings.weight``.
  TP shards are the ``tp_rank``-th slice along the parameter's ``partition_dim``.
* ``--out DIR``: per rank, ``losses_rank<R>.json`` (iteration -> losses) and, for the first
  ``--dump-grads N`` iterations, ``grads_rank<R>_it<I>.pt`` ({full name: (grad shard, partition_dim,
  tp_rank, tp_size)}) taken after finalize_model_grads, before the optimizer step.
* ``--reference``: replace the schedule by a plain sequential loop over the microbatches (forward,
  loss / M, backward), i.e. what megatron's forward_backward_no_pipelining does, without our runtime;
  with Megatron's 3-tuple loss and calculate_per_token_loss (``--variable-seq-lengths``), the summed
  loss and a 1 / total-tokens gradient scaling in finalize_model_grads, as megatron does.
* ``--megatron-schedule``: plan a run without ``--use-dpp`` as on CUDA, with megatron-core's own schedule
  as the engine (``get_forward_backward_func()``: 1F1B, or interleaved 1F1B with virtual stages; its
  DDP hooks and, with ``--overlap-grad-reduce``, its ``grad_sync_func``), where the CPU plan would run
  the runtime's static orders (trainer/config/plan.py ``uses_megatron_schedule`` says why).
* ``--landing-delay N``: stand-in for GPU payloads still in flight (CPU has none): the links answer
  "not landed yet" to the first N looks at each message of an odd microbatch (``StageLinks.landed``,
  a scheduling hint dpp-zb reads); even microbatches' messages land at the first look, so both
  answers occur whatever the timing; ``landing_rank<R>.json`` counts the looks and the "no" answers.
* ``--count-reductions``: with ``--overlap-grad-reduce``, count, when finalize_model_grads finishes
  each DDP bucket group's reduction, whether it had been started before (overlapped: by the runtime
  or megatron's hooks) or is started only there; ``reductions_rank<R>.json``. Observed by wrapping
  megatron-core's ``_ParamAndGradBucketGroup.finish_grad_sync`` in this process (a test-only probe).
* ``--count-param-gathers``: with ``--overlap-param-gather``, check at each chunk's first forward after
  an optimizer step (a forward pre-hook on the chunk, which runs after the runtime's wait and before
  any layer) that every DDP bucket group of the chunk had its parameter all-gather started since that
  step (megatron-core's ``start_param_sync``, wrapped in this process) and finished (no handle left),
  and that megatron's own forward pre-hooks are off; ``param_gathers_rank<R>.json`` counts the checks
  and each kind of miss (a test-only probe).
* ``--started-seconds-ago S``: move the process's start time (``trainer.train._PROCESS_START``, what
  ``--exit-duration-in-mins`` counts from) S seconds back, so that a limit of whole minutes is reached
  seconds into the run instead of after a minute of training on every core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import torch

import trainer.train
from tests.dist.grads import tp_slice
from trainer.train import TrainHooks, main

_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.")


def full_name(chunk: torch.nn.Module, local: str, pp: int) -> str:
    match = _LAYER.match(local)
    if match:
        block = getattr(chunk, match.group(1))
        number = block.layers[int(match.group(2))].layer_number
        return f"{match.group(1)}.layers.{number - 1}." + local[match.end():]
    if local == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
        return "embedding.word_embeddings.weight"
    return local


def shard_of(full: torch.Tensor, name: str, param: torch.nn.Parameter, tp_rank: int, tp: int,
             gated: bool) -> torch.Tensor:
    if getattr(param, "tensor_model_parallel", False):
        return tp_slice(full, name, param.partition_dim, tp_rank, tp, gated)
    return full


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # DDP, then Float16Module with --bf16/--fp16
        chunk = chunk.module
    return chunk


def sequential_reference(*, forward_step_func, data_iterator, model, num_microbatches, forward_only=False, **_):
    chunk, it = model[0], data_iterator[0]
    config = chunk.config
    losses = []
    total_tokens = torch.zeros([], dtype=torch.int)
    for _m in range(num_microbatches):
        output, loss_func = forward_step_func(it, chunk)
        outputs = loss_func(output)
        if len(outputs) == 3:  # Megatron's (summed loss, tokens, report), e.g. --variable-seq-lengths
            loss, tokens, reduced = outputs
            total_tokens += tokens
            if not config.calculate_per_token_loss:
                loss = loss / torch.clamp(tokens, min=1) / num_microbatches
        else:
            loss, reduced = outputs
            loss = loss / num_microbatches
        if not forward_only:
            config.grad_scale_func(loss).backward()
        losses.append(reduced)
    if not forward_only:
        config.finalize_model_grads_func([chunk], total_tokens if config.calculate_per_token_loss else None)
    return losses


def delay_landing(looks: int, counts: dict[str, int]) -> None:
    """Make every concrete StageLinks answer ``landed() == False`` to its first ``looks`` looks at a
    message of an odd microbatch. Only the hint changes: the payload itself is there (CPU), so the
    maths must not. Why only odd ones: a "yes" must occur whatever the timing. The runtime looks at
    every gradient at least once (each decision looks at all gradients in transit) but may run a
    gradient's backward after fewer than ``looks`` looks, when nothing else is ready (CI once saw
    rank 1 told "no" 13 times out of 13 with every message delayed)."""
    from trainer.transport.base import StageLinks

    # id(message) -> looks so far. The entry goes when the runtime releases the message (every
    # consumed message is released), so a later message that reuses the id starts again at 0.
    seen: dict[int, int] = {}

    def patch(cls: type) -> None:
        original, release = cls.__dict__.get("landed"), cls.__dict__.get("release")
        if original is not None:
            def landed(self, message, _original=original) -> bool:
                counts["looks"] += 1
                n = seen[id(message)] = seen.get(id(message), 0) + 1
                if message.header.microbatch % 2 == 1 and n <= looks:
                    counts["not_landed"] += 1
                    counts["not_landed_act"] += message.header.kind == "act"
                    return False
                return _original(self, message)
            cls.landed = landed
        if release is not None:
            def released(self, message, _release=release) -> None:
                seen.pop(id(message), None)
                _release(self, message)
            cls.release = released
        for sub in cls.__subclasses__():
            patch(sub)

    import trainer.transport.channels  # noqa: F401 - the concrete links must exist before patching

    patch(StageLinks)


def count_reductions(counts: dict[str, int]) -> None:
    """Wrap megatron-core's bucket-group finish to count overlapped vs. late-started reductions."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    original = _ParamAndGradBucketGroup.finish_grad_sync

    def finish_grad_sync(self, *args, **kwargs):
        if self.ddp_config.overlap_grad_reduce:
            counts["started_before" if self.grad_reduce_handle is not None else "started_at_finish"] += 1
        return original(self, *args, **kwargs)

    _ParamAndGradBucketGroup.finish_grad_sync = finish_grad_sync


class ParamGatherProbe:
    """--count-param-gathers (module docstring): counts per rank, written after every step."""

    def __init__(self) -> None:
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

        self.counts = {"checked": 0, "groups": 0, "not_started": 0, "not_finished": 0, "hooks_on": 0}
        self.started: set[int] = set()  # bucket groups whose gather was started and not yet checked
        self.seen: set[int] = set()  # chunks that ran a forward since the last optimizer step
        self.steps_done = 0
        self.ddp: list = []  # the DDP-wrapped chunks, known from the first after_backward
        original, started = _ParamAndGradBucketGroup.start_param_sync, self.started

        def start_param_sync(group, *args, **kwargs):
            if not kwargs.get("force_sync", args[0] if args else False):
                started.add(id(group))
            return original(group, *args, **kwargs)

        _ParamAndGradBucketGroup.start_param_sync = start_param_sync

    def watch(self, chunks: list) -> None:
        for c, chunk in enumerate(chunks):
            chunk.register_forward_pre_hook(lambda module, args, c=c: self._first_forward(c))

    def _first_forward(self, c: int) -> None:
        if c in self.seen:
            return
        self.seen.add(c)
        if not self.steps_done:  # before the first optimizer step nothing is gathered
            return
        ddp = self.ddp[c]
        self.counts["checked"] += 1
        self.counts["hooks_on"] += bool(ddp.remove_forward_pre_hook_handles)
        for group in list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups):
            self.counts["groups"] += 1
            self.counts["not_started"] += id(group) not in self.started
            self.counts["not_finished"] += group.param_gather_handle is not None
            self.started.discard(id(group))

    def around(self, hooks: TrainHooks, path: Path) -> TrainHooks:
        """``hooks`` with the probe's own steps before each: watch the built chunks, learn the DDP
        chunks, and after every step reset and write the counts to ``path``."""

        def after_build(chunks, topology) -> None:
            self.watch(chunks)
            hooks.after_build(chunks, topology)

        def after_backward(iteration, model) -> None:
            self.ddp = list(model)
            hooks.after_backward(iteration, model)

        def after_step(iteration, reduced) -> None:
            self.steps_done, self.seen = iteration, set()
            path.write_text(json.dumps(self.counts))
            hooks.after_step(iteration, reduced)

        return dataclasses.replace(hooks, after_build=after_build, after_backward=after_backward,
                                   after_step=after_step)


def build_hooks(args: argparse.Namespace) -> TrainHooks:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(__import__("os").environ.get("RANK", "0"))
    topo_box: dict = {}
    losses: dict[int, dict] = {}
    landing = {"looks": 0, "not_landed": 0, "not_landed_act": 0}
    if args.landing_delay:
        delay_landing(args.landing_delay, landing)
    reductions = {"started_before": 0, "started_at_finish": 0}
    if args.count_reductions:
        count_reductions(reductions)

    def after_build(chunks, topology) -> None:
        topo_box["t"] = topology
        if args.save_init:
            assert topology.world_size == 1, "--save-init is for the single-process reference"
            torch.save({n: p.detach().clone() for n, p in chunks[0].named_parameters()}, args.save_init)
        if args.load_init:
            full = torch.load(args.load_init)
            with torch.no_grad():
                for chunk in chunks:
                    gated = bool(getattr(chunk.config, "gated_linear_unit", False))
                    for name, param in chunk.named_parameters():
                        key = full_name(chunk, name, topology.pipeline_parallel)
                        param.copy_(shard_of(full[key], key, param, topology.tp_rank, topology.tensor_parallel,
                                             gated))

    def after_backward(iteration, model) -> None:
        if iteration >= args.dump_grads:
            return
        t = topo_box["t"]
        grads = {}
        for wrapped in model:
            chunk = _unwrap(wrapped)
            for name, param in chunk.named_parameters():
                grad = getattr(param, "main_grad", None)
                grad = param.grad if grad is None else grad
                key = full_name(chunk, name, t.pipeline_parallel)
                dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else -1
                grads[key] = (grad.detach().float().clone(), dim, t.tp_rank, t.tensor_parallel,
                              bool(getattr(chunk.config, "gated_linear_unit", False)))
        torch.save(grads, out / f"grads_rank{rank}_it{iteration}.pt")

    def after_step(iteration, reduced) -> None:
        losses[iteration] = reduced
        (out / f"losses_rank{rank}.json").write_text(json.dumps(losses, indent=0))
        if args.landing_delay:
            (out / f"landing_rank{rank}.json").write_text(json.dumps(landing))
        if args.count_reductions:
            (out / f"reductions_rank{rank}.json").write_text(json.dumps(reductions))

    hooks = TrainHooks(after_build=after_build, after_backward=after_backward, after_step=after_step,
                       forward_backward_func=sequential_reference if args.reference else None)
    return ParamGatherProbe().around(hooks, out / f"param_gathers_rank{rank}.json") if args.count_param_gathers \
        else hooks


def cli(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m tests.dist.train_harness")
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-init")
    parser.add_argument("--load-init")
    parser.add_argument("--dump-grads", type=int, default=0)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--megatron-schedule", action="store_true")
    parser.add_argument("--landing-delay", type=int, default=0)
    parser.add_argument("--count-reductions", action="store_true")
    parser.add_argument("--count-param-gathers", action="store_true")
    parser.add_argument("--started-seconds-ago", type=float, default=0.0)
    args = parser.parse_args(argv[:split])
    trainer.train._PROCESS_START -= args.started_seconds_ago
    if args.megatron_schedule:
        from trainer.config import plan

        plan.uses_megatron_schedule = lambda cfg: not cfg.parallel.use_dpp
    return main(argv[split + 1:], build_hooks(args))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
