"""verify=True (issue 13 item 4): live bucket files are checksummed per chunk when written and checked
when read back from disk.

Before: a byte flipped in `exp_avg` of a live bucket file between two steps moved params by ~4e36 and
no error was raised. With verify the next step raises StateCorruptionError naming bucket, segment and
file, and the store is poisoned until load_from. With verify off (the default) the old behaviour
stands: the flip is trained on silently (test_verify_off_trains_on_the_flipped_byte documents it).
"""

import os
import sys

import pytest
import torch

from miles_plugins.optimizers.nvme_stream import StateCorruptionError, StorePoisonedError, stream_optimizer_state

sys.path.insert(0, os.path.dirname(__file__))
from test_store_sharded import make_opt, make_model_params as make_params  # noqa: E402  (same sizes and groups)

BUCKET = 4096 + 50  # several buckets, params split across them
ENGINES = ("pipelined", "sync")
MOMENT_DTYPES = ("fp32", "bf16", "fp8e4m3")
SEGMENTS = ("main", "exp_avg", "exp_avg_sq")


def streamed(root, **config):
    params = make_params()
    opt = make_opt(params)
    store = stream_optimizer_state(opt, dir=str(root), rank=0, bucket_numel=BUCKET, **config)
    return params, opt, store


def step(opt, params, index):
    g = torch.Generator().manual_seed(100 + index)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
    opt.step()


def state_of(store):
    """Every bucket's mains and moments as the next step would see them (read from the files)."""
    store.flush()
    out = []
    for bucket in store.buckets:
        bucket.fetch(store.stager, bucket.segments_to_fetch())
        out.extend(bucket.flat[name].clone() for name in bucket.segments_to_fetch())
        bucket.release()
    return out


def flip_byte(store, segment, bucket_index=1):
    """Change one byte in the middle of a live segment through a descriptor of our own (the store's
    write-behind has landed: flush first)."""
    bucket = store.buckets[bucket_index]
    seg = bucket.layout.segments[segment]
    fd = os.open(bucket.file.path, os.O_RDWR)
    try:
        offset = seg.offset + seg.nbytes // 8 * 4 + 3  # the exponent byte of an fp32 value mid-segment
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x40]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return bucket


@pytest.mark.parametrize("moment_dtype", MOMENT_DTYPES)
@pytest.mark.parametrize("io_engine", ENGINES)
@pytest.mark.parametrize("segment", SEGMENTS)
def test_flipped_byte_between_steps_raises_and_poisons(tmp_path, segment, io_engine, moment_dtype):
    params, opt, store = streamed(tmp_path, verify=True, io_engine=io_engine, moment_dtype=moment_dtype)
    for i in range(2):
        step(opt, params, i)
    store.flush()
    bucket = flip_byte(store, segment)
    with pytest.raises(StateCorruptionError) as caught:
        step(opt, params, 2)
    message = str(caught.value)
    assert f"bucket {bucket.index}, segment {segment}," in message
    assert bucket.file.path in message and "load_from" in message
    assert isinstance(store.poisoned_by, StateCorruptionError)
    with pytest.raises(StorePoisonedError, match="load_from"):
        step(opt, params, 3)
    store.close()


@pytest.mark.parametrize("io_engine", ENGINES)
def test_verify_off_trains_on_the_flipped_byte(tmp_path, io_engine):
    """The default (verify=False) keeps the old behaviour: nothing checks the live files."""
    ref_params, ref_opt, ref_store = streamed(tmp_path / "ref", io_engine=io_engine)
    params, opt, store = streamed(tmp_path / "flip", io_engine=io_engine)
    for i in range(2):
        step(ref_opt, ref_params, i)
        step(opt, params, i)
    store.flush()
    flip_byte(store, "exp_avg")
    step(ref_opt, ref_params, 2)
    step(opt, params, 2)  # no error
    assert store.poisoned_by is None
    assert not all(torch.equal(a, b) for a, b in zip(ref_params, params))
    ref_store.close()
    store.close()


