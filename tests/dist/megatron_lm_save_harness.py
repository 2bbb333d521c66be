"""``python -m tests.dist.megatron_lm_save_harness --out DIR --at K [--weights-only] -- <trainer.train flags>``:
train, and after iteration K also write a checkpoint as Megatron-LM's own save path does (its
``generate_state_dict`` and ``save_checkpoint`` for ``--ckpt-format torch_dist``): megatron-core's
``dist_checkpointing.save`` of each chunk's ``sharded_state_dict`` (keys ``model`` / ``model<i>``), the
optimizer's ``sharded_state_dict`` under ``optimizer`` and the LR scheduler's state under
``opt_param_scheduler`` (both unless ``--weights-only``, Megatron-LM's --no-save-optim), its ``rng_state``
(a ShardedObject of shape (PP, TP) holding a one-element list, as without --data-parallel-random-init;
unless ``--weights-only``, its --no-save-rng), its common keys ``args`` (an argparse Namespace like its
own), ``iteration`` and ``checkpoint_version``, the sharding switches as ``content_metadata``, then its
tracker file -- and none of this trainer's own ('mdpp') section. A stand-in for a checkpoint Megatron-LM
wrote for the same model: the test cannot run Megatron-LM's training script (not installed here), so it
makes the calls that script makes. The CUDA RNG entries Megatron-LM adds on GPUs are left out (CPU run).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import trainer.train as train_module
from trainer.config import parse_config
from trainer.train import TrainHooks, main


def _megatron_lm_rng_state():
    """Megatron-LM's get_rng_state(ckpt_format='torch_dist') without --data-parallel-random-init, on CPU."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedObject

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state()}
    return ShardedObject("rng_state", [state],
                         (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def cli(argv: list[str]) -> int:
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m tests.dist.megatron_lm_save_harness")
    parser.add_argument("--out", required=True)
    parser.add_argument("--at", type=int, required=True)
    parser.add_argument("--weights-only", action="store_true", help="as Megatron-LM's --no-save-optim --no-save-rng")
    args = parser.parse_args(argv[:split])
    train_argv = argv[split + 1:]
    cfg = parse_config(train_argv, 1)
    sessions: list = []
    setup = train_module.TrainingSession.setup

    def keep_session(self):  # the optimizer and scheduler the save needs
        sessions.append(self)
        return setup(self)

    train_module.TrainingSession.setup = keep_session

    def after_step(iteration, reduced) -> None:
        if iteration != args.at:
            return
        from megatron.core import dist_checkpointing
        from megatron.core import parallel_state as ps
        from megatron.core.utils import unwrap_model

        from trainer.checkpoint.state import _sharding_metadata

        run = sessions[0].built
        m, o, par = cfg.model, cfg.optim, cfg.parallel
        megatron_args = argparse.Namespace(
            num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
            ffn_hidden_size=m.ffn_size, seq_length=m.seq_length, world_size=dist.get_world_size(),
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            virtual_pipeline_model_parallel_size=None if len(run.model) == 1 else len(run.model),
            consumed_train_samples=sessions[0].state.consumed_samples,
            use_distributed_optimizer=par.use_distributed_optimizer, optimizer=o.optimizer, fp16=o.fp16, bf16=o.bf16,
            no_save_optim=True if args.weights_only else None, no_save_rng=True if args.weights_only else None,
            ckpt_format="torch_dist")
        # Megatron-LM's _build_sharded_state_dict_metadata (its default for the distributed optimizer,
        # dp_reshardable, unless --dist-ckpt-optim-fully-reshardable).
        content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if par.use_distributed_optimizer:
            content["distrib_optim_sharding_type"] = "dp_reshardable"
        chunks = unwrap_model(run.model)
        state = {("model" if len(chunks) == 1 else f"model{i}"): c.sharded_state_dict(
            metadata=_sharding_metadata(par.use_distributed_optimizer, content)) for i, c in enumerate(chunks)}
        if not args.weights_only:
            state["optimizer"] = run.optimizer.sharded_state_dict(
                state, metadata=_sharding_metadata(par.use_distributed_optimizer, content))
            state["opt_param_scheduler"] = run.scheduler.state_dict()
            state["rng_state"] = _megatron_lm_rng_state()
        state.update(args=megatron_args, iteration=iteration, checkpoint_version=3.0)
        folder = Path(args.out) / f"iter_{iteration:07d}"
        if dist.get_rank() == 0:
            folder.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(state, str(folder), content_metadata=content)
        if dist.get_rank() == 0:
            (Path(args.out) / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
        dist.barrier()

    return main(train_argv, TrainHooks(after_step=after_step))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
