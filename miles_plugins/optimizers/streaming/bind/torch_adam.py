"""Bindings for torch optimizers: plain Adam/AdamW, and the torch backend's ZeRO-1 sharded Adam.

Binding is in place: `optimizer.step()` streams afterwards, and the store is reachable as
`optimizer._nvme_state_store`. Identity (layout.store_identity): `instance` (0 unless the caller gives
another), part 0. The bucket files are the state, so `state_dict()` returns a marker, and
`load_state_dict()` accepts only that marker (nothing to load) and refuses any other state;
checkpoints go through `store.save_to` / `store.load_from`.

The streamed step runs torch's step hooks (global and the optimizer's own) once around the whole step,
as `torch.optim` does, through `torch.optim.Optimizer.profile_hook_step`; it is a bound method, so an
LR scheduler can wrap it. The sharded optimizer's streamed `update` runs its inner optimizer's hooks,
as the inner's own step would.
"""

from __future__ import annotations

import types

import torch

from ..bucket import StreamEntry, storage_identity
from ..config import StreamConfig
from ..errors import StoreConfigError
from ..store import NVMeOptimizerStateStore

_ADAM_CLASS_NAMES = {"Adam", "AdamW", "FusedAdam"}  # torch, and TE / apex FusedAdam


def check_adam_family(optimizer) -> None:
    cls = type(optimizer)
    is_adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or cls.__name__ in _ADAM_CLASS_NAMES
    if not is_adam:
        raise StoreConfigError(
            f"{cls.__module__}.{cls.__name__} is not an Adam optimizer; the store streams Adam's fp32 masters and "
            "moments (exp_avg, exp_avg_sq): use torch.optim.Adam or AdamW")
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise StoreConfigError("amsgrad=True keeps a third moment the store does not stream; set amsgrad=False")
    if any(optimizer.state.values()):
        raise StoreConfigError("the optimizer already holds state; bind the store before the first optimizer step")


def check_distinct_params(params: list[torch.Tensor]) -> None:
    """Each param once, and no two over the same memory: the store steps (and publishes) bucket by bucket,
    so two params over the same bytes would see each other's update in an order resident Adam does not
    use. Params viewing disjoint parts of one storage are fine."""
    first_index: dict[int, int] = {}
    for i, p in enumerate(params):
        if id(p) in first_index:
            raise StoreConfigError(
                f"param {first_index[id(p)]} (shape {tuple(p.shape)}) is listed more than once in the optimizer's "
                f"param groups (again as param {i}); list every param in exactly one group, once")
        first_index[id(p)] = i
    extents = []  # (storage, first byte, end byte, param index)
    for i, p in enumerate(params):
        if p.numel():
            storage, offset = storage_identity(p)
            extents.append((storage, offset * p.element_size(), (offset + p.numel()) * p.element_size(), i))
    extents.sort()  # any overlap then shows between neighbours
    for (storage, _, stop, i), (next_storage, next_start, _, j) in zip(extents, extents[1:]):
        if storage == next_storage and next_start < stop:
            i, j = sorted((i, j))
            raise StoreConfigError(
                f"params {i} and {j} share memory (shapes {tuple(params[i].shape)} and {tuple(params[j].shape)}, "
                "overlapping parts of one storage: tied weights as two Parameters); the store would update the "
                "same bytes twice, bucket by bucket. Give the optimizer each tied weight once")


def state_marker(store: NVMeOptimizerStateStore) -> dict:
    return {"nvme_stream": {"relative_dir": store.relative_dir,
                            "note": "optimizer state lives in bucket files; use store.save_to / store.load_from"}}


def bind_common(optimizer, store: NVMeOptimizerStateStore) -> None:
    optimizer.state_dict = lambda: state_marker(store)
    optimizer.load_state_dict = lambda state_dict: None
    optimizer._nvme_state_store = store


def _bind_torch(optimizer, store: NVMeOptimizerStateStore) -> None:
    """`bind_common`, and `load_state_dict` loads only this store's own marker (nothing to load): any
    other state dict would be ignored while the bucket files keep their state."""
    bind_common(optimizer, store)

    def load_state_dict(state_dict) -> None:
        if state_dict == state_marker(store):
            return
        found = f"keys {list(state_dict)[:5]}" if isinstance(state_dict, dict) else type(state_dict).__name__
        raise StoreConfigError(
            f"load_state_dict() got an optimizer state ({found}), but this optimizer's state lives in the bucket "
            f"files of store {store.relative_dir}; load a checkpoint with store.load_from(<checkpoint>) (after the "
            "model weights), or load this state dict into an optimizer that is not streamed")

    optimizer.load_state_dict = load_state_dict


def _hooked(step):
    """`step(optimizer, ...)` wrapped to run torch's step hooks around it, exactly as torch.optim does."""
    return torch.optim.Optimizer.profile_hook_step(step)


def bind_plain_adam(optimizer: torch.optim.Optimizer, config: StreamConfig, instance: int = 0) -> NVMeOptimizerStateStore:
    """fp32 params are their own masters: only the moments stream; the params stay where they are."""
    check_adam_family(optimizer)
    check_distinct_params([p for group in optimizer.param_groups for p in group["params"]])
    entries = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:  # identity: the param's position in group order (checkpoints)
            if p.dtype != torch.float32:
                raise StoreConfigError(
                    f"param of shape {tuple(p.shape)} is {p.dtype}; a plain Adam streams fp32 params only. For "
                    "low-precision params use miles' ShardedMixedPrecisionAdam (fp32 masters) and stream that")
            entries.append(StreamEntry(main=p, group=g, name=f"param{len(entries)}"))
    store = NVMeOptimizerStateStore(entries, optimizer, config, instance=instance,
                                    model_params={e.name: e.main.numel() for e in entries})

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        store.step()
        return loss

    optimizer.step = types.MethodType(_hooked(step), optimizer)
    _bind_torch(optimizer, store)
    return store


def bind_sharded_adam(optimizer, config: StreamConfig, instance: int = 0) -> NVMeOptimizerStateStore:
    """ZeRO-1 sharded mixed precision: the fp32 master shards stream; updates publish into the model."""
    check_adam_family(optimizer.inner)
    check_distinct_params(optimizer.params)
    entries = [StreamEntry(main=s.master, group=s.group, model_view=s.model_view, name=f"param{s.index}",
                           start=s.start, full_numel=s.param.numel()) for s in optimizer.shards]
    # A rank holds shards of some params only; a checkpoint must cover all of them (every rank's part)
    model_params = {f"param{i}": p.numel() for i, p in enumerate(optimizer.params)}
    store = NVMeOptimizerStateStore(entries, optimizer.inner, config, instance=instance, model_params=model_params)

    def check_model_storage() -> None:
        """The store publishes into (and refreshes from) the storage the params had at binding."""
        for shard, entry in zip(optimizer.shards, entries):
            if storage_identity(shard.model_view) != storage_identity(entry.model_view):
                raise StoreConfigError(
                    f"param {shard.index} (shape {tuple(shard.param.shape)}) of the streamed optimizer was given "
                    "new storage after the store was bound (param.data replaced); the store publishes into the "
                    "storage it was bound to. Copy new values in place (param.data.copy_(...)) instead")

    def update() -> None:
        check_model_storage()
        streamed_update(optimizer.inner)

    def reload_model_params() -> None:
        check_model_storage()
        store.refresh_main_from_model_params()

    def inner_step(inner) -> None:
        store.step()

    streamed_update = _hooked(inner_step)
    optimizer.update = update
    optimizer.reload_model_params = reload_model_params
    _bind_torch(optimizer, store)
    return store
