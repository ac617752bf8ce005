"""Binding for megatron-core (0.19.x) DistributedOptimizer and ChainedOptimizer.

Each non-stub DistributedOptimizer gets one store over its fp32 master shards
(`shard_fp32_from_float16_groups`); updated mains are published into the DDP param buffer exactly
where Megatron's `_copy_main_params_to_model_params` writes them. Native-fp32 model params (MoE
router weights kept in fp32, GDN/Mamba `A_log`) are tiny: they stay under a small always-resident
Adam of the master's own class whose params alias the model params, so stepping updates the model
with no copy. Nothing here imports megatron at module level: detection is by class.
"""

from __future__ import annotations

import logging

import torch

from ..bucket import StreamEntry, adam_constructor_kwargs
from ..config import StreamConfig
from ..errors import StoreConfigError
from ..store import NVMeOptimizerStateStore
from .torch_adam import bind_common, state_marker, check_adam_family

logger = logging.getLogger(__name__)
_LOW_PRECISION = (torch.bfloat16, torch.float16)  # Megatron's float16 groups: the params whose masters stream


def _is_distributed_optimizer(opt) -> bool:
    return type(opt).__name__ == "DistributedOptimizer" or any(
        c.__name__ == "DistributedOptimizer" for c in type(opt).__mro__)


def check_megatron_config(opt) -> None:
    """Reject, at construction, what the store cannot stream correctly."""
    config, ddp = opt.config, opt.ddp_config
    if getattr(config, "use_precision_aware_optimizer", False):
        raise StoreConfigError("streaming optimizer state does not support Megatron's precision-aware optimizer "
                               "(its FusedAdam holds the mains itself); disable --use-precision-aware-optimizer")
    if getattr(config, "optimizer_cpu_offload", False) or type(opt.optimizer).__name__ == "HybridDeviceOptimizer":
        raise StoreConfigError("streaming optimizer state and Megatron's optimizer CPU offload both move the state; "
                               "disable --optimizer-cpu-offload")
    if getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        raise StoreConfigError("streaming optimizer state does not support the MXFP8 param all-gather "
                               "(reuse_grad_buf_for_mxfp8_param_ag); disable it")
    if getattr(ddp, "fp8_param_gather", False) or getattr(ddp, "fp4_param_gather", False):
        raise StoreConfigError("streaming optimizer state does not support fp8/fp4 params: their quantization is "
                               "a data-parallel collective over all params that cannot run per bucket; train "
                               "with bf16 params (drop --fp8-param-gather / fp8 params)")
    if getattr(ddp, "use_megatron_fsdp", False):
        raise StoreConfigError("streaming optimizer state does not support Megatron-FSDP; use the DDP "
                               "DistributedOptimizer")
    for chunk in getattr(opt, "model_chunks", None) or []:
        if getattr(getattr(chunk, "config", None), "qk_clip", False):
            raise StoreConfigError("streaming optimizer state does not support QK-clip (TransformerConfig.qk_clip): "
                                   "it rescales the fp32 mains in place after the step, and streamed mains live "
                                   "on disk; disable --qk-clip")
    for group in opt.model_float16_groups:
        for p in group:
            if opt._is_distopt_quantized_param(p) or type(p).__name__ in ("NVFP4Tensor", "Float8Tensor"):
                raise StoreConfigError(f"streaming optimizer state does not support fp8 params "
                                       f"(found {type(p).__name__} of shape {tuple(p.shape)}); use bf16 params")
    check_adam_family(opt.optimizer)


class ResidentAdam:
    """Adam of the master's class over the native-fp32 shards, which alias the model params.

    Megatron's shards are views of params that require grad (non-leaf tensors a torch optimizer
    refuses), so the instance steps detached aliases and takes their grads from the shards.
    """

    def __init__(self, master: torch.optim.Optimizer, groups: list[list[torch.Tensor]]):
        self.master = master
        self.group_index = [g for g, shards in enumerate(groups) if shards]
        self.shards = [s for g in self.group_index for s in groups[g]]
        self.aliases = [s.detach() for s in self.shards]
        alias_of = dict(zip(map(id, self.shards), self.aliases))
        param_groups = [{**self._hyper(g), "params": [alias_of[id(s)] for s in groups[g]]} for g in self.group_index]
        self.optimizer = type(master)(param_groups, **adam_constructor_kwargs(master)) if param_groups else None

    def _hyper(self, g: int) -> dict:
        return {k: v for k, v in self.master.param_groups[g].items() if k not in ("params", "step")}

    def step(self) -> None:
        if self.optimizer is None:
            return
        for group, g in zip(self.optimizer.param_groups, self.group_index):
            group.update(self._hyper(g))
        for alias, shard in zip(self.aliases, self.shards):
            alias.grad = shard.grad
        self.optimizer.step()
        for alias in self.aliases:
            alias.grad = None


