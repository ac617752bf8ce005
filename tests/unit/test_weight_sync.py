"""The weight handoff's pure parts: routes, who feeds whom, the layer-by-layer conversion, the metrics."""

import pytest
import torch

from miles.ray.weight_sync import EnginePayload, WeightRoutes, engine_feed_ranks, payload_peer_ranks, plan_routes
from miles.weights.push import PayloadPeers


def test_auto_hands_colocated_engines_by_reference_and_broadcasts_the_rest():
    routes = plan_routes("auto", num_ranks=4, engine_ranks=[0, 2, None])
    assert routes.ipc == {0: (0,), 2: (1,)}
    assert routes.broadcast == (2,)
    assert "rank 0 -> engine 0" in routes.describe() and "broadcast from rank 0 to engine(s) 2" in routes.describe()


def test_two_engines_on_one_rank_are_both_fed_by_it():
    assert plan_routes("ipc", num_ranks=1, engine_ranks=[0, 0]).ipc == {0: (0, 1)}


def test_distributed_broadcasts_to_every_engine():
    routes = plan_routes("distributed", num_ranks=2, engine_ranks=[0, 1])
    assert routes == WeightRoutes(ipc={}, broadcast=(0, 1))


def test_ipc_refuses_an_engine_that_shares_no_rank():
    with pytest.raises(ValueError, match=r"engine\(s\) \[1\] share no GPU"):
        plan_routes("ipc", num_ranks=2, engine_ranks=[0, None])
    with pytest.raises(ValueError, match="must be one of"):
        plan_routes("nccl", num_ranks=1, engine_ranks=[0])
    with pytest.raises(ValueError, match=r"train rank 3 is not in \[0, 2\)"):
        plan_routes("auto", num_ranks=2, engine_ranks=[3])


def _info(node, gpu=None):
    return {"node_id": node, "cuda_visible_devices": gpu}


def test_feed_ranks_on_gpu_need_the_same_gpu_of_the_colocated_rank():
    ranks = [_info("a", "0"), _info("a", "1")]
    engines = [_info("a", "0"), _info("a", "0")]
    # engine 1 is placed with rank 1 but sees GPU 0: it cannot open rank 1's handles
    assert engine_feed_ranks(ranks, engines, use_gpu=True, colocated_rank=[0, 1]) == [0, None]
    assert engine_feed_ranks(ranks, engines, use_gpu=True, colocated_rank=None) == [None, None]


def test_feed_ranks_on_cpu_take_any_rank_of_the_node():
    ranks = [_info("a"), _info("b")]
    engines = [_info("b"), _info("c")]
    assert engine_feed_ranks(ranks, engines, use_gpu=False, colocated_rank=None) == [1, None]
    assert engine_feed_ranks(ranks, [_info("a")], use_gpu=False, colocated_rank=[1]) == [0]


def test_an_sglang_engine_with_tp_takes_each_ranks_payload_from_the_train_rank_on_its_gpu():
    sglang_tp2 = EnginePayload("sglang_flattened_bucket", 2)
    ranks = [_info("a", "0"), _info("a", "1"), _info("a", "2"), _info("b", "0")]
    routes = plan_routes("ipc", num_ranks=4, engine_ranks=[0, 2])
    # engine 0: its rank i on GPU i; engine 1's next rank is on node b
    assert payload_peer_ranks(routes, sglang_tp2, ranks) == {0: PayloadPeers(ranks=(0, 1), caller=0)}
    # ranks in the engine's order are by GPU number (10 after 9), whatever order Ray gave them
    shuffled = [_info("a", "10"), _info("a", "9"), _info("a", "11"), _info("a", "8")]
    tp4 = EnginePayload("sglang_flattened_bucket", 4)
    assert payload_peer_ranks(plan_routes("ipc", num_ranks=4, engine_ranks=[0]), tp4, shuffled) == {
        0: PayloadPeers(ranks=(3, 1, 0, 2), caller=0)}
    assert payload_peer_ranks(routes, EnginePayload("sglang_flattened_bucket", 1), ranks) == {}
    assert payload_peer_ranks(routes, EnginePayload("miles_flat_bucket", 2), ranks) == {}
    # a rank feeding two engines hands each all its payloads; two ranks on one GPU are no peers
    assert payload_peer_ranks(plan_routes("ipc", num_ranks=2, engine_ranks=[0, 0]), sglang_tp2, ranks) == {}
    assert payload_peer_ranks(routes, sglang_tp2, [_info("a", "0")] * 4) == {}


