"""Command lines users arrive with run to completion under torchrun, on CPU with tiny
sizes and the shipped corpus:

- the AWS test case's ``pretrain_gpt.py`` line (aws-samples/awsome-distributed-training,
  3.test_cases/megatron/megatron-lm/slurm/gpt3/2.distributed-training.sbatch): every flag it passes,
  sizes shrunk, TP 4 -> 1, plus ``--device cpu``;
- the AWS test case's Llama-2 line (same repository, megatron-lm/slurm/llama2/pretrain-llama2.sbatch,
  its llama2-70b preset): every flag it passes with a tokenizer the project trains
  (trainer/data/train_tokenizer.py, a SentencePiece model like Llama-2's), sizes shrunk;
- Megatron-LM's own ``examples/gpt3/train_gpt3_175b_distributed.sh``: every flag it passes, its
  ``--rampup-batch-size`` included, sizes shrunk (TP 8 -> 1, PP 16 -> 4) so that the ramp starts below
  the pipeline depth as the original does under DP > 1;
- the prototype's example (MegatronDPP's examples/gpt3/train_gpt3_175b_distributed.sh) as its multi-node
  form runs it: two torchrun "nodes" of 2 ranks on this host, ``--node-ips`` one address per rank,
  ``--num-gpus`` per node, ``--multi-node``, ``--workload`` the prototype's integer; sizes shrunk.

Both read their data through megatron-core's dataset builder (--split of documents, indices cached
beside the data as Megatron-LM does) and print Megatron-LM's validation lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.checkpoints import assert_megatron_checkpoint
from tests.dist.launch import REPO
from trainer.launch.ports import free_port

VOCAB, MERGES = str(REPO / "datasets/gpt2/vocab.json"), str(REPO / "datasets/gpt2/merges.txt")
ITERATION = re.compile(r"iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \|")


def _torchrun(nproc: int, args: list[str], *, nodes: int = 1, node_rank: int = 0, port: int | None = None
              ) -> subprocess.Popen:
    where = ["--standalone"] if nodes == 1 else ["--nnodes", str(nodes), "--node-rank", str(node_rank),
                                                 "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc}",
                             "-m", "trainer.train", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> str:
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    text = "\n".join(outputs)
    assert all(proc.returncode == 0 for proc in procs), text[-6000:]
    return text


def _check_run(text: str, iterations: int, samples_per_iteration: int, validated_at: list[int]) -> None:
    lines = ITERATION.findall(text)
    assert [int(i) for i, _, _ in lines] == list(range(1, iterations + 1)), text[-4000:]
    assert all(int(total) == iterations for _, total, _ in lines)
    assert int(lines[-1][2]) == iterations * samples_per_iteration
    found = VALIDATION.findall(text)
    assert [int(i) for i, _, _ in found] == validated_at, text[-4000:]
    assert all(float(loss) > 0 for _, loss, _ in found)
    assert "GPT data (megatron-core builder)" in text


@pytest.mark.timeout(900)
def test_aws_test_case_pretrain_gpt_line(gpt2_corpus: str) -> None:
    line = [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-samples", "24", "--lr-decay-samples", "20", "--lr-warmup-samples", "4",
        "--lr", "6.0e-5", "--min-lr", "6.0e-6", "--lr-decay-style", "cosine", "--log-interval", "1",
        "--eval-iters", "2", "--eval-interval", "3",
        "--data-path", gpt2_corpus, "--vocab-file", VOCAB, "--merge-file", MERGES, "--split", "98,2,0",
        "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--fp16", "--recompute-activations",
    ]
    text = _finish([_torchrun(2, ["--device", "cpu", *line])], timeout_s=800)
    _check_run(text, iterations=6, samples_per_iteration=4, validated_at=[3, 6])
    # megatron-core's indices, cached where Megatron-LM caches them without --data-cache-path.
    cached = {p.name.split("-", 1)[1] for p in (Path(gpt2_corpus) / "cache" / "GPTDataset_indices").iterdir()}
    assert {"GPTDataset-train-sample_index.npy", "GPTDataset-valid-sample_index.npy"} <= cached, cached


@pytest.mark.timeout(900)
def test_prototype_example_line_on_two_nodes(gpt2_corpus: str, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    checkpoints, tensorboard = tmp_path / "mcore_ckpt", tmp_path / "tb_logs"
    gpus_per_node = 2
    line = [
        # GPT_MODEL_ARGS
        "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--attention-backend", "auto",
        # TRAINING_ARGS
        "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "4", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0",
        "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
        "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000", "--recompute-activations", "--use-dpp",
        "--node-ips", "127.0.0.1,127.0.0.1,127.0.0.2,127.0.0.2", "--workload", str(2048 * 512),
        "--num-gpus", str(gpus_per_node), "--multi-node",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "2",
        # DATA_ARGS
        "--data-path", gpt2_corpus, "--vocab-file", VOCAB, "--merge-file", MERGES, "--split", "949,50,1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--save-interval", "50", "--eval-interval", "2", "--save", str(checkpoints),
        "--load", str(checkpoints), "--eval-iters", "1", "--tensorboard-dir", str(tensorboard),
    ]
    port = free_port()
    nodes = [_torchrun(gpus_per_node, ["--device", "cpu", *line], nodes=2, node_rank=rank, port=port)
             for rank in range(2)]
    text = _finish(nodes, timeout_s=800)
    _check_run(text, iterations=4, samples_per_iteration=16, validated_at=[2, 4])
    assert "world=4 nodes=2 TP=2 PP=2 VP=2 DP=1" in text  # the per-rank --node-ips placed the ranks
    assert_megatron_checkpoint(checkpoints, 4)
    events = EventAccumulator(str(tensorboard))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("lm loss validation")] == [2, 4]


@pytest.mark.timeout(900)
def test_megatron_lm_gpt3_175b_example_line(gpt2_corpus: str, tmp_path: Path) -> None:
    """96 -> 4 layers, hidden 12288 -> 64, 96 -> 4 heads, seq 2048 -> 32, global batch 1536 -> 8, the ramp
    16 16 5859375 -> 2 2 12 (2, 2, 4, 6, 8 samples: 2 microbatches under 4 stages first), 500000 -> 5
    iterations, the log/save/eval intervals and --eval-iters shrunk to fit 5 iterations."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    checkpoints, tensorboard = tmp_path / "ckpt", tmp_path / "tb"
    line = [
        # GPT_MODEL_ARGS
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--attention-backend", "auto",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12",
        "--train-iters", "5", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
        "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
        # DATA_ARGS
        "--data-path", gpt2_corpus, "--vocab-file", VOCAB, "--merge-file", MERGES, "--split", "949,50,1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--save-interval", "4", "--eval-interval", "3", "--save", str(checkpoints),
        "--load", str(checkpoints), "--eval-iters", "1", "--tensorboard-dir", str(tensorboard),
    ]
    text = _finish([_torchrun(4, ["--device", "cpu", *line])], timeout_s=800)
    lines = ITERATION.findall(text)
    assert [(int(i), int(c)) for i, _, c in lines] == [(1, 2), (2, 4), (3, 8), (4, 14), (5, 22)], text[-4000:]
    assert [int(b) for b in re.findall(r"global batch size:\s+(\d+)", text)] == [2, 2, 4, 6, 8]
    assert [int(i) for i, _, _ in VALIDATION.findall(text)] == [3], text[-4000:]
    assert "world=4 nodes=1 TP=1 PP=4 VP=1 DP=1" in text
    assert_megatron_checkpoint(checkpoints, 5)
    events = EventAccumulator(str(tensorboard))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def llama_corpus(corpus_slice: Path, tmp_path_factory) -> tuple[str, str]:
    """(data prefix, tokenizer.model): a SentencePiece model trained on the shipped corpus, and 150
    documents preprocessed with it as the AWS case's Llama-2 preprocessing does (Llama2Tokenizer,
    --append-eod)."""
    from trainer.data.train_tokenizer import corpus_texts, train_sentencepiece

    folder = tmp_path_factory.mktemp("llama-corpus")
    model = train_sentencepiece(list(corpus_texts(REPO / "datasets" / "python-docs.jsonl.xz", 400)),
                                folder / "llama2", vocab_size=1000)
    subprocess.run([sys.executable, "-m", "trainer.preprocess", "--input", str(corpus_slice), "--output-prefix",
                    str(folder / "my-llama2"), "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(model),
                    "--append-eod", "--workers", "2"], check=True, cwd=REPO, capture_output=True, timeout=300)
    return str(folder / "my-llama2_text_document"), str(model)


