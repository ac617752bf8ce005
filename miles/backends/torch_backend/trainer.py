"""The torch training backend: a transformers causal LM, data parallel over torch.distributed.

One :class:`TorchTrainer` lives in each train actor (one per data-parallel rank). Every rank holds the
full model; the fp32 masters and Adam moments are sharded ZeRO-1 style by
:class:`ShardedMixedPrecisionAdam`, and with ``--stream-optimizer-state-to-disk`` that state lives in
bucket files under the rank's directory and streams through ``optimizer.step()``.

Sleep/wake (``--offload-train``): on CPU (or GPU without torch_memory_saver) the storage offloader
moves params, buffers and the resident optimizer state to host copies or a file and resizes their
storage to 0; on GPU with torch_memory_saver the whole process memory is paused. The streamed
optimizer state needs no backup: its storage is already released between steps.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import random
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from miles.backends.base import TrainBackend, offload_stats, settle_store_for_sleep, stream_step_metrics
from miles.config import RunConfig
from miles.models import torch_dtype
from miles.offload import make_offloader, make_resizable

logger = logging.getLogger(__name__)


def loss_arguments(config: RunConfig) -> dict[str, float]:
    """The policy-gradient loss's knobs from the config, exactly as given (``--eps-clip 0`` is 0)."""
    return {"eps_clip": config.training.eps_clip, "temperature": config.rollout.rollout_temperature}


