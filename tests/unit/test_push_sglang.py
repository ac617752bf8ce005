"""The trainer's push speaks the payload the engine names (miles/weights/push.py): sglang's own bucket by
reference, passed to sglang as it is, and by broadcast over a weight-update group that sglang's ranks join the
way sglang joins one (the fake of tests/fakes/fake_sglang.py, on CPU with gloo)."""

import multiprocessing
import os
import sys

import pytest
import torch
from test_sglang_engine import _load_fake

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, start  # noqa: E402

FAKES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fakes")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _weights():
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(8, 4, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.randn(4, generator=g)),
            ("lm_head.weight", torch.randn(8, 4, generator=g).to(torch.bfloat16))]


def _sglang_rank(port, names, dtypes, shapes, queue, taken):
    """An sglang rank (the fake engine) in its own process: joins at rank 1 and receives one broadcast."""
    sys.path[:0] = [FAKES, REPO]
    fake_sglang = _load_fake()
    engine = fake_sglang.FakeSglangEngine()
    try:
        assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, "miles-weights", "gloo") == (True, "Success")
        assert engine.update_weights_from_distributed(names, dtypes, shapes, "miles-weights",
                                                      load_format="flattened_bucket") == (True, "Success")
        queue.put({n: t.clone() for n, t in engine.weights.items()})
        taken.wait(60)  # the tensors travel as shared memory this process hands out: it outlives the parent's get
        engine.destroy_weights_update_group("miles-weights")
    except BaseException as e:  # the parent reports it
        queue.put(repr(e))


def test_a_trainer_group_meets_sglangs_ranks_and_its_bucket_lands_bit_exact(monkeypatch):
    """The trainer's WeightUpdateGroup and a rank joined as sglang joins (torch's new-group helper under a
    store prefixed with the group name) find each other, and the flat of sglang's own bucket lands bit-exact."""
    from miles.rollout.sglang.payloads import SglangPayloads
    from miles.weights import WeightUpdateGroup, free_port

    fake_sglang = _load_fake()
    named = [(n, t) for n, t in _weights() if t.dtype == torch.bfloat16]
    bucket = SglangPayloads(fake_sglang.FakeFlattenedTensorBucket, fake_sglang.FakeSerializer).bucket(named)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    queue, taken = ctx.Queue(), ctx.Event()
    rank = ctx.Process(target=_sglang_rank, args=(port, [n for n, _ in named], ["bfloat16"] * 2,
                                                  [list(t.shape) for _, t in named], queue, taken))
    rank.start()
    try:
        group = WeightUpdateGroup(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, backend="gloo",
                                  group_name="miles-weights", timeout_s=20)
        group.broadcast(bucket.flat)
        received = queue.get(timeout=60)
        taken.set()
        group.destroy()
    finally:
        rank.join(30)
        if rank.is_alive():
            rank.kill()
    assert isinstance(received, dict), received
    for name, tensor in named:
        assert torch.equal(received[name], tensor)


class _Remote:
    """A Ray method stand-in: ``.remote(...)`` calls the engine now (the push's ``ray.get`` is patched)."""

    def __init__(self, method):
        self.method = method

    def remote(self, *args, **kwargs):
        return self.method(*args, **kwargs)


class _EngineHandle:
    def __init__(self, engine):
        self.update_weights_from_tensor = _Remote(engine.update_weights_from_tensor)
        self.update_weights_from_distributed = _Remote(engine.update_weights_from_distributed)


