"""Named models, one list for `miles plan --preset`, `miles bench rl --preset` and scripts/make_random_model.py.

Two kinds: published models' shapes (glm5-744b, qwen3-30b-a3b, qwen3.5-35b-a3b), which `miles plan` sizes and
nothing here writes, and random-init models of real architectures (RANDOM_MODEL_PRESETS), which
`write_random_model` (miles/models.py) writes with the char tokenizer's vocabulary and `miles plan` sizes
the same. Each plan config is the subset of a transformers config.json the planner reads. Until this list
was shared, `miles plan` named three of the random models with a `-random` suffix: those names still work.

| preset          | hidden | layers (dense) | attention                          | vocab   | experts x ffn | top-k | shared | MTP |
|-----------------|--------|----------------|------------------------------------|---------|---------------|-------|--------|-----|
| glm5-744b       | 6144   | 78 (first 3)   | MLA 64 heads, q/kv rank 2048/512,  | 154880  | 256 x 2048    | 8     | 1      | 1   |
|                 |        |                | qk 192+64, v 256; DSA indexer 32x128 |       |               |       |        |     |
| glm5-2b         | 2048   | 12 (first 1)   | MLA 16 heads, q/kv rank 768/256,   | 100     | 24 x 1024     | 4     | 1      | 0   |
|                 |        |                | qk 96+32, v 96; DSA indexer 8x64   |         |               |       |        |     |
| llama-9.2b      | 4096   | 42 (42)        | GQA 32 q / 8 kv heads x 128        | 100     | dense 14336   |       |        | 0   |
| qwen3-30b-a3b   | 2048   | 48 (0)         | GQA 32 q / 4 kv heads x 128        | 151936  | 128 x 768     | 8     | 0      | 0   |
| qwen3.5-35b-a3b | 2048   | 40 (0)         | 3 of 4 Gated DeltaNet (16 k / 32 v | 248320  | 256 x 512     | 8     | 1x512  | 1   |
|                 |        |                | heads x 128), 1 of 4 gated GQA     |         |               |       |        |     |
|                 |        |                | 16 q / 2 kv heads x 256            |         |               |       |        |     |
| qwen3.5-moe-1b  | 2048   | 12 (0)         | qwen3.5-35b-a3b's, 9 + 3 layers    | 100     | 16 x 512      | 8     | 1x512  | 0   |
| qwen3-30b-a3b-12l | 2048 | 12 (0)         | qwen3-30b-a3b's, 12 of its layers  | 151936  | 128 x 768     | 8     | 0      | 0   |

Sources and assumptions:
  * glm5-744b: "a GLM-5.2-744B-like MoE". The numbers are GLM-5's published config.json (zai-org/GLM-5,
    744B total / 40B active: DeepSeek-V3-style MLA + DeepSeek sparse attention, 256 routed experts);
    GLM-5.2 is assumed to keep GLM-5's architecture. Without its MTP layer the count is 744B, the
    published total; the MTP layer (trained by default) adds ~10B.
  * qwen3-30b-a3b: Qwen/Qwen3-30B-A3B config.json (30.5B total / 3.3B active).
  * qwen3.5-35b-a3b: "a Qwen3.5-35B-A3B-like MoE": the language model of Qwen/Qwen3.5-35B-A3B's
    config.json (`text_config`, hybrid Gated DeltaNet / gated attention like Qwen3-Next, untied
    embeddings, one MTP layer); its vision tower is not counted (RL recipes freeze it).
  * qwen3-30b-a3b-12l: qwen3-30b-a3b's config with 12 layers, as scripts/make_random_model.py writes it
    (8.10B params; its vocabulary too, unlike the other random-init models).
  * qwen3.5-moe-1b: the config scripts/make_random_model.py qwen3.5-moe-1b writes (1.03B params);
    the count is transformers' own (tests/unit/test_megatron_qwen35.py compares them).
"""

from __future__ import annotations

import argparse
from typing import Any

from .tensors import ModelConfigError

GLM5_744B = {
    "model_type": "glm_moe_dsa",
    "hidden_size": 6144, "num_hidden_layers": 78, "first_k_dense_replace": 3, "intermediate_size": 12288,
    "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "index_n_heads": 32, "index_head_dim": 128,
    "vocab_size": 154880, "tie_word_embeddings": False,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
    "num_nextn_predict_layers": 1,
}

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048, "num_hidden_layers": 48, "intermediate_size": 6144,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 151936, "tie_word_embeddings": False,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

QWEN3_5_35B_A3B = {
    "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "attn_output_gate": True,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "vocab_size": 248320, "tie_word_embeddings": False,
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "mtp_num_hidden_layers": 1,
    },
}

