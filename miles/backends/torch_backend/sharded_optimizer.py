"""ZeRO-1 sharded mixed-precision Adam for the torch backend.

Why: Adam needs 12 B/param of fp32 state (master + two moments). Every data-parallel rank keeps the
full low-precision model params (forward/backward need them), but only 1/world of that state.

Layout: all params, flattened and concatenated in group order, form one virtual 1-D space of
`numel` elements, padded to `dp_world_size * shard_numel`. Rank r owns the contiguous range
`[r * shard_numel, (r + 1) * shard_numel)`. Each param intersecting it gets one `MasterShard`: a
separate fp32 1-D tensor (its own storage, so a disk store can release masters one by one) that is
a param of `inner`, the user's Adam class; inner group i mirrors user group i.

Grad rule: grads are averaged in fp32 over the data-parallel group (sum, then divide by the world
size). A rank whose param has `grad is None` contributes zeros; a param whose grad is None on every
rank gets `master.grad = None`, so Adam skips it exactly as plain torch would.

The disk-streaming store binds by replacing `update` and `reload_model_params` on the instance
(docs/dev/contracts.md), which is why `step()` calls `self.update()` instead of inlining it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["MasterShard", "ShardedMixedPrecisionAdam"]

# torch 2.13 renamed the tensor collectives; older torch only has the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(eq=False)
class MasterShard:
    """This rank's part `[start, stop)` of `param.view(-1)`, with its fp32 master copy."""

    param: torch.Tensor
    master: torch.Tensor  # fp32, 1-D, stop - start elements; a param of `inner`
    group: int  # index of the user's (and inner's) param group
    start: int
    stop: int
    index: int  # position of `param` in the flattened group order
    local_offset: int  # where this range sits inside the rank's reduced-grad slice

    @property
    def model_view(self) -> torch.Tensor:
        """Where updated masters are published. Recomputed on access, so it follows `param.data`
        even if the model's weights are swapped for new tensors."""
        return self.param.data.view(-1)[self.start : self.stop]


def _fail(what: str, value, todo: str):
    raise ValueError(f"ShardedMixedPrecisionAdam: {what} (got {value!r}). {todo}")


