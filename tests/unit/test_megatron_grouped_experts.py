"""Grouped experts' weights (pieces/grouped_experts.py; CPU, no megatron): the layout is SequentialMLP's per-expert
tensors stacked (transformers 5's fused experts), the HF round trip is exact, expert-parallel ranks hold their slice
of the expert axis and join back exactly, and expert-tensor parallelism cuts each expert as it cuts SequentialMLP's.

Each conversion into megatron names its layout (``grouped_experts``); the way back reads it from the state dict's
names. The modules are checked on megatron in test_megatron_cpu_grouped_experts.py.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from miles.backends.megatron_backend.convert import (  # noqa: E402
    experts_to_global,
    hf_moe_layout,
    hf_to_megatron,
    iter_megatron_to_hf,
    join_experts,
    megatron_to_hf,
)
from miles.backends.megatron_backend.families import describe  # noqa: E402
from miles.backends.megatron_backend.model import transformer_config_from_hf  # noqa: E402
from miles.backends.megatron_backend.pieces.grouped_experts import (  # noqa: E402
    grouped_expert_rules,
    stacked_rule,
)
from miles.backends.megatron_backend.tp_shards import tp_gather, tp_shard  # noqa: E402
from miles.backends.megatron_backend.weight_rules import Rule, cat_rows, halves, routed_expert_rules  # noqa: E402

from test_megatron_convert import tiny  # noqa: E402

MOE_FAMILIES = ["qwen3_moe", "mixtral"]  # tiny("qwen3_moe"): layer 1 dense; 4 experts of 24 rows, hidden 32


def _grouped(hf, config, **kwargs):
    """The grouped experts' layout of the HF weights (``build_gpt_model(..., grouped_experts=True)``'s names)."""
    return hf_to_megatron(hf, config, grouped_experts=True, **kwargs)


def _sequential(hf, config):
    """The SequentialMLP layout of the same weights (the default)."""
    return hf_to_megatron(hf, config)


def _in_hf_layout(hf, config, layout: str):
    """The same HF weights in HF expert layout ``layout`` (through the SequentialMLP conversion)."""
    return megatron_to_hf(_sequential(hf, config), config, hf_moe_layout=layout)


def _per_expert(name: str, expert: int) -> str:
    prefix, projection = name.split(".mlp.experts.")
    return f"{prefix}.mlp.experts.local_experts.{expert}.{projection}"


def _equal_states(a, b):
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:6]
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _grouped_names(config):
    arch = describe(config)
    return [f"decoder.layers.{i}.mlp.experts.linear_fc{n}.weight"
            for i in range(arch.num_layers) if arch.is_moe_layer(i) for n in (1, 2)]


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_grouped_tensors_are_the_per_expert_ones_stacked(name):
    config, hf = tiny(name)
    mcore, sequential = _grouped(hf, config), _sequential(hf, config)
    names = _grouped_names(config)
    assert names and set(mcore) - set(names) == {k for k in sequential if ".local_experts." not in k}
    for k in names:
        per_expert = [sequential[_per_expert(k, e)] for e in range(mcore[k].shape[0])]
        assert mcore[k].shape[0] == 4 and torch.equal(mcore[k], torch.stack(per_expert)), k
    for k in set(mcore) - set(names):
        assert torch.equal(mcore[k], sequential[k]), k


def test_grouped_tensors_are_transformers_5s_fused_experts():
    config, hf = tiny("qwen3_moe")
    assert hf_moe_layout(hf) == "fused", "transformers >= 5 stacks experts; this checks its layout"
    mcore = _grouped(hf, config)
    for i in (0, 2):
        experts = f"model.layers.{i}.mlp.experts."
        assert torch.equal(mcore[f"decoder.layers.{i}.mlp.experts.linear_fc1.weight"], hf[experts + "gate_up_proj"])
        assert torch.equal(mcore[f"decoder.layers.{i}.mlp.experts.linear_fc2.weight"], hf[experts + "down_proj"])


@pytest.mark.parametrize("fused_norms", [False, True], ids=["local-spec", "te-spec"])
@pytest.mark.parametrize("hf_layout", ["fused", "per_expert"])
@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_round_trip_is_exact(name, hf_layout, fused_norms):
    config, fused = tiny(name)
    hf = _in_hf_layout(fused, config, hf_layout)
    assert hf_moe_layout(hf) == hf_layout
    mcore = _grouped(hf, config, fused_norms=fused_norms)
    assert set(_grouped_names(config)) <= set(mcore) and not any(".local_experts." in k for k in mcore)
    back = megatron_to_hf(mcore, config, fused_norms=fused_norms, hf_moe_layout=hf_layout)
    _equal_states(back, hf)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_expert_parallel_ranks_hold_their_slice_and_join_back_exactly(name):
    config, hf = tiny(name)
    full = _grouped(hf, config)
    ranks = [_grouped(hf, config, ep_rank=r, ep_size=2) for r in range(2)]
    for r, state in enumerate(ranks):
        assert set(state) == set(full)
        for k in full:
            expected = full[k][2 * r:2 * r + 2] if k in _grouped_names(config) else full[k]
            assert torch.equal(state[k], expected), (r, k)
    experts = [{k: v for k, v in state.items() if ".mlp.experts." in k} for state in ranks]
    _equal_states({**ranks[0], **join_experts(experts, config)}, full)
    with pytest.raises(ValueError, match="join_experts"):
        experts_to_global(ranks[1], config, 1, 2)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_the_layer_by_layer_export_joins_expert_parallel_ranks(name):
    """iter_megatron_to_hf hands each MoE layer's grouped tensors to the expert gather (as the trainer does at
    EP > 1); joined over the ranks they export the HF weights exactly."""
    config, hf = tiny(name)
    ranks = [_grouped(hf, config, ep_rank=r, ep_size=2) for r in range(2)]
    seen = []

    def layer_experts(layer, local):
        seen.append((layer, sorted(local)))
        prefix = f"decoder.layers.{layer}.mlp.experts."
        return join_experts([{k: v for k, v in state.items() if k.startswith(prefix)} for state in ranks], config)

    back = dict(iter_megatron_to_hf(ranks[0], config, hf_moe_layout=hf_moe_layout(hf), layer_experts=layer_experts))
    _equal_states(back, hf)
    names = _grouped_names(config)
    assert [name for _, local in seen for name in local] == names


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_expert_tensor_parallelism_cuts_each_expert_as_sequential_mlps(name):
    config, hf = tiny(name)
    arch = describe(config)
    full, sequential = _grouped(hf, config), _sequential(hf, config)
    cut = dict(tp=2, etp=2, vocab_size=arch.vocab_size, rules=arch.tp_rules)
    shards = [tp_shard(full, tp_rank=r, etp_rank=r, **cut) for r in range(2)]
    sequential_shards = [tp_shard(sequential, tp_rank=r, etp_rank=r, **cut) for r in range(2)]
    for r in range(2):
        for k in _grouped_names(config):
            assert shards[r][k].shape[1:] == sequential_shards[r][_per_expert(k, 0)].shape
            per_expert = [sequential_shards[r][_per_expert(k, e)] for e in range(4)]
            assert torch.equal(shards[r][k], torch.stack(per_expert)), (r, k)
    gathered = tp_gather(shards, tp_rank=1, etp=2, vocab_size=arch.vocab_size, rules=arch.tp_rules)
    _equal_states(gathered, full)
    _equal_states(megatron_to_hf(gathered, config, hf_moe_layout=hf_moe_layout(hf)), hf)


def test_expert_tensor_parallelism_refuses_rows_it_cannot_split():
    config, hf = tiny("qwen3_moe")  # 24 rows per expert projection: not over ETP 16
    full = _grouped(hf, config)
    with pytest.raises(ValueError, match="linear_fc1.weight: its row sections"):
        tp_shard(full, tp_rank=0, tp=16, etp_rank=0, etp=16, vocab_size=96)


def test_the_transformer_config_asks_for_grouped_experts_when_told():
    config, _ = tiny("qwen3_moe")
    assert transformer_config_from_hf(config, params_dtype=torch.float32)["moe_grouped_gemm"] is False
    grouped = transformer_config_from_hf(config, params_dtype=torch.float32, grouped_experts=True)
    assert grouped["moe_grouped_gemm"] is True


def test_grouped_rules_need_every_expert_converted_alike():
    config, _ = tiny("qwen3_moe")
    rules = routed_expert_rules(describe(config), 0)
    with pytest.raises(ValueError, match=r"experts \[0, 2, 3\]"):
        grouped_expert_rules([r for r in rules if ".local_experts.1." not in r.mcore])
    fc1 = [r for r in rules if r.mcore.endswith("linear_fc1.weight")]
    unlike = Rule(fc1[1].hf, fc1[1].mcore, lambda ts: torch.cat(ts[::-1]), halves)
    with pytest.raises(ValueError, match="convert unlike"):
        stacked_rule([fc1[0], unlike], "decoder.layers.0.mlp.experts.linear_fc1.weight")


def test_stacked_rule_merges_any_run_of_experts_and_splits_to_views():
    gate = [torch.full((2, 3), float(e)) for e in range(3)]
    up = [torch.full((2, 3), 10.0 + e) for e in range(3)]
    per_expert = [Rule((f"g{e}", f"u{e}"), f"x.local_experts.{e}.linear_fc1.weight", cat_rows, halves)
                  for e in range(3)]
    rule = stacked_rule(per_expert, "x.mlp.experts.linear_fc1.weight")
    assert rule.hf == ("g0", "u0", "g1", "u1", "g2", "u2")
    stacked = rule.merge([t for e in range(3) for t in (gate[e], up[e])])
    assert stacked.shape == (3, 4, 3) and torch.equal(stacked[1], torch.cat([gate[1], up[1]]))
    assert torch.equal(rule.merge([gate[2], up[2]]), stacked[2:])  # one rank's run of experts
    parts = rule.split(stacked)
    assert all(torch.equal(p, t) for p, t in zip(parts, [t for e in range(3) for t in (gate[e], up[e])]))
    assert all(p.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr() for p in parts)
