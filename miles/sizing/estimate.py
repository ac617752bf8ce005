"""The sizing of one run: per-rank bytes, which mechanism fits, disk per node, streamed bytes and step floors.

Pure: a model's tensors, a parallel layout and the hardware in, an `Estimate` out. Per-rank figures are
for the pipeline stage that holds the most (it decides whether the run fits); `stages` has each one.

The disk model (`Hardware`): all GPUs of a node share its disk, and reads and writes share the disk's
budget (measured on the H200 hosts: ~2.1-2.4 GB/s moving both at once, against 1.3-2.4 read or 2.2-3.6
write alone). So a step's disk time is the node's read + write bytes / `disk_combined_gbps` when that is
known (`miles bench stream` measures it), else read bytes / read speed + write bytes / write speed
(the disk serving one direction at a time). Bytes served by the host tier (RAM) cost bytes / `pcie_gbps`
instead (each GPU has its own link; both directions run at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_plugins.optimizers.nvme_stream import StoreConfigError
from miles_plugins.optimizers.streaming.config import DEFAULT_BUCKET_NUMEL
from miles_plugins.optimizers.streaming.footprint import StoreFootprint, smallest_bucket_numel

from .bounds import MAX_BUCKETS
from .inputs import GB, GRAD_BYTES, WEIGHT_BYTES, Hardware, SizingError, Training, short_decimal
from .sharding import Parallelism, RankShard, check_parallelism, rank_shards
from .store_plan import TierSplit, plan_store, split_by_host_tier
from .tensors import ModelTensors

GIB = 2**30
RESIDENT_STATE_BYTES = 12  # Megatron's resident Adam: fp32 main + two fp32 moments per owned param
# Megatron's optimizer CPU offload held 1.8x its state in host RSS (one H200, megatron-core 0.19.2:
# 28.9 GB of RSS for 16.1 GB of state): staging buffers and pinned copies come on top of the state.
CPU_OFFLOAD_RSS_FACTOR = 1.8


@dataclass(frozen=True)
class StageEstimate:
    stage: int
    params_local: int  # weights this rank holds (dense + expert)
    dense_local: int
    expert_local: int
    params_owned: int  # params whose optimizer state this rank owns
    dense_owned: int
    expert_owned: int
    weight_bytes: int
    grad_bytes: int
    resident_state_bytes: int  # Megatron's own fp32 state for the owned params
    dense_store: StoreFootprint
    expert_store: StoreFootprint

    @property
    def stores(self) -> tuple[StoreFootprint, StoreFootprint]:
        return self.dense_store, self.expert_store

    @property
    def streamed_state_bytes(self) -> int:
        return self.dense_store.state_bytes + self.expert_store.state_bytes

    @property
    def step_bytes(self) -> int:
        """Read, and written, by every step from the second on."""
        return sum(s.payload_bytes for s in self.stores)

    @property
    def first_step_read_bytes(self) -> int:
        """The first step reads the mains only: Adam creates the moments during it."""
        return sum(s.main_bytes for s in self.stores)


@dataclass(frozen=True)
class Fit:
    resident: bool
    cpu_offload: bool
    streaming: bool
    verdict: str  # "resident", "cpu-offload", "streaming" or "does-not-fit"
    reason: str  # what the verdict rests on, in words
    device_bytes: dict = field(default_factory=dict)  # HBM use per mechanism
    host_bytes_per_node: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Floors:
    """Seconds one step cannot go below on this disk (and host tier), for the binding rank's node."""

    disk_model: str
    steady_seconds: float
    first_seconds: float
    tiered_seconds: float  # steady state, with the host tier serving what it holds
    node_read_bytes: int
    node_write_bytes: int
    node_first_read_bytes: int
    tier_bytes_per_rank: int  # of the rank's step bytes, served by the host tier (each direction)
    ram_bytes_per_rank: int = 0  # of the rank's streamed state, the buckets the host tier holds (no files)
    disk_bytes_per_rank: int = 0  # of the rank's streamed state, the bucket files on disk


@dataclass(frozen=True)
class Estimate:
    model: str
    total_params: int
    dense_params: int
    expert_params: int
    parallel: Parallelism
    hardware: Hardware
    training: Training
    stages: tuple[StageEstimate, ...]
    binding: StageEstimate  # the stage with the most state: it decides the fit
    mean_params_owned: float
    fit: Fit
    disk_bytes_per_node: dict
    floors: Floors


def _store(entry_numels, training: Training, hw: Hardware) -> StoreFootprint:
    """The store a run builds over these entries; SizingError where it would refuse to be built."""
    try:
        return plan_store(entry_numels, training.moment_dtype, training.bucket_numel, hw.device_budget_bytes)
    except StoreConfigError as exc:
        raise SizingError(f"the store would refuse this run: {exc} (miles plan takes the device budget as "
                          "--device-budget-mb and the bucket size as --bucket-numel)") from None


