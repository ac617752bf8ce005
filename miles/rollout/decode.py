"""Batched token-by-token decoding for the embedded engine: sampling and two ways to step the model.

:func:`decode` drives a decoder: one prefill over the left-padded prompts, then one step per new token.
It never copies to the host inside the loop except for the all-finished check, made every
``check_every`` tokens (every token on CPU, where a check costs nothing; every
:data:`CUDA_CHECK_EVERY` tokens on CUDA, where each check stalls the launch queue).

- :class:`DynamicCacheDecoder`: transformers' default cache, grown by concatenation each step; the
  attention mask and positions are preallocated and updated in place. The CPU default.
- :class:`StaticCacheDecoder`: a transformers ``StaticCache`` of one shape bucket (batch rounded up to
  a power of two, cache length to a multiple of :data:`CACHE_LEN_STEP`), allocated once and kept; a
  4-D additive attention mask, positions and input tokens in static buffers updated in place. With a
  4-D mask transformers builds no mask of its own (no data-dependent host sync in the forward), so on
  CUDA one decode step is captured as a CUDA graph and replayed for every token. A capture that fails
  logs one line and the decoder steps eagerly. The CUDA default; full-attention models only (hybrid
  models with recurrent layers, e.g. Qwen3.5's Gated DeltaNet, use the dynamic decoder). The
  model's attention runs through :func:`packed_gqa_sdpa`, which reads the cache once per KV head.

:class:`RoutesRecordingDecoder` wraps either and keeps each forward's routed experts (R3,
:mod:`miles.routing`): the prefill's and every decode step's. Router hooks do not run when a CUDA graph
replays: a static decoder given the recorder keeps the ids its captured step's hooks saw (graph outputs, like
its logits) and hands them back to the recorder after each replay.

Sampling draws exactly what ``torch.multinomial(probs, 1, generator)`` draws (its exponential race,
``argmax(p / q)`` with ``q ~ Exp(1)``), without multinomial's input checks, which copy to the host
every call. Top-p sorts only when ``top_p < 1``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Protocol

import torch

if TYPE_CHECKING:
    from miles.routing import Routes
    from miles.routing.record import RouteRecorder

logger = logging.getLogger(__name__)

__all__ = ["decode", "sample_next", "left_pad", "DynamicCacheDecoder", "StaticCacheDecoder", "StaticDecoderPool",
           "RoutesRecordingDecoder", "cache_keyword", "cache_bytes", "supports_static_cache", "use_packed_gqa_attention",
           "CUDA_CHECK_EVERY", "CACHE_LEN_STEP"]

CUDA_CHECK_EVERY = 16     # tokens between all-finished checks on CUDA (each one is a host sync)
CACHE_LEN_STEP = 128      # static cache lengths are rounded up to this (fewer shapes, fewer graphs)
GRAPH_WARMUP_STEPS = 3    # eager steps before a capture (lazy allocations, kernel selection)
MAX_STATIC_DECODERS = 4   # shape buckets kept resident at once (least recently used dropped first)


# ------------------------------------------------------------------------------------------ sampling


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest prefix of the most likely tokens whose mass reaches ``top_p`` (>= 1 token)."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    sorted_p = sorted_p.masked_fill((cum - sorted_p) > top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)


def draw_categorical(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row, distributed as the row's (unnormalized) ``probs``; the same draw as
    ``torch.multinomial(probs, 1, generator=generator).squeeze(-1)`` for the same generator state."""
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(dim=-1)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, logprobs)`` for fp32 ``logits`` of shape (B, V): greedy when ``temperature`` is 0, else
    sampled from ``softmax(logits / temperature)`` restricted to top-p. ``logprobs`` is
    ``log_softmax(logits / temperature)`` (temperature 0: 1) of the chosen tokens, top-p not applied."""
    if temperature > 0:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        tokens = draw_categorical(top_p_filter(logp.exp(), top_p), generator)
    else:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# ------------------------------------------------------------------------------------------ the loop


class Decoder(Protocol):
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) after the prompts; ``valid`` (B, P) marks real (not padding) tokens."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) after feeding one token per row."""


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, valid)`` of shape (B, max prompt length), prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
        valid[row, width - len(prompt):] = True
    return ids.to(device), valid.to(device)


