"""Transformer Engine: whether the model is built from its layer spec, and what rules out the attention
backend asked for (its kernels, the flash-attn package, NVTE_*_ATTN variables), before any process starts."""

from __future__ import annotations

import functools
import importlib.util
import os

from trainer.config.training import TrainConfig

# Environment switches megatron-core sets for Transformer Engine per backend (LanguageModule's
# _set_attention_backend), in the order NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN.
NVTE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
NVTE_ATTENTION_VALUES = {"auto": (1, 1, 1), "flash": (1, 0, 0), "fused": (0, 1, 0), "unfused": (0, 0, 1),
                         "local": (0, 0, 0)}
TE_ATTENTION_BACKENDS = ("flash", "fused", "unfused")  # kernels of Transformer Engine's attention


@functools.cache
def import_problem(module: str) -> str | None:
    """Why ``module`` does not import here (None: it does). A real import, not a look-up: a broken
    install is found by the spec look-up and then fails in every rank."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a missing shared library / symbol at load time
        return f"{type(exc).__name__}: {exc}"
    return None


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def uses_transformer_engine_spec(cfg: TrainConfig, te_installed: bool) -> bool:
    """Whether the model is built from megatron-core's Transformer Engine layer spec: a TE attention
    backend needs it, --attention-backend local is the local spec (Megatron-LM's --spec local), and
    otherwise --transformer-impl decides ("auto": TE on CUDA where it is installed)."""
    backend, impl = cfg.model.attention, cfg.model.transformer_impl
    if backend in TE_ATTENTION_BACKENDS:
        return True
    if backend == "local" or impl == "local":
        return False
    return impl == "transformer_engine" or (cfg.run.device == "cuda" and te_installed)


def attention_backend_problems(cfg: TrainConfig, environ: dict[str, str] | None = None) -> list[str]:
    """What rules out the --attention-backend / --use-flash-attn chosen, before any process starts:
    a contradicting --transformer-impl, a TE kernel on CPU or without Transformer Engine (or, for
    flash, without the flash-attn package), and NVTE_*_ATTN variables that megatron-core would find
    set against the backend (it asserts on them when building the model, even for auto)."""
    backend, impl = cfg.model.attention, cfg.model.transformer_impl
    flag = ("--use-flash-attn" if cfg.model.use_flash_attn else
            f"--attention-backend {backend}" + (" (the default)" if backend == "auto" else ""))
    p = []
    if backend == "local" and impl == "transformer_engine":
        p.append(f"{flag} is megatron-core's own attention (the local layer spec) but --transformer-impl "
                 "transformer_engine asks for Transformer Engine's: give one of them")
    if backend in TE_ATTENTION_BACKENDS:
        if impl == "local":
            p.append(f"{flag} is a kernel of Transformer Engine's attention but --transformer-impl local builds "
                     "megatron-core's own: drop one of them (--attention-backend local is the local one)")
        if cfg.run.device != "cuda":
            p.append(f"{flag} needs --device cuda (Transformer Engine's attention kernels are CUDA only); "
                     "on CPU use --attention-backend auto or local")
        elif not installed("transformer_engine"):
            p.append(f"{flag} needs Transformer Engine, which is not installed (transformer_engine does not "
                     "import here); install it, or use --attention-backend auto or local")
        if backend == "flash" and cfg.run.device == "cuda" and not any(
                installed(m) for m in ("flash_attn", "flash_attn_interface", "flash_attn_3")):
            p.append(f"{flag} needs the flash-attn package (Transformer Engine's flash backend calls it), which "
                     "is not installed; install flash-attn, or use --attention-backend fused/unfused/auto")
    if impl == "transformer_engine" and backend not in (*TE_ATTENTION_BACKENDS, "local"):
        # The TE backends and --attention-backend local name their own problem above; otherwise the
        # model build would fail after start-up, in every rank, with an import traceback.
        if cfg.run.device != "cuda":
            p.append("--transformer-impl transformer_engine needs --device cuda (Transformer Engine's layers are "
                     "CUDA only); on CPU use --transformer-impl local or auto")
        else:
            why = import_problem("transformer_engine.pytorch")
            if why is not None:
                p.append(f"--transformer-impl transformer_engine needs Transformer Engine, which does not import "
                         f"here ({why}); build it with scripts/te/build.sh (docs/transformer_engine.md), or use "
                         "--transformer-impl local or auto")
    if cfg.model.te_rng_tracker:
        if cfg.run.device != "cuda":
            p.append("--te-rng-tracker needs --device cuda (Transformer Engine's RNG tracker holds CUDA "
                     "generator states); drop it on CPU")
        elif (why := import_problem("transformer_engine.pytorch")) is not None:
            p.append(f"--te-rng-tracker needs Transformer Engine, which does not import here ({why}); drop it, "
                     "or build TE with scripts/te/build.sh (docs/transformer_engine.md)")
    env = os.environ if environ is None else environ
    for name, want in zip(NVTE_ATTENTION_ENV, NVTE_ATTENTION_VALUES[backend], strict=True):
        if env.get(name) not in (None, str(want)):
            p.append(f"{flag} sets {name}={want} but the environment has {name}={env[name]} "
                     "(megatron-core refuses the mismatch): unset it")
    return p


def te_rng_tracker(cfg: TrainConfig) -> tuple[bool, str]:
    """(whether the run seeds Transformer Engine's RNG tracker, why). Asked for (--te-rng-tracker), or,
    as Megatron-LM does, where megatron-core's graphs (--cuda-graph-impl local) capture TE's layers:
    TE's attention asserts "Unsupported RNG states tracker" under their capture with any other."""
    if cfg.model.te_rng_tracker:
        return True, "--te-rng-tracker"
    if (cfg.parallel.cuda_graph_impl != "none" and cfg.run.device == "cuda"
            and uses_transformer_engine_spec(cfg, installed("transformer_engine"))):
        return True, ("--cuda-graph-impl local with Transformer Engine's layers: TE's attention needs TE's RNG "
                      "tracker under graph capture (Megatron-LM turns --te-rng-tracker on for it too)")
    return False, ""
