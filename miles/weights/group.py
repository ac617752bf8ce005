"""A weight-update process group: the trainer's source rank broadcasts buckets to rollout engines on other
GPUs or nodes. Built apart from the default process group (the trainer's and Megatron's groups stay as they
are; an engine with no default group can join), the way sglang builds the groups its ranks join
(``init_custom_process_group``: a TCPStore, prefixed with the group's name, given to torch's new-group
helper), so that an sglang engine's ranks meet the trainer in the same store keys: a group built from the
bare backend classes names its keys otherwise, and sglang's ranks would wait for them until the timeout.

Every rank constructs its WeightUpdateGroup at the same time (rank 0 serves the store and waits for the
others); then the source calls ``send_buckets`` while each receiver calls ``receive_bucket`` for the same
specs, in the same order. The specs travel apart (plain dicts, ``BucketSpec.to_dict``).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _new_process_group_helper, _world

from .buckets import BucketSpec

BACKENDS = ("gloo", "nccl")


class WeightUpdateGroup:
    def __init__(self, *, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                 group_name: str, timeout_s: float = 300.0):
        if backend not in BACKENDS:
            raise ValueError(f"WeightUpdateGroup backend {backend!r} is not one of {BACKENDS}")
        if backend == "nccl" and not dist.is_nccl_available():
            raise ValueError("WeightUpdateGroup backend 'nccl' needs a torch built with NCCL; this one has none: "
                             "use 'gloo'")
        if type(world_size) is not int or world_size < 1 or type(rank) is not int or not 0 <= rank < world_size:
            raise ValueError(f"WeightUpdateGroup rank {rank!r} must lie in [0, world_size={world_size!r})")
        if type(master_port) is not int or not 0 < master_port < 65536:
            raise ValueError(f"WeightUpdateGroup master_port {master_port!r} is not a TCP port (1..65535)")
        if not isinstance(group_name, str) or not group_name:
            raise ValueError(f"WeightUpdateGroup group_name must be a non-empty str, got {group_name!r}")
        if not timeout_s > 0:
            raise ValueError(f"WeightUpdateGroup timeout_s must be positive, got {timeout_s!r}")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.group_name = group_name
        self.timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                                    timeout=self.timeout)
        # NCCL connects at the first broadcast, on the current GPU (as sglang's ranks do: an eager connect here
        # would wait for theirs, which come only with the first bucket)
        self._process_group, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend),
                                                           dist.PrefixStore(group_name, self._store),
                                                           group_name=group_name, timeout=self.timeout)
        _world.pg_group_ranks[self._process_group] = {r: r for r in range(world_size)}  # destroy removes it

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """``tensor`` of rank ``src`` into every rank's ``tensor``; returns once this rank's part is done
        (for NCCL: the device finished it, so the source may free or reuse the tensor)."""
        if self._process_group is None:
            raise RuntimeError(f"weight-update group {self.group_name!r} was destroyed; create a new one")
        if type(src) is not int or not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src {src!r} is not a rank of the {self.world_size}-rank group")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout
        self._process_group.broadcast([tensor], opts).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def destroy(self) -> None:
        """Drop the group (its name is free again in this process) and the store; idempotent."""
        if self._process_group is not None:
            dist.destroy_process_group(self._process_group)
        self._process_group = None
        self._store = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for the group's master_port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def send_buckets(group: WeightUpdateGroup, buckets: Iterable[tuple[BucketSpec, torch.Tensor]], src: int = 0) -> int:
    """Broadcast each flat from this rank, the source; returns the bytes sent. A flat may be freed once its
    broadcast returned."""
    if group.rank != src:
        raise ValueError(f"send_buckets runs on the source rank src={src!r}; this is rank {group.rank}: "
                         "receivers call receive_bucket")
    sent = 0
    for spec, flat in buckets:
        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != spec.nbytes:
            raise ValueError(f"bucket {spec.index}: send a 1-D uint8 flat of the spec's {spec.nbytes} bytes, got "
                             f"{flat.dtype} of shape {tuple(flat.shape)}")
        if spec.nbytes:  # receive_bucket skips empty buckets the same way
            group.broadcast(flat, src)
        sent += spec.nbytes
    return sent


def receive_bucket(group: WeightUpdateGroup, spec: BucketSpec, device, src: int = 0) -> torch.Tensor:
    """A new flat on ``device`` holding the source's bucket ``spec``."""
    if group.rank == src:
        raise ValueError(f"receive_bucket runs on the receivers; rank {group.rank} is the source src={src}")
    flat = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    if spec.nbytes:
        group.broadcast(flat, src)
    return flat
