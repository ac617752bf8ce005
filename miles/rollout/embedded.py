"""The embedded rollout engine: batched torch generation with the policy's own model class.

It implements :class:`miles.rollout.contract.RolloutEngine` (the module docstring there has the memory
states and the colocated order). A plain class; as a Ray actor use ``ray.remote(EmbeddedRolloutEngine)``
(or :func:`miles.rollout.remote_engine_class`). Every public method takes and returns picklable values.

    engine = EmbeddedRolloutEngine(config)                        # loads miles.models.load_policy(config)
    samples = engine.generate(prompt_ids, SamplingParams(...))    # list[Sample], prompt-major
    engine.release_memory_occupation()                            # sleep: weights and kv_cache
    engine.resume_memory_occupation(["weights"])
    engine.begin_weight_update(v); engine.update_weights_from_tensor([...]); engine.end_weight_update(v)
    engine.resume_memory_occupation(["kv_cache"])
    engine.close()

``"weights"`` are released with the trainer's sleep/wake mechanism, :class:`miles.offload.StorageOffloader`:
on CPU the weights' storages are written to ``<backup_dir>/offload.bin`` and resized to 0 bytes (the RAM
is returned); on CUDA they are copied to host memory (``backup="cpu"``, default) or to the same file
(``backup="disk"``) and freed. Resume restores them bit-exactly into the same storages (parameter
objects are unchanged). ``backup="none"`` (what the RL loop uses: it pushes every weight after resuming
them) frees the parameters' storages without a copy; after resume their contents are undefined, and
generate is refused until a weight update has rewritten every parameter. A loaded checkpoint's storages (mmap'ed safetensors, tied embeddings) are made
resizable once, at construction (:func:`miles.offload.make_resizable`).

With ``record_routes=True`` (MoE models, R3) every sample carries its :class:`miles.routing.Routes`: the
experts each MoE layer chose for its prompt and response tokens, recorded by hooks on the routers in the
prefill and every decode step (:class:`miles.rollout.decode.RoutesRecordingDecoder`; with CUDA graphs, the
ids the captured step's hooks kept are graph outputs that each replay rewrites).

``"kv_cache"`` is the static decoders' memory (:mod:`miles.rollout.decode`: static KV caches, decode
buffers, CUDA graphs), freed on release and allocated again by the next ``generate`` for its shape.
"""

from __future__ import annotations

import gc
import logging
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from miles.config import RunConfig
from miles.offload import StorageOffloader, make_resizable
from miles.rollout import decode
from miles.rollout.contract import (FLATTENED_BUCKET, KV_CACHE, LOAD_FORMATS, MILES_FLAT_BUCKET, WEIGHTS,
                                    check_memory_tags)
from miles.rollout.engine_state import EngineState, check_prompts
from miles.rollout.types import Sample, SamplingParams
from miles.routing.record import RouteRecorder
from miles_plugins.optimizers.streaming.config import DEFAULT_CHUNK_MB

logger = logging.getLogger(__name__)

__all__ = ["EmbeddedRolloutEngine"]

GROUP_BACKENDS = ("gloo", "nccl")


@dataclass
class _Group:
    group: Any            # miles.weights.WeightUpdateGroup
    receive_device: torch.device


def _few(names: list[str], limit: int = 5) -> str:
    return f"{names[:limit]}{f' and {len(names) - limit} more' if len(names) > limit else ''}"


