"""A model's trained tensors in Megatron-core's GPT layout, as `miles plan`, validation and the MFU count them:
names, shapes, how they shard over tensor and expert parallelism.

The builders take plain sizes: a megatron family counts its model from its Architecture
(``miles.backends.megatron_backend.model_tensors``), and ``model_params.model_tensors`` reads a config.json of a
model type no family builds into the same builders. :func:`assemble_model` puts the layers together and refuses a
model past the planner's bounds before building it whole.

What is modelled:
  * attention, one of
      - GQA (Llama/Qwen): fused `linear_qkv` [q + 2 kv, hidden] (q doubled when the output is gated,
        as Qwen3-Next/3.5's `attn_output_gate`), `linear_proj`, optional per-head q/k norms;
      - MLA (DeepSeek-V3/GLM-5): q down/up (or a direct q projection without `q_lora_rank`), kv
        down/up, output projection, the two latent norms; the down projections are replicated
        across tensor parallelism (Megatron-core builds them "duplicated"), the rest is split;
      - a DeepSeek sparse-attention indexer (replicated: small), on the layers that compute their own top-k;
      - Gated DeltaNet linear attention (Qwen3-Next/3.5): fused in-projection (q, k, v, z, b, a), depthwise
        conv, A_log, dt_bias, gated norm, out-projection;
  * MLP: dense SwiGLU (fused gate/up `linear_fc1` [2 ffn, hidden], `linear_fc2`) on dense layers;
    on MoE layers a router [experts, hidden] (replicated), per-expert SwiGLU weights (the only
    "expert" tensors, sharded by expert parallelism), and shared experts (+ their sigmoid gate
    when the model has one: Qwen);
  * norms (replicated), embedding and output layer (vocab-parallel; the vocabulary padded to a
    multiple of 128 x TP as Megatron does; no output layer when embeddings are tied);
  * multi-token-prediction layers: two norms, `eh_proj` [hidden, 2 hidden] and one transformer layer each
    (full attention, MoE when the model is MoE), sharing embedding and output with the main model.
Not modelled: biases (none of the presets has any besides the indexer's), vision towers of
multimodal checkpoints (RL recipes usually freeze them), Megatron's DDP buffer padding (< 3%).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Optional, Sequence

from .bounds import (MAX_LAYERS, MAX_PARAMS, MAX_TENSORS, PARALLEL_SIZE, PARAMS, Bound, PlanInputError, check_bound,
                     shown_path)

__all__ = ["VOCAB_PAD_MULTIPLE", "STAND_IN_TENSORS", "Tensor", "ModelTensors", "ModelConfigError", "gqa_tensors",
           "mla_tensors", "indexer_tensors", "gated_deltanet_tensors", "mlp_tensors", "decoder_layer_tensors",
           "mtp_layer_tensors", "padded_vocab", "assemble_model", "stand_in_numels", "flat_model"]

VOCAB_PAD_MULTIPLE = 128  # Megatron's make-vocab-size-divisible-by default (times TP)


@dataclass(frozen=True)
class Tensor:
    """One trained parameter. `tp_split`: the tensor is divided over tensor parallelism (else replicated).
    `expert`: index of the routed expert it belongs to (None for everything else)."""

    name: str
    shape: tuple[int, ...]
    tp_split: bool = True
    expert: Optional[int] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelTensors:
    """A model's tensors by pipeline position: `first` lives on the first stage (embedding), `layers[i]`
    is decoder layer i, `last` lives on the last stage (final norm, output layer, MTP layers)."""

    name: str
    first: tuple[Tensor, ...]
    layers: tuple[tuple[Tensor, ...], ...]
    last: tuple[Tensor, ...]

    def all(self) -> list[Tensor]:
        return [*self.first, *(t for layer in self.layers for t in layer), *self.last]

    def total(self, expert: Optional[bool] = None) -> int:
        """Params of the whole model; expert=True/False counts only routed-expert / other tensors."""
        return sum(t.numel for t in self.all() if expert is None or (t.expert is not None) == expert)


class ModelConfigError(PlanInputError):
    """A config.json that lacks what the planner needs, or holds a value it cannot use; the message names
    the key and the value."""


# ---- the builders: a model's tensors from plain sizes ---------------------------------------------------------
def _norm(name: str, width: int) -> Tensor:
    return Tensor(name, (width,), tp_split=False)


def _swiglu_shapes(h: int, ffn: int) -> tuple[tuple[int, int], tuple[int, int]]:
    return (2 * ffn, h), (h, ffn)  # fused gate/up projection, down projection


def _swiglu(p: str, shapes: tuple[tuple[int, int], tuple[int, int]], expert: Optional[int] = None) -> list[Tensor]:
    return [Tensor(f"{p}.linear_fc1", shapes[0], expert=expert), Tensor(f"{p}.linear_fc2", shapes[1], expert=expert)]


def gqa_tensors(p: str, hidden: int, heads: int, kv_heads: int, head_dim: int, gated: bool,
                qk_norm: bool) -> list[Tensor]:
    """Grouped-query attention under `p` (a layer's "...self_attention"): fused q/k/v (q doubled when `gated`,
    the output gate of Qwen3-Next/3.5), output projection, per-head q and k norms when `qk_norm`."""
    q_out = heads * head_dim * (2 if gated else 1)
    out = [Tensor(f"{p}.linear_qkv", (q_out + 2 * kv_heads * head_dim, hidden)),
           Tensor(f"{p}.linear_proj", (hidden, heads * head_dim))]
    if qk_norm:
        out += [_norm(f"{p}.q_layernorm", head_dim), _norm(f"{p}.k_layernorm", head_dim)]
    return out


def mla_tensors(p: str, hidden: int, heads: int, q_lora_rank: Optional[int], kv_lora_rank: int,
                qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int) -> list[Tensor]:
    """Multi-head latent attention under `p` (DeepSeek-V3/GLM-5), without a DSA indexer: a direct q projection
    when `q_lora_rank` is None or 0. The down projections are replicated (Megatron-core builds them duplicated)."""
    qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
    if q_lora_rank:
        out = [Tensor(f"{p}.linear_q_down_proj", (q_lora_rank, hidden), tp_split=False),
               _norm(f"{p}.q_layernorm", q_lora_rank),
               Tensor(f"{p}.linear_q_up_proj", (heads * qk_head_dim, q_lora_rank))]
    else:
        out = [Tensor(f"{p}.linear_q_proj", (heads * qk_head_dim, hidden))]
    return [*out, Tensor(f"{p}.linear_kv_down_proj", (kv_lora_rank + qk_rope_head_dim, hidden), tp_split=False),
            _norm(f"{p}.kv_layernorm", kv_lora_rank),
            Tensor(f"{p}.linear_kv_up_proj", (heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)),
            Tensor(f"{p}.linear_proj", (hidden, heads * v_head_dim))]


def indexer_tensors(p: str, hidden: int, q_lora_rank: Optional[int], index_heads: int,
                    index_head_dim: int) -> list[Tensor]:
    """The DeepSeek sparse-attention indexer of an MLA layer, under the attention's prefix `p` (replicated:
    small). Its queries come from the q latent, or from the hidden state without `q_lora_rank`."""
    return [Tensor(f"{p}.indexer.wq_b", (index_heads * index_head_dim, q_lora_rank or hidden), tp_split=False),
            Tensor(f"{p}.indexer.wk", (index_head_dim, hidden), tp_split=False),
            _norm(f"{p}.indexer.k_norm", index_head_dim), _norm(f"{p}.indexer.k_norm_bias", index_head_dim),
            Tensor(f"{p}.indexer.weights_proj", (index_heads, hidden), tp_split=False)]


def gated_deltanet_tensors(p: str, hidden: int, key_heads: int, value_heads: int, key_head_dim: int,
                           value_head_dim: int, conv_kernel: int) -> list[Tensor]:
    """Gated DeltaNet linear attention under `p` (a layer's "...linear_attention", Qwen3-Next/3.5)."""
    key_dim, value_dim = key_heads * key_head_dim, value_heads * value_head_dim
    return [Tensor(f"{p}.in_proj", (2 * key_dim + 2 * value_dim + 2 * value_heads, hidden)),  # q k v z, then b a
            Tensor(f"{p}.conv1d", (2 * key_dim + value_dim, 1, conv_kernel)),
            Tensor(f"{p}.A_log", (value_heads,)), Tensor(f"{p}.dt_bias", (value_heads,)),
            _norm(f"{p}.norm", value_head_dim),
            Tensor(f"{p}.out_proj", (hidden, value_dim))]


def mlp_tensors(p: str, hidden: int, *, ffn: int, experts: int = 0, shared_ffn: int = 0,
                shared_gate: bool = False) -> list[Tensor]:
    """The MLP of the layer `p` ("decoder.layers.3"): a dense SwiGLU of width `ffn` when `experts` is 0, else a
    router (replicated), `experts` routed SwiGLUs of width `ffn` (the only expert tensors) and, when
    `shared_ffn`, a shared SwiGLU of that width (with its sigmoid gate when `shared_gate`: Qwen's)."""
    if experts == 0:
        return _swiglu(f"{p}.mlp", _swiglu_shapes(hidden, ffn))
    out = [Tensor(f"{p}.mlp.router", (experts, hidden), tp_split=False)]
    shapes = _swiglu_shapes(hidden, ffn)  # one pair for all experts: fewer objects for the garbage collector to scan
    for e in range(experts):
        out += _swiglu(f"{p}.mlp.experts.{e}", shapes, expert=e)
    if shared_ffn:
        out += _swiglu(f"{p}.mlp.shared_experts", _swiglu_shapes(hidden, shared_ffn))
        if shared_gate:
            out.append(Tensor(f"{p}.mlp.shared_experts.gate", (1, hidden), tp_split=False))
    return out


def decoder_layer_tensors(p: str, hidden: int, attention: Iterable[Tensor], mlp: Iterable[Tensor]) -> list[Tensor]:
    """One decoder layer under `p`: the attention and MLP tensors (built under `p`), each after its norm."""
    return [_norm(f"{p}.input_layernorm", hidden), *attention, _norm(f"{p}.pre_mlp_layernorm", hidden), *mlp]


def mtp_layer_tensors(p: str, hidden: int, transformer_layer: Iterable[Tensor]) -> list[Tensor]:
    """One multi-token-prediction layer under `p` ("mtp.layers.0"): its norms and projection around the
    transformer layer (built under f"{p}.transformer_layer")."""
    return [_norm(f"{p}.enorm", hidden), _norm(f"{p}.hnorm", hidden), Tensor(f"{p}.eh_proj", (hidden, 2 * hidden)),
            *transformer_layer, _norm(f"{p}.final_layernorm", hidden)]


def padded_vocab(vocab: int, tp: int) -> int:
    multiple = VOCAB_PAD_MULTIPLE * tp
    return -(-vocab // multiple) * multiple


# ---- the model -------------------------------------------------------------------------------------------------
def _layer_size(tensors: Iterable[Tensor]) -> tuple[int, int]:
    tensors = tuple(tensors)
    return len(tensors), sum(t.numel for t in tensors)


def _check_totals(name: str, sizes: list[tuple[int, int, int]], layers: str) -> None:
    """`sizes`: (count, tensors, params) of each kind of part; ModelConfigError past MAX_TENSORS / MAX_PARAMS."""
    tensors = sum(n * t for n, t, _ in sizes)
    if tensors > MAX_TENSORS:
        raise ModelConfigError(f"{shown_path(name)}: {layers} of up to {max(t for _, t, _ in sizes)} tensors each make "
                               f"{tensors} tensors, over the {MAX_TENSORS} the planner counts: check "
                               "num_hidden_layers and the expert count")
    params = sum(n * p for n, _, p in sizes)
    if params > MAX_PARAMS:
        raise ModelConfigError(f"{shown_path(name)}: the config describes {params:.3g} parameters, over the "
                               f"{MAX_PARAMS:g} the planner sizes: check hidden_size, num_hidden_layers and the widths")


def assemble_model(name: str, hidden: int, vocab_size: int, tp: int, tied: bool, layer_kinds: Sequence[Hashable],
                   build_layer: Callable[[int, str], list[Tensor]], mtp_layers: int = 0,
                   build_mtp: Optional[Callable[[str], list[Tensor]]] = None) -> ModelTensors:
    """The model of ``len(layer_kinds)`` decoder layers, layer ``i`` being ``build_layer(i, "decoder.layers.{i}")``,
    and ``mtp_layers`` multi-token-prediction layers ``build_mtp("mtp.layers.{m}")``, with the embedding, final norm
    and (unless ``tied``) output layer of the vocabulary padded for ``tp`` as Megatron pads it.

    Layers of one kind (equal ``layer_kinds`` entries) differ only in their names: one layer of each kind, and one
    MTP layer, is built first and the totals checked, so a model past MAX_TENSORS tensors or MAX_PARAMS parameters
    is refused (ModelConfigError naming ``name``) before it is built."""
    check_bound(ModelConfigError, f"{shown_path(name)}: tensor-parallel size", tp, PARALLEL_SIZE)
    vocab = padded_vocab(vocab_size, tp)
    first = (Tensor("embedding", (vocab, hidden)),)
    head = (_norm("decoder.final_layernorm", hidden), *(() if tied else (Tensor("output_layer", (vocab, hidden)),)))
    counts = Counter(layer_kinds)
    first_of = {kind: i for i, kind in reversed(list(enumerate(layer_kinds)))}
    sizes = [(1, *_layer_size((*first, *head)))]
    sizes += [(n, *_layer_size(build_layer(first_of[kind], "probe"))) for kind, n in counts.items()]
    if mtp_layers:
        sizes.append((mtp_layers, *_layer_size(build_mtp("probe"))))
    _check_totals(name, sizes, f"{len(layer_kinds)} layers" + (f" (+ {mtp_layers} MTP)" if mtp_layers else ""))
    decoder = tuple(tuple(build_layer(i, f"decoder.layers.{i}")) for i in range(len(layer_kinds)))
    mtp = tuple(t for m in range(mtp_layers) for t in build_mtp(f"mtp.layers.{m}"))
    return ModelTensors(name, first, decoder, (*head, *mtp))


STAND_IN_TENSORS = 16  # tensors of a parameter count's stand-in (`miles plan --params`, `miles bench stream`)


def stand_in_numels(params: int, tensors: int = STAND_IN_TENSORS) -> list[int]:
    """The tensor sizes standing in for `params` parameters, one list for `miles plan --params` and the state
    `miles bench stream` builds, so the plan's buckets are the bench store's: alternately 3/4 and 5/4 of the
    mean (irregular, so that buckets split tensors as a real model's do), the last taking the rest. Fewer
    parameters than tensors make one tensor."""
    if params < tensors:
        return [params]
    mean = params // tensors
    sizes = [mean * 3 // 4 if i % 2 == 0 else mean * 5 // 4 for i in range(tensors - 1)]
    return [*sizes, params - sum(sizes)]


def flat_model(params: int, tensors: int = STAND_IN_TENSORS, name: str = "flat") -> ModelTensors:
    """A dense stand-in of `params` parameters in the tensors of :func:`stand_in_numels` (one per layer):
    for sizing the state of a parameter count without an architecture."""
    check_bound(ModelConfigError, f"{name}: parameter count", params, PARAMS)
    check_bound(ModelConfigError, f"{name}: tensor count", tensors, Bound(1, MAX_LAYERS, integer=True))
    sizes = stand_in_numels(params, tensors)
    return ModelTensors(name, (), tuple((Tensor(f"layers.{i}.weight", (n,)),) for i, n in enumerate(sizes) if n), ())