@pytest.fixture()
def sglang_engine(monkeypatch):
    """An sglang engine (the contract's client) of the fake over HTTP, with ``import sglang`` giving the
    stand-in package (what the trainer's push imports sglang's bucket class from)."""
    from miles.rollout.sglang.engine import SglangRolloutEngine
    from miles.rollout.sglang.payloads import SglangPayloads
    from miles.rollout.sglang.transport import HttpSglang

    fake_sglang = _load_fake()
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for k in saved:
        del sys.modules[k]
    monkeypatch.syspath_prepend(FAKES)
    servers = []

    def make(tp_size=1):
        fake = fake_sglang.FakeSglangEngine(tp_size=tp_size, random_seed=5)
        server = fake_sglang.FakeSglangServer(fake).__enter__()
        servers.append(server)
        payloads = SglangPayloads(fake_sglang.FakeFlattenedTensorBucket, fake_sglang.FakeSerializer)
        return SglangRolloutEngine(HttpSglang(server.url, timeout_s=60), tp_size=tp_size, payloads=payloads), fake

    yield make
    for s in servers:
        s.__exit__(None, None, None)
    for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
        del sys.modules[k]
    sys.modules.update(saved)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_push_builds_sglangs_own_bucket_and_the_engine_hands_it_over_as_is(sglang_engine, monkeypatch,
                                                                               tp_size):
    import ray

    from miles.rollout.contract import SGLANG_FLATTENED_BUCKET
    from miles.weights.push import push_weights

    fake_sglang = _load_fake()
    engine, fake = sglang_engine(tp_size)
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    engine.begin_weight_update(1)
    stats = push_weights(_weights(), payload=SGLANG_FLATTENED_BUCKET, tp_size=tp_size,
                         ipc_engines=[_EngineHandle(engine)], max_bucket_bytes=1 << 20)
    engine.end_weight_update(1)
    for name, tensor in _weights():
        assert torch.equal(fake.weights[name], tensor), name
    calls = [c[1] for c in fake.calls if c[0] == "update_weights_from_tensor"]
    assert calls == [{"payloads": tp_size, "load_format": "flattened_bucket", "flush_cache": False}] * 2  # bf16, fp32
    pad = fake_sglang.FakeFlattenedTensorBucket.PAD  # the bytes are sglang's layout's, not miles' aligned one
    assert stats["weight_handoff_bytes"] == sum(-(-t.numel() * t.element_size() // pad) * pad for _, t in _weights())
    assert stats["weight_handoff_buckets"] == 2 and not stats["weight_handoff_through_host"]


def test_the_sglang_engine_takes_no_miles_bucket_to_repack(sglang_engine):
    from miles.weights import iter_buckets, share_bucket

    engine, fake = sglang_engine()
    (spec, flat), = list(iter_buckets([(n, t) for n, t in _weights() if t.dtype == torch.bfloat16], 1 << 20))
    shared = share_bucket(spec, flat)
    engine.begin_weight_update(1)
    try:
        with pytest.raises(TypeError, match="sglang_flattened_bucket.*got 1 of \\['SharedBucket'\\]"):
            engine.update_weights_from_tensor([shared])
    finally:
        shared.release()
    assert not [c for c in fake.calls if c[0] == "update_weights_from_tensor"]


def _trainer_source(port, queue):
    """Train rank 0 in its own process: the source of the group, pushing sglang's bucket by broadcast."""
    sys.path[:0] = [FAKES, REPO]
    _load_fake()
    import ray

    from miles.rollout.contract import SGLANG_FLATTENED_BUCKET
    from miles.weights import WeightUpdateGroup
    from miles.weights.push import push_weights

    try:
        group = WeightUpdateGroup(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                                  backend="gloo", group_name="miles-weights", timeout_s=60)
        specs = []

        class Engine:  # the engine's receive runs in the parent, which calls it with the same specs
            update_weights_from_distributed = _Remote(lambda s, name: specs.append((s, name)))

        ray.get = lambda refs: refs
        stats = push_weights(_weights(), payload=SGLANG_FLATTENED_BUCKET, group=group, group_engines=[Engine()],
                             max_bucket_bytes=1 << 20)
        group.destroy()
        queue.put({"specs": specs, "stats": stats})
    except BaseException as e:
        queue.put(repr(e))


def test_broadcast_to_sglang_from_the_trainer_lands_bit_exact(sglang_engine):
    """The trainer's broadcast path end to end on CPU (gloo): train rank 0's push broadcasts sglang's own
    bucket of each spec; the sglang engine asks sglang to receive the spec's names, dtypes and shapes."""
    from miles.weights import free_port

    engine, fake = sglang_engine()
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    source = ctx.Process(target=_trainer_source, args=(port, queue))
    source.start()
    try:
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, "miles-weights", "gloo")
        from miles.weights import plan_buckets

        specs = [spec.to_dict() for spec, _ in plan_buckets(_weights(), 1 << 20)]
        engine.begin_weight_update(1)
        stats = engine.update_weights_from_distributed(specs, "miles-weights")
        engine.end_weight_update(1)
        sent = queue.get(timeout=60)
    finally:
        source.join(30)
        if source.is_alive():
            source.kill()
    assert isinstance(sent, dict), sent
    assert [s for s, _ in sent["specs"]] == [[d] for d in specs] and {n for _, n in sent["specs"]} == {"miles-weights"}
    assert stats["tensors"] == 3 and sent["stats"]["weight_handoff_buckets"] == 2
    assert [r["load_format"] for r in fake.distributed_requests] == ["flattened_bucket"] * 2
    for name, tensor in _weights():
        assert torch.equal(fake.weights[name], tensor), name
    engine.close()
    assert not fake.groups


def _peer_rank(rank, port, engine_order, engine_fails):
    """Train rank ``rank`` of 2 feeding one sglang engine of TP 2 (rank 0 runs it and calls it; its rank i on the
    GPU of train rank ``engine_order[i]``): each rank's weights are its own (plus ``rank``), so what each sglang
    rank read tells whose payload it was. What push_weights raised is part of the result."""
    sys.path[:0] = [FAKES, REPO]
    fake_sglang = _load_fake()
    import ray
    import torch.distributed as dist

    from miles.rollout.contract import SGLANG_FLATTENED_BUCKET
    from miles.weights.push import PayloadPeers, push_weights

    ray.get = lambda refs: refs
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    peers = PayloadPeers(engine_order, caller=0, group=dist.new_group([0, 1]))
    engines, fake, server = [], None, None
    if rank == 0:
        from miles.rollout.sglang.engine import SglangRolloutEngine
        from miles.rollout.sglang.payloads import SglangPayloads
        from miles.rollout.sglang.transport import HttpSglang

        fake = fake_sglang.FakeSglangEngine(tp_size=2)
        fake.resident["weights"] = not engine_fails  # released weights: the engine refuses the update
        server = fake_sglang.FakeSglangServer(fake).__enter__()
        payloads = SglangPayloads(fake_sglang.FakeFlattenedTensorBucket, fake_sglang.FakeSerializer)
        engine = SglangRolloutEngine(HttpSglang(server.url, timeout_s=60), tp_size=2, payloads=payloads)
        engine.begin_weight_update(1)
        engines = [_EngineHandle(engine)]
    try:
        stats = push_weights([(n, t + rank) for n, t in _weights()], payload=SGLANG_FLATTENED_BUCKET, tp_size=2,
                             ipc_engines=engines, peers=peers, max_bucket_bytes=1 << 20)
    except Exception as e:  # noqa: BLE001 - the parent checks what each rank raised
        return {"rank": rank, "raised": f"{type(e).__name__}: {e}"}
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    if fake is None:
        return {"rank": rank, "stats": stats}
    return {"rank": rank, "stats": stats,
            "read": [{n: t.tolist() for n, t in by_rank.items()} for by_rank in fake.received_by_rank],
            "calls": [c[1]["payloads"] for c in fake.calls if c[0] == "update_weights_from_tensor"]}


def _run_peers(engine_fails: bool, engine_order=(0, 1)) -> dict:
    from miles.weights import free_port

    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = start(ctx, results, *[(_peer_rank, (r, port, engine_order, engine_fails)) for r in range(2)])
    return {g["rank"]: g for g in collect(procs, results, 90)}


@pytest.mark.parametrize("engine_order", [(0, 1), (1, 0)])
def test_each_sglang_rank_reads_the_payload_of_the_train_rank_on_its_gpu(engine_order):
    got = _run_peers(engine_fails=False, engine_order=engine_order)
    assert got[0]["calls"] == [2, 2]  # one call per bucket (bf16, fp32), with both ranks' payloads
    for tp_rank, read in enumerate(got[0]["read"]):  # the fp32 bucket's, the last: its train rank's tensors
        assert read == {n: (t + engine_order[tp_rank]).tolist() for n, t in _weights() if t.dtype == torch.float32}
    assert got[1]["stats"]["weight_handoff_buckets"] == 2  # the other rank built and shared every bucket too


def test_a_failed_engine_call_stops_every_peer_instead_of_leaving_it_waiting():
    got = _run_peers(engine_fails=True)
    assert "weights are released" in got[0]["raised"]
    assert "RuntimeError: the rollout engine fed by train ranks [0, 1] failed to load a weight bucket" in got[1]["raised"]