class EmbeddedRolloutEngine:
    """Generates samples with log-probs; releases/resumes its memory by tag and takes new weights.

    Args:
        config: the run's :class:`~miles.config.RunConfig` (loads the model when ``model`` is None; the
            backup directory, transfer chunk and sampling seed). May be None when ``model`` and
            ``tokenizer`` are given.
        model, tokenizer: use these instead of loading (tests).
        device: default ``cuda`` when available, else ``cpu``.
        backup: ``"disk"``, ``"cpu"`` (default: disk on CPU, cpu on CUDA) or ``"none"`` (released weights are
            dropped; a complete weight update must follow their resume).
        backup_dir: where the disk backup goes (default ``config.paths.engine_dir(engine_id)``, else a
            fresh temporary directory). Removed by :meth:`close` when this engine created it.
        max_batch_size: sequences generated together.
        static_cache: decode with static KV caches (default: on CUDA, for full-attention models).
        cuda_graphs: replay one captured CUDA graph per decode step (default: with a static cache on
            CUDA; needs both).
        record_routes: return each sample's routed experts (``Sample.routes``); MoE models only.
    """

    weight_payload = MILES_FLAT_BUCKET  # a SharedBucket by reference, miles' aligned flat by broadcast
    tp_size = 1

    def __init__(
        self,
        config: Optional[RunConfig] = None,
        *,
        model: Optional[torch.nn.Module] = None,
        tokenizer: Any = None,
        description: Optional[str] = None,
        device: Optional[Union[str, torch.device]] = None,
        backup: Optional[str] = None,
        backup_dir: Optional[str] = None,
        engine_id: int = 0,
        max_batch_size: int = 64,
        static_cache: Optional[bool] = None,
        cuda_graphs: Optional[bool] = None,
        record_routes: bool = False,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if model is None or tokenizer is None:
            if config is None:
                raise ValueError("EmbeddedRolloutEngine needs a RunConfig or (model, tokenizer)")
            from miles.models import load_policy

            model, tokenizer, description = load_policy(config, device=self.device)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        make_resizable(self.model)  # releasing "weights" resizes storages; a loaded checkpoint's cannot be
        self.tokenizer = tokenizer
        self.description = description or type(model).__name__
        self.engine_id = engine_id
        self.max_batch_size = max_batch_size
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.backup = backup or ("disk" if self.device.type == "cpu" else "cpu")
        self._temp_backup_dir: Optional[str] = None
        self._offloader = self._make_offloader(config, backup_dir)
        self._track_tensors()
        self.weight_version = 0
        seed = config.rollout.rollout_seed if config is not None else 0
        self._generator = torch.Generator(device=self.device).manual_seed(int(seed) * 7919 + engine_id)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_token_ids = self._default_stop_ids()
        self._recorder = RouteRecorder(self.model) if record_routes else None
        self.static_cache, self.cuda_graphs = self._choose_decoding(static_cache, cuda_graphs)
        if self.static_cache:
            decode.use_packed_gqa_attention(self.model)
        self._static = decode.StaticDecoderPool(self.model, self.cuda_graphs, recorder=self._recorder)
        self._dynamic_kv_bytes = 0  # the largest dynamic cache a generate call built since the last release
        self._check_every = 1 if self.device.type == "cpu" else decode.CUDA_CHECK_EVERY
        self._state = EngineState(engine_id)  # released tags, the open weight update, a generate running
        self._groups: dict[str, _Group] = {}
        self._shared: list = []  # the weights shared with a trainer by share_weights, until released
        self._closed = False
        logger.info("rollout engine %d: %s on %s (%s%s)", engine_id, self.description, self.device,
                    "static cache, CUDA graphs" if self.cuda_graphs else
                    "static cache" if self.static_cache else "dynamic cache",
                    f", recording routes ({self._recorder.shape.bytes_per_token} B/token)" if record_routes else "")

    def _make_offloader(self, config: Optional[RunConfig], backup_dir: Optional[str]) -> StorageOffloader:
        """The offloader of released weights. Its directory: the given one; with a run's config the engine's
        own (locked by the offloader, removed at close only if this run made it); else, for a disk backup, a
        private temporary directory (removed at close)."""
        if backup_dir is None and config is not None:
            backup_dir = config.paths.engine_dir(self.engine_id)
        if backup_dir is None and self.backup == "disk":
            backup_dir = self._temp_backup_dir = tempfile.mkdtemp(prefix=f"miles-rollout-engine{self.engine_id}-")
        chunk_mb = config.offload.offload_train_disk_chunk_mb if config is not None else DEFAULT_CHUNK_MB
        return StorageOffloader(self.backup, backup_dir, chunk_mb, run_id=config.run_id if config is not None else None)

    def _track_tensors(self) -> None:
        """What release backs up and what updates may write: every weight and buffer, tied ones under each name
        (the offloader backs each storage up once); without a backup only the parameters, which a weight
        update rewrites (buffers such as rotary frequencies are not sent, and are small)."""
        self._tensors = [t for _, t in self.model.named_parameters(remove_duplicate=False)]
        self._param_storages = {t.untyped_storage()._cdata for t in self._tensors}
        if self.backup != "none":
            self._tensors += [t for _, t in self.model.named_buffers(remove_duplicate=False)]
        self._updated_storages: set[int] = set()  # the parameters weight updates rewrote since the last release
        self._name_to_tensor = dict(self.model.named_parameters(remove_duplicate=False))
        self._name_to_tensor.update(dict(self.model.named_buffers(remove_duplicate=False)))

    def _choose_decoding(self, static_cache: Optional[bool], cuda_graphs: Optional[bool]) -> tuple[bool, bool]:
        supported = decode.supports_static_cache(self.model)
        if static_cache and not supported:
            raise ValueError(f"static_cache=True: {self.description} has sliding-window, sparse (DSA) or linear "
                             "(recurrent) attention layers, which the static decoder's plain causal attention does "
                             "not model; leave static_cache unset")
        static = (self.device.type == "cuda" and supported) if static_cache is None else bool(static_cache)
        if cuda_graphs and not (static and self.device.type == "cuda"):
            raise ValueError(f"cuda_graphs=True needs a static cache on CUDA (device {self.device}, static_cache="
                             f"{static}); leave cuda_graphs unset")
        graphs = (static and self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        return static, graphs

    # ---------------------------------------------------------------------------------- info

    def _default_stop_ids(self) -> tuple[int, ...]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        eos = self.model.generation_config.eos_token_id if self.model.generation_config is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        return tuple(sorted(ids))

    def get_description(self) -> str:
        return self.description

    def get_weight_version(self) -> int:
        return self.weight_version

    def health(self) -> bool:
        return not self._closed

    # ---------------------------------------------------------------------------------- generate

    @torch.no_grad()
    def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: Union[SamplingParams, dict, None] = None,
                 return_logprob: bool = True) -> list[Sample]:
        """See :meth:`miles.rollout.contract.RolloutEngine.generate`."""
        self._state.check_generate()
        sp = SamplingParams.coerce(sampling_params).check()
        prompts = check_prompts(input_ids, self.vocab_size)
        jobs = [(i, ids) for i, ids in enumerate(prompts) for _ in range(sp.n)]
        gen = self._generator
        if sp.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(int(sp.seed))
        stop = tuple(sp.stop_token_ids) if sp.stop_token_ids is not None else self.stop_token_ids
        samples: list[Sample] = []
        with self._state.generating_call():
            for start in range(0, len(jobs), self.max_batch_size):
                chunk = jobs[start: start + self.max_batch_size]
                results = self._generate_batch([ids for _, ids in chunk], sp, stop, gen)
                for (pi, ids), (resp, lps, reason, routes) in zip(chunk, results):
                    samples.append(Sample(
                        index=len(samples), prompt_index=pi, prompt_ids=list(ids), response_ids=resp,
                        response_logprobs=lps if return_logprob else [],
                        response_text=self.tokenizer.decode(resp, skip_special_tokens=True),
                        finish_reason=reason, weight_version=self.weight_version, routes=routes,
                    ))
        return samples

    def _generate_batch(self, batch: list[list[int]], sp: SamplingParams, stop: tuple[int, ...], gen):
        """Per row: response tokens, their log-probs, the finish reason and the routes (None unless recorded)."""
        input_ids, valid = decode.left_pad(batch, self.pad_token_id, self.device)
        if self.static_cache:
            decoder = self._static.get(len(batch), input_ids.shape[1] + sp.max_new_tokens - 1)
        else:
            decoder = decode.DynamicCacheDecoder(self.model, sp.max_new_tokens)
        recording = decode.RoutesRecordingDecoder(decoder, self._recorder) if self._recorder is not None else None
        tokens, logprobs = decode.decode(
            recording or decoder, input_ids, valid, max_new_tokens=sp.max_new_tokens, temperature=sp.temperature,
            top_p=sp.top_p, stop_ids=stop, pad_id=self.pad_token_id, generator=gen, check_every=self._check_every)
        if not self.static_cache:  # freed when this call returns: the largest is what the next generate needs
            self._dynamic_kv_bytes = max(self._dynamic_kv_bytes, decoder.cache_bytes())
        stop_set = set(stop)
        results = []
        for row_tokens, row_logprobs in zip(tokens.tolist(), logprobs.tolist()):
            end = next((j + 1 for j, t in enumerate(row_tokens) if t in stop_set), None)
            reason = "length" if end is None else "stop"
            end = len(row_tokens) if end is None else end
            results.append((row_tokens[:end], row_logprobs[:end], reason))
        if recording is None:
            return [(*row, None) for row in results]
        routes = recording.routes(valid, [len(resp) for resp, _, _ in results])
        return [(*row, row_routes) for row, row_routes in zip(results, routes)]

    def flush_cache(self) -> None:
        """Nothing to flush: the embedded engine keeps no prompt state between generate calls (each call
        resets its static caches)."""

    # ---------------------------------------------------------------------------------- weights

    def begin_weight_update(self, version: int) -> None:
        """See :meth:`miles.rollout.contract.RolloutEngine.begin_weight_update`."""
        self._state.begin(version)

    def end_weight_update(self, version: int) -> dict:
        """See :meth:`miles.rollout.contract.RolloutEngine.end_weight_update`."""
        session = self._state.end(version)
        if self._param_storages <= self._updated_storages:
            self._state.weights_undefined = False
        self.weight_version = session.version
        return {"version": session.version, "tensors": session.tensors, "bytes": session.bytes}

    @torch.no_grad()
    def update_weights_from_tensor(self, serialized_named_tensors: list, load_format: Optional[str] = FLATTENED_BUCKET,
                                   flush_cache: bool = False) -> dict:
        """See :meth:`miles.rollout.contract.RolloutEngine.update_weights_from_tensor` (tensor parallel size 1:
        one payload)."""
        session = self._state.open_session("update_weights_from_tensor")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
        if load_format is None:
            if isinstance(serialized_named_tensors, Mapping):
                raise TypeError("load_format None takes a list of (name, tensor) pairs: pass "
                                "list(state_dict.items())")
            stats = self._copy_in(serialized_named_tensors)
        else:
            from miles.weights import SharedBucket, open_bucket, unpack_bucket

            if len(serialized_named_tensors) != 1:
                raise ValueError(f"the embedded engine has tensor parallel size 1: pass one payload, got "
                                 f"{len(serialized_named_tensors)}")
            payload = serialized_named_tensors[0]
            if not isinstance(payload, SharedBucket):
                raise TypeError(f"load_format 'flattened_bucket' takes a miles.weights.SharedBucket, got "
                                f"{type(payload).__name__}")
            spec, flat = open_bucket(payload)
            try:
                stats = self._copy_in(unpack_bucket(spec, flat))
            finally:
                del flat
        session.count(stats)
        if flush_cache:
            self.flush_cache()
        return stats

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> None:
        """See :meth:`miles.rollout.contract.RolloutEngine.init_weights_update_group`."""
        from miles.weights import WeightUpdateGroup

        if group_name in self._groups:
            raise ValueError(f"rollout engine {self.engine_id} already joined weight update group {group_name!r}; "
                             "destroy it first or pick another name")
        if backend not in GROUP_BACKENDS:
            raise ValueError(f"weight update group backend must be one of {GROUP_BACKENDS}, got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend 'nccl' needs the engine on CUDA (it is on {self.device}); use 'gloo'")
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        group = WeightUpdateGroup(master_address=master_address, master_port=master_port, rank=rank_offset,
                                  world_size=world_size, backend=backend, group_name=group_name)
        self._groups[group_name] = _Group(group, self.device if backend == "nccl" else torch.device("cpu"))

    @torch.no_grad()
    def update_weights_from_distributed(self, bucket_specs: list[dict], group_name: str, src: int = 0) -> dict:
        """See :meth:`miles.rollout.contract.RolloutEngine.update_weights_from_distributed`."""
        from miles.weights import BucketSpec, receive_bucket, unpack_bucket

        session = self._state.open_session("update_weights_from_distributed")
        joined = self._group(group_name)
        specs = [BucketSpec.from_dict(d) for d in bucket_specs]  # all validated before any is received
        total = {"tensors": 0, "bytes": 0}
        for spec in specs:
            flat = receive_bucket(joined.group, spec, joined.receive_device, src)
            stats = self._copy_in(unpack_bucket(spec, flat))
            del flat
            session.count(stats)
            total = {k: total[k] + stats[k] for k in total}
        return total

    def destroy_weights_update_group(self, group_name: str) -> None:
        """See :meth:`miles.rollout.contract.RolloutEngine.destroy_weights_update_group`."""
        self._group(group_name).group.destroy()
        del self._groups[group_name]

    def _group(self, group_name: str) -> _Group:
        if group_name not in self._groups:
            raise KeyError(f"rollout engine {self.engine_id} has not joined weight update group {group_name!r} "
                           f"(joined: {sorted(self._groups)}); call init_weights_update_group first")
        return self._groups[group_name]

    def _copy_in(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Copy named tensors into the weights after checking every name and shape (nothing is copied when
        one is wrong). Returns ``{"tensors", "bytes"}``; on CUDA the copies have landed when it returns,
        so the sender may reuse its buffers."""
        pairs, unknown = [], []
        for name, tensor in named_tensors:
            key = name[len("module."):] if name.startswith("module.") and name not in self._name_to_tensor else name
            dst = self._name_to_tensor.get(key)
            if dst is None:
                unknown.append(name)
            elif tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, the engine's is {tuple(dst.shape)}")
            else:
                pairs.append((dst, tensor))
        if unknown:
            raise KeyError(f"unknown parameter names {_few(unknown)}: names are the model's state_dict keys, e.g. "
                           f"{_few(list(self._name_to_tensor), 3)}")
        for dst, src in pairs:
            dst.copy_(src)
            self._updated_storages.add(dst.untyped_storage()._cdata)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return {"tensors": len(pairs), "bytes": sum(src.numel() * src.element_size() for _, src in pairs)}

    def share_weights(self) -> list:
        """The weights by reference, for a trainer on this GPU that rebuilds its own from them at wake (the
        sleep plan's ``rebuild_from_engine``; :mod:`miles.weights.readback`): one ``SharedBucket`` per
        parameter, valid until the weights are released (which drops them) or this is called again."""
        from miles.weights.readback import share_named_tensors

        if WEIGHTS in self._state.released or self._state.weights_undefined:
            raise RuntimeError(f"rollout engine {self.engine_id}: its weights are released or not yet rewritten: "
                               "there is nothing to share; share them after a weight update, before releasing them")
        self._drop_shared()
        self._shared = share_named_tensors(self.model.named_parameters())
        return list(self._shared)

    def _drop_shared(self) -> None:
        for bucket in self._shared:
            bucket.release()
        self._shared = []

    def get_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the engine's state dict (tests, debugging)."""
        if WEIGHTS in self._state.released:
            raise RuntimeError("rollout engine weights are released; call resume_memory_occupation(['weights'])")
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    # ---------------------------------------------------------------------------------- memory

    def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> dict:
        """See :meth:`miles.rollout.contract.RolloutEngine.release_memory_occupation`. ``"kv_cache"``: the
        static caches freed now or, with dynamic caches (each freed as its generate call returns), the largest
        one a call built since the last release: what the sleep plan leaves room for."""
        tags = check_memory_tags(tags)
        self._state.check_release(tags)
        freed = {}
        if KV_CACHE in tags:
            if KV_CACHE in self._state.released:
                freed[KV_CACHE] = 0
            elif self.static_cache:
                freed[KV_CACHE] = self._static.clear()
            else:  # each generate call freed its dynamic cache as it returned: the largest since the last release
                freed[KV_CACHE], self._dynamic_kv_bytes = self._dynamic_kv_bytes, 0
            self._state.released.add(KV_CACHE)
        if WEIGHTS in tags:
            self._drop_shared()  # a trainer read them back already (share_weights' contract)
            self._static.drop_graphs()  # they point at the weights' storages, which come back elsewhere
            stats = self._offloader.sleep(self._tensors)
            self._state.released.add(WEIGHTS)
            if self.backup == "none":
                self._state.weights_undefined, self._updated_storages = True, set()
            freed[WEIGHTS] = stats.bytes
            if not stats.skipped:
                logger.info("rollout engine %d: released %.1f MiB of weights %s in %.2f s", self.engine_id,
                            stats.bytes / 2**20, "(no backup: the next weight update rewrites them)"
                            if self.backup == "none" else f"to {stats.path or 'host memory'}", stats.seconds)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> dict:
        """See :meth:`miles.rollout.contract.RolloutEngine.resume_memory_occupation`. ``"kv_cache"`` is
        allocated by the next generate (its size depends on the batch), so it reports 0 bytes."""
        tags = check_memory_tags(tags)
        restored = {}
        if WEIGHTS in tags:
            restored[WEIGHTS] = self._offloader.wake().bytes
            self._state.released.discard(WEIGHTS)
        if KV_CACHE in tags:
            self._state.released.discard(KV_CACHE)
            restored[KV_CACHE] = 0
        return restored

    def close(self) -> None:
        """Leave every weight update group, drop the decoders and the backup (and the backup directory
        when this run created it)."""
        for name in list(self._groups):
            self.destroy_weights_update_group(name)
        self._static.clear()
        self._drop_shared()
        if self._recorder is not None:
            self._recorder.close()
        self._offloader.close(remove_directory=self._temp_backup_dir is None)
        if self._temp_backup_dir is not None:
            shutil.rmtree(self._temp_backup_dir, ignore_errors=True)
        self._closed = True
