"""The embedded rollout engine: batched torch generation with the policy's own model class.

A plain class; as a Ray actor use ``ray.remote(EmbeddedRolloutEngine)`` (or
:func:`miles.rollout.remote_engine_class`). Every public method takes and returns picklable values.

    engine = EmbeddedRolloutEngine(config)                      # loads miles.models.load_policy(config)
    samples = engine.generate(prompt_ids, SamplingParams(...))  # list[Sample], prompt-major
    engine.release_memory(); engine.resume_memory()             # sleep / wake (idempotent)
    engine.update_weights(state_dict_or_named_tensors)          # after each train step
    engine.close()

Memory release uses the trainer's sleep/wake mechanism, :class:`miles.offload.StorageOffloader`: on
CPU the weights' storages are written to ``<backup_dir>/offload.bin`` and resized to 0 bytes (the RAM
is returned); on CUDA they are copied to host memory (``backup="cpu"``, default) or to the same file
(``backup="disk"``) and freed. Resume restores them bit-exactly into the same storages (parameter
objects are unchanged). A loaded checkpoint's storages (mmap'ed safetensors, tied embeddings) are made
resizable once, at construction (:func:`miles.offload.make_resizable`).
"""

from __future__ import annotations

import gc
import logging
import shutil
import tempfile
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from miles.config import RunConfig
from miles.offload import StorageOffloader, make_resizable
from miles.rollout.types import Sample, SamplingParams
from miles_plugins.optimizers.streaming.config import DEFAULT_CHUNK_MB

logger = logging.getLogger(__name__)

__all__ = ["EmbeddedRolloutEngine"]

WeightsLike = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return probs
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    remove = (cum - sorted_p) > top_p  # keep the smallest prefix whose mass reaches top_p (>= 1 token)
    sorted_p = sorted_p.masked_fill(remove, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)


