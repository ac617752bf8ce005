"""Handing weight buckets to another process (miles/weights/transport.py: shm files on CPU; the CUDA IPC
payload's refusals) and the standalone weight-update group (miles/weights/group.py, gloo on loopback)."""

import multiprocessing as mp
import os
import pickle
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from miles.weights import (BucketSpec, SharedBucket, WeightUpdateGroup, free_port, iter_buckets, open_bucket,
                           receive_bucket, send_buckets, share_bucket, unpack_bucket)

TIMEOUT = 60


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [("embed", torch.randn(300, 17, generator=g).to(torch.bfloat16)),
            ("norm", torch.randn(64, generator=g)),
            ("w", torch.randn(40, 33, generator=g).to(torch.bfloat16).t()),
            ("count", torch.arange(5, dtype=torch.int64))]


def _consume(queue, ack):
    """The engine's side: open each payload, copy out, drop the mapping, acknowledge with the copies."""
    while (shared := queue.get(timeout=TIMEOUT)) is not None:
        spec, flat = open_bucket(shared)
        copies = {name: view.clone() for name, view in unpack_bucket(spec, flat)}
        del flat
        shared.release()  # the consumer's copy owns nothing: the producer's file must survive this
        ack.put((spec.index, os.path.exists(shared.handle), copies))


def test_shm_handoff_between_processes_is_bit_exact_and_leaves_nothing(tmp_path):
    ctx = mp.get_context("spawn")
    queue, ack = ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=_consume, args=(queue, ack))
    consumer.start()
    try:
        received = {}
        for spec, flat in iter_buckets(weights(), max_bytes=4096):
            shared = share_bucket(spec, flat, shm_dir=str(tmp_path))
            assert shared.kind == "shm_file" and os.path.dirname(shared.handle) == str(tmp_path)
            assert os.path.basename(shared.handle).startswith(f"miles-weights-{os.getpid()}-")
            queue.put(shared)
            index, file_there_after_consumer_release, copies = ack.get(timeout=TIMEOUT)
            assert index == spec.index and file_there_after_consumer_release
            shared.release()
            assert not os.path.exists(shared.handle)
            shared.release()  # idempotent
            received.update(copies)
        queue.put(None)
        consumer.join(TIMEOUT)
        assert consumer.exitcode == 0
    finally:
        if consumer.is_alive():
            consumer.kill()
    for name, t in weights():
        assert torch.equal(received[name], t), name
    assert os.listdir(tmp_path) == []


def test_shared_bucket_pickles_small_without_tensor_data(tmp_path):
    spec, flat = next(iter_buckets([("big", torch.randn(100_000))], max_bytes=1 << 20))
    shared = share_bucket(spec, flat, shm_dir=str(tmp_path))
    try:
        assert len(pickle.dumps(shared)) < 2048
        assert shared.nbytes == spec.nbytes == 400_000
    finally:
        shared.release()


def test_default_shm_dir_is_dev_shm():
    spec, flat = next(iter_buckets([("a", torch.ones(3))], max_bytes=1024))
    shared = share_bucket(spec, flat)
    try:
        expected = "/dev/shm" if os.path.isdir("/dev/shm") else None
        if expected:
            assert os.path.dirname(shared.handle) == expected
        assert torch.equal(open_bucket(shared)[1], flat)
    finally:
        shared.release()
    assert not os.path.exists(shared.handle)


