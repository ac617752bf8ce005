"""The tensor builders of miles.sizing.tensors over plain sizes (which the megatron families and the config reader
share), assemble_model's bound on a model's size before it is built, and check_config_bounds. The expected
shapes are worked out by hand from Megatron-core's layout. CPU only."""

import pytest

from miles.sizing.bounds import MAX_LAYERS, MAX_TENSORS
from miles.sizing.model_params import CONFIG_SIZES, check_config_bounds, model_tensors
from miles.sizing.presets import PRESETS, RANDOM_MODEL_PRESETS
from miles.sizing.tensors import (ModelConfigError, Tensor, assemble_model, decoder_layer_tensors,
                                  gated_deltanet_tensors, gqa_tensors, indexer_tensors, mla_tensors, mlp_tensors,
                                  mtp_layer_tensors)

SPLIT, REPLICATED = True, False


def described(tensors):
    return [(t.name, t.shape, t.tp_split, t.expert) for t in tensors]


# ---- the builders ----------------------------------------------------------------------------------------------
def test_gqa_plain_and_gated_with_qk_norms():
    p = "decoder.layers.0.self_attention"
    # 4 q heads and 2 kv heads of 16 over hidden 64: q 64 + k 32 + v 32 rows
    assert described(gqa_tensors(p, 64, heads=4, kv_heads=2, head_dim=16, gated=False, qk_norm=False)) == [
        (f"{p}.linear_qkv", (128, 64), SPLIT, None), (f"{p}.linear_proj", (64, 64), SPLIT, None)]
    # head_dim 32 (not hidden / heads), one kv head, the output gate doubling q: 2 x 4 x 32 + 32 + 32 rows
    assert described(gqa_tensors(p, 64, heads=4, kv_heads=1, head_dim=32, gated=True, qk_norm=True)) == [
        (f"{p}.linear_qkv", (320, 64), SPLIT, None), (f"{p}.linear_proj", (64, 128), SPLIT, None),
        (f"{p}.q_layernorm", (32,), REPLICATED, None), (f"{p}.k_layernorm", (32,), REPLICATED, None)]