@pytest.mark.parametrize("moment_dtype", MOMENT_DTYPES)
@pytest.mark.parametrize("io_engine,host_cache_mb", [("pipelined", 0), ("pipelined", 1), ("sync", 0)])
def test_verify_on_is_bit_identical_to_verify_off(tmp_path, io_engine, host_cache_mb, moment_dtype):
    """Through steps, a prefetch, a save and a load (which rewrites the files outside the engines and so
    forgets their checksums; the next writes record them again)."""
    runs = []
    for verify in (False, True):
        params, opt, store = streamed(tmp_path / str(verify), verify=verify, io_engine=io_engine,
                                      host_cache_mb=host_cache_mb, moment_dtype=moment_dtype)
        for i in range(3):
            step(opt, params, i)
        store.prefetch()
        step(opt, params, 3)
        store.save_to(str(tmp_path / f"ckpt{verify}"))
        step(opt, params, 4)
        assert store.load_from(str(tmp_path / f"ckpt{verify}"))
        for i in range(4, 7):
            step(opt, params, i)
        runs.append(([p.detach().clone() for p in params], state_of(store)))
        store.close()
    (params_off, state_off), (params_on, state_on) = runs
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_on))
    assert len(state_off) == len(state_on) and all(torch.equal(a, b) for a, b in zip(state_off, state_on))


def test_load_from_recovers_a_store_poisoned_by_corruption(tmp_path):
    ref_params, ref_opt, ref_store = streamed(tmp_path / "ref")
    params, opt, store = streamed(tmp_path / "live", verify=True)
    for i in range(2):
        step(ref_opt, ref_params, i)
        step(opt, params, i)
    store.save_to(str(tmp_path / "ckpt"))
    saved = [p.detach().clone() for p in params]
    store.flush()
    flip_byte(store, "exp_avg_sq", bucket_index=0)
    with pytest.raises(StateCorruptionError):
        step(opt, params, 2)
    for p, s in zip(params, saved):  # the recovery: model weights, then the store's state
        p.data.copy_(s)
    assert store.load_from(str(tmp_path / "ckpt"))
    for i in range(2, 5):
        step(ref_opt, ref_params, i)
        step(opt, params, i)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    assert all(torch.equal(a, b) for a, b in zip(state_of(ref_store), state_of(store)))
    ref_store.close()
    store.close()


def test_reads_served_from_the_host_cache_are_not_checked(tmp_path):
    """The host cache image never left memory: the step reads it, not the flipped file, and the
    write-through that follows overwrites the flip. Documented, not a hole in what verify promises."""
    ref_params, ref_opt, ref_store = streamed(tmp_path / "ref")
    params, opt, store = streamed(tmp_path / "live", verify=True)
    store.set_io(host_cache_mb=64)  # write-back images of files (a tier given at construction has no files)
    for i in range(2):
        step(ref_opt, ref_params, i)
        step(opt, params, i)
    store.flush()
    bucket = flip_byte(store, "exp_avg")
    assert store.stager.is_cached(bucket.file, bucket.layout.segments["exp_avg"].offset,
                                  bucket.layout.segments["exp_avg"].nbytes)
    for i in range(2, 4):
        step(ref_opt, ref_params, i)
        step(opt, params, i)
    assert store.poisoned_by is None
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    ref_store.close()
    store.close()


def test_verify_must_be_a_bool(tmp_path):
    from miles_plugins.optimizers.nvme_stream import StoreConfigError
    with pytest.raises(StoreConfigError, match="verify must be True"):
        streamed(tmp_path, verify="yes")


def test_set_io_turns_verify_on_from_the_next_write(tmp_path):
    """Benchmarks switch verify on the same files (miles bench stream --verify): once on, the next
    step's writes record the checksums and later reads are checked."""
    params, opt, store = streamed(tmp_path)
    step(opt, params, 0)
    store.set_io(verify=True)
    step(opt, params, 1)
    store.flush()
    flip_byte(store, "main")
    with pytest.raises(StateCorruptionError, match="segment main"):
        step(opt, params, 2)
    store.close()


def emulate_reflink(monkeypatch):
    """A filesystem with reflink (XFS, btrfs): the save clones each bucket and checksums the clone later,
    off the training path. Emulated by a full copy that reports itself a clone."""
    from miles_plugins.optimizers.streaming.checkpoint import save_load

    def clone(src_fd, dst_fd):
        size = os.fstat(src_fd).st_size
        os.ftruncate(dst_fd, size)
        os.pwrite(dst_fd, os.pread(src_fd, size, 0), 0)
        return True

    monkeypatch.setattr(save_load.io, "reflink", clone)