def _stage_estimate(shard: RankShard, training: Training, hw: Hardware) -> StageEstimate:
    dense = _store(shard.dense_entries, training, hw)
    expert = _store(shard.expert_entries, training, hw)
    return StageEstimate(
        stage=shard.stage, params_local=shard.local_params, dense_local=sum(shard.dense_local),
        expert_local=sum(shard.expert_local), params_owned=shard.owned_params,
        dense_owned=sum(shard.dense_entries), expert_owned=sum(shard.expert_entries),
        weight_bytes=WEIGHT_BYTES[training.weight_dtype] * shard.local_params, grad_bytes=GRAD_BYTES[training.grad_dtype] * shard.local_params,
        resident_state_bytes=RESIDENT_STATE_BYTES * shard.owned_params, dense_store=dense, expert_store=expert)


def store_device_bytes(stage: StageEstimate) -> int:
    """GPU bytes the stores hold while stepping: each store's residency bound (its buckets in flight at its
    depth, within its device budget). The dense and expert stores step one after the other, so the larger
    of the two counts."""
    return max(s.residency_bound_bytes for s in stage.stores)


def _fit(stage: StageEstimate, hw: Hardware) -> Fit:
    hbm, reserve = hw.hbm_gb * GB, hw.reserve_bytes
    base = stage.weight_bytes + stage.grad_bytes + reserve
    device = {"resident": base + stage.resident_state_bytes, "cpu-offload": base,
              "streaming": base + store_device_bytes(stage), "weights+grads+reserve": base}
    host = {"cpu-offload": hw.gpus_per_node * CPU_OFFLOAD_RSS_FACTOR * stage.resident_state_bytes,
            "streaming": hw.gpus_per_node * hw.host_tier_gb * GB}
    ram = hw.host_ram_gb * GB
    resident = device["resident"] <= hbm
    cpu_offload = device["cpu-offload"] <= hbm and host["cpu-offload"] <= ram
    streaming = device["streaming"] <= hbm and host["streaming"] <= ram
    gb = lambda b: f"{b / GB:.1f} GB"  # noqa: E731
    if resident:
        verdict, reason = "resident", f"weights + grads + state + reserve = {gb(device['resident'])} <= {gb(hbm)} HBM"
    elif cpu_offload:
        verdict, reason = "cpu-offload", (f"resident needs {gb(device['resident'])} > {gb(hbm)} HBM; the state "
                                          f"fits in host RAM ({gb(host['cpu-offload'])} of {gb(ram)} per node)")
    elif streaming:
        why_not_cpu = (f"host RAM {gb(ram)} < {gb(host['cpu-offload'])} for CPU offload"
                       if device["cpu-offload"] <= hbm else "")
        verdict, reason = "streaming", (f"resident needs {gb(device['resident'])} > {gb(hbm)} HBM"
                                        + (f"; {why_not_cpu}" if why_not_cpu else "")
                                        + f"; streaming needs {gb(device['streaming'])}")
    else:
        verdict, reason = "does-not-fit", (f"weights + grads + reserve alone take {gb(base)} of {gb(hbm)} HBM "
                                           "(with streaming: " + gb(device["streaming"]) + "): raise TP, PP or EP, "
                                           "or use more nodes")
        if host["streaming"] > ram:
            reason = (f"the host tier ({short_decimal(hw.host_tier_gb)} GB x {hw.gpus_per_node} GPUs) exceeds the "
                      f"node's {short_decimal(hw.host_ram_gb)} GB of RAM: lower --host-tier-gb")
    return Fit(resident, cpu_offload, streaming, verdict, reason, device, host)


def tier_split(stage: StageEstimate, hw: Hardware) -> TierSplit:
    """The rank's streamed state split between its host tier (whole buckets, in RAM only) and its files."""
    return split_by_host_tier(stage.stores, int(hw.host_tier_gb * GB))


def disk_bytes_per_rank(stage: StageEstimate, training: Training, host_tier_bytes: int = 0) -> dict:
    """Node-local disk one rank of ``stage`` writes, by mechanism (``miles train`` checks every node
    against this times its ranks before starting the train actors). The streamed state's files are the
    buckets a host tier of `host_tier_bytes` per rank cannot hold; a checkpoint copy holds all of it.

    The trainer offload is what a sleeping trainer backs up, the same on both backends: the weights, and
    the optimizer state when it is not streamed (the streamed state is in its files already). Not the
    grads: every step starts from zeroed grads, so the megatron backend frees its grad buffers at sleep
    and the torch backend's step leaves none."""
    streamed = stage.streamed_state_bytes if training.stream_optimizer_state else 0
    files = split_by_host_tier(stage.stores, host_tier_bytes).disk_state_bytes if streamed else 0
    in_memory_state = 0 if training.stream_optimizer_state else stage.resident_state_bytes
    return {"streamed_state": files,
            "trainer_offload": stage.weight_bytes + in_memory_state if training.offload_train_to_disk else 0,
            "checkpoint_copies": training.checkpoint_copies * streamed}


