"""The megatron training backend: one :class:`MegatronTrainer` per train actor (data-parallel rank), the
train rank (:class:`miles.backends.rank.TrainRank`) over a :class:`MegatronEngine`, which only computes.

megatron-core GPTModel (expert parallelism; tensor and pipeline parallelism through model_parallel.py and
pipeline.py, which train only with --experimental-model-parallel until run on GPUs) built from the policy's
transformers config and loaded with its weights, wrapped bf16 (Float16Module) in megatron's
DistributedDataParallel, stepped by its DistributedOptimizer (a ChainedOptimizer of dense + expert
members for MoE). With ``--stream-optimizer-state-to-disk`` the store is bound to that optimizer.

Same contract and semantics as the torch backend (:class:`miles.backends.engine.TrainEngine`): the loss
the rank hands in (the GRPO loss of ``miles.rl.loss``) on the token grid of ``collate_samples``, the token
mean over the whole rollout, constant lr, no weight decay on biases and norms, global-norm gradient clipping.

Collectives: ``init``, ``train``, ``save`` and ``load`` run on every rank; with expert parallelism > 1
``hf_weights`` (the weight handoff, ``export_weights``) is one too (each rank holds only its experts), so
every rank must iterate it.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from miles.backends.engine import LossFunction, TrainEngine, tensors_finite
from miles.backends.rank import TrainRank
from miles.models import load_policy
from miles.sizing.flops import tensor_flops

from .checkpoint_views import HFModelView, ResidentOptimizerState
from .convert import hf_moe_layout, hf_to_megatron, iter_megatron_to_hf
from .expert_gather import gather_layer_experts
from .families import count_tensors, describe
from .grad_buffers import GradBuffers
from .logprobs import LogprobRequest, output_logprobs
from .machine import DISTRIBUTION, needs_cuda_message, runs_without_cuda
from .model import build_gpt_model, native_fp32_param_names
from .model_parallel import ModelParallelRank, initialize, pad_sequence
from .router_bias import clear_router_token_counts, keep_routers_fp32, routers_to_fp32, step_router_expert_bias

logger = logging.getLogger(__name__)

_EXTRA_STATE = "_extra_state"  # Transformer Engine metadata in state dicts, not a weight
_LOW_PRECISION = (torch.bfloat16, torch.float16)  # param buffers whose masters the optimizer keeps in fp32


def _installed_megatron_version() -> Optional[str]:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


class MegatronEngine(TrainEngine):
    """The compute of one data-parallel rank of the megatron backend (:class:`TrainEngine`)."""

    def __init__(self, config, **placement):
        super().__init__(config, **placement)
        self.gpt = None  # the bare GPTModel: its state dict has the names convert.py maps
        self.ddp = None  # what runs forward/backward: DDP(Float16Module(gpt))
        self.hf_config = None
        self.scheduler = None
        self.grad_buffers: Optional[GradBuffers] = None  # dropped while asleep, zero-filled on wake
        self.uses_te_spec = False
        self.hf_moe_layout: Optional[str] = None
        self.ep_size = config.training.expert_model_parallel_size
        self.ep_rank = 0
        self.parallel: Optional[ModelParallelRank] = None  # this rank's TP/PP place (model_parallel.py)
        self._model_view: Optional[HFModelView] = None
        self.router_bias_update_rate: Optional[float] = None  # set for routers with an expert bias (router_bias.py)
        self.route_replays: dict = {}  # under R3: this stage's router replays by MoE layer (route_replay.py)

    # ---- setup --------------------------------------------------------------------------------
    def check_config(self) -> None:
        # the flags are validation's (miles.preflight.validation); what only this process can see is its own GPU
        if not torch.cuda.is_available():
            version = _installed_megatron_version()
            if not runs_without_cuda(version):
                raise RuntimeError(f"{needs_cuda_message(version)} in this process; use --train-backend torch on "
                                   "this machine")

    def join_process_group(self, rendezvous: str) -> str:
        from megatron.core import parallel_state

        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())  # Ray gives each actor its own GPU
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"  # a megatron-core build for CPU (machine.py)
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{rendezvous}", rank=self.rank,
                                    world_size=self.world_size, timeout=datetime.timedelta(minutes=30))
        initialize(self.config.parallel_layout)
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        return backend

    def seed(self, seed: int) -> None:
        super().seed(seed)
        if self.device.type == "cuda":
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)  # megatron's CUDA RNG tracker (dropout paths need it seeded)

    def build_model(self) -> str:
        hf_state, description = self._load_hf_policy()
        # Built in the default CUDA pool, not in a torch_memory_saver region: the actor's environment
        # (TMS_INIT_ENABLE) already makes every allocation pausable with its backup. A region would put
        # them in a torch MemPool that lives as long as the process, and empty_cache() never returns the
        # free blocks of a live MemPool: the fp32 mains the store frees and the pre-DDP param copies
        # would stay reserved, and every sleep would back them up (docs/advanced/megatron.md).
        self._build(hf_state, self.dtype)
        del hf_state
        self.grad_buffers = GradBuffers(self.ddp.buffers + self.ddp.expert_parallel_buffers)
        self._model_view = HFModelView(self.hf_config, self._load_hf_state)
        return description

    def policy_flops(self) -> Any:
        arch = describe(self.hf_config)
        return tensor_flops(count_tensors(arch, "the policy", mtp=False), arch.moe_topk or 0)

    def describe(self) -> dict[str, Any]:
        return {"train_backend": "megatron",
                "num_params": sum(p.numel() for p in self.gpt.parameters()),  # this rank's experts only
                "layer_spec": "transformer_engine" if self.uses_te_spec else "local",
                "expert_model_parallel_size": self.ep_size, "parallel_layout": self.parallel.layout.describe()}

    def _load_hf_policy(self) -> tuple[dict[str, torch.Tensor], str]:
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
        self.parallel = ModelParallelRank.of(self.config.parallel_layout, int(self.hf_config.vocab_size))
        self.gpt, tconfig, self.uses_te_spec = build_gpt_model(
            self.hf_config, params_dtype=dtype, expert_model_parallel_size=self.ep_size,
            layout=self.config.parallel_layout, sequence_parallel=self.config.training.sequence_parallel,
            pp_rank=self.parallel.pp_rank, grouped_experts=self.config.training.moe_grouped_gemm)
        if tconfig.moe_router_enable_expert_bias:
            self.router_bias_update_rate = tconfig.moe_router_bias_update_rate
        self.gpt.to(self.device)
        routers_to_fp32(self.gpt)  # routers with an expert bias train in fp32 (router_bias.py)
        if self.config.training.use_rollout_routing_replay:
            from miles.routing.routers import moe_decoder_layers_of_config

            from .route_replay import install

            self.route_replays = install(self.gpt, moe_decoder_layers_of_config(self.hf_config.to_dict()))
        self._load_hf_state(hf_state)  # before DDP: its param buffer takes the values over
        to_bf16 = lambda: Float16Module(tconfig, self.gpt)  # noqa: E731
        module = self.gpt if dtype == torch.float32 else keep_routers_fp32(self.gpt, to_bf16)
        for name in native_fp32_param_names(self.gpt, self.hf_config):  # after Float16Module's cast, before DDP
            param = self.gpt.get_parameter(name)
            param.data = param.data.float()
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
        result = self.gpt.load_state_dict(self._megatron_state(hf_state), strict=False)
        missing = [k for k in result.missing_keys if not k.endswith(_EXTRA_STATE)]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"converted weights do not fit the built GPTModel: missing {missing[:5]}, "
                               f"unexpected {list(result.unexpected_keys)[:5]} (conversion and layer spec disagree)")

    def _megatron_state(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-layout weights as this rank's Megatron state dict: its experts, and its stage, TP and ETP shard."""
        mcore = hf_to_megatron(hf_state, self.hf_config, fused_norms=self.uses_te_spec, ep_rank=self.ep_rank,
                               ep_size=self.ep_size, grouped_experts=self.config.training.moe_grouped_gemm)
        if self.parallel.sharded:
            arch = describe(self.hf_config)
            mcore = self.parallel.shard(mcore, arch)
        return mcore

    def _hf_state(self) -> dict[str, torch.Tensor]:
        """The full HF-layout weights on the host (checkpoints); a collective over the expert-parallel group."""
        return {k: v.to("cpu", copy=True) for k, v in self.hf_weights()}

    def hf_weights(self):
        """HF-layout weights on the device, converted layer by layer; with EP > 1 each MoE layer's experts are
        all-gathered over the expert-parallel group as the iteration reaches it (every rank must iterate)."""
        local = {k: v.detach() for k, v in self.gpt.state_dict().items() if not k.endswith(_EXTRA_STATE)}
        if self.parallel.sharded:  # gathered over the TP group part by part (a collective)
            return self.parallel.iter_hf(local, self.hf_config, fused_norms=self.uses_te_spec,
                                         hf_moe_layout=self.hf_moe_layout,
                                         layer_experts=self._layer_experts() if self.ep_size > 1 else None)
        return iter_megatron_to_hf(local, self.hf_config, fused_norms=self.uses_te_spec,
                                   hf_moe_layout=self.hf_moe_layout,
                                   layer_experts=self._layer_experts() if self.ep_size > 1 else None)

    def _layer_experts(self):
        """The expert gather of :func:`hf_weights` over this rank's expert-parallel group."""
        from megatron.core import parallel_state

        group = parallel_state.get_expert_model_parallel_group()
        return lambda layer, local: gather_layer_experts(local, hf_config=self.hf_config, ep_size=self.ep_size,
                                                         group=group)


    # ---- training -----------------------------------------------------------------------------
    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """Log-probs of ``input_ids[:, 1:]`` (``[B, L-1]``) from Megatron's output layer, as forward_logprobs
        does for an HF model. Rows are right-padded, so the causal mask alone keeps pads out of real tokens."""
        input_ids = batch["input_ids"]
        position_ids = (batch["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        if self.parallel.layout.tp > 1:  # this rank's vocabulary slice: [B, L, V/TP]
            return self.parallel.logprobs(self._tp_logits(input_ids, position_ids)[:, :-1], input_ids[:, 1:],
                                          temperature)
        # the output layer runs chunk by chunk: no [B, L, V] fp32 logits (logprobs.py)
        return self.ddp(input_ids, position_ids, None, output_processor=output_logprobs,
                        output_processor_context=LogprobRequest(input_ids[:, 1:], temperature))

    def route_replay(self, routes, batch):
        """The routers on ``routes`` through megatron-core's RouterReplay (route_replay.py), in the token order
        of :meth:`logprobs`' forward: ``[B, L]``, padded to a multiple of TP under sequence parallelism."""
        from .route_replay import MegatronRouteReplay

        tp, sequence_parallel = self.parallel.layout.tp, self.config.training.sequence_parallel
        length = batch["input_ids"].shape[1]
        padded = length + (-length) % tp if sequence_parallel else length  # as _tp_logits' pad_sequence
        return MegatronRouteReplay(self.route_replays, routes, batch["attention_mask"], padded_length=padded, tp=tp,
                                   tp_rank=self.parallel.tp_rank, sequence_parallel=sequence_parallel,
                                   tp_group=self.parallel.tp_group)

    def _tp_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The vocab-parallel logits of ``input_ids``; with sequence parallelism the sequence is right-padded to
        a multiple of TP (causal: the padding changes no earlier position) and cut back."""
        length = input_ids.shape[1]
        if self.config.training.sequence_parallel:
            input_ids, position_ids = pad_sequence(input_ids, position_ids, self.parallel.layout.tp)
        return self.ddp(input_ids, position_ids, None)[:, :length]

    def zero_grads(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.router_bias_update_rate is not None:  # a skipped step's token counts must not reach the bias
            clear_router_token_counts(self.gpt)

    def forward_backward(self, samples: list, advantages: list[float], micro_batches: list,
                         loss: LossFunction) -> list[float]:
        if self.parallel.layout.pp == 1:
            return super().forward_backward(samples, advantages, micro_batches, loss)
        from .pipeline import pipeline_policy_gradient

        return pipeline_policy_gradient(self.ddp, self.parallel, samples, advantages, micro_batches, loss,
                                        sequence_parallel=self.config.training.sequence_parallel,
                                        pad_id=self.tokenizer.pad_token_id, device=self.device,
                                        route_replay=self.route_replay if loss.routing_replay else None)

    def finish_backward(self) -> None:
        if self.parallel.sharded:  # + sequence-parallel norm grads over TP, tied embedding grads over PP
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.ddp])
            return
        self.ddp.finish_grad_sync()  # DDP averages over ranks: the sum of the ranks' token means is the mean

    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @torch.no_grad()
    def local_grads_finite(self) -> bool:
        """Over the DDP grad buffers, every param's grad (native-fp32 ones too): Megatron's step checks
        for inf/NaN only with an fp16 loss scaler, and with bf16 would apply them."""
        return tensors_finite([b.grad_data for b in self.ddp.buffers + self.ddp.expert_parallel_buffers],
                              self.device)

    def trained_weights(self) -> list[torch.Tensor]:
        """The DDP param buffers (bf16 and native-fp32 alike), all-gathered by the step's param sync."""
        return [b.param_data for b in self.ddp.buffers + self.ddp.expert_parallel_buffers
                if b.param_data is not None]

    def optimizer_step(self, rollout_id: int) -> float:
        ok, grad_norm, _ = self.optimizer.step()  # clips by config.clip_grad over dense + expert grads
        if not ok:
            raise RuntimeError(f"rollout {rollout_id}: the Megatron optimizer skipped its step (non-finite grads)")
        self.scheduler.step(1)
        if self.router_bias_update_rate is not None:
            step_router_expert_bias(self.gpt, self.router_bias_update_rate)
        return float(grad_norm) if grad_norm is not None else float("nan")

    # ---- checkpoints --------------------------------------------------------------------------
    def checkpoint_model(self) -> HFModelView:
        return self._model_view

    def checkpoint_optimizer(self):
        """The bound optimizer when streaming (its state is the store's); else the resident-state view."""
        return self.optimizer if self.store is not None else ResidentOptimizerState(self.optimizer)

    def prepare_save(self) -> None:
        if self.rank == 0 or self.ep_size > 1 or self.parallel.sharded:  # the EP/TP gathers need every rank
            hf_state = self._hf_state()
            if self.rank == 0:
                self._model_view.prepare_save(hf_state)

    # ---- sleep / wake -------------------------------------------------------------------------
    def offload_tensors(self) -> list[torch.Tensor]:
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

    def sleep_groups(self):
        """For the sleep plan: the bf16 param buffers (the weights: the store's masters cast, when it streams
        them), the rest of the model (native-fp32 param buffers, params outside DDP's buffers, buffers), and
        the optimizer state on the device (all of it when resident; the resident Adam's of native-fp32 params
        when streamed). The grad buffers are not a group: :meth:`before_offload` drops them."""
        from miles.backends.planned_sleep import make_groups
        from miles.offload.plan import OPTIMIZER_STATE, OTHER, WEIGHTS

        buffers = self.ddp.buffers + self.ddp.expert_parallel_buffers
        low = [b.param_data for b in buffers if b.param_data is not None and b.param_data.dtype in _LOW_PRECISION]
        streams_mains = self.store is not None and all(s.streams_main for s in self.streamed_stores())
        other = [b.param_data for b in buffers if b.param_data is not None and b.param_data.dtype not in _LOW_PRECISION]
        other += list(self.gpt.parameters()) + list(self.gpt.buffers())
        specs = [("weights", WEIGHTS, low, {"from_masters": streams_mains, "engine_copy": True}),
                 ("model_other", OTHER, other, {}),
                 ("optimizer_state", OPTIMIZER_STATE, self._device_optimizer_state(), {})]
        return make_groups([(n, k, [t for t in ts if t is not None and t.is_cuda], src) for n, k, ts, src in specs])

    def _device_optimizer_state(self) -> list[torch.Tensor]:
        if self.store is None:
            return [t for t in self.offload_tensors() if t.dtype == torch.float32]  # masters and moments
        tensors = []
        for store in self.streamed_stores():
            adam = store.resident_adam.optimizer if store.resident_adam is not None else None
            for state in (adam.state.values() if adam is not None else ()):
                tensors += [v for v in state.values() if torch.is_tensor(v)]
        return tensors

    def weights_from_engine(self, engine_weights: list) -> int:
        """The bf16 params <- the engine's HF-layout copy through the inverse of the handoff's conversion
        (convert.hf_to_megatron; this rank's experts and shard); the native-fp32 params are not rebuilt from
        it (the plan keeps or writes them out)."""
        from miles.backends.planned_sleep import copy_from_engine
        from miles.weights.readback import open_named_tensors

        mcore = self._megatron_state(dict(open_named_tensors(engine_weights)))
        targets = {k: v for k, v in self.gpt.state_dict().items()
                   if torch.is_tensor(v) and not k.endswith(_EXTRA_STATE) and v.dtype in _LOW_PRECISION}
        nbytes = copy_from_engine(mcore.items(), targets)
        self._synchronize()
        return nbytes

    def weights_from_masters(self) -> int:
        """The bf16 param buffers <- the store's masters cast (this rank's shards), then all-gathered over the
        data-parallel ranks as the step's tail does (the binding's step_with_ready_grads)."""
        read = self.store.publish_mains()
        if self.world_size > 1:
            for member in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
                if not member.is_stub_optimizer:
                    member.start_param_sync_for_bucket_group_subset()
        self._synchronize()
        return read

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_offload(self) -> dict[str, Any]:
        # Before the offloader: torch_memory_saver must never see the grad buffers (grad_buffers.py).
        return {"grad_bytes_dropped": self.grad_buffers.release()}

    def asleep_report(self) -> dict[str, Any]:
        if self.device.type != "cuda":
            return {}
        free, total = torch.cuda.mem_get_info()
        # Device-wide: what this trainer still holds plus the (released) rollout engine's residue and
        # every process's CUDA context; an upper bound on the trainer's share while asleep.
        return {"device_used_bytes_asleep": total - free}

    def after_wake(self) -> dict[str, Any]:
        return {"grad_bytes_zeroed": self.grad_buffers.restore()}  # after the resume: see grad_buffers.py

    # ---- teardown -----------------------------------------------------------------------------
    def leave_process_group(self) -> None:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except ImportError:  # init never got as far as megatron
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


class MegatronTrainer(TrainRank):
    """One data-parallel rank of the megatron backend: the train rank over a :class:`MegatronEngine`."""

    engine_type = MegatronEngine
