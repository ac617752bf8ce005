"""The embedded rollout engine: batched torch generation with the policy's own model class.

A plain class; as a Ray actor use ``ray.remote(EmbeddedRolloutEngine)`` (or
:func:`miles.rollout.remote_engine_class`). Every public method takes and returns picklable values.

    engine = EmbeddedRolloutEngine(args)                        # loads miles.models.load_policy(args)
    samples = engine.generate(prompt_ids, SamplingParams(...))  # list[Sample], prompt-major
    engine.release_memory(); engine.resume_memory()             # sleep / wake (idempotent)
    engine.update_weights(state_dict_or_named_tensors)          # after each train step
    engine.close()

Memory release: on CPU the weights' storages are written to ``<backup_dir>/weights.bin`` and resized
to 0 bytes (the RAM is returned); on CUDA they are copied to host memory (``backup="cpu"``, default)
or to the same file (``backup="disk"``) and freed. Resume restores them bit-exactly into the same
storages (parameter objects are unchanged).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from miles.rollout.types import Sample, SamplingParams

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
        args: the validated ``miles train`` namespace (used to load the model when ``model`` is None,
            and for ``rollout_offload_dir`` / ``rollout_seed``). May be None when ``model`` and
            ``tokenizer`` are given.
        model, tokenizer: use these instead of loading (tests).
        device: default ``cuda`` when available, else ``cpu``.
        backup: ``"disk"`` or ``"cpu"`` (default: disk on CPU, cpu on CUDA).
        backup_dir: where the disk backup goes (default ``<args.rollout_offload_dir>/engine<engine_id>``,
            else a fresh temporary directory). Created on first release, removed by :meth:`close`.
        max_batch_size: sequences generated together.
    """

    def __init__(
        self,
        args: Any = None,
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
            if args is None:
                raise ValueError("EmbeddedRolloutEngine needs args or (model, tokenizer)")
            from miles.models import load_policy

            model, tokenizer, description = load_policy(args, device=self.device)
        self.model = model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.description = description or type(model).__name__
        self.engine_id = engine_id
        self.max_batch_size = max_batch_size
        self.backup = backup or ("disk" if self.device.type == "cpu" else "cpu")
        if self.backup not in ("disk", "cpu"):
            raise ValueError(f"backup must be 'disk' or 'cpu', got {self.backup!r}")
        if backup_dir is None and args is not None and getattr(args, "rollout_offload_dir", None):
            backup_dir = os.path.join(args.rollout_offload_dir, f"engine{engine_id}")
        self._backup_dir = backup_dir
        self._owns_backup_dir = False
        self._released = False
        self._host_backup: list[torch.Tensor] = []
        self.weight_version = 0
        seed = getattr(args, "rollout_seed", 0) if args is not None else 0
        self._generator = torch.Generator(device=self.device).manual_seed(int(seed) * 7919 + engine_id)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_token_ids = self._default_stop_ids()
        # unique storages of all weights, in a fixed order (tied weights share one storage)
        self._storages: list[tuple[torch.UntypedStorage, int]] = []
        seen = set()
        tensors = [p for _, p in self.model.named_parameters(remove_duplicate=False)]
        tensors += [b for _, b in self.model.named_buffers(remove_duplicate=False)]
        for t in tensors:
            st = t.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                self._storages.append((st, st.nbytes()))
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
        return self._released

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
        if self._released:
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
        if self._released:
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
        if self._released:
            raise RuntimeError("rollout engine memory is released")
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    # ---------------------------------------------------------------------------------- memory

    def _backup_file(self) -> str:
        if self._backup_dir is None:
            self._backup_dir = tempfile.mkdtemp(prefix=f"miles-rollout-engine{self.engine_id}-")
            self._owns_backup_dir = True
        elif not os.path.isdir(self._backup_dir):
            os.makedirs(self._backup_dir, exist_ok=True)
            self._owns_backup_dir = True
        return os.path.join(self._backup_dir, "weights.bin")

    @staticmethod
    def _bytes_view(st: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)

    def release_memory(self) -> dict:
        """Back up the weights and free their memory (idempotent). Returns ``{"released_bytes", "backup"}``."""
        if self._released:
            return {"released_bytes": 0, "backup": self.backup}
        total = 0
        if self.backup == "disk":
            path = self._backup_file()
            with open(path, "wb") as fh:
                for st, nbytes in self._storages:
                    # copy out (a numpy view would pin the storage as non-resizable)
                    fh.write(memoryview(self._bytes_view(st).cpu().clone().numpy()))
                    total += nbytes
                fh.flush()
                os.fsync(fh.fileno())
        else:
            pin = self.device.type == "cuda"
            self._host_backup = []
            for st, nbytes in self._storages:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                host.copy_(self._bytes_view(st))
                self._host_backup.append(host)
                total += nbytes
        for st, _ in self._storages:
            st.resize_(0)
        self._released = True
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("rollout engine %d: released %.1f MiB of weights to %s", self.engine_id, total / 2**20,
                    self._backup_dir if self.backup == "disk" else "host memory")
        return {"released_bytes": total, "backup": self.backup}

    def resume_memory(self) -> dict:
        """Restore the weights released by :meth:`release_memory` (idempotent). Returns ``{"resumed_bytes"}``."""
        if not self._released:
            return {"resumed_bytes": 0}
        total = 0
        if self.backup == "disk":
            with open(self._backup_file(), "rb") as fh:
                for st, nbytes in self._storages:
                    st.resize_(nbytes)
                    buf = torch.empty(nbytes, dtype=torch.uint8)
                    if nbytes and fh.readinto(memoryview(buf.numpy())) != nbytes:
                        raise IOError("rollout engine backup file is truncated")
                    self._bytes_view(st).copy_(buf)
                    total += nbytes
        else:
            for (st, nbytes), host in zip(self._storages, self._host_backup):
                st.resize_(nbytes)
                self._bytes_view(st).copy_(host)
                total += nbytes
            self._host_backup = []
        self._released = False
        return {"resumed_bytes": total}

    def close(self) -> None:
        """Drop the disk backup (the directory too when this engine created it)."""
        self._host_backup = []
        if self._backup_dir and os.path.isdir(self._backup_dir):
            f = os.path.join(self._backup_dir, "weights.bin")
            if os.path.exists(f) and not self._released:
                os.remove(f)
            if self._owns_backup_dir and not self._released:
                shutil.rmtree(self._backup_dir, ignore_errors=True)
