"""Trainer offload for sleep (miles.offload.StorageOffloader): cpu and disk targets, bit-exact."""

import os

import pytest
import torch

from miles.offload import StorageOffloader, make_offloader, make_resizable, unique_storages


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 50, bias=False))
    model[3].weight = model[0].weight  # tied weights: one storage
    model.to(torch.bfloat16)
    model.register_buffer("inv_freq", torch.arange(8, dtype=torch.float32))
    return model


def _snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def _bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dim() else a,
                                                                      b.view(torch.uint8) if b.dim() else b)


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_round_trip_is_bit_exact_and_frees_storage(tmp_path, target):
    model = _model()
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).float().sum().backward()
    adam.step()  # creates exp_avg / exp_avg_sq / step
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [v for s in adam.state.values() for v in s.values() if torch.is_tensor(v)]
    views = [model[1].weight.view(-1)[3:9]]  # a view into a param: must follow the storage
    before = _snapshot(tensors + views)
    expected = unique_storages(tensors + views)
    expected_count, expected_bytes = len(expected), sum(s.nbytes() for s in expected)
    del expected

    off = StorageOffloader(target, str(tmp_path / "trainer"), chunk_mb=1)
    off.chunk_bytes = 100  # force many chunks per storage
    stats = off.sleep(tensors + views)
    assert off.asleep and not stats.skipped
    assert stats.storages == expected_count < len(tensors) + len(views)  # tied weight, view: counted once
    assert stats.bytes == expected_bytes
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    if target == "disk":
        assert os.path.getsize(off.path) == stats.bytes
    again = off.sleep(tensors)  # idempotent
    assert again.skipped and off.asleep

    woke = off.wake()
    assert not off.asleep and woke.bytes == stats.bytes
    for a, b in zip(tensors + views, before):
        assert _bits_equal(a.detach(), b)
    assert model[3].weight.untyped_storage()._cdata == model[0].weight.untyped_storage()._cdata
    assert off.wake().skipped  # idempotent
    if target == "disk":
        assert not os.path.exists(off.path), "the offload file only exists while asleep"

    # training continues normally after wake
    model(torch.tensor([[4, 5]])).float().sum().backward()
    adam.step()


def test_empty_storages_are_skipped(tmp_path):
    """The streamed optimizer state lives on disk with its storage resized to 0: nothing to back up."""
    released = torch.ones(1000)
    released.untyped_storage().resize_(0)
    kept = torch.arange(10, dtype=torch.float32)
    off = StorageOffloader("disk", str(tmp_path))
    stats = off.sleep([released, kept, None])
    assert stats.storages == 1 and stats.bytes == kept.nbytes
    off.wake()
    assert torch.equal(kept, torch.arange(10, dtype=torch.float32))
    assert released.untyped_storage().nbytes() == 0


def test_several_cycles_and_close(tmp_path):
    t = torch.randn(1234, dtype=torch.float32)
    ref = t.clone()
    off = make_offloader("disk", str(tmp_path / "d"), chunk_mb=1, device_type="cpu")
    for _ in range(3):
        off.sleep([t])
        off.wake()
        t.add_(1)
        ref.add_(1)
    assert torch.equal(t, ref)
    off.sleep([t])
    off.close(remove_directory=True)
    assert not (tmp_path / "d").exists()


def test_make_resizable_copies_mmapped_storage(tmp_path):
    path = tmp_path / "w.bin"
    torch.arange(64, dtype=torch.float32).numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=64, dtype=torch.float32)
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(mapped)
    assert not module.w.untyped_storage().resizable()
    assert make_resizable(module) == 1
    assert module.w.untyped_storage().resizable()
    assert torch.equal(module.w.detach(), torch.arange(64, dtype=torch.float32))