def positions_of(valid: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: 0 at each row's first real token (padding: 0)."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def decode(decoder: Decoder, input_ids: torch.Tensor, valid: torch.Tensor, *, max_new_tokens: int,
           temperature: float, top_p: float, stop_ids: tuple[int, ...], pad_id: int, generator: torch.Generator,
           check_every: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate up to ``max_new_tokens`` per row. Returns CPU ``(tokens, logprobs)`` of shape (B, T),
    T <= max_new_tokens: after a row's stop token its tokens are ``pad_id`` (log-probs meaningless).
    Stops early once every row has stopped (seen every ``check_every`` tokens)."""
    batch = input_ids.shape[0]
    device = input_ids.device
    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    stop = torch.as_tensor(stop_ids, dtype=torch.long, device=device) if stop_ids else None
    pad = torch.full((batch,), pad_id, dtype=torch.long, device=device)
    logits = decoder.prefill(input_ids, valid)
    steps = max_new_tokens
    for t in range(max_new_tokens):
        nxt, lp = sample_next(logits, temperature, top_p, generator)
        nxt = torch.where(finished, pad, nxt)
        tokens[:, t] = nxt
        logprobs[:, t] = lp
        if stop is not None:
            finished |= torch.isin(nxt, stop)
        if t + 1 == max_new_tokens or ((t + 1) % check_every == 0 and bool(finished.all())):
            steps = t + 1
            break
        logits = decoder.step(nxt)
    return tokens[:, :steps].cpu(), logprobs[:, :steps].cpu()


# ------------------------------------------------------------------------------------------ decoders


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward's KV-cache argument: ``cache`` from transformers 5.2x on, ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(output) -> object:
    return output["cache"] if "cache" in output.keys() else output["past_key_values"]


def cache_bytes(cache: object, _depth: int = 0, _seen: Optional[set] = None) -> int:
    """Bytes of the tensors a transformers cache holds, each storage counted once: keys and values of
    attention layers, MLA latents, an indexer's keys, the conv and recurrent states of linear-attention
    layers, whatever the model's cache class keeps (found by walking its attributes and containers)."""
    seen = set() if _seen is None else _seen
    if isinstance(cache, torch.Tensor):
        key = (cache.device, cache.untyped_storage().data_ptr())
        if key in seen:
            return 0
        seen.add(key)
        return cache.untyped_storage().nbytes()
    if _depth > 4 or cache is None or isinstance(cache, (str, bytes, int, float, bool, torch.nn.Module)):
        return 0
    if isinstance(cache, dict):
        children = cache.values()
    elif isinstance(cache, (list, tuple)):
        children = cache
    elif hasattr(cache, "__dict__"):
        children = vars(cache).values()
    else:
        return 0
    return sum(cache_bytes(child, _depth + 1, seen) for child in children)


class DynamicCacheDecoder:
    """Steps with transformers' default (growing) cache: one per generate call."""

    def __init__(self, model: torch.nn.Module, max_new_tokens: int):
        self.model = model
        self.max_new_tokens = max_new_tokens
        self._cache_kw = cache_keyword(model)
        self._cache = None
        self._mask: Optional[torch.Tensor] = None
        self._length = 0
        self._position: Optional[torch.Tensor] = None

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        batch, prompt_len = input_ids.shape
        self._mask = torch.zeros((batch, prompt_len + self.max_new_tokens), dtype=torch.long, device=input_ids.device)
        self._mask[:, :prompt_len] = valid
        self._length = prompt_len
        positions = positions_of(valid)
        self._position = positions[:, -1:].clone()
        out = self.model(input_ids=input_ids, attention_mask=self._mask[:, :prompt_len], position_ids=positions,
                         use_cache=True)
        self._cache = _cache_of(out)
        return out.logits[:, -1, :].float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self._mask[:, self._length] = 1
        self._length += 1
        self._position += 1
        out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=self._mask[:, :self._length],
                         position_ids=self._position, use_cache=True, **{self._cache_kw: self._cache})
        self._cache = _cache_of(out)
        return out.logits[:, -1, :].float()

    def cache_bytes(self) -> int:
        """What the cache holds now (at the end of a call: the most this call's cache held)."""
        return cache_bytes(self._cache)