# Qwen3.5-35B-A3B's layer shapes with 12 layers (9 Gated DeltaNet, 3 gated attention) and 16 experts (top-8)
# instead of 40 and 256: 1.03B params as scripts/make_random_model.py qwen3.5-moe-1b builds it (the char
# tokenizer's vocabulary), which one H200 trains with and without the optimizer-state store.
QWEN3_5_MOE_1B_RANDOM = {
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048, "num_hidden_layers": 12, "full_attention_interval": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "vocab_size": 100, "tie_word_embeddings": False,
    "num_experts": 16, "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
}

# Qwen3-30B-A3B's layers (QWEN3_30B_A3B: 32 q / 4 kv heads x 128 with qk norms, 128 experts x 768, top-8, its
# 151936-token vocabulary, untied) with 12 of its 48: 8.10B params, 97.2 GB of streamed fp32 Adam state, the
# most whole layers whose state one H200 host's tier holds (`miles plan --preset qwen3-30b-a3b-12l
# --gpus-per-node 1 --host-ram-gb 134 --host-tier-gb 100 --disk-gb 64 --checkpoint-copies 0`: streaming, 65.1 GB
# of HBM, the whole state in RAM). The tier that host gave llama-9.2b's 110 GB was 92-111 GB
# (docs/benchmarks.md): 13 layers' 104.7 GB would leave no room, 14 layers' 112.2 GB spill to disk. A save of
# the state does not fit the 64 GB disk (`miles bench rl` saves none). Written at random init with the whole
# vocabulary (the char tokenizer uses its first 100 ids): the output layer is the real model's.
QWEN3_30B_A3B_12L_RANDOM = {**QWEN3_30B_A3B, "num_hidden_layers": 12}

# Llama-3-8B's shape (hidden 4096, FFN 14336, 32 heads, 8 KV heads) with 42 layers instead of 32: 9.16B params
# as scripts/make_random_model.py llama-9.2b builds it (its 100-token character tokenizer adds almost no
# embedding); 110 GB of fp32 Adam state, the largest dense model one H200 host trains from RAM and disk.
LLAMA_9B_RANDOM = {
    "model_type": "llama",
    "hidden_size": 4096, "num_hidden_layers": 42, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 100, "tie_word_embeddings": False,
}

# GLM-5's architecture (MLA + DSA indexer, first layer dense, sigmoid-routed experts + one shared expert) at
# 1.86B params, as scripts/make_random_model.py glm5-2b builds it (the char tokenizer's 100-token vocabulary);
# one H200 trains it with and without the optimizer-state store. index_topk is GLM-5's: shorter sequences
# attend densely.
GLM5_2B_RANDOM = {
    "model_type": "glm_moe_dsa",
    "hidden_size": 2048, "num_hidden_layers": 12, "first_k_dense_replace": 1, "intermediate_size": 5632,
    "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": 768, "kv_lora_rank": 256, "qk_nope_head_dim": 96, "qk_rope_head_dim": 32, "v_head_dim": 96,
    "index_n_heads": 8, "index_head_dim": 64, "index_topk": 2048,
    "vocab_size": 100, "tie_word_embeddings": False,
    "n_routed_experts": 24, "num_experts_per_tok": 4, "moe_intermediate_size": 1024, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
}

# Small enough to train in seconds on one CPU core, big enough to learn a format: `--tiny-model`.
TINY_MODEL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

CHAR_VOCAB_SIZE = 100  # the char tokenizer's (miles.models.build_tiny_tokenizer), which random-init models use


def _without_vocab(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "vocab_size"}