@pytest.mark.timeout(900)
def test_aws_test_case_llama2_line(llama_corpus: tuple[str, str], tmp_path: Path) -> None:
    """The AWS Llama-2 line, llama2-70b preset: TP 4 -> 2 and PP 4 -> 2 (4 CPU ranks), 80 -> 4 layers,
    hidden 8192 -> 64, 64 -> 8 heads in 8 -> 2 key/value groups, seq 4096 -> 32, global batch 2048 -> 4.
    Left out: ``--use-flash-attn --transformer-impl transformer_engine`` (the line's "to test with as
    few nodes as possible" extras: Transformer Engine's CUDA kernels, which a CPU run cannot have -- on
    CUDA with Transformer Engine they are accepted). Changed so the run validates and saves:
    ``--split 100,0,0 --eval-iters 0 --train-iters 5`` -> ``--split 98,2,0 --eval-iters 1 --eval-interval 3
    --train-iters 6``, plus ``--save``."""
    data, tokenizer_model = llama_corpus
    checkpoints = tmp_path / "ckpt"
    line = [
        # llama2-70b preset
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
        "--num-query-groups", "2", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        # "Required for Llama2-style architecture"
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--no-position-embedding",
        "--normalization", "RMSNorm", "--swiglu", "--no-masked-softmax-fusion",
        "--no-rope-fusion",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "6", "--split", "98,2,0",
        "--use-mcore-models", "--log-throughput", "--lr", "6.0e-5", "--min-lr", "6.0e-6", "--lr-decay-style", "cosine",
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "3", "--data-path", data,
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", tokenizer_model, "--clip-grad", "1.0",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006", "--fp16",
        "--save", str(checkpoints),
    ]
    text = _finish([_torchrun(4, ["--device", "cpu", *line])], timeout_s=800)
    _check_run(text, iterations=6, samples_per_iteration=4, validated_at=[3, 6])
    assert "world=4 nodes=1 TP=2 PP=2 VP=1 DP=1" in text
    assert "vocab 1000 (padded 1024)" in text  # the SentencePiece model's vocabulary, padded by 128 x TP
    assert "throughput per GPU (TFLOP/s/GPU)" in text
    assert_megatron_checkpoint(checkpoints, 6)
