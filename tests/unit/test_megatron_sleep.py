"""What the megatron trainer's sleep moves, decided on the CPU (the GPU path is the same code on CUDA
storages): grad buffers dropped and re-zeroed instead of backed up, and what torch_memory_saver's
offloader reports as paused (the device memory the pause gave back)."""

import sys
from types import ModuleType, SimpleNamespace

import torch

from miles.backends.megatron_backend.grad_buffers import GradBuffers, droppable_grad_storages


def _buffer(numel: int, *, shared: bool = False, param: bool = True):
    """A megatron _ParamAndGradBuffer's two fields: bf16 params, fp32 grads (or one shared buffer, as
    megatron builds for MXFP8 params)."""
    if shared:
        storage = torch.zeros(numel, dtype=torch.float32)
        return SimpleNamespace(param_data=storage[: numel // 2].view(torch.bfloat16), grad_data=storage)
    return SimpleNamespace(param_data=torch.zeros(numel, dtype=torch.bfloat16) if param else None,
                           grad_data=torch.zeros(numel, dtype=torch.float32))


def test_only_grad_only_storages_are_droppable():
    dense, expert, shared, no_param = _buffer(8), _buffer(4), _buffer(6, shared=True), _buffer(2, param=False)
    storages = droppable_grad_storages([dense, expert, shared, no_param, dense])  # dense twice: counted once
    keys = [s._cdata for s in storages]
    assert keys == [b.grad_data.untyped_storage()._cdata for b in (dense, expert, no_param)]


def test_release_frees_and_restore_zero_fills_every_view():
    buf = _buffer(8)
    main_grad = buf.grad_data[2:6].view(2, 2)  # a param's main_grad: a view at an offset
    main_grad.fill_(3.0)
    grads = GradBuffers([buf])

    assert grads.release() == 8 * 4 and grads.release() == 0  # idempotent
    assert buf.grad_data.untyped_storage().nbytes() == 0 and buf.param_data.untyped_storage().nbytes() == 8 * 2

    assert grads.restore() == 8 * 4 and grads.restore() == 0
    assert torch.equal(buf.grad_data, torch.zeros(8)) and torch.equal(main_grad, torch.zeros(2, 2))
    main_grad.fill_(1.0)  # the view writes into the buffer again, at its old offset
    assert buf.grad_data.tolist() == [0, 0, 1, 1, 1, 1, 0, 0]


def test_shared_param_grad_buffer_is_kept_through_sleep():
    buf = _buffer(8, shared=True)
    buf.param_data.fill_(2.0)
    grads = GradBuffers([buf])
    assert grads.release() == 0
    assert torch.equal(buf.param_data, torch.full((8,), 2.0, dtype=torch.bfloat16))


class _FakeDevice:
    """torch.cuda's calls TmsOffloader makes, over a device whose pause unmaps `paused` bytes."""

    def __init__(self, paused: int):
        self.free, self.paused = 10_000, paused

    def pause(self):
        self.free += self.paused

    def resume(self):
        self.free -= self.paused


def test_tms_offloader_reports_the_bytes_the_pause_gave_back(monkeypatch):
    device = _FakeDevice(paused=4096)
    tms_module = ModuleType("torch_memory_saver")
    tms_module.torch_memory_saver = SimpleNamespace(pause=device.pause, resume=device.resume)
    monkeypatch.setitem(sys.modules, "torch_memory_saver", tms_module)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (device.free, 1 << 40))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 999_999)  # not what was paused

    from miles.offload import TmsOffloader

    offloader = TmsOffloader("cpu")
    sleep = offloader.sleep()
    assert (sleep.action, sleep.bytes, offloader.asleep) == ("sleep", 4096, True)
    assert offloader.sleep().skipped
    wake = offloader.wake()
    assert (wake.action, wake.bytes, offloader.asleep) == ("wake", 4096, False)