def test_mla_with_and_without_a_q_latent():
    p = "decoder.layers.1.self_attention"
    # 4 heads, q/kv latents 32/16, qk 16 + 8, v 16: q heads 4 x 24 = 96, kv down 16 + 8, kv up 4 x (16 + 16)
    tail = [(f"{p}.linear_kv_down_proj", (24, 64), REPLICATED, None), (f"{p}.kv_layernorm", (16,), REPLICATED, None),
            (f"{p}.linear_kv_up_proj", (128, 16), SPLIT, None), (f"{p}.linear_proj", (64, 64), SPLIT, None)]
    sizes = dict(heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    assert described(mla_tensors(p, 64, q_lora_rank=32, **sizes)) == [
        (f"{p}.linear_q_down_proj", (32, 64), REPLICATED, None), (f"{p}.q_layernorm", (32,), REPLICATED, None),
        (f"{p}.linear_q_up_proj", (96, 32), SPLIT, None), *tail]
    for no_latent in (None, 0):
        assert described(mla_tensors(p, 64, q_lora_rank=no_latent, **sizes)) == [
            (f"{p}.linear_q_proj", (96, 64), SPLIT, None), *tail]


def test_indexer_reads_the_q_latent_or_the_hidden_state():
    p = "decoder.layers.1.self_attention"
    expected = [(f"{p}.indexer.wq_b", (128, 32), REPLICATED, None), (f"{p}.indexer.wk", (16, 64), REPLICATED, None),
                (f"{p}.indexer.k_norm", (16,), REPLICATED, None), (f"{p}.indexer.k_norm_bias", (16,), REPLICATED, None),
                (f"{p}.indexer.weights_proj", (8, 64), REPLICATED, None)]
    assert described(indexer_tensors(p, 64, q_lora_rank=32, index_heads=8, index_head_dim=16)) == expected
    assert described(indexer_tensors(p, 64, q_lora_rank=None, index_heads=8, index_head_dim=16))[0] == (
        f"{p}.indexer.wq_b", (128, 64), REPLICATED, None)


def test_gated_deltanet():
    p = "decoder.layers.0.linear_attention"
    # keys 2 x 32 = 64, values 4 x 32 = 128: in_proj q k v z (64 + 64 + 128 + 128) and b a (4 + 4)
    assert described(gated_deltanet_tensors(p, 128, key_heads=2, value_heads=4, key_head_dim=32, value_head_dim=32,
                                             conv_kernel=4)) == [
        (f"{p}.in_proj", (392, 128), SPLIT, None), (f"{p}.conv1d", (256, 1, 4), SPLIT, None),
        (f"{p}.A_log", (4,), SPLIT, None), (f"{p}.dt_bias", (4,), SPLIT, None),
        (f"{p}.norm", (32,), REPLICATED, None), (f"{p}.out_proj", (128, 128), SPLIT, None)]


def test_mlp_dense_routed_and_shared():
    p = "decoder.layers.3"
    assert described(mlp_tensors(p, 64, ffn=128)) == [(f"{p}.mlp.linear_fc1", (256, 64), SPLIT, None),
                                                      (f"{p}.mlp.linear_fc2", (64, 128), SPLIT, None)]
    experts = [t for e in range(3) for t in [(f"{p}.mlp.experts.{e}.linear_fc1", (64, 64), SPLIT, e),
                                             (f"{p}.mlp.experts.{e}.linear_fc2", (64, 32), SPLIT, e)]]
    router = (f"{p}.mlp.router", (3, 64), REPLICATED, None)
    shared = [(f"{p}.mlp.shared_experts.linear_fc1", (96, 64), SPLIT, None),
              (f"{p}.mlp.shared_experts.linear_fc2", (64, 48), SPLIT, None)]
    gate = (f"{p}.mlp.shared_experts.gate", (1, 64), REPLICATED, None)
    assert described(mlp_tensors(p, 64, ffn=32, experts=3)) == [router, *experts]
    assert described(mlp_tensors(p, 64, ffn=32, experts=3, shared_ffn=48)) == [router, *experts, *shared]
    assert described(mlp_tensors(p, 64, ffn=32, experts=3, shared_ffn=48, shared_gate=True)) == [
        router, *experts, *shared, gate]
    # a gate without a shared expert gates nothing
    assert described(mlp_tensors(p, 64, ffn=32, experts=3, shared_gate=True)) == [router, *experts]


def test_decoder_and_mtp_layers_put_the_norms_around_the_given_parts():
    attention, mlp = [Tensor("decoder.layers.2.self_attention.x", (5, 7))], [Tensor("decoder.layers.2.mlp.y", (3,))]
    assert described(decoder_layer_tensors("decoder.layers.2", 64, attention, mlp)) == [
        ("decoder.layers.2.input_layernorm", (64,), REPLICATED, None), *described(attention),
        ("decoder.layers.2.pre_mlp_layernorm", (64,), REPLICATED, None), *described(mlp)]
    inner = [Tensor("mtp.layers.0.transformer_layer.z", (2, 2))]
    assert described(mtp_layer_tensors("mtp.layers.0", 64, inner)) == [
        ("mtp.layers.0.enorm", (64,), REPLICATED, None), ("mtp.layers.0.hnorm", (64,), REPLICATED, None),
        ("mtp.layers.0.eh_proj", (64, 128), SPLIT, None), *described(inner),
        ("mtp.layers.0.final_layernorm", (64,), REPLICATED, None)]


# ---- assemble_model ---------------------------------------------------------------------------------------------
def prebuilt(name, hidden, vocab, tp, tied, layers, mtp_layer=None):
    """assemble_model over decoder layers built beforehand (each its own kind) and at most one MTP layer."""
    return assemble_model(name, hidden, vocab, tp, tied, list(range(len(layers))), lambda i, p: layers[i],
                          int(mtp_layer is not None), lambda p: mtp_layer)


def test_assemble_pads_the_vocabulary_for_tp_and_ties_the_output():
    layers = [[Tensor(f"decoder.layers.{i}.w", (4, 64))] for i in range(2)]
    model = prebuilt("m", 64, 100, 2, False, layers, [Tensor("mtp.layers.0.w", (3,))])
    assert described(model.first) == [("embedding", (256, 64), SPLIT, None)]  # 100 up to a multiple of 128 x 2
    assert [described(layer) for layer in model.layers] == [described(layer) for layer in layers]
    assert described(model.last) == [("decoder.final_layernorm", (64,), REPLICATED, None),
                                     ("output_layer", (256, 64), SPLIT, None), ("mtp.layers.0.w", (3,), SPLIT, None)]
    tied = prebuilt("m", 64, 300, 1, True, layers)
    assert described(tied.first) == [("embedding", (384, 64), SPLIT, None)]
    assert [t.name for t in tied.last] == ["decoder.final_layernorm"]


def recording(build, built):
    """`build`, recording in `built` the prefix of each layer it builds."""
    def record(*args):
        built.append(args[-1])
        return build(*args)
    return record


def routed(i, p):
    return mlp_tensors(p, 64, ffn=32, experts=100)  # 201 tensors


def test_assemble_refuses_too_many_tensors_having_built_one_layer_of_each_kind():
    built = []
    with pytest.raises(ModelConfigError) as refused:
        assemble_model("huge", 64, 100, 1, False, ["moe"] * MAX_LAYERS, recording(routed, built))
    assert built == ["probe"]
    assert str(refused.value) == (f"huge: {MAX_LAYERS} layers of up to 201 tensors each make {MAX_LAYERS * 201 + 3} "
                                  f"tensors, over the {MAX_TENSORS} the planner counts: check num_hidden_layers and "
                                  "the expert count")


def test_assemble_refuses_too_many_parameters_decoder_or_mtp():
    big = [Tensor("w", (10**6, 10**7))]  # 1e13 parameters
    built = []
    with pytest.raises(ModelConfigError, match=r"^huge: the config describes 1e\+17 parameters, over the 1e\+15"):
        assemble_model("huge", 64, 100, 1, False, [0] * MAX_LAYERS, recording(lambda i, p: big, built))
    assert built == ["probe"]
    with pytest.raises(ModelConfigError, match=r"parameters, over the 1e\+15"):
        assemble_model("huge", 64, 100, 1, False, [0], lambda i, p: big, 100, recording(lambda p: big, built))
    assert built == ["probe", "probe"]


def test_assemble_probes_the_first_layer_of_each_kind_and_takes_a_model_at_the_bound():
    def layer(i, p):
        return [Tensor(f"{p}.w", (2,))] if i % 2 else routed(i, p)
    n = (MAX_TENSORS - 3 - 1) // 201  # the embedding, final norm and output layer take 3, the small layer 1
    built = []
    model = assemble_model("big", 64, 100, 1, False, ["moe"] * n + ["small"], recording(layer, built))
    assert built[:2] == ["probe"] * 2 and built[2:] == [f"decoder.layers.{i}" for i in range(n + 1)]
    assert len(model.layers) == n + 1 and len(model.all()) <= MAX_TENSORS
    with pytest.raises(ModelConfigError, match="tensors, over the"):
        assemble_model("big", 64, 100, 1, False, ["moe"] * (n + 1) + ["small"], layer)


# ---- check_config_bounds ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_check_config_bounds_takes_every_preset(name):
    check_config_bounds(PRESETS[name], name)
    model_tensors(PRESETS[name], name)  # and the reader counts it


@pytest.mark.parametrize("config, named", [
    ({"num_hidden_layers": 10**9}, ["num_hidden_layers", "1000000000"]),
    ({"hidden_size": -64}, ["hidden_size", "-64"]),
    ({"hidden_size": "64"}, ["hidden_size", "'64'"]),
    ({"intermediate_size": 2.5}, ["intermediate_size", "2.5"]),
    ({"num_experts": True}, ["num_experts", "True"]),
    ({"layer_types": ["linear_attention"] * 20_000}, ["layer_types", "20000", str(MAX_LAYERS)]),
    ({"mlp_only_layers": list(range(MAX_LAYERS + 1))}, ["mlp_only_layers", str(MAX_LAYERS + 1)]),
    ({"indexer_types": "s" * 20_000}, ["indexer_types", "20000"]),
    ({"model_type": "qwen3_5_moe", "text_config": {"linear_key_head_dim": 0}}, ["linear_key_head_dim", "0"]),
], ids=["layers-1e9", "hidden-negative", "hidden-string", "ffn-fraction", "experts-bool", "layer-types-20000",
        "mlp-only-layers-long", "indexer-types-string", "nested-text-config"])
def test_check_config_bounds_refuses_naming_the_model_key_and_value(config, named):
    with pytest.raises(ModelConfigError) as refused:
        check_config_bounds({**PRESETS["llama-tiny"], **config}, "my-model")
    message = str(refused.value)
    assert message.startswith("my-model: ") and all(word in message for word in named), message


@pytest.mark.parametrize("key", sorted(CONFIG_SIZES))
def test_check_config_bounds_covers_every_size_the_reader_knows(key):
    with pytest.raises(ModelConfigError, match=f"{key} = 1000000000000"):
        check_config_bounds({key: 10**12})
    check_config_bounds({key: None})  # null is "not set"


def test_check_config_bounds_requires_no_key_and_refuses_a_non_object():
    check_config_bounds({})
    check_config_bounds({"layer_types": ["full_attention"] * MAX_LAYERS, "hidden_size": None})
    with pytest.raises(ModelConfigError, match="m: must be a JSON object"):
        check_config_bounds([1], "m")


# ---- the reader on the builders -------------------------------------------------------------------------------
def test_the_reader_builds_glm5_tiny_from_the_builders():
    """glm5-tiny: MLA + indexer, dense first layer, MoE after it; index_topk_freq 2 / offset 2 give layer 2 no
    indexer of its own; no MTP layer (none configured)."""
    cfg = RANDOM_MODEL_PRESETS["glm5-tiny"]

    def attention(p, indexer):
        sizes = dict(hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                     v_head_dim=16)
        own = indexer_tensors(p, 64, 32, index_heads=8, index_head_dim=16) if indexer else []
        return [*mla_tensors(p, **sizes), *own]

    moe = dict(ffn=32, experts=8, shared_ffn=32)  # one shared expert of the routed experts' width, no gate
    layers = [decoder_layer_tensors(f"decoder.layers.{i}", 64, attention(f"decoder.layers.{i}.self_attention", i < 2),
                                    mlp_tensors(f"decoder.layers.{i}", 64, **({"ffn": 128} if i == 0 else moe)))
              for i in range(3)]
    expected = prebuilt("glm5-tiny", 64, 50, 2, False, layers)
    assert model_tensors({**cfg, "vocab_size": 50}, "glm5-tiny", tp=2) == expected


def test_the_reader_builds_the_qwen35_hybrid_with_its_mtp_layer():
    """qwen3.5-moe-tiny plus one MTP layer: Gated DeltaNet on layers 0 and 2, gated GQA with qk norms (the model
    type's defaults) on 1 and 3, routed experts with a gated shared expert, the MTP layer full attention."""
    cfg = {**RANDOM_MODEL_PRESETS["qwen3.5-moe-tiny"], "vocab_size": 100, "mtp_num_hidden_layers": 1}

    def layer(p, linear):
        attention = (gated_deltanet_tensors(f"{p}.linear_attention", 128, 2, 4, 32, 32, 4) if linear else
                     gqa_tensors(f"{p}.self_attention", 128, 4, 2, 32, gated=True, qk_norm=True))
        return decoder_layer_tensors(p, 128, attention,
                                     mlp_tensors(p, 128, ffn=64, experts=8, shared_ffn=64, shared_gate=True))

    layers = [layer(f"decoder.layers.{i}", linear=i % 2 == 0) for i in range(4)]
    mtp = mtp_layer_tensors("mtp.layers.0", 128, layer("mtp.layers.0.transformer_layer", linear=False))
    assert model_tensors(cfg, "q") == prebuilt("q", 128, 100, 1, False, layers, mtp)
    assert model_tensors(cfg, "q", mtp=False) == prebuilt("q", 128, 100, 1, False, layers)
