"""Parameter tensors of a model, from a transformers `config.json` dict: names, shapes, and how they shard.

What is modelled (Megatron-core's GPT layout, which is what the megatron backend trains):
  * attention, one of
      - GQA (Llama/Qwen): fused `linear_qkv` [q + 2 kv, hidden] (q doubled when the output is gated,
        as Qwen3-Next/3.5's `attn_output_gate`), `linear_proj`, optional per-head q/k norms;
      - MLA (DeepSeek-V3/GLM-5): q down/up (or a direct q projection without `q_lora_rank`), kv
        down/up, output projection, the two latent norms; the down projections are replicated
        across tensor parallelism (Megatron-core builds them "duplicated"), the rest is split;
      - a DeepSeek sparse-attention indexer when `index_n_heads` is set (replicated: small);
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

from dataclasses import dataclass
from typing import Optional

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


class ModelConfigError(ValueError):
    """A config.json that lacks what the planner needs; the message names the key."""


def _get(cfg: dict, key: str, *alternatives: str, default=None, required: bool = True):
    for k in (key, *alternatives):
        if cfg.get(k) is not None:
            return cfg[k]
    if default is not None or not required:
        return default
    names = " or ".join(repr(k) for k in (key, *alternatives))
    raise ModelConfigError(f"config has no {names}; the planner needs it to count parameters "
                           f"(keys present: {', '.join(sorted(cfg)) or 'none'})")


def text_config(cfg: dict) -> dict:
    """Multimodal checkpoints (Qwen3.5, ...) nest the language model's config under `text_config`."""
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