PACKED_GQA_SDPA = "miles_packed_gqa_sdpa"


def packed_gqa_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except for one query token over grouped KV heads with a mask shared by
    the heads: the query heads that share a KV head are folded into the query length, so the cache is
    read once per KV head instead of being copied once per query head (transformers before 5.2x copies
    the whole static cache every step: half the decode step of a 1B Llama on an H200)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or kv_heads == heads or attention_mask is None or attention_mask.shape[1] != 1 or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, heads // kv_heads, dim), key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_packed_gqa_attention(model: torch.nn.Module) -> None:
    """Run the model's attention through :func:`packed_gqa_sdpa` (its masks built as for sdpa), whatever
    implementation it was loaded with: the static decoder's 4-D additive masks need an sdpa-style one."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_GQA_SDPA, packed_gqa_sdpa)
    AttentionMaskInterface.register(PACKED_GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(PACKED_GQA_SDPA)


# Layer types whose attention is plain causal softmax over the (possibly windowed) past: what the static
# decoder's packed-GQA attention computes. Others (GLM-5's "indexed_attention" / "deepseek_sparse_attention",
# whose indexer picks each query's keys; linear attention) decode with transformers' dynamic cache.
_STATIC_DECODER_LAYER_TYPES = frozenset(("full_attention", "sliding_attention"))


def supports_static_cache(model: torch.nn.Module) -> bool:
    """Whether every layer attends to the whole past with plain causal attention (the static decoder's mask
    is plain causal, its attention function dense): not sliding-window layers, nor GLM-5's indexed (DSA)
    layers, nor recurrent ones (Qwen3.5's Gated DeltaNet "linear_attention", whose conv and recurrent states
    the static decoder does not model); those decode with transformers' own cache (:class:`DynamicCacheDecoder`)."""
    from transformers import StaticCache

    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or ()
    if set(layer_types) - _STATIC_DECODER_LAYER_TYPES:
        return False
    return not any(StaticCache(config=model.config, max_cache_len=1).is_sliding)


def batch_bucket(batch: int) -> int:
    return 1 << max(0, batch - 1).bit_length()