def gguf_like_model():
    """The storage layout of the default model as loaded from its GGUF-converted checkpoint: every weight
    in a non-resizable storage (numpy-backed here; mmap'ed safetensors there), the embedding tied to the
    LM head (one Parameter under two names), and two weights viewing one shared storage."""
    import numpy as np

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(40, 8)
    model.head = torch.nn.Linear(8, 40, bias=False)
    model.q = torch.nn.Linear(8, 8, bias=False)
    model.k = torch.nn.Linear(8, 8, bias=False)
    model.embed.weight = torch.nn.Parameter(torch.from_numpy(np.random.default_rng(0).standard_normal(
        (40, 8), dtype=np.float32)))
    model.head.weight = model.embed.weight  # tied
    shared = torch.from_numpy(np.arange(128, dtype=np.float32))  # one file-backed block behind q and k
    model.q.weight = torch.nn.Parameter(shared[:64].view(8, 8))
    model.k.weight = torch.nn.Parameter(shared[64:].view(8, 8))
    return model


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_non_resizable_tied_and_shared_storages_sleep_and_wake(tmp_path, target):
    model = gguf_like_model()
    named = dict(model.named_parameters(remove_duplicate=False))
    assert not any(p.untyped_storage().resizable() for p in named.values())
    before = {k: v.detach().clone() for k, v in named.items()}
    off = StorageOffloader(target, str(tmp_path / "o"), chunk_mb=1)
    with pytest.raises(RuntimeError, match="make_resizable"):  # the clear error, not torch's resize failure
        off.sleep(named.values())
    assert make_resizable(model) == 2  # the embedding's storage and the shared q/k block, each copied once
    assert all(p.untyped_storage().resizable() for p in named.values())
    assert model.head.weight is model.embed.weight
    assert model.q.weight.untyped_storage()._cdata == model.k.weight.untyped_storage()._cdata  # still shared
    for _ in range(2):
        stats = off.sleep(named.values())
        assert stats.storages == 2 and all(p.untyped_storage().nbytes() == 0 for p in named.values())
        off.wake()
        assert all(torch.equal(named[k].detach(), before[k]) for k in before)
    assert model.k.weight.storage_offset() == 64  # the shared block's layout survived
    with torch.no_grad():
        model.embed.weight[0, 0] = 5.0
    assert float(model.head.weight.detach()[0, 0]) == 5.0  # still tied after the cycles


def test_bad_target():
    with pytest.raises(ValueError):
        StorageOffloader("nvme")
    with pytest.raises(ValueError):
        StorageOffloader("disk", None)


def test_host_arena_spans_its_pieces_bit_exactly_and_only_grows():
    from miles.offload.storage import HostArena

    arena = HostArena(pinned=False, piece_bytes=64)
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (1, 63, 64, 65, 200)]
    arena.reserve(sum(c.numel() for c in chunks))
    assert arena.nbytes == 448 and len(arena.pieces) == 7  # 393 bytes in whole pieces of 64
    offset, offsets = 0, []
    for c in chunks:  # ranges that start and end inside pieces and cross their borders
        arena.write(offset, c)
        offsets.append(offset)
        offset += c.numel()
    for c, at in zip(chunks, offsets):
        back = torch.empty_like(c)
        arena.read(at, back)
        assert torch.equal(back, c)
    arena.reserve(10)
    assert arena.nbytes == 448  # kept for the next sleep, never shrunk


def test_host_bytes_held_reach_the_sleep_plan_budget(monkeypatch):
    """Host memory the offloader keeps between sleeps is counted by the host as used, yet it is where this
    sleep's copies go: the plan's RAM budget counts it as available."""
    from miles.backends import planned_sleep
    from miles.offload.plan import EngineNeeds

    monkeypatch.setattr(planned_sleep, "available_host_memory", lambda: 40 << 30)
    budget = [planned_sleep.memory_facts(torch.device("cpu"), EngineNeeds(), None, 2, "embedded",
                                         host_bytes_held=held).host_ram_budget for held in (0, 6 << 30)]
    assert budget[1] - budget[0] == 3 << 30  # this rank's share of the held memory (2 ranks on the node)