def _tiny_moe(transformers, seed: int):
    """A 2-layer, 4-expert Qwen3-MoE config and a random HF state dict of it."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return cfg, {k: torch.randn_like(v) for k, v in transformers.Qwen3MoeForCausalLM(cfg).state_dict().items()}


def test_layer_by_layer_conversion_equals_the_dict_one():
    transformers = pytest.importorskip("transformers")
    from miles.backends.megatron_backend.convert import hf_to_megatron, iter_megatron_to_hf, megatron_to_hf

    cfg, hf = _tiny_moe(transformers, seed=0)
    mcore = hf_to_megatron(hf, cfg)
    pairs = list(iter_megatron_to_hf(mcore, cfg, hf_moe_layout="fused"))
    whole = megatron_to_hf(mcore, cfg, hf_moe_layout="fused")
    assert [k for k, _ in pairs] == list(whole) and len({k for k, _ in pairs}) == len(pairs)
    assert all(torch.equal(v, whole[k]) for k, v in pairs)
    assert set(whole) == set(hf) and all(torch.equal(whole[k], hf[k]) for k in hf)


def test_layer_experts_callback_supplies_the_other_ranks_experts():
    """EP 2 simulated in one process: each rank's state has half the experts; the callback hands over
    the layer's experts of both ranks, and the result is the full HF state."""
    transformers = pytest.importorskip("transformers")
    from miles.backends.megatron_backend.convert import experts_to_global, hf_to_megatron, iter_megatron_to_hf

    cfg, hf = _tiny_moe(transformers, seed=1)
    ranks = [hf_to_megatron(hf, cfg, ep_rank=r, ep_size=2) for r in range(2)]
    calls = []

    def layer_experts(layer, local):
        calls.append(layer)
        full = {}
        for r, state in enumerate(ranks):
            mine = {k: state[k] for k in local}
            full.update(experts_to_global(mine, cfg, r, 2))
        return full

    out = dict(iter_megatron_to_hf(ranks[0], cfg, hf_moe_layout="fused", layer_experts=layer_experts))
    assert calls == [0, 1]
    assert set(out) == set(hf) and all(torch.equal(out[k], hf[k]) for k in hf)


def test_rollout_record_splits_the_train_call_and_reports_the_handoff():
    from types import SimpleNamespace

    from miles.metrics import format_rollout_line, rollout_record

    rank = {"loss": 0.5, "grad_norm": 1.0, "clipfrac": 0.0, "train_rollout_logprob_abs_diff": 0.0,
            "host_rss_peak_bytes": 2 << 30, "forward_backward_seconds": 1.0, "optimizer_step_seconds": 0.25,
            "train_seconds": 1.5}
    handoff = [{"weight_handoff_seconds": 0.05, "weight_handoff_bytes": 2 << 30, "weight_handoff_buckets": 4,
                "weight_handoff_largest_bucket_bytes": 512 << 20, "weight_handoff_through_host": False}]
    timings = {"generate_seconds": 1.0, "train_seconds": 1.6, "sleep_seconds": 0.1, "wake_seconds": 0.1,
               "step_seconds": 3.0}
    rec = rollout_record(0, [1.0, 0.0], [SimpleNamespace(response_ids=[1, 2])] * 2,
                         [rank, {**rank, "train_seconds": 2.0, "host_rss_peak_bytes": 3 << 30}],
                         [], [], timings, None, handoff)
    assert rec["forward_backward_seconds"] == 1.0 and rec["train_rank_seconds"] == 2.0
    assert rec["host_rss_peak_gb"] == (3 << 30) / 1e9  # the largest rank's
    assert rec["other_seconds"] == pytest.approx(0.75)
    assert rec["weight_handoff_seconds"] == 0.05 and rec["weight_handoff_buckets"] == 4
    line = format_rollout_line(rec, 1)
    assert "train 1.60 (fb 1.00 opt 0.25 other 0.75) weights 0.05" in line  # no FLOPs counted: no MFU
    assert rec["train_mfu"] is None and rec["train_model_flops"] is None
    counted = {**rank, "model_flops": 4e12, "device_peak_flops": 1e12}
    rec = rollout_record(0, [1.0], [SimpleNamespace(response_ids=[1])], [counted, {**counted, "model_flops": 2e12}],
                         [], [], timings, None, handoff)
    # 6e12 FLOPs over two devices of 1e12 FLOP/s: 3 s at peak, done in the slowest rank's 1.0 s
    assert rec["train_model_flops"] == 6e12 and rec["forward_backward_floor_seconds"] == 3.0
    assert rec["train_mfu"] == 3.0


