"""A transformers `config.json` dict read into its model's tensors (``miles.sizing.tensors``' builders), for the
model types no megatron family builds (the torch backend trains any transformers causal LM) and the torch
engine's FLOP count; a model a family builds is read through the family (``families.read_config``), as its
trainer reads it. Every value is checked where it is read, with the ranges of :data:`CONFIG_SIZES`;
:func:`check_config_bounds` checks all of them on an untrusted config before anything is built from it.

Layer kinds from the config's per-layer keys: attention as `layer_types` says ("linear_attention": a Gated
DeltaNet), else MLA where `kv_lora_rank` is set (with its DSA indexer where `index_n_heads` is, on the layers
`indexer_types` gives their own), else GQA; the MLP dense on the first `first_k_dense_replace` layers,
`mlp_only_layers` and off the `decoder_sparse_step`, MoE elsewhere when the config has experts;
multi-token-prediction layers from `num_nextn_predict_layers` (DeepSeek/GLM) or `mtp_num_hidden_layers` (Qwen).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

from .bounds import (EXPERTS, HIDDEN, LAYER_COUNT_OR_NONE, LAYERS, MAX_LAYERS, PARALLEL_SIZE, WIDTH, WIDTH_OR_NONE,
                     Bound, check_bound, shown, shown_path)
from .tensors import (ModelConfigError, ModelTensors, Tensor, assemble_model, decoder_layer_tensors,
                      gated_deltanet_tensors, gqa_tensors, indexer_tensors, mla_tensors, mlp_tensors, mtp_layer_tensors)

__all__ = ["CONFIG_SIZES", "LAYER_LISTS", "check_config_bounds", "model_tensors", "num_experts", "experts_per_token",
           "text_config"]


# ---- reading a config: every value is checked where it is read --------------------------------------------
# Every integer size the reader takes from a config, with its range (the *_OR_NONE ranges take 0 for "none"):
# the reader checks one where it reads it, check_config_bounds all that a config sets.
CONFIG_SIZES: dict[str, Bound] = {
    "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "vocab_size": WIDTH,
    "intermediate_size": WIDTH, "moe_intermediate_size": WIDTH,
    "num_experts": EXPERTS, "n_routed_experts": EXPERTS, "num_local_experts": EXPERTS,
    "num_experts_per_tok": EXPERTS, "moe_topk": EXPERTS,
    "shared_expert_intermediate_size": WIDTH_OR_NONE, "n_shared_experts": EXPERTS,
    "first_k_dense_replace": LAYER_COUNT_OR_NONE, "decoder_sparse_step": LAYERS,
    "num_attention_heads": WIDTH, "num_key_value_heads": WIDTH, "head_dim": WIDTH,
    "q_lora_rank": WIDTH_OR_NONE, "kv_lora_rank": WIDTH, "qk_nope_head_dim": WIDTH, "qk_rope_head_dim": WIDTH,
    "v_head_dim": WIDTH,
    "index_n_heads": WIDTH_OR_NONE, "index_head_dim": WIDTH, "index_topk_freq": LAYERS,
    "index_skip_topk_offset": LAYER_COUNT_OR_NONE,
    "linear_num_key_heads": WIDTH, "linear_num_value_heads": WIDTH, "linear_key_head_dim": WIDTH,
    "linear_value_head_dim": WIDTH, "linear_conv_kernel_dim": WIDTH, "full_attention_interval": LAYERS,
    "num_nextn_predict_layers": LAYER_COUNT_OR_NONE, "mtp_num_hidden_layers": LAYER_COUNT_OR_NONE,
}
LAYER_LISTS = ("layer_types", "mlp_only_layers", "indexer_types")  # one entry per decoder layer (at most)


def _json_object(config, name: str) -> dict:
    if not isinstance(config, dict):
        raise ModelConfigError(f"{shown_path(name)}: must be a JSON object (a transformers config.json), not a "
                               f"{type(config).__name__}")
    return config


def check_config_bounds(config: dict, name: str = "model") -> None:
    """ModelConfigError, naming `name`, the key and the value, for a language model's config (its `text_config`
    in a multimodal one) that sets a size of CONFIG_SIZES outside its range or a per-layer list (LAYER_LISTS)
    longer than MAX_LAYERS. For the families, which hand the dict to transformers' config classes (these build
    per-layer lists from num_hidden_layers): an untrusted config.json is bounded before anything is built from
    it. Keys it does not set are not its business (nor are nulls)."""
    cfg = text_config(_json_object(config, name))
    for key, bound in CONFIG_SIZES.items():
        if cfg.get(key) is not None:
            check_bound(ModelConfigError, f"{shown_path(name)}: {key} =", cfg[key], bound)
    for key in LAYER_LISTS:
        value = cfg.get(key)
        if isinstance(value, (list, str, dict)) and len(value) > MAX_LAYERS:
            raise ModelConfigError(f"{shown_path(name)}: {key} = {shown(value)}: holds {len(value)} entries, more "
                                   f"than the {MAX_LAYERS} layers a model may have (one entry per decoder layer)")


def _missing(cfg: dict, keys: tuple[str, ...]) -> ModelConfigError:
    names = " or ".join(repr(k) for k in keys)
    present = ", ".join(shown(k, 40) for k in sorted(map(str, cfg))[:20]) or "none"
    return ModelConfigError(f"config has no {names}; the planner needs it to count parameters (keys present: "
                            f"{present}{', ...' if len(cfg) > 20 else ''})")


def _optional(cfg: dict, key: str, *alternatives: str) -> Optional[int]:
    """The first of the keys the config sets (not null), within its CONFIG_SIZES range; None when it sets none."""
    for k in (key, *alternatives):
        if cfg.get(k) is not None:
            check_bound(ModelConfigError, f"{k} =", cfg[k], CONFIG_SIZES[k])
            return cfg[k]
    return None


def _count(cfg: dict, key: str, *alternatives: str, default: Optional[int] = None) -> int:
    """As _optional, with `default` when no key is set; without a default a missing key is refused."""
    value = _optional(cfg, key, *alternatives)
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


# ---- the reader's parts: each reads its sizes now and returns a builder of the tensors under a prefix -------
Build = Callable[[str], list[Tensor]]


def _gqa(cfg: dict, h: int) -> Build:
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
    # Qwen3 and later normalize q and k per head; their configs do not always say so explicitly.
    qk_norm = _flag(cfg, "qk_norm", default=_model_type(cfg).startswith(("qwen3", "qwen3_5")))
    return partial(gqa_tensors, hidden=h, heads=heads, kv_heads=kv, head_dim=hd, gated=gated, qk_norm=qk_norm)


def _mla(cfg: dict, h: int, indexer: bool) -> Build:
    """MLA, with the DSA indexer when the config has one (`index_n_heads`) and `indexer` (the layer's own)."""
    heads, q_lora = _count(cfg, "num_attention_heads"), _optional(cfg, "q_lora_rank")
    mla = partial(mla_tensors, hidden=h, heads=heads, q_lora_rank=q_lora,
                  kv_lora_rank=_count(cfg, "kv_lora_rank"), qk_nope_head_dim=_count(cfg, "qk_nope_head_dim"),
                  qk_rope_head_dim=_count(cfg, "qk_rope_head_dim"), v_head_dim=_count(cfg, "v_head_dim"))
    index_heads = _optional(cfg, "index_n_heads")
    if not (index_heads and indexer):
        return mla
    index = partial(indexer_tensors, hidden=h, q_lora_rank=q_lora, index_heads=index_heads,
                    index_head_dim=_count(cfg, "index_head_dim"))
    return lambda p: [*mla(p), *index(p)]


def _gated_deltanet(cfg: dict, h: int) -> Build:
    return partial(gated_deltanet_tensors, hidden=h, key_heads=_count(cfg, "linear_num_key_heads"),
                   value_heads=_count(cfg, "linear_num_value_heads"),
                   key_head_dim=_count(cfg, "linear_key_head_dim"),
                   value_head_dim=_count(cfg, "linear_value_head_dim"),
                   conv_kernel=_count(cfg, "linear_conv_kernel_dim", default=4))


def _attention(cfg: dict, h: int, linear: bool, indexer: bool) -> Build:
    """The attention of a layer, built under the layer's prefix."""
    if linear:
        build, kind = _gated_deltanet(cfg, h), "linear_attention"
    elif cfg.get("kv_lora_rank") is not None:
        build, kind = _mla(cfg, h, indexer), "self_attention"
    else:
        build, kind = _gqa(cfg, h), "self_attention"
    return lambda p: build(f"{p}.{kind}")


def num_experts(cfg: dict) -> int:
    return _count(cfg, "num_experts", "n_routed_experts", "num_local_experts", default=0)


def experts_per_token(config: dict) -> int:
    """Routed experts each token passes through (``num_experts_per_tok``; 0 for a dense model)."""
    cfg = text_config(config)
    if num_experts(cfg) == 0:
        return 0
    return _count(cfg, "num_experts_per_tok", "moe_topk")


def _mlp(cfg: dict, h: int, dense: bool) -> Build:
    if dense:
        return partial(mlp_tensors, hidden=h, ffn=_count(cfg, "intermediate_size"))
    experts = num_experts(cfg)
    ffn = _count(cfg, "moe_intermediate_size", "intermediate_size")  # Mixtral's experts are its MLP's width
    shared_ffn = _optional(cfg, "shared_expert_intermediate_size")
    gated = shared_ffn is not None  # Qwen gates its shared expert
    if shared_ffn is None:
        shared_ffn = (_optional(cfg, "n_shared_experts") or 0) * ffn
    return partial(mlp_tensors, hidden=h, ffn=ffn, experts=experts, shared_ffn=shared_ffn, shared_gate=gated)


def _layer(cfg: dict, h: int, linear: bool, dense: bool, indexer: bool) -> Build:
    attention, mlp = _attention(cfg, h, linear, indexer), _mlp(cfg, h, dense)
    return lambda p: decoder_layer_tensors(p, h, attention(p), mlp(p))


def _indexer_layers(cfg: dict, n_layers: int) -> list[bool]:
    """Which layers have their own DSA indexer (GLM-5 `indexer_types`, "shared" layers reuse the previous
    one's top-k); without the key, transformers' schedule from `index_topk_freq` / `index_skip_topk_offset`."""
    types = _layer_list(cfg, "indexer_types", str, n_layers, exact=True)
    if types is not None:
        return [t != "shared" for t in types]
    freq = max(_optional(cfg, "index_topk_freq") or 1, 1)
    offset = _optional(cfg, "index_skip_topk_offset")
    offset = 2 if offset is None else offset  # transformers' default
    return [max(i - offset + 1, 0) % freq == 0 for i in range(n_layers)]


def _layer_kinds(cfg: dict, n_layers: int) -> list[tuple[bool, bool, bool]]:
    """(linear attention, dense MLP, own DSA indexer) of each decoder layer, from the config's per-layer keys."""
    experts = num_experts(cfg)
    first_dense = _optional(cfg, "first_k_dense_replace") or 0
    mlp_only = frozenset(_layer_list(cfg, "mlp_only_layers", int, n_layers, exact=False) or ())
    step = _optional(cfg, "decoder_sparse_step") or 1
    types = _layer_list(cfg, "layer_types", str, n_layers, exact=True)
    interval = _optional(cfg, "full_attention_interval")
    hybrid = interval is not None and cfg.get("linear_num_value_heads") is not None

    def linear(i: int) -> bool:
        if types is not None:
            return types[i] == "linear_attention"
        return hybrid and (i + 1) % interval != 0

    def dense(i: int) -> bool:
        return experts == 0 or i < first_dense or i in mlp_only or (i + 1) % step != 0

    indexers = _indexer_layers(cfg, n_layers)
    return [(linear(i), dense(i), indexers[i]) for i in range(n_layers)]


# ---- the model -----------------------------------------------------------------------------------------------
def model_tensors(config: dict, name: str = "model", tp: int = 1, mtp: bool = True) -> ModelTensors:
    """All trained tensors of the language model a transformers config describes.

    tp pads the vocabulary as Megatron does for that tensor-parallel size. mtp=False leaves out the
    multi-token-prediction layers (a run that does not train them). ModelConfigError, naming the model,
    the key and the value, for a config the planner cannot count.
    """
    check_bound(ModelConfigError, "tensor-parallel size", tp, PARALLEL_SIZE)
    cfg = text_config(_json_object(config, name))
    try:
        assemble = _read_model(cfg, mtp)
    except ModelConfigError as exc:
        raise ModelConfigError(f"{shown_path(name)}: {exc}") from None
    return assemble(name=name, tp=tp)


def _read_model(cfg: dict, mtp: bool) -> Callable[..., ModelTensors]:
    """Every size of the config, read and checked now: assemble_model with all but the name and TP."""
    h = _count(cfg, "hidden_size")
    n_layers = _count(cfg, "num_hidden_layers")
    vocab = _count(cfg, "vocab_size")
    kinds = _layer_kinds(cfg, n_layers)
    n_mtp = _count(cfg, "num_nextn_predict_layers", "mtp_num_hidden_layers", default=0) if mtp else 0
    moe = num_experts(cfg) > 0
    tied = _flag(cfg, "tie_word_embeddings")
    builds = {kind: _layer(cfg, h, *kind) for kind in dict.fromkeys(kinds)}  # each kind's sizes, in layer order
    # an MTP layer's transformer layer: full attention (with its indexer), MoE when the model is MoE
    mtp_build = _layer(cfg, h, linear=False, dense=not moe, indexer=True) if n_mtp else None

    def build_mtp(p: str) -> list[Tensor]:
        return mtp_layer_tensors(p, h, mtp_build(f"{p}.transformer_layer"))

    return partial(assemble_model, hidden=h, vocab_size=vocab, tied=tied, layer_kinds=kinds,
                   build_layer=lambda i, p: builds[kinds[i]](p), mtp_layers=n_mtp, build_mtp=build_mtp)