def _param_buffer_view(opt, model_param) -> torch.Tensor:
    """Where Megatron publishes this rank's shard of `model_param` (its DDP param buffer slice).

    Adapted from DistributedOptimizer._copy_main_params_to_model_params, megatron-core 0.19.2.
    """
    world_range = opt._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
    gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
    param_data = opt.buffers[gbuf_index].buckets[bucket_id].param_data
    return param_data.view(-1)[world_range.start:world_range.end]


def _param_names(opt) -> dict[int, str]:
    """id(model param) -> a name that is the same on every data-parallel rank and differs across the
    other parallel dimensions (pipeline stage, model chunk, tensor rank; expert and expert-tensor rank
    for expert params), so that checkpoints reshard across data-parallel sizes. {} when megatron's
    parallel state is not initialized."""
    try:
        from megatron.core import parallel_state as ps

        pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
        ep, etp = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        return {}
    names = {}
    for c, chunk in enumerate(getattr(opt, "model_chunks", None) or []):
        for name, p in chunk.named_parameters():
            where = f"ep{ep}.etp{etp}" if not getattr(p, "allreduce", True) else f"tp{tp}"
            names[id(p)] = f"pp{pp}.chunk{c}.{where}.{name}"
    return names


def name_shard(name: str) -> str:
    """The model shard a :func:`_param_names` name carries: its coordinates other than data parallelism and the
    model chunk (``pp0.tp1``, ``pp0.ep1.etp0``); "" for a name not of that form (a checkpoint's names are read
    from disk)."""
    parts = name.split(".", 2)
    if len(parts) < 3 or not parts[0].startswith("pp"):
        return ""
    rest = parts[2]
    where = ".".join(rest.split(".")[:2]) if rest.startswith("ep") else rest.split(".", 1)[0]
    return f"{parts[0]}.{where}"


def streamed_param_sizes(buffers, names: dict[int, str], entries: list[StreamEntry]) -> dict[str, int] | None:
    """{name: elements} of every param a DistributedOptimizer streams, all data-parallel ranks' together:
    the bf16/fp16 params of its DDP buffers (`param_index_map`: each buffer holds every rank's params, the
    optimizer shards it; its native-fp32 params stay under the resident Adam). A load refuses a
    checkpoint that holds other params (save_load._check_coverage). None, not checked: a param has no
    name (megatron's parallel state not initialized), or the set misses a param this rank streams (the
    buffers are not what this binding expects of megatron-core: checking would refuse good checkpoints)."""
    params = [p for buffer in buffers for p in buffer.param_index_map if p.dtype in _LOW_PRECISION]
    if any(id(p) not in names for p in params):
        return None
    sizes = {names[id(p)]: p.numel() for p in params}
    missed = [e.name for e in entries if e.name is not None and sizes.get(e.name) != e.full_numel]
    if missed:
        logger.warning("the DDP buffers do not list %d params this rank streams (first: %s); a checkpoint's "
                       "params are not compared with the model's", len(missed), missed[0])
        return None
    return sizes


def _entry(opt, g: int, model_param, main, names: dict[int, str]) -> StreamEntry:
    """The shard `main` is elements [start, end) of `model_param` flattened (Megatron's "param" range)."""
    entry = StreamEntry(main=main, group=g, model_view=_param_buffer_view(opt, model_param))
    name, span = names.get(id(model_param)), opt._get_model_param_range_map(model_param)["param"]
    if name is not None and span.end - span.start == main.numel():
        entry.name, entry.start, entry.full_numel = name, span.start, model_param.numel()
    return entry