# ---- attention -----------------------------------------------------------------------------------------------
def _gqa(cfg: dict, h: int, p: str) -> list[Tensor]:
    heads = _get(cfg, "num_attention_heads")
    kv = _get(cfg, "num_key_value_heads", default=heads)
    hd = _get(cfg, "head_dim", default=h // heads)
    q_out = heads * hd * (2 if cfg.get("attn_output_gate") else 1)
    out = [Tensor(f"{p}.linear_qkv", (q_out + 2 * kv * hd, h)), Tensor(f"{p}.linear_proj", (h, heads * hd))]
    if _has_qk_norm(cfg):
        out += [Tensor(f"{p}.q_layernorm", (hd,), tp_split=False), Tensor(f"{p}.k_layernorm", (hd,), tp_split=False)]
    return out


def _has_qk_norm(cfg: dict) -> bool:
    # Qwen3 and later normalize q and k per head; their configs do not always say so explicitly.
    return bool(cfg.get("qk_norm", cfg.get("model_type", "").startswith(("qwen3", "qwen3_5"))))


def _mla(cfg: dict, h: int, p: str) -> list[Tensor]:
    heads = _get(cfg, "num_attention_heads")
    q_lora = cfg.get("q_lora_rank")
    kv_lora = _get(cfg, "kv_lora_rank")
    nope, rope, v = _get(cfg, "qk_nope_head_dim"), _get(cfg, "qk_rope_head_dim"), _get(cfg, "v_head_dim")
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
    if cfg.get("index_n_heads"):
        ih, ihd = cfg["index_n_heads"], _get(cfg, "index_head_dim")
        out += [Tensor(f"{p}.indexer.wq_b", (ih * ihd, q_lora or h), tp_split=False),
                Tensor(f"{p}.indexer.wk", (ihd, h), tp_split=False),
                Tensor(f"{p}.indexer.k_norm", (ihd,), tp_split=False),
                Tensor(f"{p}.indexer.k_norm_bias", (ihd,), tp_split=False),
                Tensor(f"{p}.indexer.weights_proj", (ih, h), tp_split=False)]
    return out


def _gated_deltanet(cfg: dict, h: int, p: str) -> list[Tensor]:
    k_heads, v_heads = _get(cfg, "linear_num_key_heads"), _get(cfg, "linear_num_value_heads")
    key_dim = k_heads * _get(cfg, "linear_key_head_dim")
    v_head_dim = _get(cfg, "linear_value_head_dim")
    value_dim = v_heads * v_head_dim
    kernel = _get(cfg, "linear_conv_kernel_dim", default=4)
    return [Tensor(f"{p}.in_proj", (2 * key_dim + 2 * value_dim + 2 * v_heads, h)),  # q k v z, then b a
            Tensor(f"{p}.conv1d", (2 * key_dim + value_dim, 1, kernel)),
            Tensor(f"{p}.A_log", (v_heads,)), Tensor(f"{p}.dt_bias", (v_heads,)),
            Tensor(f"{p}.norm", (v_head_dim,), tp_split=False),
            Tensor(f"{p}.out_proj", (h, value_dim))]


def _is_mla(cfg: dict) -> bool:
    return cfg.get("kv_lora_rank") is not None


def _attention(cfg: dict, h: int, p: str, linear: bool) -> list[Tensor]:
    if linear:
        return _gated_deltanet(cfg, h, f"{p}.linear_attention")
    return (_mla if _is_mla(cfg) else _gqa)(cfg, h, f"{p}.self_attention")


# ---- MLP -----------------------------------------------------------------------------------------------------
def num_experts(cfg: dict) -> int:
    return int(_get(cfg, "num_experts", "n_routed_experts", "num_local_experts", default=0))


def _swiglu(p: str, h: int, ffn: int, expert: Optional[int] = None) -> list[Tensor]:
    return [Tensor(f"{p}.linear_fc1", (2 * ffn, h), expert=expert), Tensor(f"{p}.linear_fc2", (h, ffn), expert=expert)]


def _is_dense_layer(cfg: dict, index: int) -> bool:
    if num_experts(cfg) == 0:
        return True
    if index < int(cfg.get("first_k_dense_replace") or 0) or index in (cfg.get("mlp_only_layers") or ()):
        return True
    step = int(cfg.get("decoder_sparse_step") or 1)
    return (index + 1) % step != 0


def _mlp(cfg: dict, h: int, p: str, dense: bool) -> list[Tensor]:
    if dense:
        return _swiglu(f"{p}.mlp", h, _get(cfg, "intermediate_size"))
    experts = num_experts(cfg)
    ffn = _get(cfg, "moe_intermediate_size")
    out = [Tensor(f"{p}.mlp.router", (experts, h), tp_split=False)]
    for e in range(experts):
        out += _swiglu(f"{p}.mlp.experts.{e}", h, ffn, expert=e)
    shared_ffn = cfg.get("shared_expert_intermediate_size")
    if shared_ffn is None and cfg.get("n_shared_experts"):
        shared_ffn = cfg["n_shared_experts"] * ffn
    if shared_ffn:
        out += _swiglu(f"{p}.mlp.shared_experts", h, shared_ffn)
        if cfg.get("shared_expert_intermediate_size") is not None:  # Qwen gates its shared expert
            out.append(Tensor(f"{p}.mlp.shared_experts.gate", (1, h), tp_split=False))
    return out


def _layer_is_linear_attention(cfg: dict, index: int) -> bool:
    types = cfg.get("layer_types")
    if types:
        return types[index] == "linear_attention"
    interval = cfg.get("full_attention_interval")
    return bool(interval) and cfg.get("linear_num_value_heads") is not None and (index + 1) % interval != 0


def _decoder_layer(cfg: dict, h: int, p: str, linear: bool, dense: bool) -> list[Tensor]:
    return [Tensor(f"{p}.input_layernorm", (h,), tp_split=False), *_attention(cfg, h, p, linear),
            Tensor(f"{p}.pre_mlp_layernorm", (h,), tp_split=False), *_mlp(cfg, h, p, dense)]


def _mtp_layers(cfg: dict) -> int:
    return int(_get(cfg, "num_nextn_predict_layers", "mtp_num_hidden_layers", default=0))


def padded_vocab(vocab: int, tp: int) -> int:
    multiple = VOCAB_PAD_MULTIPLE * tp
    return -(-vocab // multiple) * multiple


# ---- the model -----------------------------------------------------------------------------------------------
def model_tensors(config: dict, name: str = "model", tp: int = 1, mtp: bool = True) -> ModelTensors:
    """All trained tensors of the language model a transformers config describes.

    tp pads the vocabulary as Megatron does for that tensor-parallel size. mtp=False leaves out the
    multi-token-prediction layers (a run that does not train them).
    """
    cfg = text_config(config)
    h = int(_get(cfg, "hidden_size"))
    n_layers = int(_get(cfg, "num_hidden_layers"))
    vocab = padded_vocab(int(_get(cfg, "vocab_size")), tp)
    layers = tuple(tuple(_decoder_layer(cfg, h, f"decoder.layers.{i}", _layer_is_linear_attention(cfg, i),
                                        _is_dense_layer(cfg, i)))
                   for i in range(n_layers))
    last = [Tensor("decoder.final_layernorm", (h,), tp_split=False)]
    if not cfg.get("tie_word_embeddings", False):
        last.append(Tensor("output_layer", (vocab, h)))
    if mtp:
        moe = num_experts(cfg) > 0
        for m in range(_mtp_layers(cfg)):
            p = f"mtp.layers.{m}"
            last += [Tensor(f"{p}.enorm", (h,), tp_split=False), Tensor(f"{p}.hnorm", (h,), tp_split=False),
                     Tensor(f"{p}.eh_proj", (h, 2 * h)),
                     *_decoder_layer(cfg, h, f"{p}.transformer_layer", linear=False, dense=not moe),
                     Tensor(f"{p}.final_layernorm", (h,), tp_split=False)]
    return ModelTensors(name, (Tensor("embedding", (vocab, h)),), layers, tuple(last))


def flat_model(params: int, tensors: int = 64, name: str = "flat") -> ModelTensors:
    """A stand-in of `params` parameters in `tensors` equal dense tensors (one per layer), like `miles bench
    stream`'s: for sizing the state of a parameter count without an architecture."""
    if params <= 0 or tensors <= 0:
        raise ModelConfigError(f"a flat model needs params > 0 and tensors > 0, got {params} and {tensors}")
    base, extra = divmod(params, tensors)
    sizes = [base + (1 if i < extra else 0) for i in range(tensors)]
    return ModelTensors(name, (), tuple((Tensor(f"layers.{i}.weight", (n,)),) for i, n in enumerate(sizes) if n), ())
