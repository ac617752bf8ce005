"""Replaying recorded routes in a training forward (the trainer's side of R3), and measuring how far the
trainer's own routing is from them.

    with RouteReplay(model, [s.routes for s in samples], batch["attention_mask"]) as replay:
        logprobs = forward_logprobs(model, batch["input_ids"], batch["attention_mask"])
        loss.backward()                     # inside too when layers are recomputed (activation checkpointing)
    replay.mismatch_shares()                # per MoE layer: share of replayed tokens the router would route elsewhere

Inside the context every MoE layer of ``model`` runs each token a route covers on the recorded experts; the
gate weights are the family's own function of the trainer's router logits over those experts
(:meth:`miles.routing.routers.GateRule.weights`: softmax or sigmoid, renormalisation, scaling), so gradients
reach the router as in upstream miles' R3. Tokens no route covers (padding, a sample's last token when its
route stops before it, rows whose route is None) keep the router's own choice and weights.

``force=False`` is the compare mode: the forward is the model's own, and :meth:`RouteReplay.mismatch_shares`
says per layer which share of the covered tokens' natural top-k set differs from the recorded one.

Rows are those of ``attention_mask`` ``[B, T]`` (right- or left-padded: the i-th real token of row b is
token i of ``routes[b]``); every forward inside the context must be over that ``[B, T]`` grid, whole (one
forward per micro-batch, each with its own context).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from miles.routing.routers import find_routers, sites_shape
from miles.routing.routes import Routes, RouteShape, check_id_range

__all__ = ["RouteReplay", "route_grid"]


def route_grid(routes: Sequence[Optional[Routes]], valid: torch.Tensor,
               shape: RouteShape) -> tuple[torch.Tensor, torch.Tensor]:
    """The recorded ids of a batch's rows on its grid ``valid`` ``[B, T]`` (True: a real token; the i-th real
    token of row b is token i of ``routes[b]``, each checked to fit ``shape``), ``[B * T, layers, top_k]`` int64
    (0 where no route covers), and which grid tokens a route covers ``[B * T]``."""
    rows, length = valid.shape
    ids = torch.zeros((rows, length, shape.layers, shape.top_k), dtype=torch.long, device=valid.device)
    covered = torch.zeros((rows, length), dtype=torch.bool, device=valid.device)
    for row, route in enumerate(routes):
        if route is None:
            continue
        positions = valid[row].nonzero().squeeze(-1)
        route.check_fit(shape, len(positions))
        positions = positions[:route.tokens]
        ids[row, positions] = route.expert_ids(valid.device)
        covered[row, positions] = True
    check_id_range(int(ids.min()), int(ids.max()), shape)  # one check for the batch (and one host sync)
    return ids.view(rows * length, shape.layers, shape.top_k), covered.view(rows * length)


class RouteReplay:
    """Forces (or with ``force=False`` only compares to) recorded routes in the forwards inside it; see the
    module docstring."""

    def __init__(self, model: torch.nn.Module, routes: Sequence[Optional[Routes]], attention_mask: torch.Tensor,
                 force: bool = True):
        self.sites = find_routers(model)
        if not self.sites:
            raise ValueError(f"route replay needs an MoE model; {type(model).__name__} has no MoE router")
        self.shape = sites_shape(self.sites)
        self.force = force
        rows, length = attention_mask.shape
        if len(routes) != rows:
            raise ValueError(f"route replay: {len(routes)} routes for a batch of {rows} rows; pass one per row "
                             "(None for a row without)")
        self.tokens = rows * length
        self._ids, self._covered = route_grid(routes, attention_mask.bool(), self.shape)
        self._differ = torch.zeros(len(self.sites), dtype=torch.long, device=attention_mask.device)
        self._seen = torch.zeros(len(self.sites), dtype=torch.long, device=attention_mask.device)
        self._handles: list = []

    def __enter__(self) -> "RouteReplay":
        self._handles = [site.module.register_forward_hook(self._hook(site)) for site in self.sites]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, site):
        def replay(module, args, output):
            logits, _, natural = output
            if natural.shape[0] != self.tokens:
                raise RuntimeError(f"route replay: MoE layer {site.layer} ({site.name}) routed {natural.shape[0]} "
                                   f"tokens; the replay was prepared for a [B, T] grid of {self.tokens}: run one "
                                   "whole forward per context")
            recorded = self._ids[:, site.layer]
            with torch.no_grad():
                same = (natural.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
                self._differ[site.layer] += (self._covered & ~same).sum()
                self._seen[site.layer] += self._covered.sum()
            if not self.force:
                return None
            chosen = torch.where(self._covered[:, None], recorded, natural)
            return logits, site.rule.weights(logits, chosen), chosen
        return replay

    def mismatch_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per MoE layer (model order), on the device: the covered tokens whose natural top-k set differed from
        the recorded one, and the covered tokens, over the forwards inside the context so far (no host sync)."""
        return self._differ.clone(), self._seen.clone()

    def mismatch_shares(self) -> list[float]:
        """Per MoE layer (model order), the share of covered tokens whose natural top-k set differed from the
        recorded one, over the forwards inside the context (0.0 for a layer that saw none); one host sync."""
        shares = self._differ.double() / self._seen.clamp(min=1).double()
        return shares.tolist()