def _disk_per_node(stage: StageEstimate, hw: Hardware, training: Training) -> dict:
    per_node = {k: hw.gpus_per_node * v
                for k, v in disk_bytes_per_rank(stage, training, int(hw.host_tier_gb * GB)).items()}
    per_node["total"] = sum(per_node.values())
    return per_node


def disk_seconds(read_bytes: float, write_bytes: float, hw: Hardware) -> float:
    if hw.disk_combined_gbps:
        return (read_bytes + write_bytes) / (hw.disk_combined_gbps * GB)
    return read_bytes / (hw.disk_read_gbps * GB) + write_bytes / (hw.disk_write_gbps * GB)


def _floors(stage: StageEstimate, hw: Hardware) -> Floors:
    n = hw.gpus_per_node
    step, first_read = stage.step_bytes, stage.first_step_read_bytes
    split = tier_split(stage, hw)
    tier = split.ram_step_bytes
    model = (f"(read + write) / {short_decimal(hw.disk_combined_gbps)} GB/s combined" if hw.disk_combined_gbps else
             f"read / {short_decimal(hw.disk_read_gbps)} GB/s + write / {short_decimal(hw.disk_write_gbps)} GB/s")
    return Floors(
        disk_model=model, steady_seconds=disk_seconds(n * step, n * step, hw),
        first_seconds=disk_seconds(n * first_read, n * step, hw),
        tiered_seconds=disk_seconds(n * (step - tier), n * (step - tier), hw) + tier / (hw.pcie_gbps * GB),
        node_read_bytes=n * step, node_write_bytes=n * step, node_first_read_bytes=n * first_read,
        tier_bytes_per_rank=tier, ram_bytes_per_rank=split.ram_state_bytes,
        disk_bytes_per_rank=split.disk_state_bytes)


def check_inputs(par: Parallelism, hw: Hardware) -> None:
    """What the fields alone cannot say (each of Parallelism, Hardware, Training checks its own ranges)."""
    if hw.gpus != par.world:
        raise SizingError(f"--nodes {hw.nodes} x --gpus-per-node {hw.gpus_per_node} = {hw.gpus} GPUs, but "
                          f"TP {par.tp} x PP {par.pp} x DP {par.dp} = {par.world}: change --dp (or leave it out "
                          "to derive it) or the node count")


def check_bucket_count(shards: list[RankShard], training: Training, hw: Hardware) -> None:
    """Refuse a bucket size that cuts the planned ranks' state into more buckets than the planner lays out
    (counted from the element totals, before any bucket is planned). Left to the store, the bucket size is
    counted at its floor under the device budget (footprint.smallest_bucket_numel)."""
    numel = (training.bucket_numel if training.bucket_numel is not None else
             smallest_bucket_numel(training.moment_dtype, device_budget_bytes=hw.device_budget_bytes))
    count = sum(-(-sum(entries) // numel) for s in shards for entries in (s.dense_entries, s.expert_entries))
    if count <= MAX_BUCKETS:
        return
    state = f"the optimizer state of the {len(shards)} planned rank(s) (one per pipeline stage)"
    if training.bucket_numel is not None:
        raise SizingError(f"--bucket-numel {numel} cuts {state} into at least {count} buckets, over the {MAX_BUCKETS} "
                          "the planner lays out: raise --bucket-numel, or leave it out (the store then fits it to "
                          f"the device budget, at most {DEFAULT_BUCKET_NUMEL})")
    budget = (f"--device-budget-mb {short_decimal(hw.device_budget_mb)}" if hw.device_budget_mb is not None
              else "the store's default device budget")
    raise SizingError(f"under {budget} the store's buckets can be as small as {numel} elements, which would cut "
                      f"{state} into up to {count} buckets, over the {MAX_BUCKETS} the planner lays out: raise "
                      "--device-budget-mb")


def estimate(model: ModelTensors, par: Parallelism, hw: Hardware, training: Training = Training()) -> Estimate:
    check_inputs(par, hw)
    experts = len({t.expert for t in model.all() if t.expert is not None})
    check_parallelism(par, model, experts)
    shards = rank_shards(model, par)
    check_bucket_count(shards, training, hw)
    stages = tuple(_stage_estimate(s, training, hw) for s in shards)
    binding = max(stages, key=lambda s: (s.streamed_state_bytes, s.weight_bytes))
    return Estimate(
        model=model.name, total_params=model.total(), dense_params=model.total(expert=False),
        expert_params=model.total(expert=True), parallel=par, hardware=hw, training=training, stages=stages,
        binding=binding, mean_params_owned=sum(s.params_owned for s in stages) / len(stages),
        fit=_fit(binding, hw), disk_bytes_per_node=_disk_per_node(binding, hw, training), floors=_floors(binding, hw))
