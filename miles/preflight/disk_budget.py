"""What one run writes to disk, computed from the model before anything starts.

One model, `miles plan`'s (:mod:`miles.sizing.estimate`): :func:`rank_disk_need` is what one train rank
writes to its node's disk for this run's layout (TP, PP, DP and EP; the rank of the largest stage), from the
stores the run will build (:mod:`miles_plugins.optimizers.streaming.footprint`). Two callers:
:func:`miles.preflight.validation.validate_args`, before Ray starts, for the ranks that land on the driver's
filesystem (:func:`disk_budget`, with the checkpoint where ``--save`` lives), and :mod:`miles.ray.node_disk`,
once Ray has placed the ranks, for every node.

- ``state``: the streamed optimizer state's bucket files (``--stream-optimizer-state-to-disk``). A bucket
  the rank's host tier holds lives in RAM only and has no file, so the tier's share is not asked of the disk
  (``--stream-optimizer-state-host-cache-mb``; ``auto`` is resolved from the memory available now, as the
  store will resolve it when it is built).
- ``trainer_offload``: trainer offload to disk: the rank's weights, plus its in-memory optimizer state
  when that does not stream.
- ``checkpoint``: one checkpoint (weights + optimizer state), counted where ``--save`` lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from miles.config.run_config import RunConfig

GIB = 2**30
FP32_BYTES = 4
# fp32 master + two fp32 moments: the in-memory Adam state per parameter
RESIDENT_ADAM_BYTES = 12
DTYPE_BYTES = {"fp32": 4, "bf16": 2}

# SmolLM2-135M-Instruct (the embedded default): its config.json counted by miles.sizing.model_params
# (tied embeddings). A constant because the HF folder exists only after the first run converts it.
SMOLLM2_PARAMS = 134_515_008


@dataclass(frozen=True)
class RankDisk:
    """Bytes one train rank writes to its node's disk, and the part of its streamed state that its host tier
    keeps in RAM instead (no file)."""

    state_files: int = 0
    trainer_offload: int = 0
    state_in_ram: int = 0

    @property
    def total(self) -> int:
        return self.state_files + self.trainer_offload


@dataclass(frozen=True)
class DiskBudget:
    """Bytes a run writes on one filesystem, by mechanism (0 when the mechanism is off)."""

    state: int = 0
    trainer_offload: int = 0
    checkpoint: int = 0
    state_in_ram: int = 0  # the streamed state the ranks' host tiers hold: not on this disk

    @property
    def scratch(self) -> int:
        """Everything under ``--offload-train-disk-dir``."""
        return self.state + self.trainer_offload

    def describe(self, with_checkpoint: bool) -> str:
        """``1.61 GiB streamed state + 0.54 GiB trainer offload + ...`` (the non-zero terms)."""
        state = "streamed optimizer state"
        if self.state_in_ram:
            state += f" files (the host tier holds {self.state_in_ram / GIB:.2f} GiB more in RAM)"
        terms = [(self.state, state), (self.trainer_offload, "trainer offload")]
        if with_checkpoint:
            terms.append((self.checkpoint, "checkpoint copy"))
        return " + ".join(f"{n / GIB:.2f} GiB {what}" for n, what in terms if n) or "nothing"


def model_tensors_of_run(model_source: str, hf_config: dict | None, tp: int = 1, backend: str = "torch"):
    """The policy's tensors as :mod:`miles.sizing` counts them (a ``ModelTensors``, dense and expert apart):
    from ``--hf-checkpoint``'s config.json (the megatron backend's model through its family, without the
    multi-token-prediction layers it does not build; the torch backend's as transformers lays it out), the
    embedded default's count, or the tiny model's config. None when the config describes an architecture the
    counter does not know (the free-space checks are then skipped rather than guessed; the model checks say
    what is wrong with it). ``tp``: the tensor-parallel size the vocabulary is padded for (Megatron's 128 x TP)."""
    from miles.sizing.model_params import model_tensors
    from miles.sizing.tensors import ModelConfigError, flat_model

    if model_source == "smollm2":
        return flat_model(SMOLLM2_PARAMS, name="SmolLM2-135M-Instruct")
    if model_source == "tiny":
        from miles.models import TINY_MODEL_CONFIG

        # the tiny char vocabulary is under 128 tokens; the counter pads any vocabulary to 128
        return model_tensors({**TINY_MODEL_CONFIG, "vocab_size": 128}, "tiny", tp=tp)
    if backend == "megatron":
        from miles.backends.megatron_backend.families import UnsupportedModelError, count_tensors, read_config

        try:
            return count_tensors(read_config(hf_config, "--hf-checkpoint"), "--hf-checkpoint", tp=tp, mtp=False)
        except (ModelConfigError, UnsupportedModelError):
            return None
    try:
        return model_tensors(hf_config or {}, "--hf-checkpoint", tp=tp)
    except (ModelConfigError, KeyError, TypeError, ValueError):
        return None


def streamed_state_bytes(params: int, moment_dtype: str) -> int:
    """fp32 masters + both moments in ``moment_dtype``, as the store's codecs encode them."""
    from miles_plugins.optimizers.streaming.codec import make_moment_codecs

    moments = sum(codec.encoded_nbytes(params) for codec in make_moment_codecs(moment_dtype).values())
    return FP32_BYTES * params + moments


def ranks_on_driver_node(num_train_ranks: int, node_slots: int) -> int:
    """Train ranks that can land on the driver's node of a cluster: one bundle each, and the node holds at
    most ``node_slots`` bundles (its GPUs, or its CPUs / --num-cpus-per-rank)."""
    return max(0, min(num_train_ranks, node_slots))


def host_tier_bytes(host_cache_mb: Union[int, str, None], state_bytes: int, ranks_on_node: int,
                    memory_available: Optional[int]) -> int:
    """The host tier one rank's store takes: ``host_cache_mb`` MiB, or for ``auto`` this rank's share of
    ``memory_available`` as the store computes it (None: unknown, counted as no tier)."""
    from miles_plugins.optimizers.streaming.config import DEFAULT_HOST_CACHE_RESERVE_MB, HOST_CACHE_AUTO
    from miles_plugins.optimizers.streaming.plan import fit_host_cache
    from miles_plugins.optimizers.streaming.units import MiB

    if not host_cache_mb:
        return 0
    if host_cache_mb == HOST_CACHE_AUTO:
        if memory_available is None:
            return 0
        return fit_host_cache(memory_available, state_bytes, max(1, ranks_on_node),
                              DEFAULT_HOST_CACHE_RESERVE_MB * MiB, 0)
    return int(host_cache_mb) * MiB


def rank_disk_need(cfg: RunConfig, model, ranks_on_node: int, memory_available: Optional[int]) -> RankDisk:
    """What one train rank of the resolved ``cfg`` writes to its node's disk (:class:`RankDisk`), from `miles
    plan`'s estimate of this run's stores for the policy's tensors ``model``; ``ranks_on_node`` ranks share the
    node's ``memory_available`` for an ``auto`` host tier (None: unknown, no tier counted). Raises the
    planner's SizingError / LayoutError where it cannot size the run."""
    from miles.sizing.estimate import Hardware, Training, disk_bytes_per_rank, estimate
    from miles.sizing.sharding import Parallelism

    opt, n = cfg.optimizer, cfg.cluster.num_train_ranks
    stream = opt.stream_optimizer_state_to_disk
    training = Training(moment_dtype=opt.stream_optimizer_state_moment_dtype,
                        bucket_numel=opt.stream_optimizer_state_bucket_numel, weight_dtype=cfg.model.model_dtype,
                        offload_train_to_disk=cfg.trainer_offload_to_disk, stream_optimizer_state=stream,
                        checkpoint_copies=0)
    layout = cfg.parallel_layout  # the largest stage's rank decides: plan.binding
    par = Parallelism(tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, etp=layout.etp,
                      first_stage_layers=layout.first_stage_layers, last_stage_layers=layout.last_stage_layers)
    plan = estimate(model, par,
                    Hardware(nodes=1, gpus_per_node=n, device_budget_mb=opt.stream_optimizer_state_device_budget_mb),
                    training)
    stage = plan.binding
    state = stage.streamed_state_bytes if stream else 0
    tier = host_tier_bytes(opt.stream_optimizer_state_host_cache_mb, state, ranks_on_node,
                           memory_available) if stream else 0
    need = disk_bytes_per_rank(stage, training, tier)
    return RankDisk(state_files=need["streamed_state"], trainer_offload=need["trainer_offload"],
                    state_in_ram=state - need["streamed_state"])


def disk_budget(cfg: RunConfig, model, ranks_here: int | None = None,
                memory_available: Optional[int] = None) -> DiskBudget:
    """The run's :class:`DiskBudget` on the driver's filesystems for the resolved ``cfg`` and the policy's
    tensors ``model``.

    ``ranks_here``: the train ranks whose scratch lands on the checked filesystem (None: all of them, the
    single-node case); they share this host's ``memory_available`` for an ``auto`` host tier."""
    opt = cfg.optimizer
    ranks = cfg.cluster.num_train_ranks if ranks_here is None else ranks_here
    rank = rank_disk_need(cfg, model, ranks, memory_available)
    params = model.total()
    optimizer_state = (streamed_state_bytes(params, opt.stream_optimizer_state_moment_dtype)
                       if opt.stream_optimizer_state_to_disk else RESIDENT_ADAM_BYTES * params)
    return DiskBudget(state=rank.state_files * ranks, trainer_offload=rank.trainer_offload * ranks,
                      checkpoint=params * DTYPE_BYTES[cfg.model.model_dtype] + optimizer_state
                      if cfg.checkpoint.save else 0,
                      state_in_ram=rank.state_in_ram * ranks)
