"""Build megatron-core GPTModel/BertModel chunks for this rank and wrap them in megatron DDP.

A rank of pipeline stage ``s`` holds ``v`` chunks; chunk ``c`` is virtual stage ``c * p + s``, so it
pre-processes (embeddings) only at virtual stage 0 and post-processes (final norm, LM head, loss)
only at the last virtual stage. Layer placement is megatron-core's own (each layer keeps its global
``layer_number``), so checkpoints and tests can map layers by global index.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging

import torch

from trainer.config import RngPlan, TrainConfig, uses_transformer_engine_spec
from trainer.launch.topology import Topology
from trainer.model.layer_parts import parts_block_spec, stage_parts_layout
from trainer.model.steps import uses_per_token_loss

log = logging.getLogger(__name__)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def _te_available() -> bool:
    return _importable("transformer_engine")


def use_transformer_engine(cfg: TrainConfig) -> bool:
    """TE layer spec or local one (trainer.config.uses_transformer_engine_spec: --transformer-impl and
    --attention-backend, whose contradictions config validation has already refused)."""
    te = uses_transformer_engine_spec(cfg, _te_available())
    if te and not _te_available():
        raise RuntimeError(f"--transformer-impl {cfg.model.transformer_impl} / --attention-backend "
                           f"{cfg.model.attention} need transformer_engine, which does not import")
    return te


def params_dtype(cfg: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.optim.bf16 else torch.float16 if cfg.optim.fp16 else torch.float32


NO_TRACKERS = RngPlan()
"""A plan's RNG trackers without graphs or TE's tracker (what a CPU run has)."""


def transformer_config(cfg: TrainConfig, topology: Topology, rng: RngPlan = NO_TRACKERS):
    """megatron-core TransformerConfig; fusions that need CUDA kernels are off on CPU. ``rng``: the
    run plan's trackers (RunPlan.rng)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    m, on_cpu = cfg.model, cfg.run.device == "cpu"
    dtype = params_dtype(cfg)
    overlap_p2p = cfg.parallel.overlap_p2p_comm and topology.virtual_pipeline > 1
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        tensor_model_parallel_size=topology.tensor_parallel,
        # --sequence-parallel: activations [seq/TP, batch, hidden] between layers and stages.
        sequence_parallel=cfg.parallel.sequence_parallel,
        pipeline_model_parallel_size=topology.pipeline_parallel,
        virtual_pipeline_model_parallel_size=topology.virtual_pipeline if topology.virtual_pipeline > 1 else None,
        # Megatron-LM's uneven split (--decoder-first/last-pipeline-num-layers): megatron-core places
        # the layers itself, so every schedule, ours included, builds the same stages.
        num_layers_in_first_pipeline_stage=cfg.parallel.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=cfg.parallel.decoder_last_pipeline_num_layers,
        # --pipeline-stage-layers: the same placement through megatron-core's layout hook, whose
        # offsets count layers, not parts (trainer/model/layer_parts.py).
        **({"pipeline_model_parallel_layout": stage_parts_layout(cfg.parallel.pipeline_stage_layers,
                                                                 topology.pipeline_parallel)}
           if cfg.parallel.pipeline_stage_layers else {}),
        # P2P settings read only by megatron-core's schedules, set as Megatron-LM sets them:
        # overlap with interleaving unless --no-overlap-p2p-communication, batching otherwise.
        overlap_p2p_comm=overlap_p2p,
        batch_p2p_comm=not overlap_p2p,
        batch_p2p_sync=cfg.parallel.batch_p2p_sync,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=cfg.optim.bf16,
        fp16=cfg.optim.fp16,
        init_method_std=m.init_method_std,
        # --attention-backend / --use-flash-attn: megatron-core forces TE's kernel through NVTE_*_ATTN.
        attention_backend=AttnBackend[m.attention],
        # Activation recompute, as Megatron-LM passes it (--recompute-activations = selective).
        recompute_granularity=m.recompute,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        use_cpu_initialization=on_cpu,
        # Megatron frees a sent activation's storage and keeps its graph (deallocate_output_tensor).
        # Not with its CUDA graphs: a graphed layer's output is a view of the graph's static buffer,
        # which megatron refuses to free ("counter-productive to free a view"), and whose memory
        # belongs to the graph pool anyway (freeing .data would release nothing).
        deallocate_pipeline_outputs=cfg.parallel.cuda_graph_impl == "none",
        # Megatron's own softmax kernels ship with Megatron-LM builds, not the pip wheel: only use
        # them when they import (TE's attention does not need them).
        # --no-masked-softmax-fusion switches them off as in Megatron-LM.
        masked_softmax_fusion=m.masked_softmax_fusion and not on_cpu
        and _importable("scaled_upper_triang_masked_softmax_cuda"),
        bias_activation_fusion=not on_cpu,
        bias_dropout_fusion=not on_cpu,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,  # Apex-only; torch's LayerNorm (local spec without Apex) refuses it
        # Fused RoPE is Transformer Engine's kernel: only with its spec, and not after --no-rope-fusion.
        apply_rope_fusion=m.rope_fusion and m.position_embedding_type == "rope" and not on_cpu
        and use_transformer_engine(cfg),
        **llama_transformer_fields(m),
        # --variable-seq-lengths: megatron-core's P2P exchanges shapes before each transfer (our
        # runtime's headers carry them anyway), and GPT averages its loss over the batch's tokens.
        variable_seq_lengths=cfg.data.variable_seq_lengths,
        # megatron-core refuses variable_seq_lengths with its default MoE dispatcher (allgather) even
        # in a dense model; alltoall is what Megatron-LM users pass, and unused without experts.
        **({"moe_token_dispatcher_type": "alltoall"} if cfg.data.variable_seq_lengths else {}),
        calculate_per_token_loss=uses_per_token_loss(m.model, cfg.data.variable_seq_lengths),
        use_te_rng_tracker=rng.te_tracker,
        # --cuda-graph-impl local: megatron-core's per-layer graphs, recorded by its schedules.
        **({"cuda_graph_impl": cfg.parallel.cuda_graph_impl,
            "cuda_graph_warmup_steps": cfg.parallel.cuda_graph_warmup_steps}
           if cfg.parallel.cuda_graph_impl != "none" else {}),
    )


