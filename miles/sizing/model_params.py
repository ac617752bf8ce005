"""Parameter tensors of a model, from a transformers `config.json` dict: names, shapes, and how they shard.

What is modelled (Megatron-core's GPT layout, which is what the megatron backend trains):
  * attention, one of
      - GQA (Llama/Qwen): fused `linear_qkv` [q + 2 kv, hidden] (q doubled when the output is gated,
        as Qwen3-Next/3.5's `attn_output_gate`), `linear_proj`, optional per-head q/k norms;
      - MLA (DeepSeek-V3/GLM-5): q down/up (or a direct q projection without `q_lora_rank`), kv
        down/up, output projection, the two latent norms; the down projections are replicated
        across tensor parallelism (Megatron-core builds them "duplicated"), the rest is split;
      - a DeepSeek sparse-attention indexer when `index_n_heads` is set (replicated: small), on the layers
        that compute their own top-k (GLM-5's `indexer_types`: "shared" layers reuse another's);
      - Gated DeltaNet linear attention on the layers `layer_types` marks "linear_attention"
        (Qwen3-Next/3.5): fused in-projection (q, k, v, z, b, a), depthwise conv, A_log, dt_bias,
        gated norm, out-projection;
  * MLP: dense SwiGLU (fused gate/up `linear_fc1` [2 ffn, hidden], `linear_fc2`) on dense layers;
    on MoE layers a router [experts, hidden] (replicated), per-expert SwiGLU weights (the only
    "expert" tensors, sharded by expert parallelism), and shared experts (+ their sigmoid gate
    when the model has one: Qwen);
  * norms (replicated), embedding and output layer (vocab-parallel; the vocabulary padded to a
    multiple of 128 x TP as Megatron does; no output layer when embeddings are tied);
  * multi-token-prediction layers (DeepSeek/GLM `num_nextn_predict_layers`, Qwen `mtp_num_hidden_layers`):
    two norms, `eh_proj` [hidden, 2 hidden] and one transformer layer each (full attention, MoE when the
    model is MoE), sharing embedding and output with the main model.
Not modelled: biases (none of the presets has any besides the indexer's), vision towers of
multimodal checkpoints (RL recipes usually freeze them), Megatron's DDP buffer padding (< 3%).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from .bounds import (EXPERTS, HIDDEN, LAYER_COUNT_OR_NONE, LAYERS, MAX_LAYERS, MAX_PARAMS, MAX_TENSORS, PARALLEL_SIZE,
                     PARAMS, WIDTH, WIDTH_OR_NONE, Bound, PlanInputError, check_bound, shown, shown_path)

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
        n = 1
        for d in self.shape:
            n *= d
        return n


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


# ---- reading a config: every value is checked where it is read --------------------------------------------
def _missing(cfg: dict, keys: tuple[str, ...]) -> ModelConfigError:
    names = " or ".join(repr(k) for k in keys)
    present = ", ".join(shown(k, 40) for k in sorted(map(str, cfg))[:20]) or "none"
    return ModelConfigError(f"config has no {names}; the planner needs it to count parameters (keys present: "
                            f"{present}{', ...' if len(cfg) > 20 else ''})")


def _optional(cfg: dict, key: str, *alternatives: str, bound: Bound = WIDTH) -> Optional[int]:
    """The first of the keys the config sets (not null), within `bound`; None when it sets none."""
    for k in (key, *alternatives):
        if cfg.get(k) is not None:
            check_bound(ModelConfigError, f"{k} =", cfg[k], bound)
            return cfg[k]
    return None


def _count(cfg: dict, key: str, *alternatives: str, bound: Bound = WIDTH, default: Optional[int] = None) -> int:
    """As _optional, with `default` when no key is set; without a default a missing key is refused."""
    value = _optional(cfg, key, *alternatives, bound=bound)
    if value is not None:
        return value
    if default is None:
        raise _missing(cfg, (key, *alternatives))
    return default


def _flag(cfg: dict, key: str, default: bool = False) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelConfigError(f"{key} = {shown(value)}: must be true or false")
    return value


def _model_type(cfg: dict) -> str:
    value = cfg.get("model_type")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ModelConfigError(f"model_type = {shown(value)}: must be a string")
    return value


def _layer_list(cfg: dict, key: str, item: type, n_layers: int, exact: bool) -> Optional[list]:
    """A per-layer list: `n_layers` items of `item` when `exact`, else at most that many; None when unset."""
    value = cfg.get(key)
    if value is None:
        return None
    ok = (isinstance(value, list) and (len(value) == n_layers if exact else len(value) <= n_layers)
          and all(isinstance(v, item) and not isinstance(v, bool) for v in value))
    if not ok:
        size = f"{n_layers}" if exact else f"at most {n_layers}"
        kind = {int: "integers", str: "strings"}[item]
        raise ModelConfigError(f"{key} = {shown(value)}: must be a list of {size} {kind} "
                               f"(num_hidden_layers = {n_layers})")
    return value


def text_config(cfg: dict) -> dict:
    """Multimodal checkpoints (Qwen3.5, ...) nest the language model's config under `text_config`."""
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


