"""Bindings for torch optimizers: plain Adam/AdamW, and the torch backend's ZeRO-1 sharded Adam.

Binding is in place: `optimizer.step()` streams afterwards, and the store is reachable as
`optimizer._nvme_state_store`. Identity (layout.store_identity): `instance` (0 unless the caller gives
another), part 0. The bucket files are the state, so `state_dict()` returns a marker and
`load_state_dict()` does nothing; checkpoints go through `store.save_to` / `store.load_from`.
"""

from __future__ import annotations

import torch

from ..bucket import StreamEntry
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


def _state_marker(store: NVMeOptimizerStateStore) -> dict:
    return {"nvme_stream": {"relative_dir": store.relative_dir,
                            "note": "optimizer state lives in bucket files; use store.save_to / store.load_from"}}


def _bind_common(optimizer, store: NVMeOptimizerStateStore) -> None:
    optimizer.state_dict = lambda: _state_marker(store)
    optimizer.load_state_dict = lambda state_dict: None
    optimizer._nvme_state_store = store


def bind_plain_adam(optimizer: torch.optim.Optimizer, config: StreamConfig, instance: int = 0) -> NVMeOptimizerStateStore:
    """fp32 params are their own masters: only the moments stream; the params stay where they are."""
    check_adam_family(optimizer)
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

    def step(closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        store.step()
        return loss

    optimizer.step = step
    _bind_common(optimizer, store)
    return store


def bind_sharded_adam(optimizer, config: StreamConfig, instance: int = 0) -> NVMeOptimizerStateStore:
    """ZeRO-1 sharded mixed precision: the fp32 master shards stream; updates publish into the model."""
    check_adam_family(optimizer.inner)
    entries = [StreamEntry(main=s.master, group=s.group, model_view=s.model_view, name=f"param{s.index}",
                           start=s.start, full_numel=s.param.numel()) for s in optimizer.shards]
    # A rank holds shards of some params only; a checkpoint must cover all of them (every rank's part)
    model_params = {f"param{i}": p.numel() for i, p in enumerate(optimizer.params)}
    store = NVMeOptimizerStateStore(entries, optimizer.inner, config, instance=instance, model_params=model_params)
    optimizer.update = store.step
    optimizer.reload_model_params = store.refresh_main_from_model_params
    _bind_common(optimizer, store)
    return store