class ShardedMixedPrecisionAdam:
    """ZeRO-1 Adam: full low-precision params on every rank, fp32 masters/moments sharded."""

    def __init__(self, params, lr=None, betas=None, eps=None, weight_decay=None, *,
                 optimizer_cls=torch.optim.AdamW, process_group=None, **optimizer_kwargs):
        # None means "the optimizer class's own default", so the inner keeps torch's semantics.
        defaults = {k: v for k, v in dict(lr=lr, betas=betas, eps=eps,
                                          weight_decay=weight_decay).items() if v is not None}
        defaults.update(optimizer_kwargs)
        groups = self._normalize_groups(params)
        self._params = [p for g in groups for p in g["params"]]
        self._validate(optimizer_cls, defaults, groups)

        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.process_group = process_group
        grouped = process_group is not None
        self.dp_world_size = dist.get_world_size(process_group) if grouped else 1
        self.dp_rank = dist.get_rank(process_group) if grouped else 0
        # gloo's reduce_scatter works but measured ~3x slower than all_reduce + slicing (torch 2.13).
        self._use_reduce_scatter = grouped and dist.get_backend(process_group) != "gloo"
        self._device = self._params[0].device

        # Layout: segments[r] lists (param index, start, stop, local offset) for rank r.
        world = self.dp_world_size
        self.numel = sum(p.numel() for p in self._params)
        self.shard_numel = max(1, math.ceil(self.numel / world))
        self._offsets, self._segments, offset = [], [[] for _ in range(world)], 0
        for idx, p in enumerate(self._params):
            self._offsets.append(offset)
            end = offset + p.numel()
            for r in range(offset // self.shard_numel, min(world, -(-end // self.shard_numel))):
                lo, hi = max(offset, r * self.shard_numel), min(end, (r + 1) * self.shard_numel)
                if lo < hi:
                    self._segments[r].append((idx, lo - offset, hi - offset, lo - r * self.shard_numel))
            offset = end
        # gather_params moves raw bytes; every rank's send buffer is padded to the largest one.
        self._gather_nbytes = max(
            sum((b - a) * self._params[i].element_size() for i, a, b, _ in segs) for segs in self._segments)

        group_of = [gi for gi, g in enumerate(groups) for _ in g["params"]]
        with torch.no_grad():
            self.shards = [
                MasterShard(param=self._params[i], group=group_of[i], start=a, stop=b, index=i,
                            local_offset=off,
                            master=self._params[i].data.view(-1)[a:b].to(torch.float32, copy=True))
                for i, a, b, off in self._segments[self.dp_rank]]
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [s.master for s in self.shards if s.group == gi]}
                        for gi, g in enumerate(groups)]
        self.inner = optimizer_cls(inner_groups, **defaults)

    # ----------------------------------------------------------------- construction helpers
    @staticmethod
    def _normalize_groups(params):
        if isinstance(params, torch.Tensor):
            _fail("params must be an iterable of tensors or of param-group dicts, not a tensor",
                  tuple(params.shape), "Pass model.parameters() or [{'params': [...]}, ...].")
        params = list(params)
        if params and not isinstance(params[0], dict):
            params = [{"params": params}]
        groups = []
        for g in params:
            g = dict(g)
            ps = g.get("params", [])
            g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            groups.append(g)
        if not any(g["params"] for g in groups):
            _fail("empty parameter list", params,
                  "Pass the params to train, e.g. model.parameters(); a frozen model has nothing to optimize.")
        return groups

    def _validate(self, optimizer_cls, defaults, groups):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, (torch.optim.Adam, torch.optim.AdamW))):
            _fail("optimizer_cls is not an Adam-family torch optimizer", optimizer_cls,
                  "Use torch.optim.AdamW or torch.optim.Adam (or a subclass): the sharded state and the "
                  "disk-streaming store implement Adam math only.")
        if defaults.get("amsgrad") or any(g.get("amsgrad") for g in groups):
            _fail("amsgrad is not supported", True,
                  "Drop amsgrad=True: its extra max_exp_avg_sq state is neither sharded nor streamed.")
        devices = sorted({str(p.device) for p in self._params})
        if len(devices) > 1:
            _fail("params live on more than one device", devices,
                  "Move the whole model to one device (model.to(device)) before building the optimizer.")
        seen = set()
        for i, p in enumerate(self._params):
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                _fail(f"param #{i} has dtype {p.dtype}; only fp32/bf16/fp16 params are supported", p.dtype,
                      "Keep fp8/integer tensors out of the optimizer (or train them in bf16).")
            if not p.is_contiguous():
                _fail(f"param #{i} is not contiguous (shape {tuple(p.shape)}, strides {p.stride()})",
                      p.stride(), "Make it contiguous (param.data = param.data.contiguous()) first.")
            if id(p) in seen:
                _fail(f"param #{i} appears more than once", tuple(p.shape),
                      "List every param in exactly one group (tied weights once).")
            seen.add(id(p))

    # ----------------------------------------------------------------- torch.optim-like surface
    @property
    def params(self) -> list[torch.Tensor]:
        """Every param this optimizer trains, on all ranks together (the model's, not this rank's
        shards), in the flattened group order `MasterShard.index` counts in."""
        return list(self._params)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def defaults(self):
        return self.inner.defaults

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True):
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()
        for s in self.shards:  # views of a per-step buffer: always dropped, never kept around
            s.master.grad = None

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_grads()
        self.update()  # may be replaced on the instance by the disk-streaming store
        self.gather_params()
        return loss

    # ----------------------------------------------------------------- the three phases
    @torch.no_grad()
    def reduce_grads(self):
        """Average model grads over the DP group in fp32; this rank's slice -> `master.grad`.

        The masters' grads are views into one fp32 buffer of `shard_numel` elements (valid until
        the next `reduce_grads` / `zero_grad`); do not resize their storage."""
        world, n = self.dp_world_size, self.shard_numel
        flat = torch.empty(world * n, dtype=torch.float32, device=self._device)
        present = []
        for p, off in zip(self._params, self._offsets):
            dst = flat[off : off + p.numel()]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.reshape(-1))
            present.append(p.grad is not None)
        flat[self.numel :].zero_()
        if world > 1:
            flags = torch.tensor(present, dtype=torch.int32, device=self._device)
            dist.all_reduce(flags, group=self.process_group)
            present = [bool(f) for f in flags.tolist()]
            if self._use_reduce_scatter:
                local = torch.empty(n, dtype=torch.float32, device=self._device)
                _reduce_scatter(local, flat, group=self.process_group)
            else:
                dist.all_reduce(flat, group=self.process_group)
                local = flat[self.dp_rank * n : (self.dp_rank + 1) * n].clone()  # frees `flat`
            local.div_(world)
        else:
            local = flat
        for s in self.shards:
            s.master.grad = local[s.local_offset : s.local_offset + s.stop - s.start] if present[s.index] else None

    @torch.no_grad()
    def update(self):
        """Adam over this rank's masters, then publish them into the model params (cast on device)."""
        self.inner.step()
        for s in self.shards:
            s.model_view.copy_(s.master)

    @torch.no_grad()
    def gather_params(self):
        """All-gather every rank's published slices, so each rank ends with the full params.

        One collective over a byte buffer covers mixed param dtypes (e.g. an fp32 router bias)."""
        world, nbytes = self.dp_world_size, self._gather_nbytes
        if world == 1:
            return
        send = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        pos = 0
        for s in self.shards:
            v = s.model_view.view(torch.uint8)
            send[pos : pos + v.numel()].copy_(v)
            pos += v.numel()
        recv = torch.empty(world * nbytes, dtype=torch.uint8, device=self._device)
        _all_gather(recv, send, group=self.process_group)
        for r, segs in enumerate(self._segments):
            if r == self.dp_rank:
                continue
            pos = r * nbytes
            for i, a, b, _ in segs:
                v = self._params[i].data.view(-1)[a:b].view(torch.uint8)
                v.copy_(recv[pos : pos + v.numel()])
                pos += v.numel()

    @torch.no_grad()
    def reload_model_params(self):
        """masters <- model params, after new weights were loaded into the model (every rank holds
        the full params, so this is local). Replaced on the instance by the disk-streaming store."""
        for s in self.shards:
            s.master.copy_(s.model_view)

    # ----------------------------------------------------------------- checkpointing
    def _layout(self):
        return {"dp_world_size": self.dp_world_size, "dp_rank": self.dp_rank, "numel": self.numel}

    def state_dict(self):
        """This rank's masters and Adam state (per-rank: each rank saves its own)."""
        return {"layout": self._layout(), "masters": [s.master for s in self.shards],
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state_dict):
        """Restores masters and moments; the model weights must be loaded separately (they are
        the published masters, so loading the same checkpoint's model gives consistent params)."""
        if state_dict.get("layout") != self._layout():
            _fail("state dict was saved under a different sharding layout", state_dict.get("layout"),
                  f"Load it with the same data-parallel size and model (this optimizer: {self._layout()}), "
                  "or start the optimizer fresh from the model weights.")
        with torch.no_grad():
            for s, m in zip(self.shards, state_dict["masters"]):
                s.master.copy_(m)
        self.inner.load_state_dict(state_dict["inner"])
