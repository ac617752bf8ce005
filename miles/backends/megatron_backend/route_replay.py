"""R3 on the megatron backend: recorded routes replayed through megatron-core's ``RouterReplay``.

megatron-core's router asks its ``router_replay`` object for each forward's top-k
(``RouterReplay.get_replay_topk``); under ``REPLAY_FORWARD`` it returns the target indices set for that layer and
gathers their scores, which ``topk_routing_with_score_function`` then turns into gate weights as for its own choice
(the softmax over the chosen logits, or the chosen sigmoids renormalised and scaled): the weights come from the
trainer's own router logits, and gradients reach the router. :func:`install` gives every ``TopKRouter`` of the
model a ``CountingReplay`` (:func:`counting_replay`), a ``RouterReplay`` that also counts the covered tokens whose own top-k set (what
the router would have chosen, its expert bias included) differs from the replayed one.

Token order. The model runs a micro-batch ``[B, L]`` right-padded (under sequence parallelism, padded further to
a multiple of TP: ``model_parallel.pad_sequence``); a router sees the hidden states sequence-first, ``[L, B]``
flattened (token ``s * B + b``), and under sequence parallelism only this TP rank's slice of the sequence
(``L / TP`` positions from ``tp_rank * L / TP``). Tokens no route covers (padding, a sample's last token) are
replayed on experts ``0 .. top_k - 1``: causal attention keeps them out of every covered token, and no loss reads
their outputs. Each rank of an expert-parallel group routes its own micro-batch, so nothing else changes under EP.
Pipeline stages: a stage holds some MoE layers (its routers' ``layer_number`` places them among the policy's MoE
layers); each micro-batch's forward runs inside its own context (pipeline.py), and the backward re-runs no router
(no activation recomputation), so the schedule's interleaving needs nothing more.

megatron-core is imported inside the functions, as in the backend's other modules (this one imports on any machine).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from miles.routing.replay import route_grid
from miles.routing.routes import Routes, RouteShape

__all__ = ["counting_replay", "MegatronRouteReplay", "install", "sequence_first_targets"]


def install(gpt: torch.nn.Module, moe_decoder_layers: Sequence[int]) -> dict:
    """Give every ``TopKRouter`` of ``gpt`` (this pipeline stage's) a :func:`counting_replay`; returns them by
    route layer: the position of the router's decoder layer (megatron's 1-based ``layer_number``, counted over
    all stages) in ``moe_decoder_layers`` (the 0-based decoder layer of each MoE layer, route order). Megatron's
    global list of replay instances is reset to these."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    replays = {}
    for module in gpt.modules():
        if isinstance(module, TopKRouter):
            if module.layer_number - 1 not in moe_decoder_layers:
                raise ValueError(f"route replay: megatron's router of decoder layer {module.layer_number - 1} is not "
                                 f"one of the policy's MoE layers {list(moe_decoder_layers)[:8]}")
            replay = counting_replay()()
            replay.layer_number = module.layer_number
            module.router_replay = replay
            replays[list(moe_decoder_layers).index(module.layer_number - 1)] = replay
    return replays