def cache_len_bucket(length: int) -> int:
    return -(-length // CACHE_LEN_STEP) * CACHE_LEN_STEP


class StaticCacheDecoder:
    """Steps a fixed (batch, cache length) shape with a static cache; see the module docstring.

    Serves any batch up to ``batch`` rows (the spare rows repeat the last prompt; their outputs are
    dropped) whose prompt length + new tokens - 1 fits ``cache_len``. ``warmup_stream``: the side stream of
    the eager steps before a capture (shared by the engine's decoders, see :class:`StaticDecoderPool`).
    ``graph_pool``: CUDA graph memory
    pool shared by the decoders of one engine (None: no CUDA graph). ``recorder``: the engine's route recorder
    (None: routes are not recorded), whose ids a replayed graph step hands back."""

    def __init__(self, model: torch.nn.Module, batch: int, cache_len: int, graph_pool=None,
                 warmup_stream: Optional[torch.cuda.Stream] = None, recorder: Optional["RouteRecorder"] = None):
        from transformers import StaticCache

        self.model = model
        self.batch = batch
        self.cache_len = cache_len
        self.device = next(model.parameters()).device
        self._cache_kw = cache_keyword(model)
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        self._masked = torch.finfo(model.dtype).min
        self.tokens = torch.zeros((batch, 1), dtype=torch.long, device=self.device)
        self.positions = torch.zeros((batch, 1), dtype=torch.long, device=self.device)
        self.mask = torch.full((batch, 1, 1, cache_len), self._masked, dtype=model.dtype, device=self.device)
        self._next_slot = 0
        self._graph_pool = graph_pool
        self._warmup_stream = warmup_stream
        self.use_graph = graph_pool is not None
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._graph_logits: Optional[torch.Tensor] = None
        self.recorder = recorder
        self._graph_routes: Optional[list] = None  # the ids the captured step's router hooks kept

    def fits(self, batch: int, length: int) -> bool:
        return batch <= self.batch and length <= self.cache_len

    def nbytes(self) -> int:
        cache = sum(t.nbytes for layer in self.cache.layers if layer.is_initialized for t in (layer.keys, layer.values))
        return cache + self.tokens.nbytes + self.positions.nbytes + self.mask.nbytes

    def drop_graph(self) -> None:
        """Forget the captured graph (it points at the weights' memory; after the weights move, the next
        prefill captures again)."""
        self._graph = None
        self._graph_logits = None
        self._graph_routes = None

    def _forward(self) -> torch.Tensor:
        return self.model(input_ids=self.tokens, attention_mask=self.mask, position_ids=self.positions,
                          use_cache=True, **{self._cache_kw: self.cache}).logits

    def _capture(self) -> None:
        self.tokens.zero_()
        self.positions.zero_()
        self.mask.fill_(self._masked)
        self.mask[..., 0] = 0
        side = self._warmup_stream or torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        sync_mode = torch.cuda.get_sync_debug_mode()
        try:
            with torch.cuda.stream(side):
                self._forward()  # allocates the cache (its lazy initialization copies to the device)
                # a host sync would break the capture, and a broken capture leaves the process's default
                # CUDA generator unusable: find syncs in the eager warm-up steps instead
                torch.cuda.set_sync_debug_mode("error")
                for _ in range(GRAPH_WARMUP_STEPS - 1):
                    self._forward()
        except RuntimeError as e:
            return self._fall_back(e)
        finally:
            torch.cuda.set_sync_debug_mode(sync_mode)
            torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool):
                self._graph_logits = self._forward()
        except RuntimeError as e:
            return self._fall_back(e)
        self._graph = graph
        if self.recorder is not None:
            self._graph_routes = self.recorder.last_outputs()

    def _fall_back(self, error: Exception) -> None:
        logger.warning("rollout decode: CUDA graph capture failed for batch %d, cache length %d (%s: %s); "
                       "decoding eagerly", self.batch, self.cache_len, type(error).__name__, error)
        self.use_graph = False
        self._graph_logits = None

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        batch, prompt_len = input_ids.shape
        if self.use_graph and self._graph is None:
            self._capture()
        self.cache.reset()
        rows = torch.arange(self.batch, device=self.device).clamp(max=batch - 1)
        input_ids, valid = input_ids[rows], valid[rows]
        key_valid = torch.zeros((self.batch, self.cache_len), dtype=torch.bool, device=self.device)
        key_valid[:, :prompt_len] = valid
        causal = (torch.arange(prompt_len, device=self.device)[:, None]
                  >= torch.arange(self.cache_len, device=self.device)[None, :])
        prompt_mask = self._additive(key_valid[:, None, None, :] & causal[None, None])
        positions = positions_of(valid)
        out = self.model(input_ids=input_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                         **{self._cache_kw: self.cache})
        self.mask.copy_(self._additive(key_valid[:, None, None, :]))
        self.positions.copy_(positions[:, -1:])
        self._next_slot = prompt_len
        return out.logits[:batch, -1, :].float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        batch = tokens.shape[0]
        self.tokens[:batch, 0] = tokens
        self.positions += 1
        self.mask[..., self._next_slot] = 0
        self._next_slot += 1
        if self._graph is not None:
            self._graph.replay()
            logits = self._graph_logits
            if self._graph_routes is not None:
                self.recorder.set_outputs(self._graph_routes)
        else:
            logits = self._forward()
        return logits[:batch, -1, :].float()

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        return torch.where(allowed, 0.0, self._masked).to(self.mask.dtype)


