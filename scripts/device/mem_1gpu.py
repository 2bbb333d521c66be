"""One GPU, two ranks sharing it (gloo): each rank's peak *reserved* memory for DPP variants of the
PP=2 memory configuration (GPT 8 layers h2048, split 5/3, M=16, bf16, SGD -- the same flags as
scripts/device/call_pp2_mem.sh's bench lines). Memory per process does not depend on which GPU the
other rank uses, so this measures what a 2-GPU run would reserve; times mean nothing here.

    python3 scripts/device/mem_1gpu.py [--pp4] VARIANT [VARIANT ...]   (names: see VARIANTS)

--pp4: the issue-12 model instead (GPT 16 layers, split 5/4/4/3, PP=4, M=32; four ranks on the GPU).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from trainer.local_ranks import run_ranks

BASE = ("--device cuda --mock-data --num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024 "
        "--max-position-embeddings 1024 --vocab-size 50257 --micro-batch-size 2 --global-batch-size 32 "
        "--pipeline-model-parallel-size 2 --train-iters 4 --optimizer sgd --lr 1e-4 --hidden-dropout 0 "
        "--attention-dropout 0 --seed 1234 --log-interval 1 --bf16 --decoder-first-pipeline-num-layers 5 "
        "--decoder-last-pipeline-num-layers 3 --distributed-backend gloo --dpp-timeout 120").split()
DPP = ["--use-dpp", "--dpp-policy", "dpp"]
RC = ["--recompute-activations"]
VARIANTS = {
    "dpp-eager": DPP,
    "dpp-eager-rc": DPP + RC,
    "dpp-graphs": DPP + ["--dpp-cuda-graphs"],
    "dpp-graphs-rc": DPP + ["--dpp-cuda-graphs"] + RC,
    "dpp-graphs-cf1.5": DPP + ["--dpp-cuda-graphs", "--dpp-cap-factor", "1.5"],
    "dpp-graphs-rc-cf1.5": DPP + ["--dpp-cuda-graphs", "--dpp-cap-factor", "1.5"] + RC,
    "dpp-graphs-rc-cf2": DPP + ["--dpp-cuda-graphs", "--dpp-cap-factor", "2"] + RC,
}
PP4 = {"--num-layers": "16", "--global-batch-size": "64", "--pipeline-model-parallel-size": "4"}
GIB = 2**30


def _with(base: list[str], values: dict[str, str]) -> list[str]:
    out = list(base)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


def main(argv: list[str]) -> int:
    pp4 = "--pp4" in argv
    argv = [a for a in argv if a != "--pp4"]
    base, world = (_with(BASE, PP4), 4) if pp4 else (BASE, 2)
    for name in argv or list(VARIANTS):
        out = Path("/tmp/mem1") / f"{'pp4-' if pp4 else ''}{name}"
        metrics = out / "metrics"
        start = time.monotonic()
        run = run_ranks("trainer.train", [*base, *VARIANTS[name], "--metrics-dir", str(metrics)], world, out,
                        "cuda", timeout_s=240, threads=4)
        text = "".join(log.read_text(errors="replace") for log in run.logs)
        graphs = sorted(set(m.group(0) for m in re.finditer(r"stage \d: CUDA graphs.*reserved for them", text)))
        losses = re.findall(r"lm loss:? ([0-9.E+-]+)", text)[-2:]
        print(f"== {name}: rc={run.returncode} {time.monotonic() - start:.0f}s losses {losses}", flush=True)
        for g in graphs:
            print("   ", g)
        for rank in range(world):
            f = metrics / f"metrics_rank{rank:05d}.json"
            if f.exists():
                m = json.loads(f.read_text())
                print(f"    rank {rank}: peak reserved {(m['peak_reserved_bytes'] or 0) / GIB:.2f} GiB, "
                      f"allocated {(m['peak_memory_bytes'] or 0) / GIB:.2f} GiB")
        if run.returncode:
            print("\n".join(text.splitlines()[-25:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
