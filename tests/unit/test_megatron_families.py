"""The Megatron backend's model families: one registry keyed by model_type, and shared modules that hold no
family's facts (no model-type name, no branch on a family's pieces), so a family is added with its folder and one
registry line."""

import ast
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from miles.backends.megatron_backend.convert import hf_moe_layout, hf_to_megatron, megatron_to_hf  # noqa: E402
from miles.backends.megatron_backend.families import (FAMILIES, SUPPORTED_MODEL_TYPES,  # noqa: E402
                                                      UnsupportedModelError, count_tensors, describe, family_of,
                                                      layout_sizes, read_config)
from miles.backends.megatron_backend.model import transformer_config_from_hf  # noqa: E402
from miles.backends.megatron_backend.tp_shards import tp_gather, tp_shard  # noqa: E402
from miles.models import RANDOM_MODEL_PRESETS  # noqa: E402
from miles.sizing.flops import model_flops, tensor_flops  # noqa: E402
from miles.sizing.model_params import model_tensors  # noqa: E402
from miles.sizing.presets import PRESET_NAMES, preset_config  # noqa: E402
from miles.sizing.tensors import ModelConfigError  # noqa: E402

BACKEND = os.path.join(os.path.dirname(__file__), "..", "..", "miles", "backends", "megatron_backend")
# Where a family's facts may live: its folder, the pieces it composes, and the registry
FAMILY_HOMES = ("families", "pieces")
# Fields of Architecture that only some families have: the shared modules read none of them
FAMILY_PIECES = ("mla", "dsa", "linear_attention")


# Llama-3.1's rope scaling, which transformers builds and the megatron backend does not
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 5e5}


def _shared_modules() -> dict[str, ast.Module]:
    out = {}
    for name in sorted(os.listdir(BACKEND)):
        if name.endswith(".py") and name != "__init__.py":
            with open(os.path.join(BACKEND, name)) as f:
                out[name] = ast.parse(f.read())
    return out


def _tiny_config(preset: str):
    spec = {"max_position_embeddings": 128, **RANDOM_MODEL_PRESETS[preset], "vocab_size": 256}
    return transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)


def test_every_model_type_has_one_family_and_each_family_a_tiny_preset_of_its_own():
    types = [t for family in FAMILIES for t in family.model_types]
    assert len(types) == len(set(types)) and tuple(types) == SUPPORTED_MODEL_TYPES
    for family in FAMILIES:
        assert RANDOM_MODEL_PRESETS[family.tiny_preset]["model_type"] in family.model_types, family.name
        assert family_of(family.model_types[0]) is family


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_family_describes_converts_and_cuts_its_tiny_model_exactly(family):
    config = _tiny_config(family.tiny_preset)
    arch = describe(config)
    assert family_of(arch.model_type) is family
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    mcore = hf_to_megatron(hf, config)
    back = megatron_to_hf(mcore, config, hf_moe_layout=hf_moe_layout(hf))
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    shards = [tp_shard(mcore, tp_rank=r, tp=2, vocab_size=arch.vocab_size, rules=arch.tp_rules) for r in range(2)]
    gathered = tp_gather(shards, tp_rank=0, vocab_size=arch.vocab_size, rules=arch.tp_rules)
    assert set(gathered) == set(mcore) and all(torch.equal(gathered[k], mcore[k]) for k in mcore)
    assert transformer_config_from_hf(config, params_dtype=torch.float32)["num_layers"] == arch.num_layers
    # what `miles plan` and validation size from config.json: the family's reading, layer by layer
    planned = count_tensors(read_config(config.to_dict()), tp=1, mtp=False)
    trained = {name: t.numel() for name, t in mcore.items() if not name.endswith("router.expert_bias")}  # a buffer
    assert planned.total() == sum(trained.values()), "miles plan and the built model disagree"
    for i, layer in enumerate(planned.layers):
        built = sum(n for name, n in trained.items() if name.startswith(f"decoder.layers.{i}."))
        assert sum(t.numel for t in layer) == built, f"decoder layer {i}: miles plan and the built model disagree"