class TorchTrainer(TrainBackend):
    """One data-parallel rank of the torch backend (the :class:`TrainBackend` contract)."""

    def __init__(self, config: RunConfig, *, rank: int, world_size: int, cell: int = 0,
                 rank_dir: Optional[str] = None, ranks_on_node: Optional[int] = None):
        super().__init__(config, rank=rank, world_size=world_size, cell=cell, rank_dir=rank_dir,
                         ranks_on_node=ranks_on_node)
        self.model = None
        self.tokenizer = None
        self.optimizer = None
        self.device = torch.device("cpu")
        self._info: dict[str, Any] = {}

    # ---- setup --------------------------------------------------------------------------------
    def init(self, rendezvous: str) -> dict[str, Any]:
        config = self.config
        torch.set_num_threads(config.cluster.num_cpus_per_rank)
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.world_size > 1 or not dist.is_initialized():
            dist.init_process_group(backend=backend, init_method=f"tcp://{rendezvous}",
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=datetime.timedelta(minutes=30))
        self.claim_rank_dir()

        seed = config.training.seed
        random.seed(seed)
        torch.manual_seed(seed)

        from miles.models import load_policy  # imported late (heavy)

        try:  # checkpoint saves would draw transformers' per-file progress bars into the operator's log
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except Exception:
            pass

        model, tokenizer, description = load_policy(config)
        dtype = torch_dtype(config.model.model_dtype)
        model = model.to(device=self.device, dtype=dtype)
        make_resizable(model)  # sleep resizes storages; mmap'ed checkpoint tensors cannot be resized
        model.train()
        if hasattr(model, "config"):
            model.config.use_cache = False
        self.model, self.tokenizer, self.description = model, tokenizer, description
        self.optimizer = self._build_optimizer()
        if config.optimizer.stream_optimizer_state_to_disk:
            self.store = self._build_store()
        offload = config.offload
        if offload.offload_train:
            if offload.offload_train_target == "disk" and self.rank_dir is None:
                raise RuntimeError("--offload-train-target=disk needs the rank directory: build the trainer with "
                                   "rank_dir=config.paths.rank_dir(cell, rank)")
            self.offloader = make_offloader(offload.offload_train_target, self.rank_dir,
                                            offload.offload_train_disk_chunk_mb, self.device.type,
                                            run_id=config.run_id, lock=self.rank_dir_lock)
        self._info = {"rank": self.rank, "pid": os.getpid(), "device": str(self.device), "backend": backend,
                      "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # set per actor by Ray
                      "num_params": sum(p.numel() for p in model.parameters()),
                      "dtype": str(dtype).replace("torch.", ""), "description": description,
                      "rank_dir": self.rank_dir, "offload": type(self.offloader).__name__ if self.offloader else None,
                      "store": self._store_info()}
        return self.info()

    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def _param_groups(self) -> list[dict[str, Any]]:
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.dim() < 2 or name.endswith(".bias") else decay).append(p)
        wd = self.config.optimizer.weight_decay
        groups = [{"params": decay, "weight_decay": wd}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return [g for g in groups if g["params"]]

    def _build_optimizer(self):
        opt = self.config.optimizer
        if opt.optimizer == "adam":
            from .sharded_optimizer import ShardedMixedPrecisionAdam

            return ShardedMixedPrecisionAdam(
                self._param_groups(), lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                optimizer_cls=torch.optim.AdamW)
        if opt.optimizer == "sgd":
            return _DataParallelSGD(self._param_groups(), lr=opt.lr, world_size=self.world_size)
        raise ValueError(f"the torch backend supports --optimizer adam or sgd, got {opt.optimizer!r}")

    def _build_store(self):
        from miles_plugins.optimizers.nvme_stream import stream_optimizer_state

        config = store_config(self.config, self.rank, self.ranks_on_node)
        return stream_optimizer_state(self.optimizer, config=config)

    def _store_info(self) -> Optional[dict[str, Any]]:
        if self.store is None:
            return None
        st = self.store.stats
        return {"num_buckets": st.num_buckets, "state_bytes": st.state_bytes,
                "path": getattr(self.store, "path", None), "relative_dir": getattr(self.store, "relative_dir", None)}

    # ---- training -----------------------------------------------------------------------------
    def _all_reduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized() and self.world_size > 1:
            t = t.to(self.device) if self.device.type == "cuda" else t
            dist.all_reduce(t)
        return [float(v) for v in t.cpu()]

    def train(self, rollout_id: int, samples: list, advantages: list[float]) -> dict[str, Any]:
        """One optimizer step over this rank's share of a rollout.

        ``samples`` carry ``prompt_ids``, ``response_ids``, ``response_logprobs`` (the rollout engine's
        log-probs); ``advantages[i]`` belongs to ``samples[i]``. The loss is the token mean over the whole
        rollout (all ranks): each rank divides by the global token count / world size, and the DP grad
        average makes the sum.
        """
        from miles.rl.loss import accumulate_policy_gradient, forward_logprobs

        start = time.perf_counter()
        model, opt = self.model, self.optimizer
        loss_args = loss_arguments(self.config)
        pad_id = self.tokenizer.pad_token_id  # load_policy guarantees one
        local_tokens = float(sum(len(s.response_ids) for s in samples))
        global_tokens, global_samples = self._all_reduce([local_tokens, float(len(samples))])
        num_tokens = max(1.0, global_tokens) / self.world_size

        opt.zero_grad(set_to_none=True)
        if self.store is not None:  # read-ahead: the disk is idle during forward/backward
            self.store.prefetch()
        fwd_bwd = time.perf_counter()

        def logprobs(batch, temperature):
            return forward_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature)

        sums = accumulate_policy_gradient(samples, advantages, logprobs, pad_id=pad_id,
                                          micro_batch_size=self.config.training.micro_batch_size,
                                          device=self.device, eps_clip=loss_args["eps_clip"],
                                          temperature=loss_args["temperature"], num_tokens=num_tokens)
        fwd_bwd = time.perf_counter() - fwd_bwd

        step_start = time.perf_counter()
        grad_norm = self._optimizer_step()
        step_seconds = time.perf_counter() - step_start
        opt.zero_grad(set_to_none=True)

        loss_sum, clipped, absdiff = self._all_reduce(sums)
        tokens = max(1.0, global_tokens)
        metrics: dict[str, Any] = {
            "rank": self.rank,
            "loss": loss_sum / self.world_size,  # each rank's sum is its part of the global token mean x world
            "clipfrac": clipped / tokens,
            "train_rollout_logprob_abs_diff": absdiff / tokens,
            "grad_norm": grad_norm,
            "samples": len(samples),
            "response_tokens": int(local_tokens),
            "forward_backward_seconds": fwd_bwd,
            "optimizer_step_seconds": step_seconds,
            "train_seconds": time.perf_counter() - start,
        }
        if self.store is not None:
            metrics.update(stream_step_metrics([self.store]))
        return metrics

    @torch.no_grad()
    def _optimizer_step(self) -> float:
        opt = self.optimizer
        clip = self.config.optimizer.clip_grad
        if not hasattr(opt, "reduce_grads"):  # the SGD fallback
            return opt.step(clip)
        opt.reduce_grads()
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for s in opt.shards:
            if s.master.grad is not None:
                sq += s.master.grad.double().pow(2).sum()
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(sq)
        norm = math.sqrt(float(sq))
        if clip > 0 and math.isfinite(norm) and norm > clip:
            coef = clip / (norm + 1e-6)
            for s in opt.shards:
                if s.master.grad is not None:
                    s.master.grad.mul_(coef)
        opt.update()  # the streamed step when the store is bound
        opt.gather_params()
        return norm

    # ---- weights ------------------------------------------------------------------------------
    def hf_weights(self):
        """The model's state dict on its device (every rank holds the full model after the step's
        all-gather); a tensor tied to an earlier one (the output embedding) is handed over once."""
        seen = set()
        for name, tensor in self.model.state_dict().items():
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
            if key in seen:
                continue
            seen.add(key)
            yield name, tensor.detach()

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, base: str, wait: bool = True) -> dict[str, Any]:
        from miles import checkpoint

        with self.awake():
            return checkpoint.save_train_state(base, model=self.model, optimizer=self.optimizer, store=self.store,
                                               rank=self.rank, world_size=self.world_size,
                                               tokenizer=self.tokenizer, wait=wait)

    def finish_save(self) -> Optional[dict[str, Any]]:
        from miles import checkpoint

        return checkpoint.finish_train_state(self.store)

    def load(self, base: str, load_optimizer: bool) -> dict[str, Any]:
        from miles import checkpoint

        with self.awake():
            return checkpoint.load_train_state(base, model=self.model, optimizer=self.optimizer, store=self.store,
                                               rank=self.rank, world_size=self.world_size,
                                               load_optimizer=load_optimizer)

    # ---- sleep / wake -------------------------------------------------------------------------
    def _offload_tensors(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = list(self.model.parameters()) + list(self.model.buffers())
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.store is None:  # streamed state lives on disk already: nothing to back up
            opt = self.optimizer
            tensors += [s.master for s in getattr(opt, "shards", [])]
            inner = getattr(opt, "inner", opt)
            for state in getattr(inner, "state", {}).values():
                tensors += [v for v in state.values() if torch.is_tensor(v)]
        return tensors

    def sleep(self) -> dict[str, Any]:
        store_wait = settle_store_for_sleep(self.store, self.config.optimizer.stream_optimizer_state_flush_at_sleep)
        if self.offloader is None:
            return {"rank": self.rank, "skipped": True, "reason": "--offload-train is off", **store_wait}
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        stats = self.offloader.sleep(self._offload_tensors())
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"rank": self.rank, **offload_stats(stats), **store_wait}

    def wake(self) -> dict[str, Any]:
        if self.offloader is None:
            return {"rank": self.rank, "skipped": True, "reason": "--offload-train is off"}
        return {"rank": self.rank, **offload_stats(self.offloader.wake())}

    # ---- teardown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        if not self.close_resources():
            return
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        self.release_rank_dir()


