"""Model FLOPs of the train call (miles.sizing.flops), against numbers worked out by hand."""

from __future__ import annotations

import pytest

from miles.sizing.flops import ModelFlops, mfu, model_flops, peak_bf16_flops, train_flops

DENSE = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 128,
         "tie_word_embeddings": False}
MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "vocab_size": 128, "tie_word_embeddings": False}


def test_dense_model_by_hand():
    # per layer: qkv (64 q + 2 x 2 x 16 kv) x 64 = 8192, proj 64 x 64 = 4096, fc1 2 x 96 x 64 = 12288,
    # fc2 64 x 96 = 6144: 30720; two layers 61440; output layer 128 x 64 = 8192; norms and embedding not
    flops = model_flops(DENSE)
    assert flops == ModelFlops(active_params=69632, attention_width=2 * 4 * (16 + 16))
    # one sequence of 10 tokens: 6 x 69632 x 10 + 3 x 256 x 10 x 11
    assert flops.per_sequence(10) == 4_177_920 + 84_480
    assert train_flops(flops, [10, 10, 1]) == 2 * 4_262_400 + 6 * 69632 + 3 * 256 * 2


def test_tied_embeddings_still_multiply_through_the_output_matrix():
    assert model_flops({**DENSE, "tie_word_embeddings": True}).active_params == 69632


def test_moe_counts_the_routed_experts_a_token_passes_through():
    # per layer: qkv 8192 + proj 4096 + router 4 x 64 = 256 + two of four experts of (2 x 32 x 64 + 64 x 32)
    # = 2 x 6144: 24832; two layers 49664; + output 8192 (qk norms are vectors)
    flops = model_flops(MOE)
    assert flops == ModelFlops(active_params=57856, attention_width=256)
    assert model_flops({**MOE, "num_experts_per_tok": 4}).active_params == 57856 + 2 * 2 * 6144


def test_peak_by_device_name_and_mfu():
    assert peak_bf16_flops("NVIDIA H200") == 989e12 and peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops(None) is None and peak_bf16_flops("Some GPU") is None
    assert mfu(989e12 * 0.4, 989e12, 1.0) == pytest.approx(0.4)
    assert mfu(1e12, None, 1.0) is None and mfu(1e12, 1e15, 0.0) is None
