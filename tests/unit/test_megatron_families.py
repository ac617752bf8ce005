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
                                                      UnsupportedModelError, describe, family_of)
from miles.backends.megatron_backend.model import transformer_config_from_hf  # noqa: E402
from miles.backends.megatron_backend.tp_shards import tp_gather, tp_shard  # noqa: E402
from miles.models import RANDOM_MODEL_PRESETS  # noqa: E402
from miles.sizing.model_params import model_tensors  # noqa: E402

BACKEND = os.path.join(os.path.dirname(__file__), "..", "..", "miles", "backends", "megatron_backend")
# Where a family's facts may live: its folder, the pieces it composes, and the registry
FAMILY_HOMES = ("families", "pieces")
# Fields of Architecture that only some families have: the shared modules read none of them
FAMILY_PIECES = ("mla", "dsa", "linear_attention")


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
    planned = model_tensors(config.to_dict(), tp=1, mtp=False)  # what `miles plan` sizes from config.json
    trained = sum(t.numel() for name, t in mcore.items() if not name.endswith("router.expert_bias"))  # a buffer
    assert planned.total() == trained, "miles plan and the built model disagree"


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