def _bind_distributed(opt, config: StreamConfig, *, instance: int, part: int) -> NVMeOptimizerStateStore:
    check_megatron_config(opt)
    names = _param_names(opt)
    entries = [_entry(opt, g, model_param, main, names)
               for g, (model_group, main_group) in enumerate(zip(opt.model_float16_groups,
                                                                 opt.shard_fp32_from_float16_groups))
               for model_param, main in zip(model_group, main_group)]
    resident = ResidentAdam(opt.optimizer, [list(group) for group in opt.shard_fp32_groups])
    store = NVMeOptimizerStateStore(entries, opt.optimizer, config, instance=instance, part=part,
                                    resident_adam=resident,
                                    model_params=streamed_param_sizes(opt.buffers, names, entries),
                                    shard_of=name_shard)
    # Megatron hangs each bf16 model param's fp32 shard on it as `main_param`; the store has released
    # that storage. Readers (megatron.training's calc_params_l2_norm) fall back to the model weights
    # when the handle is absent, instead of reading a tensor with no storage.
    for model_group in opt.model_float16_groups:
        for model_param in model_group:
            if hasattr(model_param, "main_param"):
                del model_param.main_param
    n_resident = sum(p.numel() for group in opt.shard_fp32_groups for p in group)
    if n_resident:
        logger.info("%d native-fp32 param elements stay under a resident Adam (aliasing the model params)",
                    n_resident)

    def step_with_ready_grads() -> bool:
        store.step()
        resident.step()
        # Param all-gather tail of DistributedOptimizer.step_with_ready_grads (megatron-core 0.19.2). With
        # overlap_param_gather the next zero_grad / forward pre-hook launches the all-gathers instead.
        if not opt.ddp_config.overlap_param_gather and not getattr(opt, "_defer_param_sync", False):
            opt.start_param_sync_for_bucket_group_subset()
        return True

    def reload_model_params(state_dict=None) -> None:
        if state_dict is not None:
            raise StoreConfigError("with streamed optimizer state, mains are refreshed from the model params only; "
                                   "load the weights into the model, then call reload_model_params()")
        store.refresh_main_from_model_params()

    opt.step_with_ready_grads = step_with_ready_grads
    opt.reload_model_params = reload_model_params
    opt._copy_model_params_to_main_params = reload_model_params
    opt.sharded_state_dict = lambda *args, **kwargs: {}
    bind_common(opt, store)
    return store


class StoreGroup:
    """The stores of a ChainedOptimizer's members (one per non-stub member), driven as one: the store's
    public methods, each applied to every member's store in chain order."""

    def __init__(self, stores: list[NVMeOptimizerStateStore]):
        self.stores = list(stores)

    @classmethod
    def of(cls, bound) -> "StoreGroup":
        """What `stream_optimizer_state` returned (a store, or a chain's group), as a group."""
        return bound if isinstance(bound, cls) else cls([bound])

    def step(self):
        return [s.step() for s in self.stores]

    def prefetch(self) -> int:
        return sum(s.prefetch() for s in self.stores)

    def release_device(self) -> None:
        for s in self.stores:
            s.release_device()

    def flush(self) -> None:
        for s in self.stores:
            s.flush()

    def refresh_main_from_model_params(self) -> None:
        for s in self.stores:
            s.refresh_main_from_model_params()

    @property
    def mains_in_host_ram(self) -> bool:
        return all(s.mains_in_host_ram for s in self.stores)

    def publish_mains(self) -> int:
        return sum(s.publish_mains() for s in self.stores)

    def save_to(self, checkpoint_base: str, wait: bool = True) -> None:
        for s in self.stores:
            s.save_to(checkpoint_base, wait=wait)

    def wait_for_save(self) -> dict | None:
        done = [d for d in (s.wait_for_save() for s in self.stores) if d]
        return {"stores": done} if done else None

    def load_from(self, checkpoint_base: str) -> bool:
        return all([s.load_from(checkpoint_base) for s in self.stores])  # a list: every store loads

    @property
    def stats(self):
        return [s.stats for s in self.stores]

    def close(self) -> None:
        for s in self.stores:
            s.close()


def bind_megatron(optimizer, config: StreamConfig, instance: int | None = None):
    """Bind a DistributedOptimizer (returns its store) or a ChainedOptimizer (returns a StoreGroup).

    Store identity (layout.store_identity): `instance` is the member's distributed_optimizer_instance_id
    unless the caller gives one; `part` its index in the chain (0 for a lone DistributedOptimizer), stub
    members included, so a member's directory does not depend on which other members hold params."""
    members = getattr(optimizer, "chained_optimizers", None)
    if members is None:
        members = [optimizer]
    stores = []
    try:
        for part, member in enumerate(members):
            if not _is_distributed_optimizer(member):
                raise StoreConfigError(f"cannot stream the state of {type(member).__name__}: only megatron-core's "
                                       "DistributedOptimizer (use_distributed_optimizer=True) is supported")
            if member.is_stub_optimizer:
                continue
            own = member.distributed_optimizer_instance_id if instance is None else instance
            stores.append(_bind_distributed(member, config, instance=own, part=part))
    except BaseException:
        for store in stores:  # members bound before the failure: their I/O threads and files go too
            store.close()
        raise
    if hasattr(optimizer, "chained_optimizers"):
        group = StoreGroup(stores)
        optimizer._nvme_state_store = group
        optimizer.state_dict = lambda: [state_marker(s) for s in stores]
        optimizer.sharded_state_dict = lambda *args, **kwargs: {}
        optimizer.load_state_dict = lambda state_dict: None
        return group
    if not stores:
        raise StoreConfigError("this DistributedOptimizer is a stub (no trainable params on this rank): "
                               "there is no state to stream")
    return stores[0]
