"""Collectives and point-to-point sends of device tensors over gloo, staged through host memory, so that several
ranks can share one GPU in a test.

NCCL refuses two ranks on one device, and gloo carries CUDA tensors for all-reduce and broadcast only (its
coalesced all-gather of CUDA tensors segfaults on torch 2.11; it has no CUDA send/recv). :func:`install`
replaces the torch.distributed calls megatron-core and the trainer make with versions that copy a device tensor
to the host, run gloo's CPU operation, and copy the result back. Each runs to completion before it returns
(``async_op`` gives a finished handle; a point-to-point receive lands at ``wait()``), so the ranks compute what
they would over NCCL, only slower. Modules imported before :func:`install` that bound one of these functions
by name (megatron's ``param_and_grad_buffer`` binds ``_coalescing_manager`` and ``all_gather_into_tensor``) are
rebound too.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["install", "staged_calls"]

staged_calls = {"count": 0}  # how many calls copied a tensor through the host (a test checks it is not zero)
_original: dict = {}
_stage_cpu = [False]  # the CPU check of this module stages CPU tensors too (a copy through a second CPU tensor)


def _staged(tensor: torch.Tensor) -> bool:
    return _stage_cpu[0] or tensor.device.type != "cpu"


def _host(tensor: torch.Tensor) -> torch.Tensor:
    staged_calls["count"] += 1
    return tensor.detach().to("cpu", copy=True).contiguous()


class _Finished:
    """A finished operation's handle; ``then`` runs at the first ``wait()`` (a staged receive's copy back)."""

    def __init__(self, work=None, then=None):
        self._work, self._then = work, then

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            self._then()
            self._then = None
        return True

    def is_completed(self) -> bool:
        return self._work is None and self._then is None

    def is_success(self) -> bool:
        return True


def _copy_back(tensor: torch.Tensor, host: torch.Tensor) -> None:
    """As a collective writes: outside autograd (megatron receives activations into leaves that require grad)."""
    with torch.no_grad():
        tensor.copy_(host)


def _done(async_op: bool):
    return _Finished() if async_op else None


def _sum_for(op):
    """gloo has no AVG: it is a SUM divided by the group size afterwards."""
    return (dist.ReduceOp.SUM, True) if op == dist.ReduceOp.AVG else (op, False)


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    op, average = _sum_for(op)
    host = _host(tensor) if _staged(tensor) else tensor
    _original["all_reduce"](host, op=op, group=group)
    if average:
        host.div_(dist.get_world_size(group))
    if host is not tensor:
        _copy_back(tensor, host)
    return _done(async_op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    host = _host(tensor) if _staged(tensor) else tensor
    _original["broadcast"](host, src=src, group=group, group_src=group_src)
    if host is not tensor:
        _copy_back(tensor, host)
    return _done(async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    if not _staged(tensor):
        return _original["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
    hosts = [torch.empty(t.shape, dtype=t.dtype) for t in tensor_list]
    _original["all_gather"](hosts, _host(tensor), group=group)
    for out, host in zip(tensor_list, hosts):
        _copy_back(out, host)
    return _done(async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    host = torch.empty(output_tensor.shape, dtype=output_tensor.dtype)
    _original["all_gather"](list(host.chunk(dist.get_world_size(group))), _host(input_tensor), group=group)
    _copy_back(output_tensor, host)
    return _done(async_op)


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """An all-reduce of the whole input on the host, then this rank's chunk (tests' sizes are small)."""
    op, average = _sum_for(op)
    host = _host(input)
    _original["all_reduce"](host, op=op, group=group)
    size = dist.get_world_size(group)
    if average:
        host.div_(size)
    _copy_back(output, host.chunk(size)[dist.get_rank(group)].view(output.shape))
    return _done(async_op)


def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return reduce_scatter_tensor(output, torch.cat([t.reshape(-1) for t in input_list]), op, group, async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False):
    host_out = torch.empty(output.shape, dtype=output.dtype)
    sizes = [None if s is None else [int(n) for n in s] for s in (output_split_sizes, input_split_sizes)]
    _original["all_to_all_single"](host_out, _host(input), *sizes, group=group)  # sizes may come as an array
    _copy_back(output, host_out)
    return _done(async_op)


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    host = _host(tensor) if _staged(tensor) else tensor
    work = _original["isend"](host, dst, group, tag, group_dst=group_dst)
    return _Finished(work, then=lambda: host)  # keeps the host copy alive until the send completed


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    host = torch.empty(tensor.shape, dtype=tensor.dtype) if _staged(tensor) else tensor
    work = _original["irecv"](host, src, group, tag, group_src=group_src)
    return _Finished(work, then=(lambda: _copy_back(tensor, host)) if host is not tensor else None)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    isend(tensor, dst, group, tag, group_dst=group_dst).wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    irecv(tensor, src, group, tag, group_src=group_src).wait()
    return src


def batch_isend_irecv(p2p_op_list):
    """Each operation on its own (gloo's sends and receives are asynchronous: no pair of ranks deadlocks)."""
    return [p.op(p.tensor, p.peer, p.group, p.tag) if p.peer is not None
            else p.op(p.tensor, None, p.group, p.tag, p.group_peer) for p in p2p_op_list]


@contextlib.contextmanager
def _coalescing_manager(group=None, device=None, async_ops=False):
    """The operations inside already ran; megatron waits on the handle."""
    yield _Finished()


_REPLACEMENTS = {
    "all_reduce": all_reduce, "broadcast": broadcast, "all_gather": all_gather,
    "all_gather_into_tensor": all_gather_into_tensor, "_all_gather_base": all_gather_into_tensor,
    "reduce_scatter_tensor": reduce_scatter_tensor, "_reduce_scatter_base": reduce_scatter_tensor,
    "reduce_scatter": reduce_scatter, "all_to_all_single": all_to_all_single, "isend": isend, "irecv": irecv,
    "send": send, "recv": recv, "batch_isend_irecv": batch_isend_irecv, "_coalescing_manager": _coalescing_manager,
}


def install(stage_cpu_tensors: bool = False) -> None:
    """Replace the calls in ``torch.distributed``, in ``distributed_c10d`` (whose P2POp checks its ``op`` against
    that module's isend/irecv) and wherever an imported module bound one by name. ``stage_cpu_tensors``: stage
    CPU tensors too (this module's own test)."""
    _stage_cpu[0] = stage_cpu_tensors
    if _original:
        return
    for name, replacement in _REPLACEMENTS.items():
        _original[name] = getattr(c10d, name)
    replacing = {id(_original[name]): replacement for name, replacement in _REPLACEMENTS.items()}
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType) or module.__name__ == __name__:
            continue  # sys.modules may hold other objects (Cython shims)
        for attribute, value in list(vars(module).items()):
            if id(value) in replacing and callable(value):
                setattr(module, attribute, replacing[id(value)])