# ---- attention -----------------------------------------------------------------------------------------------
def _gqa(cfg: dict, h: int, p: str) -> list[Tensor]:
    heads = _count(cfg, "num_attention_heads")
    kv = _count(cfg, "num_key_value_heads", default=heads)
    if heads % kv:
        raise ModelConfigError(f"num_key_value_heads = {kv} must divide num_attention_heads = {heads}")
    hd = _optional(cfg, "head_dim")
    if hd is None:
        if h % heads:
            raise ModelConfigError(f"num_attention_heads = {heads} must divide hidden_size = {h} when the config "
                                   "gives no head_dim")
        hd = h // heads
    # Qwen3-Next / Qwen3.5 always gate (transformers has no switch; their config.json may not say so)
    gated = _flag(cfg, "attn_output_gate", default=_model_type(cfg).startswith(("qwen3_next", "qwen3_5")))
    q_out = heads * hd * (2 if gated else 1)
    out = [Tensor(f"{p}.linear_qkv", (q_out + 2 * kv * hd, h)), Tensor(f"{p}.linear_proj", (h, heads * hd))]
    if _has_qk_norm(cfg):
        out += [Tensor(f"{p}.q_layernorm", (hd,), tp_split=False), Tensor(f"{p}.k_layernorm", (hd,), tp_split=False)]
    return out


def _has_qk_norm(cfg: dict) -> bool:
    # Qwen3 and later normalize q and k per head; their configs do not always say so explicitly.
    return _flag(cfg, "qk_norm", default=_model_type(cfg).startswith(("qwen3", "qwen3_5")))


def _mla(cfg: dict, h: int, p: str, indexer: bool = True) -> list[Tensor]:
    heads = _count(cfg, "num_attention_heads")
    q_lora = _optional(cfg, "q_lora_rank", bound=WIDTH_OR_NONE)
    kv_lora = _count(cfg, "kv_lora_rank")
    nope, rope, v = _count(cfg, "qk_nope_head_dim"), _count(cfg, "qk_rope_head_dim"), _count(cfg, "v_head_dim")
    out = []
    if q_lora:
        out += [Tensor(f"{p}.linear_q_down_proj", (q_lora, h), tp_split=False),
                Tensor(f"{p}.q_layernorm", (q_lora,), tp_split=False),
                Tensor(f"{p}.linear_q_up_proj", (heads * (nope + rope), q_lora))]
    else:
        out.append(Tensor(f"{p}.linear_q_proj", (heads * (nope + rope), h)))
    out += [Tensor(f"{p}.linear_kv_down_proj", (kv_lora + rope, h), tp_split=False),
            Tensor(f"{p}.kv_layernorm", (kv_lora,), tp_split=False),
            Tensor(f"{p}.linear_kv_up_proj", (heads * (nope + v), kv_lora)),
            Tensor(f"{p}.linear_proj", (h, heads * v))]
    ih = _optional(cfg, "index_n_heads", bound=WIDTH_OR_NONE)
    if ih and indexer:
        ihd = _count(cfg, "index_head_dim")
        out += [Tensor(f"{p}.indexer.wq_b", (ih * ihd, q_lora or h), tp_split=False),
                Tensor(f"{p}.indexer.wk", (ihd, h), tp_split=False),
                Tensor(f"{p}.indexer.k_norm", (ihd,), tp_split=False),
                Tensor(f"{p}.indexer.k_norm_bias", (ihd,), tp_split=False),
                Tensor(f"{p}.indexer.weights_proj", (ih, h), tp_split=False)]
    return out


def _gated_deltanet(cfg: dict, h: int, p: str) -> list[Tensor]:
    k_heads, v_heads = _count(cfg, "linear_num_key_heads"), _count(cfg, "linear_num_value_heads")
    key_dim = k_heads * _count(cfg, "linear_key_head_dim")
    v_head_dim = _count(cfg, "linear_value_head_dim")
    value_dim = v_heads * v_head_dim
    kernel = _count(cfg, "linear_conv_kernel_dim", default=4)
    return [Tensor(f"{p}.in_proj", (2 * key_dim + 2 * value_dim + 2 * v_heads, h)),  # q k v z, then b a
            Tensor(f"{p}.conv1d", (2 * key_dim + value_dim, 1, kernel)),
            Tensor(f"{p}.A_log", (v_heads,)), Tensor(f"{p}.dt_bias", (v_heads,)),
            Tensor(f"{p}.norm", (v_head_dim,), tp_split=False),
            Tensor(f"{p}.out_proj", (h, value_dim))]


