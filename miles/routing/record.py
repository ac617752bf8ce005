"""Recording the experts a model's routers choose, forward by forward (the rollout engine's side of R3).

    recorder = RouteRecorder(model)         # forward hooks on every MoE router
    model(...)                              # any forward: prefill, one decode step
    ids = recorder.take()                   # [N, layers, top_k] on the model's device, compact dtype
    recorder.close()

``N`` is the forward's batch x sequence tokens, row-major, as the routers see them. Each router's hook keeps a
reference to its last output's ids (no copy, no host sync); :meth:`RouteRecorder.take` stacks them in the
compact dtype and forgets them, so a recorder holds one forward's ids at most.

CUDA graphs: hooks run while a forward is captured, not when the graph replays. The ids a captured forward's
hooks kept (:meth:`RouteRecorder.last_outputs`) are the graph's own output tensors, rewritten by every replay
(as its logits are); after a replay the decoder hands them back (:meth:`RouteRecorder.set_outputs`) and
:meth:`RouteRecorder.take` reads that step's ids.
"""

from __future__ import annotations

from typing import Optional

import torch

from miles.routing.routers import find_routers, sites_shape
from miles.routing.routes import id_dtype

__all__ = ["RouteRecorder"]

_TORCH_ID_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class RouteRecorder:
    """Keeps the expert ids every MoE router of ``model`` chose in its last forward (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.sites = find_routers(model)
        if not self.sites:
            raise ValueError(f"recording routes needs an MoE model; {type(model).__name__} has no MoE router "
                             "(leave route recording off for dense models)")
        self.shape = sites_shape(self.sites)
        self.dtype = _TORCH_ID_DTYPES[id_dtype(self.shape.num_experts).itemsize]
        self._last: list[Optional[torch.Tensor]] = [None] * len(self.sites)
        self._handles = [site.module.register_forward_hook(self._hook(site.layer)) for site in self.sites]

    def _hook(self, layer: int):
        def keep(module, args, output):
            self._last[layer] = output[2]
        return keep

    def last_outputs(self) -> list[Optional[torch.Tensor]]:
        """The references the hooks kept in the last forward, per MoE layer."""
        return list(self._last)

    def set_outputs(self, ids: list[Optional[torch.Tensor]]) -> None:
        """Take ``ids`` (what :meth:`last_outputs` gave after a CUDA graph's capture) as the last forward's:
        the replay of that graph rewrote them without running the hooks."""
        self._last = list(ids)

    def take(self) -> torch.Tensor:
        """The ids ``[N, layers, top_k]`` (compact dtype) of the forward since the last take."""
        missing = [i for i, ids in enumerate(self._last) if ids is None]
        if missing:
            raise RuntimeError(f"route recorder: MoE layers {missing[:5]} did not route since the last take; take "
                               "once after each forward")
        lengths = {ids.shape[0] for ids in self._last}
        if len(lengths) > 1:
            raise RuntimeError(f"route recorder: the MoE layers routed different token counts {sorted(lengths)} in "
                               "one forward; take once after each forward")
        ids = torch.stack([ids.to(self.dtype) for ids in self._last], dim=1)
        self._last = [None] * len(self.sites)
        return ids

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._last = [None] * len(self.sites)