def test_share_refuses_a_flat_that_does_not_match_its_spec(tmp_path):
    spec, flat = next(iter_buckets([("a", torch.ones(3))], max_bytes=1024))
    with pytest.raises(ValueError, match="12 bytes"):
        share_bucket(spec, flat[:8], shm_dir=str(tmp_path))
    with pytest.raises(ValueError, match="uint8"):
        share_bucket(spec, flat.view(torch.float32), shm_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.fixture()
def payload(tmp_path):
    spec, flat = next(iter_buckets([("a", torch.arange(64, dtype=torch.float32))], max_bytes=1024))
    os.mkdir(tmp_path / "shm")
    shared = share_bucket(spec, flat, shm_dir=str(tmp_path / "shm"))
    yield shared
    shared.release()


def forged(shared, handle, nbytes=None, spec=None):
    return SharedBucket(spec=spec or shared.spec, kind="shm_file", handle=handle,
                        nbytes=shared.nbytes if nbytes is None else nbytes)


def test_open_refuses_paths_outside_the_naming_rule(payload, tmp_path):
    base = os.path.basename(payload.handle)
    (tmp_path / "other-name").write_bytes(b"\0" * payload.nbytes)
    os.symlink(payload.handle, tmp_path / "shm" / "miles-weights-link")
    os.mkdir(tmp_path / "shm" / "miles-weights-dir")
    os.mkfifo(tmp_path / "shm" / "miles-weights-fifo")
    cases = {
        str(tmp_path / "shm" / ".." / "shm" / base): r"'\.\.'",
        "shm/" + base: "absolute",
        str(tmp_path / "other-name"): "miles-weights-",
        str(tmp_path / "shm" / "miles-weights-link"): "symbolic link|not a regular file|refused",
        str(tmp_path / "shm" / "miles-weights-dir"): "not a regular file",
        str(tmp_path / "shm" / "miles-weights-fifo"): "not a regular file",
        str(tmp_path / "shm" / "miles-weights-missing"): "no such file|does not exist",
    }
    for handle, message in cases.items():
        with pytest.raises(ValueError, match=message):
            open_bucket(forged(payload, handle))
    assert torch.equal(open_bucket(payload)[1].view(torch.float32), torch.arange(64, dtype=torch.float32))


def test_open_refuses_a_size_that_differs_from_the_spec(payload):
    with pytest.raises(ValueError, match="nbytes"):
        open_bucket(forged(payload, payload.handle, nbytes=payload.nbytes + 4))
    with open(payload.handle, "ab") as f:
        f.write(b"\0" * 4)
    with pytest.raises(ValueError, match=f"{payload.nbytes + 4} bytes"):
        open_bucket(payload)


def test_open_refuses_an_unknown_kind_and_foreign_pickles(payload):
    with pytest.raises(ValueError, match="kind"):
        open_bucket(SharedBucket(spec=payload.spec, kind="ray", handle=payload.handle, nbytes=payload.nbytes))
    evil = pickle.dumps(os.system)  # a CUDA IPC payload may name only torch's tensor rebuild
    with pytest.raises(ValueError, match=r"\.system"):
        open_bucket(SharedBucket(spec=payload.spec, kind="cuda_ipc", handle=evil, nbytes=payload.nbytes))


def test_consumer_opens_the_file_read_only(payload):
    """Writes to the consumer's tensor never reach the producer's file (mapped copy-on-write)."""
    _, flat = open_bucket(payload)
    flat.fill_(7)
    _, again = open_bucket(payload)
    assert torch.equal(again.view(torch.float32), torch.arange(64, dtype=torch.float32))


# ---- the weight-update group over gloo -------------------------------------------------------------

def three_buckets():
    return list(iter_buckets(weights(1), max_bytes=1024))[:3]


def _receive(port, specs, result, taken):
    group = WeightUpdateGroup(master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
                              backend="gloo", group_name="weights-test", timeout_s=TIMEOUT)
    try:
        flats = [receive_bucket(group, BucketSpec.from_dict(d), torch.device("cpu")) for d in specs]
        result.put([{name: v.clone() for name, v in unpack_bucket(BucketSpec.from_dict(d), f)}
                    for d, f in zip(specs, flats)])
        # the tensors travel as shared memory this process hands out on request: it must outlive the parent's get
        taken.wait(TIMEOUT)
    finally:
        group.destroy()


def test_gloo_group_broadcasts_mixed_dtype_buckets_and_leaves_the_default_group_alone():
    buckets = three_buckets()
    assert len({spec.dtype for spec, _ in buckets}) >= 2
    default_port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=TIMEOUT))
    try:
        default = dist.group.WORLD
        port = free_port()
        ctx = mp.get_context("spawn")
        result, taken = ctx.Queue(), ctx.Event()
        receiver = ctx.Process(target=_receive, args=(port, [s.to_dict() for s, _ in buckets], result, taken))
        receiver.start()
        try:
            group = WeightUpdateGroup(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                                      backend="gloo", group_name="weights-test", timeout_s=TIMEOUT)
            sent = send_buckets(group, buckets)
            got = result.get(timeout=TIMEOUT)
            taken.set()
            group.destroy()
            group.destroy()
            receiver.join(TIMEOUT)
            assert receiver.exitcode == 0
        finally:
            if receiver.is_alive():
                receiver.kill()
        assert sent == sum(spec.nbytes for spec, _ in buckets)
        for (spec, flat), copies in zip(buckets, got):
            for name, view in unpack_bucket(spec, flat):
                assert torch.equal(copies[name], view), name
        assert dist.is_initialized() and dist.group.WORLD is default and dist.get_world_size() == 1
        x = torch.ones(3)
        dist.all_reduce(x)
        assert torch.equal(x, torch.ones(3))
    finally:
        dist.destroy_process_group()


def test_group_refuses_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        WeightUpdateGroup(master_address="127.0.0.1", master_port=1, rank=0, world_size=1, backend="mpi",
                          group_name="g")
    with pytest.raises(ValueError, match="rank"):
        WeightUpdateGroup(master_address="127.0.0.1", master_port=1, rank=2, world_size=2, backend="gloo",
                          group_name="g")


def test_send_buckets_is_only_for_the_source_rank():
    port = free_port()
    group = WeightUpdateGroup(master_address="127.0.0.1", master_port=port, rank=0, world_size=1,
                              backend="gloo", group_name="solo", timeout_s=TIMEOUT)
    try:
        buckets = three_buckets()
        assert send_buckets(group, buckets) == sum(s.nbytes for s, _ in buckets)  # world 1: a no-op broadcast
        with pytest.raises(ValueError, match="src"):
            send_buckets(group, buckets, src=1)
    finally:
        group.destroy()
