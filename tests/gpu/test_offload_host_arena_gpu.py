"""Trainer offload to host RAM on a GPU (StorageOffloader, target cpu): device storages are copied into
page-locked pieces of HOST_PIECE_BYTES that stay from one sleep to the next, host storages are copied apart;
every byte comes back.

    python -m pytest -q -s tests/gpu/test_offload_host_arena_gpu.py
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from miles.offload.storage import HOST_PIECE_BYTES, StorageOffloader  # noqa: E402


def test_cpu_target_round_trips_through_pieces_kept_between_sleeps():
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = (HOST_PIECE_BYTES // 3, HOST_PIECE_BYTES + 17, 5)  # 1.33 pieces, borders crossed
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g) for n in sizes]
    on_host = torch.arange(10.0)
    before = [t.clone() for t in tensors + [on_host]]
    offloader = StorageOffloader("cpu")
    for _ in range(2):
        stats = offloader.sleep(tensors + [on_host])
        assert stats.bytes == sum(sizes) + 40
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors + [on_host])
        assert offloader.host_bytes_held == 2 * HOST_PIECE_BYTES
        offloader.wake()
        assert all(torch.equal(a, b) for a, b in zip(tensors + [on_host], before))
        assert offloader.host_bytes_held == 2 * HOST_PIECE_BYTES  # kept for the next sleep
    offloader.close()
    assert offloader.host_bytes_held == 0