class StaticDecoderPool:
    """The static decoders of one engine (its ``kv_cache`` memory), least recently used dropped first."""

    def __init__(self, model: torch.nn.Module, use_cuda_graphs: bool, max_decoders: int = MAX_STATIC_DECODERS,
                 recorder: Optional["RouteRecorder"] = None):
        self.model = model
        self.use_cuda_graphs = use_cuda_graphs
        self.recorder = recorder
        self.max_decoders = max_decoders
        self._decoders: OrderedDict[tuple[int, int], StaticCacheDecoder] = OrderedDict()
        self._graph_pool = None
        # One side stream for every capture of the engine's life, kept through clear(): torch gives each
        # stream that runs a matmul its own cuBLAS workspace (32 MiB on an H200) and keeps it as long as
        # the process, so a new stream per capture leaked one workspace per rollout.
        self._warmup_stream: Optional[torch.cuda.Stream] = None

    def get(self, batch: int, length: int) -> StaticCacheDecoder:
        """A decoder for ``batch`` rows and ``length`` = prompt + new tokens - 1 cache slots."""
        key = (batch_bucket(batch), cache_len_bucket(length))
        decoder = self._decoders.pop(key, None)
        if decoder is None:
            while len(self._decoders) >= self.max_decoders:
                self._decoders.popitem(last=False)
            if self.use_cuda_graphs and self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            if self.use_cuda_graphs and self._warmup_stream is None:
                self._warmup_stream = torch.cuda.Stream(next(self.model.parameters()).device)
            decoder = StaticCacheDecoder(self.model, *key, graph_pool=self._graph_pool,
                                         warmup_stream=self._warmup_stream, recorder=self.recorder)
        self._decoders[key] = decoder
        return decoder

    def nbytes(self) -> int:
        return sum(d.nbytes() for d in self._decoders.values())

    def drop_graphs(self) -> None:
        for decoder in self._decoders.values():
            decoder.drop_graph()

    def clear(self) -> int:
        """Drop every decoder (caches, buffers, graphs and their pool); returns the bytes they held."""
        freed = self.nbytes()
        self._decoders.clear()
        self._graph_pool = None
        return freed


class RoutesRecordingDecoder:
    """A decoder (:class:`Decoder`) that also keeps, after the prefill and each step, the experts every MoE layer
    chose for the tokens it fed (``recorder``: hooks on the model's routers). Recorded ids stay on the device
    in the compact dtype until :meth:`routes` copies them to the host once."""

    def __init__(self, decoder: Decoder, recorder: "RouteRecorder"):
        self.decoder = decoder
        self.recorder = recorder
        self._forwards: list[torch.Tensor] = []  # [B, tokens fed, layers, top_k] per forward

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        self._forwards = []
        logits = self.decoder.prefill(input_ids, valid)
        self._keep(*input_ids.shape)
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.decoder.step(tokens)
        self._keep(tokens.shape[0], 1)
        return logits

    def _keep(self, batch: int, fed: int) -> None:
        ids = self.recorder.take()
        # a static decoder runs its whole bucket: rows past ``batch`` repeat the last prompt and are dropped
        rows = ids.shape[0] // fed
        self._forwards.append(ids.view(rows, fed, *ids.shape[1:])[:batch])

    def routes(self, valid: torch.Tensor, response_lengths: list[int]) -> list["Routes"]:
        """Each row's routes over its prompt (``valid``: the left-padded prompts' real tokens) and its response
        but the last token (never fed): ``prompt + response - 1`` tokens, padding dropped."""
        from miles.routing import Routes

        ids = torch.cat(self._forwards, dim=1).cpu()
        self._forwards = []
        prompt_width = valid.shape[1]
        prompt_lengths = valid.sum(dim=1).tolist()
        return [Routes.from_expert_ids(ids[row, prompt_width - prompt_len: prompt_width + response_len - 1],
                                       self.recorder.shape)
                for row, (prompt_len, response_len) in enumerate(zip(prompt_lengths, response_lengths))]