def llama_transformer_fields(m) -> dict:
    """TransformerConfig fields of the Llama-family flags, set as Megatron-LM's
    core_transformer_config_from_args sets them (a plain GPT gets megatron-core's defaults)."""
    import torch.nn.functional as F

    fields: dict = {"normalization": m.normalization, "layernorm_epsilon": m.norm_epsilon,
                    "add_bias_linear": not m.disable_bias_linear}
    if m.swiglu:
        fields.update(gated_linear_unit=True, activation_func=F.silu)
    if m.group_query_attention:
        fields["num_query_groups"] = m.num_query_groups
    return fields


def gpt_position_kwargs(m) -> dict:
    """GPTModel's position-embedding keywords (--position-embedding-type, --rotary-base/-percent)."""
    return {"position_embedding_type": m.position_embedding_type, "rotary_base": m.rotary_base,
            "rotary_percent": m.rotary_percent}


def _layer_spec(cfg: TrainConfig):
    te = use_transformer_engine(cfg)
    if cfg.model.model == "bert":
        from megatron.core.models.bert import bert_layer_specs

        if te:
            return bert_layer_specs.get_bert_layer_with_transformer_engine_spec()
        # 0.16 exports a module-level spec; guard for releases that turn it into a function.
        local = getattr(bert_layer_specs, "bert_layer_local_spec", None)
        return local if local is not None else bert_layer_specs.get_bert_layer_local_spec()
    from megatron.core.models.gpt import gpt_layer_specs

    # The local spec picks its norm by --normalization (WrappedTorchNorm: torch.nn.RMSNorm without Apex);
    # Transformer Engine's norm reads the config's normalization itself.
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec() if te \
        else gpt_layer_specs.get_gpt_layer_local_spec(normalization=cfg.model.normalization)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm for megatron-core's local spec under ``--sequence-parallel`` (without Apex).

    megatron-core's fallback norm (WrappedTorchNorm) refuses sequence parallelism: each TP rank then
    normalises only its part of the sequence, so the weight and bias gradients are partial sums that
    ``finalize_model_grads`` must all-reduce over TP, which it does for parameters marked
    ``sequence_parallel`` -- the mark megatron's Apex and TE norms set and torch's lacks. This is
    torch's LayerNorm with that mark, built with WrappedTorchNorm's arguments.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> None:
        if config.normalization != "LayerNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"SequenceParallelLayerNorm is a plain LayerNorm, not {config.normalization} "
                             f"(zero-centred gamma {config.layernorm_zero_centered_gamma})")
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """:class:`SequenceParallelLayerNorm`'s counterpart for ``--normalization RMSNorm`` (torch's RMSNorm,
    what WrappedTorchNorm builds, with the ``sequence_parallel`` mark on its weight)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> None:
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"SequenceParallelRMSNorm is a plain RMSNorm, not {config.normalization} "
                             f"(zero-centred gamma {config.layernorm_zero_centered_gamma})")
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def _block_spec(cfg: TrainConfig, config, spec, vp_stage: int | None):
    """The spec GPTModel gets for one chunk: ``spec`` itself, except under --sequence-parallel with the
    local spec's torch norms, where every norm (both of each layer and the block's final one) becomes
    :class:`SequenceParallelLayerNorm` -- as a block spec, the only way to give the final norm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = spec.submodules
    if not (cfg.parallel.sequence_parallel and WrappedTorchNorm in (layer.input_layernorm, layer.pre_mlp_layernorm)):
        return spec
    norm = SequenceParallelRMSNorm if config.normalization == "RMSNorm" else SequenceParallelLayerNorm
    norms = {name: norm for name in ("input_layernorm", "pre_mlp_layernorm")
             if getattr(layer, name) is WrappedTorchNorm}
    layer_spec = dataclasses.replace(spec, submodules=dataclasses.replace(layer, **norms))
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=norm)