def test_the_rollout_line_fits_one_terminal_line():
    """Everything on: streaming, the handoff, a checkpoint, the figures of a large run."""
    from types import SimpleNamespace

    from miles.metrics import ROLLOUT_LINE_WIDTH, format_rollout_line, rollout_record

    rank = {"loss": -0.0123456, "grad_norm": 1.0, "clipfrac": 0.0, "train_rollout_logprob_abs_diff": 0.0,
            "host_rss_peak_bytes": 2 << 30, "forward_backward_seconds": 20.45, "optimizer_step_seconds": 9.37,
            "train_seconds": 30.6, "model_flops": 2e16, "device_peak_flops": 989e12,
            "stream_bytes_read": 123 << 30, "stream_bytes_written": 123 << 30, "stream_disk_bytes_read": 100 << 30,
            "stream_disk_bytes_written": 100 << 30, "stream_tier_fill_bytes": 0, "stream_seconds": 50.0,
            "stream_io_seconds": 10.0, "stream_peak_resident_bytes": 1, "stream_prefetched_buckets": 2,
            "stream_ram_state_bytes": 3 << 30, "stream_disk_state_bytes": 1 << 30}
    handoff = [{"weight_handoff_seconds": 1.234, "weight_handoff_bytes": 1, "weight_handoff_buckets": 1,
                "weight_handoff_largest_bucket_bytes": 1, "weight_handoff_through_host": False}]
    timings = {"generate_seconds": 40.2, "train_seconds": 31.2, "sleep_seconds": 5.61, "wake_seconds": 4.27,
               "step_seconds": 95.3}
    rec = rollout_record(99, [1.0], [SimpleNamespace(response_ids=[1])], [rank], [], [], timings,
                         "/ckpt/rollout_000100", handoff)
    line = format_rollout_line(rec, 1000)
    assert len(line) <= ROLLOUT_LINE_WIDTH, (len(line), line)
    assert "(fb 20.4 opt 9.37 mfu 99%)" in line  # 2e16 FLOPs / 989e12 FLOP/s = 20.2 s of the 20.45


def test_bench_phase_report_against_the_floors():
    from miles.bench.rl import phase_report

    rec = {"samples": 4, "response_len_mean": 10.0, "generate_seconds": 2.0, "train_seconds": 1.5,
           "forward_backward_seconds": 1.0, "optimizer_step_seconds": 0.2, "train_rank_seconds": 1.3,
           "other_seconds": 0.1, "weight_sync_seconds": 0.2, "weight_handoff_seconds": 0.1,
           "weight_handoff_bytes": 4e9, "weight_handoff_buckets": 8, "offload_bytes": 2e9, "sleep_seconds": 1.0,
           "wake_seconds": 1.0, "engine_release_seconds": 0.1, "engine_resume_seconds": 0.1, "step_seconds": 6.0}
    rates = {"device_copy": 2e12, "d2h_pinned": 50e9, "h2d_pinned": 50e9, "disk_write": 2e9, "disk_read": 1e9}
    disk = phase_report([rec, rec], "disk", rates)
    assert disk["generate"]["tokens_per_second"] == 20.0
    assert disk["train"]["floor"] == pytest.approx(1.2) and disk["train"]["ratio"] == pytest.approx(1.25)
    assert disk["weights"]["floor"] == pytest.approx(0.002)
    assert disk["sleep"]["floor"] == pytest.approx(1.0) and disk["wake"]["floor"] == pytest.approx(2.0)
    assert disk["step"]["floor"] == pytest.approx(2.0 + 1.2 + 0.002 + 1.0 + 2.0)
    cpu = phase_report([rec], "cpu", rates)
    assert cpu["sleep"]["floor"] == pytest.approx(0.04)
    assert disk["train"]["mfu"] is None
    gpu = {**rec, "forward_backward_floor_seconds": 0.3, "train_mfu": 0.3}  # the FLOPs at peak: 0.3 s of the 1.0
    on_gpu = phase_report([gpu, gpu], "disk", rates)
    assert on_gpu["train"]["floor"] == pytest.approx(0.5) and on_gpu["train"]["ratio"] == pytest.approx(3.0)
    assert on_gpu["train"]["mfu"] == pytest.approx(0.3)


def test_a_bucket_cuda_refuses_to_export_goes_through_host_memory(monkeypatch, caplog):
    """The fallback's logic with the refusal simulated (CPU here): the first refusal switches the rest of
    the handoff to host shared memory, with one warning."""
    from types import SimpleNamespace

    from miles.weights import iter_buckets, push

    calls = []

    def fake_share(spec, flat, **kw):
        calls.append(flat.device.type)
        if getattr(flat, "_pretend_cuda", False):
            raise RuntimeError("CUDA error: invalid argument\nmore")
        return SimpleNamespace(index=spec.index, release=lambda: None)

    class Flat(torch.Tensor):
        pass

    monkeypatch.setattr(push, "share_bucket", fake_share)
    sharer, builder = push.Sharer(), push.MilesFlatBuckets()
    buckets = list(iter_buckets([("a", torch.ones(4)), ("b", torch.ones(8))], 16))
    first = buckets[0][1].as_subclass(Flat)
    first._pretend_cuda = True
    monkeypatch.setattr(Flat, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(Flat, "cpu", lambda self: torch.Tensor.cpu(self).as_subclass(torch.Tensor))
    with caplog.at_level("WARNING", logger="miles.weights.push"):
        assert [p.index for p in builder.share(sharer, buckets[0][0], first, 1)[0]] == [0]
        assert [p.index for p in builder.share(sharer, *buckets[1], 1)[0]] == [1]
    assert sharer.through_host and caplog.text.count("through host shared memory") == 1


def test_a_resumed_run_replaces_the_records_it_writes_again(tmp_path):
    import json

    from miles.metrics import MetricsSink

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"rollout_id": i, "reward_mean": i, "run_id": "first"}) + "\n"
                            for i in range(4)) + "not json\n")
    sink = MetricsSink(str(path), None, "second", superseded_runs=["first"], start_rollout=2)
    sink.write({"rollout_id": 2, "reward_mean": 20})
    sink.close()
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert [(r["rollout_id"], r["run_id"]) for r in records] == [(0, "first"), (1, "first"), (2, "second")]
    assert records[-1]["reward_mean"] == 20 and "not json" in lines