@pytest.mark.parametrize("reflink", [False, True])
@pytest.mark.parametrize("wait", [True, False])
@pytest.mark.parametrize("io_engine", ENGINES)
def test_save_of_a_flipped_live_file_fails_and_publishes_nothing(tmp_path, monkeypatch, io_engine, wait, reflink):
    """Before: the save copied the changed file into the checkpoint, with a fresh crc32 over the corrupt
    bytes, and a later load installed it. Now the save checks the bytes it copies against verify's record."""
    if reflink:
        emulate_reflink(monkeypatch)
    params, opt, store = streamed(tmp_path / "live", verify=True, io_engine=io_engine)
    step(opt, params, 0)
    store.save_to(str(tmp_path / "ckpt1"))
    previous = {f.name: f.read_bytes() for f in (tmp_path / "ckpt1").rglob("*") if f.is_file()}
    step(opt, params, 1)
    store.flush()
    bucket = flip_byte(store, "exp_avg_sq")
    with pytest.raises(StateCorruptionError, match=rf"saving optimizer state to .*ckpt2.* failed, nothing was "
                                                   rf"published: .*bucket {bucket.index}, segment exp_avg_sq,"):
        store.save_to(str(tmp_path / "ckpt2"), wait=wait)
        store.wait_for_save()
    assert isinstance(store.poisoned_by, StateCorruptionError)
    assert not list((tmp_path / "ckpt2").rglob("*.bin")) and not list((tmp_path / "ckpt2").rglob("manifest.json"))
    with pytest.raises(StorePoisonedError):
        step(opt, params, 2)
    assert {f.name: f.read_bytes() for f in (tmp_path / "ckpt1").rglob("*") if f.is_file()} == previous
    assert store.load_from(str(tmp_path / "ckpt1"))  # the previous checkpoint is whole and recovers the store
    store.close()


def test_background_save_checks_the_bytes_as_of_its_snapshot_while_steps_overwrite_them(tmp_path, monkeypatch):
    """The clone of each bucket is checksummed after the next steps rewrote the live file (and verify's
    record of it): the save checks the clone against the record taken when it cloned."""
    emulate_reflink(monkeypatch)
    from test_checkpoint import start_copier_late
    from miles_plugins.optimizers.streaming.checkpoint import save_load
    monkeypatch.setattr(save_load.SaveJob, "_run", save_load.SaveJob._run)  # start_copier_late patches it
    start_copier_late(delay=0.2)
    params, opt, store = streamed(tmp_path / "live", verify=True)
    for i in range(2):
        step(opt, params, i)
    at_save = state_of(store)
    store.save_to(str(tmp_path / "ckpt"), wait=False)
    for i in range(2, 4):
        step(opt, params, i)
    assert store.wait_for_save()["reflinked_buckets"] == len(store.buckets)
    assert store.load_from(str(tmp_path / "ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(at_save, state_of(store)))
    store.close()


def test_in_order_check_chains_chunks_across_pieces_and_skips_padding(tmp_path):
    """The copy's pieces are not verify's chunks: a chunk split over pieces is checked once it is whole;
    bytes outside every chunk (alignment padding) are not checked."""
    from miles_plugins.optimizers.streaming.io.verify import FileChecksums
    from miles_plugins.optimizers.streaming.layout import Segment

    data = bytearray(torch.randint(0, 256, (100,), dtype=torch.uint8).numpy().tobytes())
    checksums = FileChecksums("f.bin", 0, {"main": Segment("main", 0, 100)}, enabled=True)
    for offset, n in ((10, 30), (40, 30), (80, 20)):  # 0..10 and 70..80: padding
        checksums.written(offset, [torch.frombuffer(bytearray(data[offset:offset + n]), dtype=torch.uint8)])

    def feed(pieces):
        check = checksums.in_order_check()
        for start, stop in pieces:
            check(start, memoryview(data)[start:stop])

    pieces = [(0, 7), (7, 45), (45, 46), (46, 100)]
    feed(pieces)
    data[75] ^= 1  # padding: not checked
    feed(pieces)
    data[41] ^= 1
    with pytest.raises(StateCorruptionError, match=r"bytes \[40, 70\) of f.bin"):
        feed(pieces)