@pytest.mark.parametrize("preset", [p for p in PRESET_NAMES if preset_config(p).get("model_type") in
                                    SUPPORTED_MODEL_TYPES])
def test_the_family_count_and_the_transformers_layout_count_agree_on_every_preset(preset):
    """The family's reading (plan and validation of a model the backend builds) and the reader of the model types
    no family builds share their tensor builders; on the presets, real-size ones included, they agree tensor for
    tensor but for the names Megatron gives the Gated DeltaNet (``self_attention``)."""
    config = preset_config(preset)
    by_family = count_tensors(read_config(config, preset), preset, tp=2)
    by_reader = model_tensors(config, preset, tp=2)
    assert by_family.total() == by_reader.total() and by_family.total(expert=True) == by_reader.total(expert=True)
    assert [[(t.shape, t.tp_split, t.expert) for t in layer] for layer in by_family.layers] == \
        [[(t.shape, t.tp_split, t.expert) for t in layer] for layer in by_reader.layers]
    assert [(t.name, t.shape) for t in by_family.last] == [(t.name, t.shape) for t in by_reader.last]
    arch = read_config(config, preset)  # the megatron engine's MFU counts the same FLOPs as the torch engine's
    assert tensor_flops(count_tensors(arch, mtp=False), arch.moe_topk or 0) == model_flops(config)


def test_the_family_entry_refuses_what_the_trainer_would_refuse_and_bounds_the_config_first():
    llama = {**RANDOM_MODEL_PRESETS["llama-tiny"], "vocab_size": 256, "max_position_embeddings": 128}
    with pytest.raises(UnsupportedModelError, match="rope type 'llama3' is not supported"):
        read_config({**llama, "rope_scaling": LLAMA3_ROPE})
    with pytest.raises(ModelConfigError, match=r"^my/config.json: num_hidden_layers = 1000000000: must be"):
        read_config({**llama, "num_hidden_layers": 10**9}, "my/config.json")  # before transformers builds lists
    with pytest.raises(ModelConfigError, match="must be a JSON object .*, not a list"):
        read_config([llama])
    with pytest.raises(UnsupportedModelError, match="model_type 'mistral' is not supported"):
        read_config({**llama, "model_type": "mistral"})


def test_layout_sizes_carry_each_family_s_own_pieces():
    glm = read_config(preset_config("glm5-tiny"))
    assert layout_sizes(glm) == dict(num_layers=glm.num_layers, num_attention_heads=glm.num_attention_heads,
                                     num_query_groups=glm.num_attention_heads, num_experts=glm.num_experts,
                                     indexer_layers=glm.dsa.indexer_layers)
    qwen = read_config(preset_config("qwen3.5-moe-tiny"))
    sizes = layout_sizes(qwen)
    assert (sizes["linear_key_heads"], sizes["linear_value_heads"]) == (qwen.linear_attention.num_key_heads,
                                                                        qwen.linear_attention.num_value_heads)
    assert layout_sizes(read_config(preset_config("llama-tiny")))["num_experts"] == 0


def test_an_unknown_model_type_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported.*llama.*glm_moe_dsa"):
        family_of("gpt2")


def test_shared_modules_name_no_model_type():
    found = [(name, node.value) for name, tree in _shared_modules().items() for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value in SUPPORTED_MODEL_TYPES]
    assert not found, f"model types named outside {FAMILY_HOMES}: {found}"


def test_shared_modules_do_not_branch_on_a_family_s_pieces():
    found = [(name, node.lineno, node.attr) for name, tree in _shared_modules().items() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in FAMILY_PIECES]
    assert not found, f"a family's pieces read outside {FAMILY_HOMES}: {found}"


def test_shared_modules_import_no_family_folder_but_the_registry():
    wrong = []
    for name, tree in _shared_modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level:
                parts = node.module.split(".")
                if parts[0] == "families" and parts[1:] not in ([], ["family"]):
                    wrong.append((name, node.module))
    assert not wrong, f"shared modules importing a family folder: {wrong}"
