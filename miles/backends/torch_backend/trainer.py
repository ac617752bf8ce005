"""The torch training backend: a transformers causal LM, data parallel over torch.distributed.

One :class:`TorchTrainer` lives in each train actor (one per data-parallel rank): the train rank
(:class:`miles.backends.rank.TrainRank`) over a :class:`TorchEngine`, which only computes. Every rank holds the
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

import torch
import torch.distributed as dist

from miles.backends.engine import TrainEngine, tensors_finite
from miles.backends.rank import TrainRank
from miles.models import load_policy
from miles.offload import make_resizable
from miles.rl.loss import forward_logprobs
from miles.routing.replay import RouteReplay
from miles.sizing.flops import model_flops

from .sharded_optimizer import ShardedMixedPrecisionAdam

logger = logging.getLogger(__name__)


class TorchEngine(TrainEngine):
    """The compute of one data-parallel rank of the torch backend (:class:`TrainEngine`)."""

    def __init__(self, config, **placement):
        super().__init__(config, **placement)
        self.model = None  # the transformers causal LM, once built

    # ---- setup --------------------------------------------------------------------------------
    def join_process_group(self, rendezvous: str) -> str:
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.world_size > 1 or not dist.is_initialized():
            dist.init_process_group(backend=backend, init_method=f"tcp://{rendezvous}",
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=datetime.timedelta(minutes=30))
        return backend

    def build_model(self) -> str:
        try:  # checkpoint saves would draw transformers' per-file progress bars into the operator's log
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except Exception:
            pass

        model, self.tokenizer, description = load_policy(self.config, device=self.device)  # MoE experts: per device
        model = model.to(device=self.device, dtype=self.dtype)
        make_resizable(model)  # sleep resizes storages; mmap'ed checkpoint tensors cannot be resized
        model.train()
        if hasattr(model, "config"):
            model.config.use_cache = False
        self.model = model
        self.optimizer = self._build_optimizer()
        return description

    def policy_flops(self):
        return model_flops(self.model.config.to_dict(), name="the policy")  # transformers' layout of the model

    def describe(self) -> dict:
        return {"num_params": sum(p.numel() for p in self.model.parameters())}

    def _param_groups(self) -> list[dict]:
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
            return ShardedMixedPrecisionAdam(
                self._param_groups(), lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                optimizer_cls=torch.optim.AdamW)
        if opt.optimizer == "sgd":
            return _DataParallelSGD(self._param_groups(), lr=opt.lr, world_size=self.world_size)
        raise ValueError(f"the torch backend supports --optimizer adam or sgd, got {opt.optimizer!r}")

    # ---- training -----------------------------------------------------------------------------
    def logprobs(self, batch, temperature):
        return forward_logprobs(self.model, batch["input_ids"], batch["attention_mask"], temperature)

    def route_replay(self, routes, batch):
        """The transformers model's routers forced to ``routes`` (:class:`miles.routing.replay.RouteReplay`)."""
        return RouteReplay(self.model, routes, batch["attention_mask"], force=True)

    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    @torch.no_grad()
    def local_grads_finite(self) -> bool:
        return tensors_finite([p.grad for p in self.model.parameters() if p.grad is not None], self.device)

    def trained_weights(self) -> list[torch.Tensor]:
        """The trainable params: every rank holds them whole after the step's all-gather."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def optimizer_step(self, rollout_id: int) -> float:
        with torch.no_grad():
            norm = self._clipped_step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _clipped_step(self) -> float:
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

    def checkpoint_model(self):
        return self.model

    # ---- sleep / wake -------------------------------------------------------------------------
    def offload_tensors(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = list(self.model.parameters()) + list(self.model.buffers())
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.store is None:  # streamed state lives on disk already: nothing to back up
            opt = self.optimizer
            tensors += [s.master for s in opt.shards]
            for state in opt.inner.state.values():
                tensors += [v for v in state.values() if torch.is_tensor(v)]
        return tensors

    def sleep_groups(self):
        """Weights (rebuilt from the store's masters when it streams them), the rest of the model (buffers,
        frozen params), grads (discarded), and the resident optimizer state (none when streamed)."""
        from miles.backends.planned_sleep import make_groups
        from miles.offload.plan import GRADS, OPTIMIZER_STATE, OTHER, WEIGHTS

        params = list(self.model.parameters())
        streams_mains = self.store is not None and all(s.streams_main for s in self.streamed_stores())
        specs = [("weights", WEIGHTS, [p for p in params if p.requires_grad],
                  {"from_masters": streams_mains, "engine_copy": True}),
                 ("model_other", OTHER, [p for p in params if not p.requires_grad] + list(self.model.buffers()), {}),
                 ("grads", GRADS, [p.grad for p in params], {})]
        if self.store is None:
            opt = self.optimizer
            state = [s.master for s in opt.shards]
            state += [v for st in opt.inner.state.values() for v in st.values() if torch.is_tensor(v)]
            specs.append(("optimizer_state", OPTIMIZER_STATE, state, {}))
        return make_groups(specs)

    def weights_from_engine(self, engine_weights: list) -> int:
        """The trainable weights <- the engine's copy, by name (the handoff hands the state dict's names
        over as they are)."""
        from miles.backends.planned_sleep import copy_from_engine
        from miles.weights.readback import open_named_tensors

        trainable = {id(p) for p in self.model.parameters() if p.requires_grad}
        targets = {n: p.detach() for n, p in self.model.named_parameters() if id(p) in trainable}
        return copy_from_engine(open_named_tensors(engine_weights), targets)

    def weights_from_masters(self) -> int:
        """Weights <- the store's masters cast (this rank's shard), then every rank's shards all-gathered:
        what the last step's publish and gather wrote."""
        read = self.store.publish_mains()
        self.optimizer.gather_params()
        return read


class TorchTrainer(TrainRank):
    """One data-parallel rank of the torch backend: the train rank over a :class:`TorchEngine`."""

    engine_type = TorchEngine


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