def _is_mla(cfg: dict) -> bool:
    return cfg.get("kv_lora_rank") is not None


def _attention(cfg: dict, h: int, p: str, linear: bool, indexer: bool = True) -> list[Tensor]:
    if linear:
        return _gated_deltanet(cfg, h, f"{p}.linear_attention")
    if _is_mla(cfg):
        return _mla(cfg, h, f"{p}.self_attention", indexer)
    return _gqa(cfg, h, f"{p}.self_attention")


# ---- MLP -----------------------------------------------------------------------------------------------------
def num_experts(cfg: dict) -> int:
    return _count(cfg, "num_experts", "n_routed_experts", "num_local_experts", bound=EXPERTS, default=0)


def experts_per_token(config: dict) -> int:
    """Routed experts each token passes through (``num_experts_per_tok``; 0 for a dense model)."""
    cfg = text_config(config)
    if num_experts(cfg) == 0:
        return 0
    return _count(cfg, "num_experts_per_tok", "moe_topk", bound=EXPERTS)


def _swiglu(p: str, h: int, ffn: int, expert: Optional[int] = None) -> list[Tensor]:
    return [Tensor(f"{p}.linear_fc1", (2 * ffn, h), expert=expert), Tensor(f"{p}.linear_fc2", (h, ffn), expert=expert)]


def _mlp(cfg: dict, h: int, p: str, dense: bool) -> list[Tensor]:
    if dense:
        return _swiglu(f"{p}.mlp", h, _count(cfg, "intermediate_size"))
    experts = num_experts(cfg)
    ffn = _count(cfg, "moe_intermediate_size", "intermediate_size")  # Mixtral's experts are its MLP's width
    out = [Tensor(f"{p}.mlp.router", (experts, h), tp_split=False)]
    for e in range(experts):
        out += _swiglu(f"{p}.mlp.experts.{e}", h, ffn, expert=e)
    shared_ffn = _optional(cfg, "shared_expert_intermediate_size", bound=WIDTH_OR_NONE)
    gated = shared_ffn is not None  # Qwen gates its shared expert
    if shared_ffn is None:
        shared_ffn = (_optional(cfg, "n_shared_experts", bound=EXPERTS) or 0) * ffn
    if shared_ffn:
        out += _swiglu(f"{p}.mlp.shared_experts", h, shared_ffn)
        if gated:
            out.append(Tensor(f"{p}.mlp.shared_experts.gate", (1, h), tp_split=False))
    return out


def _indexer_layers(cfg: dict, n_layers: int) -> list[bool]:
    """Which layers have their own DSA indexer (GLM-5 `indexer_types`, "shared" layers reuse the previous
    one's top-k); without the key, transformers' schedule from `index_topk_freq` / `index_skip_topk_offset`."""
    types = _layer_list(cfg, "indexer_types", str, n_layers, exact=True)
    if types is not None:
        return [t != "shared" for t in types]
    freq = max(_optional(cfg, "index_topk_freq", bound=LAYERS) or 1, 1)
    offset = _optional(cfg, "index_skip_topk_offset", bound=LAYER_COUNT_OR_NONE)
    offset = 2 if offset is None else offset  # transformers' default
    return [max(i - offset + 1, 0) % freq == 0 for i in range(n_layers)]


def _layer_kinds(cfg: dict, n_layers: int) -> list[tuple[bool, bool, bool]]:
    """(linear attention, dense MLP, own DSA indexer) of each decoder layer, from the config's per-layer keys."""
    experts = num_experts(cfg)
    first_dense = _optional(cfg, "first_k_dense_replace", bound=LAYER_COUNT_OR_NONE) or 0
    mlp_only = frozenset(_layer_list(cfg, "mlp_only_layers", int, n_layers, exact=False) or ())
    step = _optional(cfg, "decoder_sparse_step", bound=LAYERS) or 1
    types = _layer_list(cfg, "layer_types", str, n_layers, exact=True)
    interval = _optional(cfg, "full_attention_interval", bound=LAYERS)
    hybrid = interval is not None and cfg.get("linear_num_value_heads") is not None

    def linear(i: int) -> bool:
        if types is not None:
            return types[i] == "linear_attention"
        return hybrid and (i + 1) % interval != 0

    def dense(i: int) -> bool:
        return experts == 0 or i < first_dense or i in mlp_only or (i + 1) % step != 0

    indexers = _indexer_layers(cfg, n_layers)
    return [(linear(i), dense(i), indexers[i]) for i in range(n_layers)]


