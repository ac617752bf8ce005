"""The megatron training backend: one :class:`MegatronTrainer` per train actor (data-parallel rank).

megatron-core GPTModel (TP = PP = 1, expert parallelism over the train ranks) built from the policy's
transformers config and loaded with its weights, wrapped bf16 (Float16Module) in megatron's
DistributedDataParallel, stepped by its DistributedOptimizer (a ChainedOptimizer of dense + expert
members for MoE). With ``--stream-optimizer-state-to-disk`` the store is bound to that optimizer.

Same contract and semantics as the torch backend (:class:`miles.backends.base.TrainBackend`): the
GRPO loss of ``miles.rl.loss`` on the token grid of ``collate_samples``, the token mean over the whole
rollout, constant lr, no weight decay on biases and norms, global-norm gradient clipping.

Collectives: ``init``, ``train``, ``save`` and ``load`` run on every rank; with expert parallelism > 1
``hf_weights`` (the weight handoff, ``export_weights``) is one too (each rank holds only its experts), so
every rank must iterate it.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from miles.backends.base import TrainBackend, offload_stats, settle_store_for_sleep, stream_step_metrics
from miles.backends.torch_backend.trainer import loss_arguments, store_config
from miles.config import RunConfig
from miles.models import torch_dtype
from miles.offload import make_offloader

from .checkpoint_views import HFModelView, ResidentOptimizerState, StoreSet
from .convert import experts_to_global, hf_moe_layout, hf_to_megatron, iter_megatron_to_hf
from .grad_buffers import GradBuffers
from .model import build_gpt_model

logger = logging.getLogger(__name__)

_EXTRA_STATE = "_extra_state"  # Transformer Engine metadata in state dicts, not a weight


class MegatronTrainer(TrainBackend):
    """One data-parallel rank of the megatron backend."""

    def __init__(self, config: RunConfig, *, rank: int, world_size: int, cell: int = 0,
                 rank_dir: Optional[str] = None, ranks_on_node: Optional[int] = None):
        super().__init__(config, rank=rank, world_size=world_size, cell=cell, rank_dir=rank_dir,
                         ranks_on_node=ranks_on_node)
        self.gpt = None  # the bare GPTModel: its state dict has the names convert.py maps
        self.ddp = None  # what runs forward/backward: DDP(Float16Module(gpt))
        self.hf_config = None
        self.tokenizer = None
        self.optimizer = None
        self.scheduler = None
        self.store: Optional[StoreSet] = None
        self.grad_buffers: Optional[GradBuffers] = None  # dropped while asleep, zero-filled on wake
        self.uses_te_spec = False
        self.hf_moe_layout: Optional[str] = None
        self.ep_size = config.training.expert_model_parallel_size
        self.ep_rank = 0
        self._model_view: Optional[HFModelView] = None
        self._info: dict[str, Any] = {}

    # ---- setup --------------------------------------------------------------------------------
    def init(self, rendezvous: str) -> dict[str, Any]:
        if not torch.cuda.is_available():
            raise RuntimeError("--train-backend megatron needs a CUDA GPU (megatron-core has no CPU path); "
                               "use --train-backend torch on this machine")
        config = self.config
        if config.model.fp8_param:
            raise ValueError("--fp8-param is not supported by miles' megatron backend (it builds bf16 params); "
                             "drop --fp8-param")
        if self.world_size % self.ep_size:
            raise ValueError(f"--expert-model-parallel-size {self.ep_size} does not divide --num-train-ranks "
                             f"{self.world_size}")
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.set_num_threads(config.cluster.num_cpus_per_rank)
        device = torch.device("cuda", torch.cuda.current_device())  # Ray gives each actor its own GPU
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method=f"tcp://{rendezvous}", rank=self.rank,
                                    world_size=self.world_size, timeout=datetime.timedelta(minutes=30))
        if not parallel_state.model_parallel_is_initialized():  # one trainer per process, or tests' sequence
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                                     expert_model_parallel_size=self.ep_size)
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.claim_rank_dir()
        seed = config.training.seed
        random.seed(seed)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)  # megatron's CUDA RNG tracker (dropout paths need it seeded)

        dtype = torch_dtype(config.model.model_dtype)
        if config.optimizer.stream_optimizer_state_to_disk and dtype != torch.bfloat16:
            raise ValueError("--stream-optimizer-state-to-disk with --train-backend megatron needs bf16 params "
                             f"(--model-dtype bf16), got {config.model.model_dtype!r}: the store streams the fp32 "
                             "masters of low-precision params")
        offload = config.offload
        if offload.offload_train:
            if offload.offload_train_target == "disk" and self.rank_dir is None:
                raise RuntimeError("--offload-train-target=disk needs the rank directory: build the trainer with "
                                   "rank_dir=config.paths.rank_dir(cell, rank)")
            self.offloader = make_offloader(offload.offload_train_target, self.rank_dir,
                                            offload.offload_train_disk_chunk_mb, "cuda",
                                            run_id=config.run_id, lock=self.rank_dir_lock)

        hf_state, description = self._load_hf_policy()
        # Built in the default CUDA pool, not in a torch_memory_saver region: the actor's environment
        # (TMS_INIT_ENABLE) already makes every allocation pausable with its backup. A region would put
        # them in a torch MemPool that lives as long as the process, and empty_cache() never returns the
        # free blocks of a live MemPool: the fp32 mains the store frees and the pre-DDP param copies
        # would stay reserved, and every sleep would back them up (docs/advanced/megatron.md).
        self._build(hf_state, dtype)
        del hf_state
        self.grad_buffers = GradBuffers(self.ddp.buffers + self.ddp.expert_parallel_buffers)
        if config.optimizer.stream_optimizer_state_to_disk:
            from miles_plugins.optimizers.nvme_stream import stream_optimizer_state

            stream_config = store_config(config, self.rank, self.ranks_on_node)
            self.store = StoreSet(stream_optimizer_state(self.optimizer, config=stream_config))
        self._model_view = HFModelView(self.hf_config, self._load_hf_state)
        self._info = {"rank": self.rank, "pid": os.getpid(), "device": str(device), "backend": "nccl",
                      "train_backend": "megatron", "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                      "num_params": sum(p.numel() for p in self.gpt.parameters()),  # this rank's experts only
                      "dtype": str(dtype).replace("torch.", ""), "description": description,
                      "layer_spec": "transformer_engine" if self.uses_te_spec else "local",
                      "expert_model_parallel_size": self.ep_size, "rank_dir": self.rank_dir,
                      "offload": type(self.offloader).__name__ if self.offloader else None,
                      "store": self.store.info() if self.store else None}
        return self.info()

    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def _load_hf_policy(self) -> tuple[dict[str, torch.Tensor], str]:
        from miles.models import load_policy

        hf_model, self.tokenizer, description = load_policy(self.config)
        self.hf_config = hf_model.config
        hf_state = {k: v.detach() for k, v in hf_model.state_dict().items()}
        self.hf_moe_layout = hf_moe_layout(hf_state)
        return hf_state, description

    def _build(self, hf_state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        opt = self.config.optimizer
        self.gpt, tconfig, self.uses_te_spec = build_gpt_model(self.hf_config, params_dtype=dtype,
                                                               expert_model_parallel_size=self.ep_size)
        self.gpt.cuda()
        self._load_hf_state(hf_state)  # before DDP: its param buffer takes the values over
        module = Float16Module(tconfig, self.gpt) if dtype != torch.float32 else self.gpt
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True)
        self.ddp = DistributedDataParallel(tconfig, ddp_config, module)
        self.ddp.train()
        opt_config = OptimizerConfig(
            optimizer=opt.optimizer, lr=opt.lr, min_lr=opt.lr, weight_decay=opt.weight_decay,
            adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps, clip_grad=opt.clip_grad,
            bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=True,
            use_precision_aware_optimizer=opt.use_precision_aware_optimizer,
            optimizer_cpu_offload=opt.optimizer_cpu_offload,
            optimizer_offload_fraction=1.0 if opt.optimizer_cpu_offload else 0.0)
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp])
        # Constant lr as the torch backend; the scheduler also applies megatron's per-group weight-decay
        # multipliers (0 for biases and 1-D params), which the optimizer alone does not.
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=opt.lr, max_lr=opt.lr, min_lr=opt.lr, lr_warmup_steps=0, lr_decay_steps=1,
            lr_decay_style="constant", start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=1,
            wd_incr_style="constant")

    # ---- weights ------------------------------------------------------------------------------
    def _load_hf_state(self, hf_state: dict[str, torch.Tensor]) -> None:
        """Copy HF weights into the Megatron params in place (this rank's experts only)."""
        mcore = hf_to_megatron(hf_state, self.hf_config, fused_norms=self.uses_te_spec, ep_rank=self.ep_rank,
                               ep_size=self.ep_size)
        result = self.gpt.load_state_dict(mcore, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith(_EXTRA_STATE)]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"converted weights do not fit the built GPTModel: missing {missing[:5]}, "
                               f"unexpected {list(result.unexpected_keys)[:5]} (conversion and layer spec disagree)")

    def _hf_state(self) -> dict[str, torch.Tensor]:
        """The full HF-layout weights on the host (checkpoints); a collective over the expert-parallel group."""
        return {k: v.to("cpu", copy=True) for k, v in self.hf_weights()}

    def hf_weights(self):
        """HF-layout weights on the device, converted layer by layer; with EP > 1 each MoE layer's experts are
        all-gathered over the expert-parallel group as the iteration reaches it (every rank must iterate)."""
        local = {k: v.detach() for k, v in self.gpt.state_dict().items() if not k.endswith(_EXTRA_STATE)}
        return iter_megatron_to_hf(local, self.hf_config, fused_norms=self.uses_te_spec,
                                   hf_moe_layout=self.hf_moe_layout,
                                   layer_experts=self._layer_experts if self.ep_size > 1 else None)

    def _layer_experts(self, layer: int, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One layer's experts of every expert-parallel rank, globally numbered, on the device."""
        from megatron.core import parallel_state

        group = parallel_state.get_expert_model_parallel_group()
        full: dict[str, torch.Tensor] = {}
        for key in sorted(local):  # same keys and shapes on every rank
            parts = [torch.empty_like(local[key]) for _ in range(self.ep_size)]
            dist.all_gather(parts, local[key].contiguous(), group=group)
            for ep_rank, part in enumerate(parts):
                full.update(experts_to_global({key: part}, self.hf_config, ep_rank, self.ep_size))
        return full

    # ---- training -----------------------------------------------------------------------------
    def _all_reduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device="cuda")
        if self.world_size > 1:
            dist.all_reduce(t)
        return [float(v) for v in t.cpu()]

    def _logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """Log-probs of ``input_ids[:, 1:]`` (``[B, L-1]``) from Megatron's logits, as forward_logprobs does
        for an HF model. Rows are right-padded, so the causal mask alone keeps pads out of real tokens."""
        from miles.rl.loss import token_logprobs

        input_ids = batch["input_ids"]
        position_ids = (batch["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        logits = self.ddp(input_ids, position_ids, None)  # [B, L, V]; fp32 out of Float16Module
        return token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)

    def train(self, rollout_id: int, samples: list, advantages: list[float]) -> dict[str, Any]:
        """One optimizer step over this rank's share of a rollout (the torch backend's metrics)."""
        from miles.rl.loss import accumulate_policy_gradient

        start = time.perf_counter()
        loss_args = loss_arguments(self.config)
        pad_id = self.tokenizer.pad_token_id  # load_policy guarantees one
        local_tokens = float(sum(len(s.response_ids) for s in samples))
        global_tokens, _ = self._all_reduce([local_tokens, float(len(samples))])
        num_tokens = max(1.0, global_tokens) / self.world_size  # DDP averages over ranks: the sum is the mean

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.store is not None:  # read-ahead: the disk is idle during forward/backward
            self.store.prefetch()
        fwd_bwd = time.perf_counter()
        sums = accumulate_policy_gradient(samples, advantages, self._logprobs, pad_id=pad_id,
                                          micro_batch_size=self.config.training.micro_batch_size, device="cuda",
                                          eps_clip=loss_args["eps_clip"], temperature=loss_args["temperature"],
                                          num_tokens=num_tokens)
        self.ddp.finish_grad_sync()
        fwd_bwd = time.perf_counter() - fwd_bwd

        step_start = time.perf_counter()
        ok, grad_norm, _ = self.optimizer.step()  # clips by config.clip_grad over dense + expert grads
        if not ok:
            raise RuntimeError(f"rollout {rollout_id}: the Megatron optimizer skipped its step (non-finite grads)")
        self.scheduler.step(1)
        step_seconds = time.perf_counter() - step_start

        loss_sum, clipped, absdiff = self._all_reduce(sums)
        tokens = max(1.0, global_tokens)
        metrics: dict[str, Any] = {
            "rank": self.rank,
            "loss": loss_sum / self.world_size,
            "clipfrac": clipped / tokens,
            "train_rollout_logprob_abs_diff": absdiff / tokens,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "samples": len(samples),
            "response_tokens": int(local_tokens),
            "forward_backward_seconds": fwd_bwd,
            "optimizer_step_seconds": step_seconds,
            "train_seconds": time.perf_counter() - start,
        }
        if self.store is not None:
            metrics.update(stream_step_metrics(self.store.stores))
        return metrics

    # ---- checkpoints --------------------------------------------------------------------------
    def _checkpoint_optimizer(self):
        """The bound optimizer when streaming (its state is the store's); else the resident-state view."""
        return self.optimizer if self.store is not None else ResidentOptimizerState(self.optimizer)

    def save(self, base: str, wait: bool = True) -> dict[str, Any]:
        from miles import checkpoint

        with self.awake():
            if self.rank == 0 or self.ep_size > 1:  # the expert gather needs every rank
                hf_state = self._hf_state()
                if self.rank == 0:
                    self._model_view.prepare_save(hf_state)
            return checkpoint.save_train_state(base, model=self._model_view, optimizer=self._checkpoint_optimizer(),
                                               store=self.store, rank=self.rank, world_size=self.world_size,
                                               tokenizer=self.tokenizer, wait=wait)

    def finish_save(self) -> Optional[dict[str, Any]]:
        from miles import checkpoint

        return checkpoint.finish_train_state(self.store)

    def load(self, base: str, load_optimizer: bool) -> dict[str, Any]:
        """HF weights -> Megatron params, then the mains from them (through the store when streaming:
        ``refresh_main_from_model_params``), then the optimizer state (``store.load_from``)."""
        from miles import checkpoint

        with self.awake():
            return checkpoint.load_train_state(base, model=self._model_view, optimizer=self._checkpoint_optimizer(),
                                               store=self.store, rank=self.rank, world_size=self.world_size,
                                               load_optimizer=load_optimizer)

    # ---- sleep / wake -------------------------------------------------------------------------
    def _offload_tensors(self) -> list[torch.Tensor]:
        """What the storage offloader backs up when torch_memory_saver is absent: the param buffers, other
        params/buffers, and the optimizer state unless it is streamed (on disk already). Not the grad
        buffers: sleep drops them (grad_buffers.py)."""
        tensors: list[torch.Tensor] = [b.param_data for b in self.ddp.buffers + self.ddp.expert_parallel_buffers]
        tensors += list(self.gpt.parameters()) + list(self.gpt.buffers())
        if self.store is None:
            for member in ResidentOptimizerState(self.optimizer).members:
                for group in member.optimizer.param_groups:
                    for p in group["params"]:
                        tensors.append(p)
                        tensors += [v for v in member.optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
        return [t for t in tensors if t is not None and t.is_cuda]

    def sleep(self) -> dict[str, Any]:
        store_wait = settle_store_for_sleep(self.store, self.config.optimizer.stream_optimizer_state_flush_at_sleep)
        if self.offloader is None:
            return {"rank": self.rank, "skipped": True, "reason": "--offload-train is off", **store_wait}
        torch.cuda.synchronize()
        # Before the offloader: torch_memory_saver must never see the grad buffers (grad_buffers.py).
        grad_bytes = self.grad_buffers.release()
        stats = self.offloader.sleep(self._offload_tensors())
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # Device-wide: what this trainer still holds plus the (released) rollout engine's residue and
        # every process's CUDA context; an upper bound on the trainer's share while asleep.
        return {"rank": self.rank, **offload_stats(stats), "grad_bytes_dropped": grad_bytes,
                "device_used_bytes_asleep": total - free, **store_wait}

    def wake(self) -> dict[str, Any]:
        if self.offloader is None:
            return {"rank": self.rank, "skipped": True, "reason": "--offload-train is off"}
        stats = self.offloader.wake()
        grad_bytes = self.grad_buffers.restore()  # after the resume: see grad_buffers.py
        return {"rank": self.rank, **offload_stats(stats), "grad_bytes_zeroed": grad_bytes}

    # ---- teardown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        if not self.close_resources():
            return
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except ImportError:  # init never got as far as megatron
            pass
        if dist.is_initialized():
            dist.destroy_process_group()
        self.release_rank_dir()
