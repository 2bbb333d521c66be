"""The shared vocabulary: names that the trainer's flags, the workflow knobs and the recipes all
accept, and the names a run gives its shared-memory segments (spelled from the run token, which
trainer/launch/run_token.py draws), each written once here and read everywhere else.

Standard library only (no torch): it is the one trainer module that workflows/ may import
(tests/unit/test_import_boundary.py).
"""

from __future__ import annotations

from typing import Literal, get_args

Transport = Literal["auto", "shm", "nccl", "gloo"]
"""Stage-to-stage transports (``--transport``, the TRANSPORT knob). An RDMA transport does not
exist: never offer one."""
TRANSPORTS: tuple[str, ...] = get_args(Transport)

FileTokenizer = Literal["GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase"]
"""Tokenizers read from local vocabulary files (Megatron-LM's ``--tokenizer-type`` names): what
preprocessing and the recipes accept (trainer/data/tokenizer.py builds each)."""
FILE_TOKENIZERS: tuple[str, ...] = get_args(FileTokenizer)
ModelFileTokenizer = Literal["Llama2Tokenizer", "HuggingFaceTokenizer"]
"""Tokenizers read from one ``--tokenizer-model`` (Megatron-LM's names): a SentencePiece model file
(Llama2Tokenizer), or a local Hugging Face tokenizer folder or ``tokenizer.json`` (HuggingFaceTokenizer)."""
MODEL_FILE_TOKENIZERS: tuple[str, ...] = get_args(ModelFileTokenizer)
TokenizerType = Literal[FileTokenizer, ModelFileTokenizer, "NullTokenizer"]
"""What training's ``--tokenizer-type`` accepts: a file tokenizer, a --tokenizer-model one, or
NullTokenizer (token ids as they are in the dataset, with ``--vocab-size``)."""
TOKENIZERS: tuple[str, ...] = get_args(TokenizerType)

# ---- the run token and the shared-memory names made from it ----------------------------------
# No imports beyond typing (workflows/ may import this module): the environment comes in as an
# argument, and the character filter is a set rather than a regular expression.

RUN_TOKEN_MAX_LENGTH = 40
"""Shared-memory names derive from the run token; keep them well under NAME_MAX (255)."""

_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.")
_JOB_CHARS = _TOKEN_CHARS | {"-"}


def _only(text: str, allowed: frozenset[str]) -> str:
    return "".join(c if c in allowed else "_" for c in text)


def launcher_prefix(env: dict[str, str]) -> str:
    """What the launcher says about the job: Slurm's ``JOB[.STEP][-rRESTART]``, else torchrun's run id.

    The step id is kept: two job steps of one allocation may run at the same time on the same host
    (``srun --exact`` side by side), and with it their names differ by construction rather than
    only by the random suffix; a human reading /dev/shm or a trace also sees which step it was.
    Slurm sets SLURM_STEP_ID in every srun task (the training ranks), not in the batch script."""
    if env.get("SLURM_JOB_ID"):
        prefix = env["SLURM_JOB_ID"]
        if env.get("SLURM_STEP_ID"):
            prefix += f".{env['SLURM_STEP_ID']}"
        if env.get("SLURM_RESTART_COUNT", "0") not in ("", "0"):
            prefix += f"-r{env['SLURM_RESTART_COUNT']}"
        return prefix
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    return "" if run_id in ("", "none") else run_id  # "none": torchrun's default, shared by every job


RUN_TAG_ENV = "MDPP_RUN_TAG"
"""Environment: a tag put in front of every run token drawn under it ([A-Za-z0-9_.] kept, the rest
becomes ``_``), so a harness running many jobs on one host can find its own runs' segments."""


def token_prefix(env: dict[str, str]) -> str:
    """What goes in front of a run token's random suffix: the caller's tag (RUN_TAG_ENV), then the
    launcher's id (trainer/launch/run_token.py draws the suffix)."""
    return "_".join(part for part in (env.get(RUN_TAG_ENV, ""), launcher_prefix(env)) if part)


def make_token(prefix: str, suffix: int) -> str:
    """``prefix-suffix`` with only [A-Za-z0-9_.-], at most RUN_TOKEN_MAX_LENGTH characters (the
    suffix kept; a ``-`` inside the prefix becomes ``_``, so the last ``-`` starts the suffix)."""
    tail = f"{suffix & 0xFFFFFFFF:08x}"
    head = _only(prefix, _TOKEN_CHARS)[: RUN_TOKEN_MAX_LENGTH - len(tail) - 1]
    return f"{head}-{tail}" if head else tail


def job_name_part(job: str) -> str:
    """A caller's job id made safe for a shared-memory name: only [A-Za-z0-9_.-], at most
    RUN_TOKEN_MAX_LENGTH characters (a run token passes unchanged)."""
    return _only(job, _JOB_CHARS)[:RUN_TOKEN_MAX_LENGTH]


def ring_name(job: str, src: int, dst: int, direction: str) -> str:
    """POSIX shm name of one stage-to-stage channel (tests/conftest.py watches for the ``mdpp`` prefix)."""
    return f"/mdpp-{job}-{src}-{dst}-{direction}"


def doorbell_name(job: str, rank: int) -> str:
    """POSIX shm name of one receiving rank's doorbell (trainer.transport.channels.Doorbell)."""
    return f"/mdpp-{job}-{rank}-bell"


def tp_decision_name(job: str, pp_rank: int, dp_rank: int) -> str:
    """Name of one stage's TP decision segment (trainer.pipeline.tp_decision), without the leading
    ``/`` that trainer.pipeline.tp_decision.TpDecisionChannel adds."""
    return f"mdpp-{job}-pp{pp_rank}-dp{dp_rank}-tpdecide"


def is_segment_of(job: str, name: str) -> bool:
    """Whether ``name`` (an entry of /dev/shm, no leading ``/``) is one of the names above made from
    ``job``: a ring, a doorbell or a TP decision segment. The shape is checked part by part, so a job
    id that merely starts with ``job`` (``job-1``) never matches: a run removes its own segments only."""
    head = f"mdpp-{job}-"
    if not name.startswith(head):
        return False
    parts = name[len(head):].split("-")
    if len(parts) == 3 and parts[2] in ("next", "prev"):
        return parts[0].isdigit() and parts[1].isdigit()
    if len(parts) == 2 and parts[1] == "bell":
        return parts[0].isdigit()
    if len(parts) == 3 and parts[2] == "tpdecide":
        return parts[0][:2] == "pp" and parts[0][2:].isdigit() and parts[1][:2] == "dp" and parts[1][2:].isdigit()
    return False


def is_segment_of_prefix(prefix: str, name: str) -> bool:
    """Whether ``name`` is a segment of any run whose token :func:`make_token` made from ``prefix``
    (whatever its random suffix): how a launcher that knows only the environment it gave its ranks
    finds their run's segments once it has had to kill them (trainer/launch/local_ranks.py)."""
    head = make_token(prefix, 0)[:-8]  # "<prefix>-" as the token spells it ("" without a prefix)
    if not head or not name.startswith(f"mdpp-{head}"):
        return False
    suffix = name[len(f"mdpp-{head}"):][:8]
    return len(suffix) == 8 and all(c in "0123456789abcdef" for c in suffix) and \
        is_segment_of(f"{head}{suffix}", name)