def _decoder_layer(cfg: dict, h: int, p: str, linear: bool, dense: bool, indexer: bool = True) -> list[Tensor]:
    return [Tensor(f"{p}.input_layernorm", (h,), tp_split=False), *_attention(cfg, h, p, linear, indexer),
            Tensor(f"{p}.pre_mlp_layernorm", (h,), tp_split=False), *_mlp(cfg, h, p, dense)]


def _mtp_layer(cfg: dict, h: int, p: str, moe: bool) -> list[Tensor]:
    return [Tensor(f"{p}.enorm", (h,), tp_split=False), Tensor(f"{p}.hnorm", (h,), tp_split=False),
            Tensor(f"{p}.eh_proj", (h, 2 * h)),
            *_decoder_layer(cfg, h, f"{p}.transformer_layer", linear=False, dense=not moe),
            Tensor(f"{p}.final_layernorm", (h,), tp_split=False)]


def _mtp_layers(cfg: dict) -> int:
    return _count(cfg, "num_nextn_predict_layers", "mtp_num_hidden_layers", bound=LAYER_COUNT_OR_NONE, default=0)


def padded_vocab(vocab: int, tp: int) -> int:
    multiple = VOCAB_PAD_MULTIPLE * tp
    return -(-vocab // multiple) * multiple


def _numel(tensors) -> int:
    return sum(t.numel for t in tensors)


# ---- the model -----------------------------------------------------------------------------------------------
def model_tensors(config: dict, name: str = "model", tp: int = 1, mtp: bool = True) -> ModelTensors:
    """All trained tensors of the language model a transformers config describes.

    tp pads the vocabulary as Megatron does for that tensor-parallel size. mtp=False leaves out the
    multi-token-prediction layers (a run that does not train them). ModelConfigError, naming the model,
    the key and the value, for a config the planner cannot count.
    """
    check_bound(ModelConfigError, "tensor-parallel size", tp, PARALLEL_SIZE)
    if not isinstance(config, dict):
        raise ModelConfigError(f"{shown_path(name)}: must be a JSON object (a transformers config.json), not a "
                               f"{type(config).__name__}")
    try:
        return _model_tensors(text_config(config), name, tp, mtp)
    except ModelConfigError as exc:
        raise ModelConfigError(f"{shown_path(name)}: {exc}") from None


def _model_tensors(cfg: dict, name: str, tp: int, mtp: bool) -> ModelTensors:
    h = _count(cfg, "hidden_size", bound=HIDDEN)
    n_layers = _count(cfg, "num_hidden_layers", bound=LAYERS)
    vocab = padded_vocab(_count(cfg, "vocab_size"), tp)
    kinds = _layer_kinds(cfg, n_layers)
    n_mtp = _mtp_layers(cfg) if mtp else 0
    moe = num_experts(cfg) > 0
    first = (Tensor("embedding", (vocab, h)),)
    head = [Tensor("decoder.final_layernorm", (h,), tp_split=False)]
    if not _flag(cfg, "tie_word_embeddings"):
        head.append(Tensor("output_layer", (vocab, h)))
    # One layer of each kind is built first, so that a config of a billion layers' worth of tensors or
    # parameters is refused before they are built.
    kind_counts = Counter(kinds)
    parts = [(1, first), (1, head), *((n, _decoder_layer(cfg, h, "probe", *kind)) for kind, n in kind_counts.items())]
    if n_mtp:
        parts.append((n_mtp, _mtp_layer(cfg, h, "probe", moe)))
    tensors = sum(n * len(part) for n, part in parts)
    if tensors > MAX_TENSORS:
        raise ModelConfigError(f"{n_layers} layers (+ {n_mtp} MTP) of up to {max(len(p) for _, p in parts)} tensors "
                               f"each make {tensors} tensors, over the {MAX_TENSORS} the planner counts: check "
                               "num_hidden_layers and the expert count")
    params = sum(n * _numel(part) for n, part in parts)
    if params > MAX_PARAMS:
        raise ModelConfigError(f"the config describes {params:.3g} parameters, over the {MAX_PARAMS:g} the planner "
                               "sizes: check hidden_size, num_hidden_layers and the widths")
    layers = tuple(tuple(_decoder_layer(cfg, h, f"decoder.layers.{i}", *kind)) for i, kind in enumerate(kinds))
    last = [*head, *(t for m in range(n_mtp) for t in _mtp_layer(cfg, h, f"mtp.layers.{m}", moe))]
    return ModelTensors(name, first, layers, tuple(last))


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
