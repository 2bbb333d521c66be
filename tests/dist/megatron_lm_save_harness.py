"""``python -m tests.dist.megatron_lm_save_harness --out DIR --at K -- <trainer.train flags>``: train, and after
iteration K also write the model as Megatron-LM's own save path does: megatron-core's
``dist_checkpointing.save`` of each chunk's ``sharded_state_dict`` (keys ``model`` / ``model<i>``) with
Megatron-LM's common keys ``args`` (an argparse Namespace like its own), ``iteration`` and
``checkpoint_version``, then its tracker file -- no optimizer, scheduler or RNG state, and none of this
trainer's own ('mdpp') section. A stand-in for a checkpoint Megatron-LM wrote for the same model: the
test cannot run Megatron-LM's training script (not installed here), so it uses the save call that
script makes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

from trainer.config import parse_config
from trainer.train import TrainHooks, main


def cli(argv: list[str]) -> int:
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m tests.dist.megatron_lm_save_harness")
    parser.add_argument("--out", required=True)
    parser.add_argument("--at", type=int, required=True)
    args = parser.parse_args(argv[:split])
    train_argv = argv[split + 1:]
    cfg = parse_config(train_argv, 1)
    chunks: list = []

    def after_build(built, topology) -> None:
        chunks.extend(built)

    def after_step(iteration, reduced) -> None:
        if iteration != args.at:
            return
        from megatron.core import dist_checkpointing

        from trainer.checkpoint.state import _sharding_metadata

        m, o = cfg.model, cfg.optim
        megatron_args = argparse.Namespace(
            num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
            ffn_hidden_size=m.ffn_size, seq_length=m.seq_length, world_size=dist.get_world_size(),
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
            consumed_train_samples=iteration * o.global_batch_size, use_distributed_optimizer=False,
            ckpt_format="torch_dist")
        state = {("model" if len(chunks) == 1 else f"model{i}"): c.sharded_state_dict(metadata=_sharding_metadata(False))
                 for i, c in enumerate(chunks)}
        state.update(args=megatron_args, iteration=iteration, checkpoint_version=3.0)
        folder = Path(args.out) / f"iter_{iteration:07d}"
        if dist.get_rank() == 0:
            folder.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(state, str(folder))
        if dist.get_rank() == 0:
            (Path(args.out) / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
        dist.barrier()

    return main(train_argv, TrainHooks(after_build=after_build, after_step=after_step))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