def _construct(model_cls, **kwargs):
    """Pass only the keywords this megatron-core version accepts (vp_stage is newer than 0.12)."""
    accepted = inspect.signature(model_cls.__init__).parameters
    return model_cls(**{k: v for k, v in kwargs.items() if k in accepted})


def build_model_chunks(cfg: TrainConfig, topology: Topology, vocab_size: int,
                       rng: RngPlan) -> list[torch.nn.Module]:
    """This rank's model chunks (unwrapped), on the run's device."""
    config = transformer_config(cfg, topology, rng)
    spec = _layer_spec(cfg)
    padded = cfg.model.padded_vocab_size(vocab_size, topology.tensor_parallel)
    p, s, v = topology.pipeline_parallel, topology.pp_rank, topology.virtual_pipeline
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.run.device == "cuda" else torch.device("cpu")
    chunks = []
    for c in range(v):
        block_spec = _block_spec(cfg, config, spec, c if v > 1 else None)
        if cfg.parallel.pipeline_stage_layers:
            block_spec = parts_block_spec(config, block_spec, cfg.parallel.pipeline_stage_layers, c * p + s,
                                          c if v > 1 else None)
        common = dict(
            config=config, transformer_layer_spec=block_spec,
            vocab_size=padded,
            max_sequence_length=cfg.model.max_positions,
            pre_process=(c == 0 and s == 0), post_process=(c == v - 1 and s == p - 1),
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
            vp_stage=c if v > 1 else None,
        )
        if cfg.model.model == "bert":
            from megatron.core.models.bert.bert_model import BertModel

            chunk = _construct(BertModel, num_tokentypes=2, add_binary_head=True, **common)
        else:
            from megatron.core.models.gpt import GPTModel

            chunk = _construct(GPTModel, **common, **gpt_position_kwargs(cfg.model))
        chunks.append(chunk.to(device))
    return chunks


def wrap_ddp(cfg: TrainConfig, chunks: list[torch.nn.Module], runtime_launches_reduction: bool = False
             ) -> list[torch.nn.Module]:
    """megatron-core DistributedDataParallel per chunk (bucketing only on chunk 0, as Megatron does).

    ``runtime_launches_reduction``: the chunks will be trained by the DPP runtime, which starts the
    overlapped data-parallel reduction itself (trainer/model/ddp.py says why); megatron-core's
    schedules keep megatron's own DDP, whose hooks start it.

    With --bf16/--fp16 each chunk is first wrapped in megatron's Float16Module (half-precision
    weights, fp32 logits/loss), exactly as Megatron-LM's get_model does; the optimizer keeps fp32
    main weights.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if cfg.optim.bf16 or cfg.optim.fp16:
        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.optim.bf16 or cfg.optim.fp16,
        # --overlap-grad-reduce: each bucket's reduction is launched asynchronously (async_op, on CPU
        # over gloo too) once its last microbatch's gradients are in -- by megatron's parameter hooks
        # under megatron-core's schedules, by the runtime under ours -- and finalize_model_grads
        # waits. Without it every bucket is reduced at once in finalize_model_grads.
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        # --overlap-param-gather: the optimizer step leaves the parameter all-gather to later. Under
        # megatron-core's schedules forward pre-hooks dispatch each bucket's lazily, from the first
        # forward that uses it (and the next bucket's then), so align_param_gather (the schedule
        # dispatching every chunk's at once) stays off. Under our runtime the runtime starts them after
        # the step and removes the hooks (trainer/pipeline/param_gather.py).
        overlap_param_gather=cfg.parallel.overlap_param_gather,
    )
    wrapper = DistributedDataParallel
    if runtime_launches_reduction:
        from trainer.model.ddp import runtime_reduced_ddp

        wrapper = runtime_reduced_ddp()
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(wrapper(
            config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0))
    return wrapped


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())
