"""tp_shards.py: Megatron's tensor/pipeline-parallel cuts of a state dict, on tiny transformers models (CPU).

Shard then gather is the unsharded state (torch.equal); and the shards hold what Megatron puts there: whole
query groups per rank, [gate_r; up_r] in fc1, the vocabulary padded to 128 x TP, stage-local layer numbers.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from miles.backends.megatron_backend.families import describe  # noqa: E402
from miles.backends.megatron_backend.convert import hf_moe_layout, hf_to_megatron, megatron_to_hf  # noqa: E402
from miles.backends.megatron_backend.weight_rules import qkv_to_megatron  # noqa: E402
from miles.backends.megatron_backend.tp_shards import (padded_vocab_size, pp_stage, pp_unstage,  # noqa: E402
                                                       split_kind, tp_gather, tp_shard)
from miles.parallel.layout import ParallelLayout, stage_layers  # noqa: E402

from test_megatron_convert import tiny  # noqa: E402


def equal_states(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("family,tp,etp", [("llama", 2, 1), ("qwen3_moe", 2, 1), ("qwen3_moe", 2, 2),
                                           ("llama", 1, 1)])
def test_shard_then_gather_is_the_unsharded_state(family, tp, etp):
    config, hf = tiny(family)
    arch = describe(config)
    full = hf_to_megatron(hf, config)
    shards = [tp_shard(full, tp_rank=r, tp=tp, etp_rank=r % etp, etp=etp, vocab_size=arch.vocab_size)
              for r in range(tp)]
    equal_states(tp_gather(shards, tp_rank=0, etp=etp, vocab_size=arch.vocab_size), full)
    back = megatron_to_hf(tp_gather(shards, tp_rank=0, etp=etp, vocab_size=arch.vocab_size), config,
                          hf_moe_layout=hf_moe_layout(hf))
    equal_states(back, hf)


def test_each_tp_rank_holds_whole_query_groups_and_its_gate_and_up_slices():
    config, hf = tiny("llama")  # 4 heads in 2 query groups, head_dim 8, ffn 48
    arch = describe(config)
    full = hf_to_megatron(hf, config)
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    for r in range(2):
        shard = tp_shard(full, tp_rank=r, tp=2, vocab_size=arch.vocab_size)
        q = hf[attn + "q_proj.weight"][r * 16:(r + 1) * 16]  # group r: its 2 query heads
        k, v = (hf[attn + f"{p}_proj.weight"][r * 8:(r + 1) * 8] for p in "kv")
        one_group = describe(config).__class__(**{**vars(arch), "num_attention_heads": 2, "num_query_groups": 1})
        assert torch.equal(shard["decoder.layers.0.self_attention.linear_qkv.weight"],
                           qkv_to_megatron(q, k, v, one_group))
        rows = slice(r * 24, (r + 1) * 24)
        gate, up = hf[mlp + "gate_proj.weight"][rows], hf[mlp + "up_proj.weight"][rows]
        assert torch.equal(shard["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate, up]))
        assert torch.equal(shard["decoder.layers.0.mlp.linear_fc2.weight"], hf[mlp + "down_proj.weight"][:, rows])
        assert torch.equal(shard["decoder.layers.0.self_attention.linear_proj.weight"],
                           hf[attn + "o_proj.weight"][:, r * 16:(r + 1) * 16])
        assert torch.equal(shard["decoder.layers.0.input_layernorm.weight"], hf["model.layers.0.input_layernorm.weight"])


def test_the_vocabulary_is_padded_to_128_x_tp_with_zero_rows():
    config, hf = tiny("llama")  # vocab 96
    full = hf_to_megatron(hf, config)
    assert padded_vocab_size(96, 1) == 96 and padded_vocab_size(96, 2) == 256 and padded_vocab_size(300, 4) == 512
    shards = [tp_shard(full, tp_rank=r, tp=2, vocab_size=96) for r in range(2)]
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert [s[name].shape[0] for s in shards] == [128, 128]
        assert torch.equal(shards[0][name][:96], full[name])
        assert not shards[0][name][96:].any() and not shards[1][name].any()


def test_experts_split_over_etp_and_the_router_is_replicated():
    config, hf = tiny("qwen3_moe")
    full = hf_to_megatron(hf, config)
    fc1 = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    router = "decoder.layers.0.mlp.router.weight"
    whole = tp_shard(full, tp_rank=1, tp=2, etp_rank=0, etp=1, vocab_size=96)
    assert torch.equal(whole[fc1], full[fc1]) and torch.equal(whole[router], full[router])
    half = tp_shard(full, tp_rank=1, tp=2, etp_rank=1, etp=2, vocab_size=96)
    gate, up = torch.chunk(full[fc1], 2)
    assert torch.equal(half[fc1], torch.cat([gate[12:], up[12:]]))


def test_unknown_tensors_have_no_silent_rule():
    with pytest.raises(KeyError, match="no tensor-parallel rule"):
        split_kind("decoder.layers.0.self_attention.mystery.weight")


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("qwen3_moe", False)])
def test_pipeline_stages_hold_their_layers_renumbered_and_unstage_back(family, tied):
    config, hf = tiny(family)
    arch = describe(config)
    full = hf_to_megatron(hf, config)
    stages = stage_layers(arch.num_layers, ParallelLayout(world=2, pp=2, first_stage_layers=arch.num_layers - 1)
                          if arch.num_layers % 2 else ParallelLayout(world=2, pp=2))
    parts = [pp_stage(full, stages, s, tied_embeddings=tied) for s in range(2)]
    assert "embedding.word_embeddings.weight" in parts[0] and "decoder.final_layernorm.weight" in parts[1]
    assert ("output_layer.weight" in parts[1]) and "output_layer.weight" not in parts[0]
    last_first = f"decoder.layers.{stages[1].start}.self_attention.linear_qkv.weight"
    assert torch.equal(parts[1]["decoder.layers.0.self_attention.linear_qkv.weight"], full[last_first])
    assert not any(k.startswith(f"decoder.layers.{len(stages[1])}.") for k in parts[1])
    equal_states(pp_unstage(parts, stages, tied_embeddings=tied), full)


def test_tp_and_pp_together_gather_back_to_hf():
    config, hf = tiny("qwen3_moe")  # 3 layers: PP2 with 2 + 1
    arch = describe(config)
    full = hf_to_megatron(hf, config)
    stages = stage_layers(3, ParallelLayout(world=4, tp=2, pp=2, first_stage_layers=2))
    grid = [[tp_shard(pp_stage(full, stages, s, tied_embeddings=False), tp_rank=r, tp=2, vocab_size=arch.vocab_size)
             for r in range(2)] for s in range(2)]
    staged = [tp_gather(row, tp_rank=0, vocab_size=arch.vocab_size) for row in grid]
    equal_states(megatron_to_hf(pp_unstage(staged, stages, tied_embeddings=False), config,
                                hf_moe_layout=hf_moe_layout(hf)), hf)


def test_the_model_is_built_for_the_layout():
    from miles.backends.megatron_backend.model import gpt_model_kwargs, transformer_config_from_hf

    config, _ = tiny("qwen3_moe")
    layout = ParallelLayout(world=8, tp=2, pp=2, ep=2, etp=1, first_stage_layers=2)
    kw = transformer_config_from_hf(config, params_dtype=torch.bfloat16, expert_model_parallel_size=2, layout=layout,
                                    sequence_parallel=True)
    assert (kw["tensor_model_parallel_size"], kw["pipeline_model_parallel_size"], kw["expert_tensor_parallel_size"],
            kw["expert_model_parallel_size"], kw["sequence_parallel"]) == (2, 2, 1, 2, True)
    assert (kw["num_layers_in_first_pipeline_stage"], kw["num_layers_in_last_pipeline_stage"]) == (2, None)
    assert kw["pipeline_dtype"] is torch.bfloat16 and kw["variable_seq_lengths"] is True
    assert gpt_model_kwargs(config, 2)["vocab_size"] == 256 and gpt_model_kwargs(config)["vocab_size"] == 96
    single = transformer_config_from_hf(config, params_dtype=torch.bfloat16)
    assert (single["tensor_model_parallel_size"], single["pipeline_model_parallel_size"]) == (1, 1)
    assert "pipeline_dtype" not in single
    # megatron-core 0.19 refuses variable_seq_lengths with its default allgather dispatcher, dense model or not
    dense = transformer_config_from_hf(tiny("llama")[0], params_dtype=torch.float32, layout=ParallelLayout(world=2, pp=2))
    assert dense["variable_seq_lengths"] is True and dense["moe_token_dispatcher_type"] == "alltoall"


def test_sequence_parallel_padding_reaches_a_multiple_of_tp_and_keeps_the_tokens():
    from miles.backends.megatron_backend.model_parallel import pad_sequence

    ids, pos = torch.arange(2 * 13).view(2, 13) + 1, torch.arange(13).expand(2, 13)
    for tp, length in ((2, 14), (4, 16), (13, 13)):
        padded_ids, padded_pos = pad_sequence(ids, pos, tp)
        assert padded_ids.shape == padded_pos.shape == (2, length)
        assert torch.equal(padded_ids[:, :13], ids) and torch.equal(padded_pos[:, :13], pos)
        assert not padded_ids[:, 13:].any() and not padded_pos[:, 13:].any()