@functools.cache
def counting_replay() -> type:
    """``CountingReplay``: megatron-core's ``RouterReplay``, counting under ``REPLAY_FORWARD`` the covered tokens
    whose own top-k set differs from the replayed one (``differ``, ``seen``: 0-d tensors on the device, set by
    :class:`MegatronRouteReplay`); the class is made on first use (megatron-core imported inside)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class CountingReplay(RouterReplay):
        def __init__(self):
            super().__init__()
            self.covered: Optional[torch.Tensor] = None
            self.differ: Optional[torch.Tensor] = None
            self.seen: Optional[torch.Tensor] = None

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                with torch.no_grad():
                    _, natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                    target = self.target_topk_idx.to(natural.device)
                    same = (natural.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1)
                    self.differ += (self.covered & ~same).sum()
                    self.seen += self.covered.sum()
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

    return CountingReplay


def sequence_first_targets(ids: torch.Tensor, covered: torch.Tensor, rows: int, length: int, padded_length: int,
                           shape: RouteShape, tp: int, tp_rank: int, sequence_parallel: bool
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The replay targets ``[N, layers, top_k]`` and covered mask ``[N]`` in the order this rank's routers see
    the tokens (module docstring), from :func:`~miles.routing.replay.route_grid`'s row-major ``[B * L]`` grid;
    uncovered tokens take experts ``0 .. top_k - 1``."""
    ids = ids.view(rows, length, shape.layers, shape.top_k)
    covered = covered.view(rows, length)
    filler = torch.arange(shape.top_k, device=ids.device)
    ids = torch.where(covered[..., None, None], ids, filler)
    pad = padded_length - length
    if pad:
        ids = torch.cat([ids, filler.expand(rows, pad, shape.layers, shape.top_k)], dim=1)
        covered = torch.nn.functional.pad(covered, (0, pad), value=False)
    ids, covered = ids.transpose(0, 1), covered.transpose(0, 1)  # [L, B, ...]: megatron's sequence-first order
    if sequence_parallel:
        width = padded_length // tp
        ids, covered = ids[tp_rank * width:(tp_rank + 1) * width], covered[tp_rank * width:(tp_rank + 1) * width]
    return ids.reshape(-1, shape.layers, shape.top_k), covered.reshape(-1)


class MegatronRouteReplay:
    """The context in which this rank's forward of a ``[B, L]`` micro-batch runs its routers on ``routes`` (one
    per row) through ``replays`` (:func:`install`'s: this stage's, by route layer). ``padded_length``: the
    sequence length the model runs (L, or L padded to a multiple of TP under sequence parallelism)."""

    def __init__(self, replays: dict, routes: Sequence[Routes], attention_mask: torch.Tensor, *, padded_length: int,
                 tp: int, tp_rank: int, sequence_parallel: bool, tp_group=None):
        shape = routes[0].shape
        if replays and max(replays) >= shape.layers:  # a stage of dense layers alone has none
            raise ValueError(f"route replay: the megatron model routes MoE layer {max(replays)}, the routes have "
                             f"{shape.layers} MoE layers ({shape}): were they recorded with another model?")
        self.layers = shape.layers
        rows, length = attention_mask.shape
        ids, covered = route_grid(routes, attention_mask.bool(), shape)
        self.ids, self.covered = sequence_first_targets(ids, covered, rows, length, padded_length, shape, tp, tp_rank,
                                                        sequence_parallel)
        self.replays = replays
        # under sequence parallelism each TP rank counts its slice: summed over TP, as the loss's statistics are whole
        self.count_group = tp_group if sequence_parallel and tp > 1 else None

    def __enter__(self) -> "MegatronRouteReplay":
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        zero = torch.zeros((), dtype=torch.long, device=self.ids.device)
        for layer, replay in self.replays.items():
            replay.set_target_indices(self.ids[:, layer])
            replay.covered, replay.differ, replay.seen = self.covered, zero.clone(), zero.clone()
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return self

    def __exit__(self, *exc) -> None:
        for replay in self.replays.values():
            replay.clear_router_replay_action()
            replay.clear_indices()
            replay.covered = None

    def mismatch_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per MoE layer: the covered tokens whose own top-k set differed from the replayed one, and the covered
        tokens (this TP group's whole micro-batch), as :meth:`miles.routing.replay.RouteReplay.mismatch_counts`;
        0 for the layers of other pipeline stages (summed over the stages, each layer counts once)."""
        counts = torch.zeros((2, self.layers), dtype=torch.long, device=self.ids.device)
        for layer, replay in self.replays.items():
            counts[0, layer], counts[1, layer] = replay.differ, replay.seen
        if self.count_group is not None:
            dist.all_reduce(counts, group=self.count_group)
        return counts[0], counts[1]