class EmbeddedRolloutEngine:
    """Generates samples with log-probs; can release/resume its memory and take new weights.

    Args:
        config: the run's :class:`~miles.config.RunConfig` (loads the model when ``model`` is None; the
            backup directory, transfer chunk and sampling seed). May be None when ``model`` and
            ``tokenizer`` are given.
        model, tokenizer: use these instead of loading (tests).
        device: default ``cuda`` when available, else ``cpu``.
        backup: ``"disk"`` or ``"cpu"`` (default: disk on CPU, cpu on CUDA).
        backup_dir: where the disk backup goes (default ``config.paths.engine_dir(engine_id)``, else a
            fresh temporary directory). Removed by :meth:`close` when this engine created it.
        max_batch_size: sequences generated together.
    """

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
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if model is None or tokenizer is None:
            if config is None:
                raise ValueError("EmbeddedRolloutEngine needs a RunConfig or (model, tokenizer)")
            from miles.models import load_policy

            model, tokenizer, description = load_policy(config, device=self.device)
        self.model = model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        make_resizable(self.model)  # release_memory resizes storages; a loaded checkpoint's cannot be
        self.tokenizer = tokenizer
        self.description = description or type(model).__name__
        self.engine_id = engine_id
        self.max_batch_size = max_batch_size
        self.backup = backup or ("disk" if self.device.type == "cpu" else "cpu")
        if backup_dir is None and config is not None:
            backup_dir = config.paths.engine_dir(engine_id)
        # without a run's config, a private temporary directory (removed at close); with one, the engine's
        # directory, locked by the offloader and removed at close only if this run made it
        self._temp_backup_dir = None
        if backup_dir is None and self.backup == "disk":
            backup_dir = self._temp_backup_dir = tempfile.mkdtemp(prefix=f"miles-rollout-engine{engine_id}-")
        chunk_mb = config.offload.offload_train_disk_chunk_mb if config is not None else DEFAULT_CHUNK_MB
        self._offloader = StorageOffloader(self.backup, backup_dir, chunk_mb,
                                           run_id=config.run_id if config is not None else None)
        # every weight and buffer, tied ones under each name (the offloader backs each storage up once)
        self._tensors = [t for _, t in self.model.named_parameters(remove_duplicate=False)]
        self._tensors += [t for _, t in self.model.named_buffers(remove_duplicate=False)]
        self.weight_version = 0
        seed = config.rollout.rollout_seed if config is not None else 0
        self._generator = torch.Generator(device=self.device).manual_seed(int(seed) * 7919 + engine_id)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_token_ids = self._default_stop_ids()
        # transformers >= 5.2x names the KV cache argument ``cache`` (``past_key_values`` is deprecated)
        import inspect

        fwd = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in fwd else "past_key_values"
        self._name_to_tensor = dict(self.model.named_parameters(remove_duplicate=False))
        self._name_to_tensor.update(dict(self.model.named_buffers(remove_duplicate=False)))
        logger.info("rollout engine %d: %s on %s", engine_id, self.description, self.device)

    # ---------------------------------------------------------------------------------- info

    def _default_stop_ids(self) -> tuple[int, ...]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gc_ = getattr(self.model, "generation_config", None)
        eos = getattr(gc_, "eos_token_id", None) if gc_ is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        return tuple(sorted(ids))

    def get_description(self) -> str:
        return self.description

    def get_weight_version(self) -> int:
        return self.weight_version

    def is_memory_released(self) -> bool:
        return self._offloader.asleep

    def health(self) -> bool:
        return True

    # ---------------------------------------------------------------------------------- generate


    @staticmethod
    def _get_cache(out: Any) -> Any:
        if "cache" in out.keys():
            return out["cache"]
        return out["past_key_values"]

    def _encode(self, prompts: Sequence[Union[str, Sequence[int]]]) -> list[list[int]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(list(self.tokenizer(p, add_special_tokens=False)["input_ids"]))
            else:
                out.append([int(t) for t in p])
            if not out[-1]:
                raise ValueError("empty prompt")
        return out

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Union[str, Sequence[int]]], sampling: Union[SamplingParams, dict, None] = None
    ) -> list[Sample]:
        """Sample ``sampling.n`` responses per prompt (prompts: token-id lists, or strings encoded without
        added special tokens). Returns prompt-major :class:`Sample` objects with the engine's log-probs."""
        if self._offloader.asleep:
            raise RuntimeError("rollout engine memory is released; call resume_memory() before generate()")
        sp = SamplingParams.coerce(sampling)
        if sp.n < 1 or sp.max_new_tokens < 1:
            raise ValueError("n and max_new_tokens must be >= 1")
        encoded = self._encode(prompts)
        jobs = [(i, ids) for i, ids in enumerate(encoded) for _ in range(sp.n)]
        gen = self._generator
        if sp.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(int(sp.seed))
        stop = tuple(sp.stop_token_ids) if sp.stop_token_ids is not None else self.stop_token_ids
        samples: list[Sample] = []
        for start in range(0, len(jobs), self.max_batch_size):
            chunk = jobs[start : start + self.max_batch_size]
            for (pi, ids), (resp, lps, reason) in zip(chunk, self._generate_batch([j[1] for j in chunk], sp, stop, gen)):
                samples.append(
                    Sample(
                        index=len(samples),
                        prompt_index=pi,
                        prompt_ids=list(ids),
                        response_ids=resp,
                        response_logprobs=lps,
                        response_text=self.tokenizer.decode(resp, skip_special_tokens=True),
                        finish_reason=reason,
                        weight_version=self.weight_version,
                    )
                )
        return samples

    def _generate_batch(self, batch: list[list[int]], sp: SamplingParams, stop: tuple[int, ...], gen):
        dev = self.device
        B = len(batch)
        P = max(len(x) for x in batch)
        input_ids = torch.full((B, P), self.pad_token_id, dtype=torch.long, device=dev)
        mask = torch.zeros((B, P), dtype=torch.long, device=dev)
        for i, ids in enumerate(batch):  # left padding
            input_ids[i, P - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
            mask[i, P - len(ids) :] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        stop_t = torch.as_tensor(stop, dtype=torch.long, device=dev) if stop else None
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        tokens, logps = [], []
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
        past = self._get_cache(out)
        logits = out.logits[:, -1, :].float()
        for _ in range(sp.max_new_tokens):
            if sp.temperature and sp.temperature > 0:
                logp = torch.log_softmax(logits / sp.temperature, dim=-1)
                probs = _top_p_filter(logp.exp(), sp.top_p)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            else:
                logp = torch.log_softmax(logits, dim=-1)
                nxt = logits.argmax(dim=-1)
            lp = logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
            nxt = torch.where(finished, torch.full_like(nxt, self.pad_token_id), nxt)
            tokens.append(nxt)
            logps.append(lp)
            alive = ~finished
            if stop_t is not None:
                finished = finished | (alive & torch.isin(nxt, stop_t))
            if bool(finished.all()):
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=dev)], dim=1)
            position_ids = position_ids[:, -1:] + 1
            out = self.model(
                input_ids=nxt.unsqueeze(-1), attention_mask=mask, position_ids=position_ids,
                use_cache=True, **{self._cache_kwarg: past},
            )
            past = self._get_cache(out)
            logits = out.logits[:, -1, :].float()
        del past, out
        tok = torch.stack(tokens, dim=1).cpu()
        lps = torch.stack(logps, dim=1).float().cpu()
        results = []
        stop_set = set(stop)
        for i in range(B):
            resp, lp, reason = [], [], "length"
            for t in range(tok.shape[1]):
                resp.append(int(tok[i, t]))
                lp.append(float(lps[i, t]))
                if resp[-1] in stop_set:
                    reason = "stop"
                    break
            results.append((resp, lp, reason))
        return results

    # ---------------------------------------------------------------------------------- weights

    @torch.no_grad()
    def update_weights(self, weights: WeightsLike, version: Optional[int] = None) -> int:
        """Copy new weights in place (names as in the model's ``state_dict``; a ``module.`` prefix is
        stripped; dtype/device converted). Partial updates are allowed; unknown names raise KeyError.
        Increments (or sets) ``weight_version``; returns the number of tensors copied."""
        if self._offloader.asleep:
            raise RuntimeError("rollout engine memory is released; call resume_memory() before update_weights()")
        items = weights.items() if isinstance(weights, Mapping) else weights
        n = 0
        unknown = []
        for name, tensor in items:
            key = name[len("module."):] if name.startswith("module.") and name not in self._name_to_tensor else name
            dst = self._name_to_tensor.get(key)
            if dst is None:
                unknown.append(name)
                continue
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
            n += 1
        if unknown:
            raise KeyError(f"update_weights: unknown parameter names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        return n

    def get_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the engine's state dict (tests, debugging)."""
        if self._offloader.asleep:
            raise RuntimeError("rollout engine memory is released")
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    # ---------------------------------------------------------------------------------- memory

    def release_memory(self) -> dict:
        """Back up the weights and free their memory (idempotent). Returns ``{"released_bytes", "backup"}``."""
        stats = self._offloader.sleep(self._tensors)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not stats.skipped:
            logger.info("rollout engine %d: released %.1f MiB of weights to %s in %.2f s", self.engine_id,
                        stats.bytes / 2**20, stats.path or "host memory", stats.seconds)
        return {"released_bytes": stats.bytes, "backup": self.backup}

    def resume_memory(self) -> dict:
        """Restore the weights released by :meth:`release_memory` (idempotent). Returns ``{"resumed_bytes"}``."""
        return {"resumed_bytes": self._offloader.wake().bytes}

    def close(self) -> None:
        """Drop the backup (and the backup directory when this run created it)."""
        self._offloader.close(remove_directory=self._temp_backup_dir is None)
        if self._temp_backup_dir is not None:
            shutil.rmtree(self._temp_backup_dir, ignore_errors=True)