# Random-init models of real architectures, for smoke runs and benchmarks on machines without weights.
RANDOM_MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Llama family, ~1.06B params (TinyLlama's shape with the char tokenizer's vocabulary).
    "llama-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                     num_attention_heads=32, num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Llama-3-8B's shape with 42 layers, 9.16B params (LLAMA_9B_RANDOM).
    "llama-9.2b": dict(_without_vocab(LLAMA_9B_RANDOM), rms_norm_eps=1e-5),
    # Qwen3-MoE layout, 8 experts (top-2), ~0.23B params.
    "qwen3-moe-8e": dict(model_type="qwen3_moe", hidden_size=1024, intermediate_size=2048, moe_intermediate_size=1024,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Qwen3.5-MoE layout (Gated DeltaNet + gated attention, routed + shared experts), 1.03B params
    # (QWEN3_5_MOE_1B_RANDOM).
    "qwen3.5-moe-1b": dict(_without_vocab(QWEN3_5_MOE_1B_RANDOM), rms_norm_eps=1e-6),
    # GLM-5's architecture (glm_moe_dsa) at 1.86B params (GLM5_2B_RANDOM).
    "glm5-2b": dict(_without_vocab(GLM5_2B_RANDOM), rms_norm_eps=1e-5),
    # Tiny versions, for tests. glm5-tiny's indexer keeps 16 tokens (longer sequences attend sparsely) and
    # its last layer reuses the previous layer's top-k (index_topk_freq 2, offset 2: indexer_types full,
    # full, shared). 8 indexer heads: with 2, a quarter of the keys score exactly 0 after the relu, and the
    # top-k's ties at its boundary are broken differently by a full forward and a cached decode step.
    "glm5-tiny": dict(model_type="glm_moe_dsa", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                      q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      index_n_heads=8, index_head_dim=16, index_topk=16, index_topk_freq=2, index_skip_topk_offset=2,
                      n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
                      n_group=1, topk_group=1, norm_topk_prob=True, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # DeepSeek-V3's architecture (Kimi-K2's too): a dense layer then MoE ones, routing limited to 1 of 2 expert groups.
    "deepseek-v3-tiny": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                             n_shared_experts=1, routed_scaling_factor=2.5, n_group=2, topk_group=1,
                             norm_topk_prob=True, num_nextn_predict_layers=0, rms_norm_eps=1e-5,
                             tie_word_embeddings=False),
    # Qwen3-30B-A3B's layer shape and vocabulary with 12 of its 48 layers, 8.10B params (QWEN3_30B_A3B_12L_RANDOM).
    "qwen3-30b-a3b-12l": dict(QWEN3_30B_A3B_12L_RANDOM, norm_topk_prob=True, rms_norm_eps=1e-6),
    "llama-tiny": dict(model_type="llama", **TINY_MODEL_CONFIG),
    "qwen3-moe-tiny": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                           mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mixtral-tiny": dict(model_type="mixtral", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                         num_experts_per_tok=2, sliding_window=None, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # 2 Gated DeltaNet + 2 gated attention layers; head sizes of 32, the smallest the GPU kernels take comfortably.
    "qwen3.5-moe-tiny": dict(model_type="qwen3_5_moe_text", hidden_size=128, num_hidden_layers=4,
                             full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                             linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=64, shared_expert_intermediate_size=64, rms_norm_eps=1e-6,
                             tie_word_embeddings=False),
}

PUBLISHED_PRESETS: dict[str, dict] = {
    "glm5-744b": GLM5_744B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
}
# `miles plan`'s names for three random-init models before the list was shared; scripts may still use them
RENAMED_PRESETS = {"glm5-2b-random": "glm5-2b", "llama-9.2b-random": "llama-9.2b",
                   "qwen3.5-moe-1b-random": "qwen3.5-moe-1b"}
PRESET_NAMES: tuple[str, ...] = tuple(sorted([*PUBLISHED_PRESETS, *RANDOM_MODEL_PRESETS]))

# The plan config of every name, the old ones too; a random-init model's has the char tokenizer's vocabulary
PRESETS: dict[str, dict] = {
    **PUBLISHED_PRESETS,
    **{name: {**spec, "vocab_size": CHAR_VOCAB_SIZE} for name, spec in RANDOM_MODEL_PRESETS.items()},
    # the four sized at full scale keep the shapes their random-init models are made from
    "glm5-2b": GLM5_2B_RANDOM, "llama-9.2b": LLAMA_9B_RANDOM, "qwen3.5-moe-1b": QWEN3_5_MOE_1B_RANDOM,
    "qwen3-30b-a3b-12l": QWEN3_30B_A3B_12L_RANDOM,
}
PRESETS.update({old: PRESETS[new] for old, new in RENAMED_PRESETS.items()})


def preset_config(name: str) -> dict:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelConfigError(f"no preset {name!r}; choose one of {', '.join(PRESET_NAMES)} or pass a config.json") \
            from None


def preset_arg(text: str) -> str:
    """An argparse type: the preset's name (an old name as its new one), or argparse's invalid-choice refusal."""
    name = RENAMED_PRESETS.get(text, text)
    if name not in PRESET_NAMES:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(PRESET_NAMES)})")
    return name


def random_preset_arg(text: str) -> str:
    """:func:`preset_arg` for a command that writes the model at random init: a published model's shape is
    refused (at full size it is tens to hundreds of GB of weights)."""
    name = preset_arg(text)
    if name in PUBLISHED_PRESETS:
        writable = ", ".join(sorted(RANDOM_MODEL_PRESETS))
        raise argparse.ArgumentTypeError(
            f"{text!r} is a published model's shape, which `miles plan --preset {name}` sizes; this command writes "
            f"random-init models: choose one of {writable}, or pass --hf-checkpoint with the model's weights")
    return name
