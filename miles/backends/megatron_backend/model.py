"""megatron-core GPTModel from a transformers config (any TP/PP/EP/ETP layout of miles/parallel/layout.py).

:func:`transformer_config_from_hf` and :func:`gpt_model_kwargs` return plain values (tested on CPU);
:func:`build_gpt_model` imports megatron-core and builds the model. What differs by model is the family's
(``families/``): its config fields, its config class and its layer spec. The GPT family's spec is Transformer
Engine's when ``transformer_engine`` imports, else the local spec (torch RMSNorm) with torch's fused
scaled_dot_product_attention in place of its unfused attention; ``uses_te_spec`` says which, because the weight
layout of the norms differs (see ``weight_rules.py``). Under sequence parallelism the local spec's norms are
``sequence_parallel_norm``'s (megatron's torch norm refuses it).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F

from miles.parallel.layout import ParallelLayout

from .architecture import UnsupportedModelError
from .families import describe, family_of
from .families.family import BlockOptions
from .pieces.grouped_experts_layers import with_grouped_experts
from .sequence_parallel_norm import SequenceParallelRMSNorm, with_norm
from .tp_shards import padded_vocab_size

__all__ = ["transformer_config_from_hf", "gpt_model_kwargs", "build_gpt_model", "native_fp32_param_names",
           "ROUTER_BIAS_UPDATE_RATE"]

logger = logging.getLogger(__name__)

# The aux-loss-free balancing step of a router's expert bias per optimizer step (DeepSeek-V3's gamma,
# megatron-core's default): bias += rate * sign(mean load - expert load), after each applied step.
ROUTER_BIAS_UPDATE_RATE = 1e-3


def transformer_config_from_hf(hf_config: Any, *, params_dtype: torch.dtype, expert_model_parallel_size: int = 1,
                               grouped_experts: bool = False,
                               perform_initialization: bool = False, layout: Optional[ParallelLayout] = None,
                               sequence_parallel: bool = False) -> dict[str, Any]:
    """Keyword arguments of megatron-core's ``TransformerConfig`` for ``hf_config``.

    ``layout``: the tensor/pipeline/expert-tensor sizes and uneven stages (None: TP = PP = 1, ETP 1; the
    expert-parallel size is ``expert_model_parallel_size`` either way).

    ``perform_initialization=False``: the weights are loaded from the HF model right after building,
    so random initialization would be wasted time (minutes on the CPU for billions of params).
    """
    arch = describe(hf_config)
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,  # SwiGLU: linear_fc1 = cat(gate, up), silu(gate) * up
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,  # HF causal LMs of these families train without dropout
        attention_dropout=0.0,
        init_method_std=arch.init_std,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        perform_initialization=perform_initialization,
        use_cpu_initialization=False,
        **_parallel_kwargs(layout, params_dtype, sequence_parallel),
        # SwiGLU fused by torch.compile (megatron's fused_bias_swiglu, no apex or Transformer Engine): it saves only
        # its input for the backward, not its intermediates (docs/benchmarks.md, the train call's device peak). The
        # other fused kernels need apex / Transformer Engine; their plain paths give the same math.
        bias_activation_fusion=True,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # MoE layers route with all-to-all; set for dense models too: megatron-core refuses the pipeline's
        # variable_seq_lengths with its default (allgather) dispatcher whether or not the model has experts
        moe_token_dispatcher_type="alltoall",
    )
    if arch.num_experts is not None:
        kwargs.update(_moe_kwargs(arch, expert_model_parallel_size, grouped_experts))
    kwargs.update(family_of(arch.model_type).config_kwargs(arch))
    return kwargs


def _parallel_kwargs(layout: Optional[ParallelLayout], params_dtype: torch.dtype,
                     sequence_parallel: bool) -> dict[str, Any]:
    """TransformerConfig's model-parallel fields for ``layout`` (Megatron's names)."""
    layout = layout or ParallelLayout(world=1)
    kwargs: dict[str, Any] = dict(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                  expert_tensor_parallel_size=layout.etp, sequence_parallel=sequence_parallel,
                                  num_layers_in_first_pipeline_stage=layout.first_stage_layers,
                                  num_layers_in_last_pipeline_stage=layout.last_stage_layers)
    if layout.pp > 1:
        kwargs["pipeline_dtype"] = params_dtype  # what the stages send each other
        kwargs["variable_seq_lengths"] = True  # micro-batches keep their own shapes (pipeline.py)
    return kwargs


def _moe_kwargs(arch, expert_model_parallel_size: int, grouped_experts: bool) -> dict[str, Any]:
    """The MoE part of :func:`transformer_config_from_hf`: HF's router and experts as megatron-core's."""
    if arch.moe_topk == 1 and arch.moe_renormalize:
        raise UnsupportedModelError("top-1 routing with renormalized probabilities (weight 1.0 per token) has no "
                                    "megatron-core router equivalent; use a top-k >= 2 model")
    sigmoid = arch.router_score_function == "sigmoid"
    return dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_topk,
        moe_layer_freq=1 if all(arch.moe_layers) else [int(m) for m in arch.moe_layers],
        # HF softmax routers: softmax over all experts, top-k, then (Mixtral, Qwen3-MoE norm_topk_prob)
        # renormalize, which equals softmax over the top-k logits: Megatron's default (pre_softmax False).
        # Without renormalization the top-k softmax values are used as they are: pre_softmax True.
        # Sigmoid routers (GLM-5) renormalize the chosen sigmoid scores (describe refuses them otherwise).
        moe_router_score_function=arch.router_score_function,
        moe_router_pre_softmax=not arch.moe_renormalize and not sigmoid,
        moe_router_enable_expert_bias=arch.router_expert_bias,
        moe_router_bias_update_rate=ROUTER_BIAS_UPDATE_RATE,
        moe_router_topk_scaling_factor=arch.router_topk_scaling_factor,
        moe_router_num_groups=arch.router_num_groups,
        moe_router_group_topk=arch.router_group_topk,
        # GLM-5's router computes its logits in fp32 (transformers casts input and weight)
        moe_router_dtype="fp32" if sigmoid else None,
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size,
        # HF's forward adds no load-balancing loss unless output_router_logits; RL follows the policy's loss.
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        # build_gpt_model gives the experts grouped linears (pieces/grouped_experts_layers.py) by this field
        moe_grouped_gemm=grouped_experts,
        expert_model_parallel_size=expert_model_parallel_size,
    )


def gpt_model_kwargs(hf_config: Any, tensor_model_parallel_size: int = 1) -> dict[str, Any]:
    """Keyword arguments of ``GPTModel`` besides ``config`` and ``transformer_layer_spec`` (the vocabulary padded
    for TP as tp_shards.padded_vocab_size says: unpadded at TP 1)."""
    arch = describe(hf_config)
    return dict(vocab_size=padded_vocab_size(arch.vocab_size, tensor_model_parallel_size),
                max_sequence_length=arch.max_position_embeddings,
                share_embeddings_and_output_weights=arch.tied_embeddings, position_embedding_type="rope",
                rotary_base=arch.rope_theta, rotary_percent=arch.rotary_percent)


def native_fp32_param_names(gpt, hf_config: Any) -> list[str]:
    """The GPTModel parameters that train in fp32 whatever the model's dtype (the family's: Qwen3.5's ``A_log``,
    as transformers computes with ``A_log.float()``); the trainer restores them to fp32 after the bf16 cast."""
    suffixes = family_of(describe(hf_config).model_type).native_fp32_params
    return [name for name, _ in gpt.named_parameters() if name.endswith(suffixes)] if suffixes else []


def build_gpt_model(hf_config: Any, *, params_dtype: torch.dtype, expert_model_parallel_size: int = 1,
                    grouped_experts: bool = False, use_te: bool | None = None, fused_attention: bool = True,
                    layout: Optional[ParallelLayout] = None, sequence_parallel: bool = False, pp_rank: int = 0):
    """``(GPTModel, TransformerConfig, uses_te_spec)`` on the current CUDA device (the CPU without one; without apex,
    megatron's torch norms are built on the CPU in fp32, so the caller moves the model), weights uninitialized: this
    rank's pipeline stage (``pp_rank`` of ``layout``; the embedding on the first, the output
    layer on the last).

    Needs megatron-core and ``parallel_state.initialize_model_parallel`` to have run (the MoE layers
    read the expert-parallel group). The local spec's attention is torch's scaled_dot_product_attention
    (:mod:`.sdpa_attention`); ``fused_attention=False`` keeps megatron's unfused DotProductAttention (the
    GPU test compares the two). ``grouped_experts`` (``--moe-grouped-gemm``): every family's routed experts run as
    one grouped GEMM per projection (``pieces/grouped_experts_layers.py``), else as megatron's SequentialMLP.
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    kwargs = transformer_config_from_hf(hf_config, params_dtype=params_dtype,
                                        expert_model_parallel_size=expert_model_parallel_size, layout=layout,
                                        sequence_parallel=sequence_parallel, grouped_experts=grouped_experts)
    kwargs["use_cpu_initialization"] = not torch.cuda.is_available()  # else megatron allocates on the CUDA device
    arch = describe(hf_config)
    family = family_of(arch.model_type)
    pp = layout.pp if layout else 1
    stage = dict(pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                 **gpt_model_kwargs(hf_config, layout.tp if layout else 1))
    if arch.mtp_layers:
        logger.info("%s: the checkpoint's %d multi-token-prediction layer(s) are not built nor trained: "
                    "transformers drops them on load, so neither the trained policy nor its HF export holds them",
                    arch.model_type, arch.mtp_layers)
    config = family.transformer_config(kwargs)
    spec, use_te = family.block_spec(config, BlockOptions(pp_rank=pp_rank, use_te=use_te,
                                                          fused_attention=fused_attention))
    spec = with_grouped_experts(spec, config)
    if not use_te and sequence_parallel:  # megatron's torch norm (no apex) refuses sequence parallelism
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        spec = with_norm(spec, WrappedTorchNorm, SequenceParallelRMSNorm)
    return GPTModel(config, spec, **stage), config, use_te
