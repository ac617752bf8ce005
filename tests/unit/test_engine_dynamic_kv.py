"""The embedded engine's KV report with dynamic caches (the decoding of GLM-5's and Qwen3.5's architectures):
each generate call's cache is freed as the call returns, so a release reports the largest one built since the
last release, the bytes the sleep plan must leave free for the next generate. Checked against GLM-5's cache
computed from its config: MLA keeps the compressed latent and the rope key per token, the indexer its keys
in the layers that have their own."""

from __future__ import annotations

import pytest
import torch

from miles.models import load_policy, write_random_model
from miles.rollout import SamplingParams
from miles.rollout.contract import KV_CACHE
from miles.rollout.decode import cache_bytes
from miles.rollout.embedded import EmbeddedRolloutEngine

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]  # left-padded to 4 tokens
NEW = 8


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = write_random_model(str(tmp_path_factory.mktemp("glm5-tiny")), "glm5-tiny")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    return EmbeddedRolloutEngine(model=model, tokenizer=AutoTokenizer.from_pretrained(folder), device="cpu")


def _glm_cache_bytes(config, rows: int) -> int:
    per_token = sum(config.kv_lora_rank + config.qk_rope_head_dim
                    + (config.index_head_dim if kind == "full" else 0) for kind in config.indexer_types)
    return rows * (len(PROMPTS[0]) + NEW - 1) * per_token * 2  # bf16; the last sampled token is never fed


def _generate(engine, n: int) -> None:
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, n=n, seed=1, stop_token_ids=()))


def test_a_release_reports_the_largest_dynamic_cache_since_the_last_one(glm):
    assert not glm.static_cache
    _generate(glm, n=4)
    _generate(glm, n=1)
    assert glm.release_memory_occupation([KV_CACHE]) == {KV_CACHE: _glm_cache_bytes(glm.model.config, rows=8)}
    glm.resume_memory_occupation([KV_CACHE])
    assert glm.release_memory_occupation([KV_CACHE]) == {KV_CACHE: 0}, "nothing generated since the last release"
    glm.resume_memory_occupation([KV_CACHE])
    _generate(glm, n=1)
    assert glm.release_memory_occupation([KV_CACHE]) == {KV_CACHE: _glm_cache_bytes(glm.model.config, rows=2)}
    assert glm.release_memory_occupation([KV_CACHE]) == {KV_CACHE: 0}, "released already"
    glm.resume_memory_occupation([KV_CACHE])


def test_cache_bytes_counts_each_storage_once_through_any_container():
    shared = torch.zeros(10, dtype=torch.float32)

    class Layer:
        def __init__(self):
            self.keys, self.values, self.view = torch.zeros(3, 4), torch.zeros(2, dtype=torch.bfloat16), shared[2:]

    cache = {"layers": [Layer(), Layer()], "extra": (shared, None, 7, "name")}
    assert cache_bytes(cache) == 2 * (3 * 4 * 4 + 2 * 2) + 10 * 4
    assert cache_bytes(None) == 0


def test_a_static_cache_engine_reports_its_pool(tmp_path):
    """The static path is unchanged: what clearing the pool freed (here on CPU, asked for explicitly)."""
    from miles.config import parse_args
    from miles.preflight import validate_args

    config = validate_args(parse_args(["--tiny-model"]))
    model, tokenizer, _ = load_policy(config, device="cpu")
    engine = EmbeddedRolloutEngine(model=model, tokenizer=tokenizer, device="cpu", static_cache=True)
    _generate(engine, n=2)
    assert engine.release_memory_occupation([KV_CACHE])[KV_CACHE] > 0