def test_the_first_steps_disk_writes_are_its_own(tmp_path):
    """The mains evicted at construction are not counted as the first step's disk writes (a mixed-precision
    optimizer streams them: the torch backend's sharded Adam)."""
    from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam
    from miles_plugins.optimizers.nvme_stream import stream_optimizer_state

    params = [torch.nn.Parameter(torch.randn(3000, dtype=torch.bfloat16)) for _ in range(2)]
    opt = ShardedMixedPrecisionAdam([{"params": params}], lr=1e-3, optimizer_cls=torch.optim.AdamW)
    store = stream_optimizer_state(opt, dir=str(tmp_path))
    try:
        for p in params:
            p.grad = torch.ones_like(p)
        opt.reduce_grads()
        opt.update()
        step = store.stats.last_step
        assert step.disk_bytes_written <= step.bytes_written, (step.disk_bytes_written, step.bytes_written)
    finally:
        store.close()


def test_a_store_knob_given_at_its_default_value_is_used_as_given(make_config):
    """'Let the store choose' is None, not 'the flag equals its default': passing the default explicitly
    fixes the bucket size; not passing it leaves the store to fit it."""
    from miles.config import store_config
    from miles_plugins.optimizers.nvme_stream import DEFAULT_BUCKET_NUMEL

    stream = ("--tiny-model", "--stream-optimizer-state-to-disk", "--offload-train-target=disk")
    chosen = store_config(make_config(*stream), 0, 1)
    assert chosen.bucket_numel is None and chosen.device_budget_mb is None
    given = store_config(make_config(*stream, "--stream-optimizer-state-bucket-numel", str(DEFAULT_BUCKET_NUMEL),
                                     "--stream-optimizer-state-device-budget-mb", "4096"), 0, 1)
    assert given.bucket_numel == DEFAULT_BUCKET_NUMEL and given.device_budget_mb == 4096
    with pytest.raises(Exception, match="device-budget-mb must be a positive budget in MiB"):
        make_config(*stream, "--stream-optimizer-state-device-budget-mb", "0")


def test_the_train_group_tells_each_rank_its_engines_and_its_peers(monkeypatch):
    """RayTrainGroup.push_weights: rank 0 calls the TP-2 engine with rank 1 as its peer, rank 1 only
    contributes its payload, rank 2 feeds nothing (it still iterates: expert gathers are collectives)."""
    from miles.ray import train_group as tg

    calls = []

    class Method:
        def __init__(self, rank, name):
            self.rank, self.name = rank, name

        def remote(self, *args):
            calls.append((self.rank, self.name, args))
            return (self.rank, self.name)

    class Actor:
        def __init__(self, rank):
            self.push_weights = Method(rank, "push_weights")
            self.join_payload_groups = Method(rank, "join_payload_groups")

    group = object.__new__(tg.RayTrainGroup)
    group.actors, group.labels = [Actor(r) for r in range(3)], ["r0", "r1", "r2"]
    monkeypatch.setattr(tg, "wait_all", lambda refs, what, labels: refs)
    routes = plan_routes("ipc", num_ranks=3, engine_ranks=[0])
    peers = PayloadPeers(ranks=(1, 0), caller=0)
    group.join_payload_groups([(1, 0)])
    group.push_weights(routes, ["engine 0"], "sglang_flattened_bucket", 2, {0: peers})
    assert [c for c in calls if c[1] == "join_payload_groups"] == [(r, "join_payload_groups", ([(1, 0)],))
                                                                    for r in range(3)]
    pushes = {r: args for r, name, args in calls if name == "push_weights"}
    assert pushes == {0: (["engine 0"], [], "sglang_flattened_bucket", 2, peers),
                      1: ([], [], "sglang_flattened_bucket", 2, peers),
                      2: ([], [], "sglang_flattened_bucket", 2, None)}
