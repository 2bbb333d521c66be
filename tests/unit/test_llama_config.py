"""Llama-family GPT flags (Megatron-LM's names, defaults and rules): parsed, refused where Megatron-LM
refuses or where they cannot run, handed to megatron-core's TransformerConfig and GPTModel (CPU, no
process group), counted by --log-throughput as Megatron-LM counts them."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from trainer.config import ConfigError, parse_config

BASE = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--device", "cpu"]
LLAMA = ["--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--no-position-embedding",
         "--normalization", "RMSNorm", "--swiglu", "--no-masked-softmax-fusion", "--no-rope-fusion",
         "--use-mcore-models", "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--norm-epsilon", "1e-6", "--rotary-base", "500000", "--rotary-percent", "0.5"]


def _problems(flags: list[str], world_size: int = 1) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + flags, world_size=world_size)
    return err.value.problems


def test_megatron_defaults() -> None:
    m = parse_config(BASE, world_size=1).model
    assert (m.normalization, m.norm_epsilon, m.swiglu, m.disable_bias_linear) == ("LayerNorm", 1e-5, False, False)
    assert (m.position_embedding_type, m.rotary_base, m.rotary_percent) == ("learned_absolute", 10000, 1.0)
    assert (m.group_query_attention, m.num_query_groups, m.masked_softmax_fusion, m.rope_fusion) == (False, 1, True, True)
    assert m.ffn_size == 256


def test_llama_flags_reach_transformer_config_and_gpt_model() -> None:
    from trainer.launch.topology import Topology
    from trainer.model.build import gpt_position_kwargs, transformer_config

    cfg = parse_config(BASE + LLAMA + ["--tensor-model-parallel-size", "2"], world_size=2)
    tc = transformer_config(cfg, Topology(world_size=2, rank=0, tensor_parallel=2))
    assert (tc.normalization, tc.layernorm_epsilon, tc.gated_linear_unit, tc.activation_func) == \
        ("RMSNorm", 1e-6, True, F.silu)
    assert (tc.add_bias_linear, tc.num_query_groups, tc.masked_softmax_fusion, tc.apply_rope_fusion) == \
        (False, 2, False, False)
    assert gpt_position_kwargs(cfg.model) == {"position_embedding_type": "rope", "rotary_base": 500000,
                                              "rotary_percent": 0.5}
    # Megatron-LM's SwiGLU width without --ffn-hidden-size: int(4 h x 2/3 / 64) x 64.
    assert tc.ffn_hidden_size == 128 and cfg.model.ffn_size == 128
    assert parse_config(["--mock-data", "--hidden-size", "4096", "--num-attention-heads", "32", "--swiglu"],
                        world_size=1).model.ffn_size == 10880
    assert parse_config(BASE + ["--swiglu", "--ffn-hidden-size", "176"], world_size=1).model.ffn_size == 176
    # Without --group-query-attention megatron-core gets no groups (one per head), as Megatron-LM passes it.
    plain = transformer_config(parse_config(BASE + ["--num-query-groups", "2"], world_size=1), Topology(1, 0))
    assert plain.num_query_groups in (None, 8)


def test_rms_norm_under_sequence_parallel_is_marked_for_the_tp_all_reduce() -> None:
    from trainer.launch.topology import Topology
    from trainer.model.build import SequenceParallelRMSNorm, transformer_config

    cfg = parse_config(BASE + LLAMA + ["--sequence-parallel", "--tensor-model-parallel-size", "2"], world_size=2)
    norm = SequenceParallelRMSNorm(transformer_config(cfg, Topology(world_size=2, rank=0, tensor_parallel=2)), 64)
    assert [getattr(p, "sequence_parallel", False) for p in norm.parameters()] == [True]


def test_llama_refusals_name_flag_and_value() -> None:
    assert _problems(["--no-position-embedding"]) == [
        "--no-position-embedding is deprecated, use --position-embedding-type (it is accepted only with "
        "--position-embedding-type rope; got learned_absolute)"]
    assert _problems(["--group-query-attention", "--num-query-groups", "3"]) == [
        "--num-attention-heads=8 is not divisible by --num-query-groups=3"]
    assert _problems(["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"],
                     world_size=4) == [
        "--num-query-groups=2 is not divisible by --tensor-model-parallel-size=4 (each TP rank holds whole "
        "key/value groups)"]
    assert _problems(["--rotary-percent", "0"]) == ["--rotary-percent=0.0 must be in (0, 1]"]
    assert _problems(["--normalization", "LayerNorm1p"]) == [
        "--normalization='LayerNorm1p' must be LayerNorm or RMSNorm"]
    assert _problems(["--model", "bert", "--swiglu", "--normalization", "RMSNorm"]) == [
        "--normalization --swiglu are implemented for --model gpt only (Llama-family GPT models)"]
    assert _problems(["--overlap-param-gather"]) == ["--overlap-param-gather needs --use-distributed-optimizer",
                                                     "--overlap-param-gather needs --overlap-grad-reduce"]


def test_aws_llama2_flags_are_no_longer_refused() -> None:
    flags = LLAMA + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                     "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                     "--global-batch-size", "4"]
    cfg = parse_config(BASE + flags, world_size=4)
    assert cfg.parallel.overlap_param_gather and cfg.model.group_query_attention


def test_tokenizer_model_flags() -> None:
    data = ["--num-layers", "2", "--data-path", "x"]
    for kind in ("Llama2Tokenizer", "HuggingFaceTokenizer"):
        with pytest.raises(ConfigError) as err:
            parse_config(data + ["--tokenizer-type", kind], world_size=1)
        assert err.value.problems == [f"--tokenizer-model is required with --tokenizer-type={kind}"]
        cfg = parse_config(data + ["--tokenizer-type", kind, "--tokenizer-model", "t.model"], world_size=1)
        assert cfg.data.tokenizer_model == "t.model"
    with pytest.raises(ConfigError) as err:
        parse_config(data + ["--vocab-file", "v", "--merge-file", "m", "--tokenizer-model", "t.model"], world_size=1)
    assert err.value.problems == ["--tokenizer-model=t.model is read by --tokenizer-type Llama2Tokenizer or "
                                  "HuggingFaceTokenizer, not GPT2BPETokenizer"]


def test_bert_without_tokenizer_type_hears_it_needs_wordpiece() -> None:
    # The prototype's BERT example passes --vocab-file but no --tokenizer-type (GPT-2's by default).
    with pytest.raises(ConfigError) as err:
        parse_config(["--model", "bert", "--data-path", "x", "--vocab-file", "vocab.txt"], world_size=1)
    assert err.value.problems == ["BERT needs a WordPiece tokenizer: --model bert with --data-path needs "
                                  "--tokenizer-type BertWordPieceLowerCase or BertWordPieceCase and its --vocab-file "
                                  "(got GPT2BPETokenizer (the default))"]


def test_log_throughput_counts_gqa_and_swiglu_as_megatron_lm() -> None:
    from trainer.measure.flops import flops_per_iteration

    cfg = parse_config(BASE + LLAMA + ["--seq-length", "32", "--global-batch-size", "4"], world_size=1)
    L, h, s, f, V, n, g = 4, 64, 32, 128, 1024, 8, 2  # noqa: N806 - Megatron-LM's symbols
    # num_floating_point_operations: 12 x B s L h^2 x ((1 + g/n + s/h/2) + f/h x 3/2 + V / (2 L h))
    expected = 12 * 4 * s * L * h * h * ((1 + g / n + s / h / 2) + f / h * 1.5 + V / (2 * L * h))
    assert flops_per_iteration(cfg, V) == pytest.approx(expected, rel=1e-12)


def test_transformer_engine_without_it_is_refused_before_start_up() -> None:
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    assert _problems(["--transformer-impl", "transformer_engine"]) == [
        "--transformer-impl transformer_engine needs --device cuda (Transformer Engine's layers are CUDA only); on "
        "CPU use --transformer-impl local or auto"]
    with pytest.raises(ConfigError) as err:
        parse_config(["--mock-data", "--device", "cuda", "--transformer-impl", "transformer_engine"], world_size=1)
    assert "--transformer-impl transformer_engine needs Transformer Engine, which does not import here" in str(err.value)
