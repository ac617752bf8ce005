"""Random-init transformers models of the RANDOM_MODEL_PRESETS with the tiny tokenizer, built once per preset
(tests that change one work on a copy)."""

import functools

import torch

from miles.models import build_tiny_tokenizer, random_model_config

TOKENIZER = build_tiny_tokenizer()


@functools.lru_cache(maxsize=None)
def tiny_model(preset: str):
    """The preset's model (seed 0, eval mode), the tiny tokenizer's vocabulary and special tokens."""
    from transformers import AutoModelForCausalLM

    config = random_model_config(preset, len(TOKENIZER), bos_token_id=TOKENIZER.bos_token_id,
                                 eos_token_id=TOKENIZER.eos_token_id, pad_token_id=TOKENIZER.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()