def store_config(config: RunConfig, rank: int, ranks_on_node: int):
    """The store's :class:`StreamConfig` from the run's config (the store's own defaults for the rest).
    Flags at their defaults leave the choice to the store: the bucket size and depth it fits to the
    device budget, the budget one default bucket's worth.

    A host tier of "auto" is shared by the ranks of a node: ``ranks_on_node``, the train ranks the actor
    factory placed on this rank's node (rank_nodes of the placement group). No rank reserve: streaming requires
    --offload-train-target=disk (validation), so a sleeping trainer keeps no cpu backup in host RAM (its
    disk offload stages through chunk buffers, which the node reserve covers). The megatron backend
    builds its stores from this too."""
    from miles_plugins.optimizers.nvme_stream import DEFAULT_BUCKET_NUMEL, StreamConfig

    opt = config.optimizer
    bucket_numel = opt.stream_optimizer_state_bucket_numel
    return StreamConfig(dir=config.paths.optimizer_state, chunk_mb=opt.stream_optimizer_state_chunk_mb,
                        moment_dtype=opt.stream_optimizer_state_moment_dtype,
                        bucket_numel=None if bucket_numel == DEFAULT_BUCKET_NUMEL else bucket_numel,
                        device_budget_mb=opt.stream_optimizer_state_device_budget_mb or None,
                        host_cache_mb=opt.stream_optimizer_state_host_cache_mb,
                        host_cache_ranks_per_node=ranks_on_node,
                        verify=opt.stream_optimizer_state_verify, rank=rank)


class _DataParallelSGD:
    """--optimizer sgd on the torch backend: grads averaged over DP ranks, plain SGD on the params."""

    def __init__(self, groups, lr: float, world_size: int):
        self.inner = torch.optim.SGD(groups, lr=lr)
        self.world_size = world_size
        self.shards: list = []

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, clip: float = 0.0) -> float:
        params = [p for g in self.inner.param_groups for p in g["params"] if p.grad is not None]
        if dist.is_initialized() and self.world_size > 1:
            for p in params:
                dist.all_reduce(p.grad)
                p.grad.div_(self.world_size)
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")))
        self.inner.step()
        return norm

    def reload_model_params(self):
        """Nothing to refresh: SGD steps the model params themselves (no fp32 masters)."""

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd):
        self.inner.load_state_dict(sd)
