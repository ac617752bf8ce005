"""Resume streamed state on another data-parallel size: DP=2 -> DP=1 and DP=1 -> DP=2.

ShardedMixedPrecisionAdam over fp32 model params, so a DP=1 run fed the fp32 average of two virtual
ranks' grads is bit-identical to the DP=2 run (two processes over gloo). Checked:
the gathered masters, moments and step counts after a resharded load equal those saved, bit for bit,
and the resumed run equals the uninterrupted one, bit for bit. DP=2 -> DP=2 (same layout) resumes
in new processes too. Every run is a set of forked children (DP=2: two, over gloo) of a parent that
never built an optimizer or a process group.
"""

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from test_checkpoint import (  # noqa: E402,F401  (_restarted_process: autouse fixture)
    _restarted_process, assert_same, build, restart, gather, in_child, in_children, load, save, state,
    state_parts, train)

FP32 = torch.float32


def _dp1_train_save(root, base):
    params, opt, store = build("sharded", root, dtype=FP32)
    train(params, opt, range(3), virtual_world=2)
    at_save = state(store, params)
    save(params, store, base)
    train(params, opt, range(3, 6), virtual_world=2)
    return at_save, state(store, params)


def _dp1_load_train(root, base):
    params, opt, store = build("sharded", root, dtype=FP32)
    assert load(params, opt, store, base)
    loaded = state(store, params)
    train(params, opt, range(3, 6), virtual_world=2)
    return loaded, state(store, params)


def _dp2_rank(phase, rank, port, tmp):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    root, out = os.path.join(tmp, "live2"), {}

    def run(base, name, save_to=None):
        params, opt, store = build("sharded", root, dtype=FP32)
        assert opt.dp_world_size == 2
        if save_to is None:
            assert load(params, opt, store, base)
        else:
            train(params, opt, range(3), rank, world=2)
        out[name + "_at3"] = (state_parts(store), [p.detach().clone() for p in params])
        if save_to is not None:
            save(params, store, save_to)
        train(params, opt, range(3, 6), rank, world=2)
        out[name + "_at6"] = (state_parts(store), [p.detach().clone() for p in params])
        store.close()

    try:
        if phase == "save":
            run(None, "trained", save_to=os.path.join(tmp, "dp2_iter3"))
        else:
            run(os.path.join(tmp, "dp2_iter3"), "same_dp")
            restart()
            run(os.path.join(tmp, "dp1_iter3"), "resharded")
    finally:
        dist.destroy_process_group()
    return out


def _dp2(phase, tmp):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = in_children(_dp2_rank, [(phase, r, port, str(tmp)) for r in range(2)])
    return {k: gather([results[0][k][0], results[1][k][0]], results[0][k][1]) for k in results[0]}


def test_resume_on_another_data_parallel_size(tmp_path):
    dp1_at3, dp1_at6 = in_child(_dp1_train_save, tmp_path / "live1", str(tmp_path / "dp1_iter3"))
    dp2 = _dp2("save", tmp_path)
    # The premise: DP=2 and DP=1-with-averaged-grads are the same run, bit for bit.
    assert_same(dp2["trained_at3"], dp1_at3, "DP=2 vs DP=1 after 3 steps")
    assert_same(dp2["trained_at6"], dp1_at6, "DP=2 vs DP=1 after 6 steps")
    assert sorted(os.listdir(tmp_path / "dp2_iter3/nvme_opt_state")) == ["rank00000", "rank00001"]
    assert os.listdir(tmp_path / "dp1_iter3/nvme_opt_state") == ["rank00000"]

    loaded, resumed = in_child(_dp1_load_train, tmp_path / "live1", str(tmp_path / "dp2_iter3"))
    assert_same(loaded, dp2["trained_at3"], "DP=2 -> DP=1: state after load")
    assert_same(resumed, dp1_at6, "DP=2 -> DP=1: resumed run")

    dp2 = _dp2("load", tmp_path)
    assert_same(dp2["same_dp_at3"], dp1_at3, "DP=2 -> DP=2: state after load")
    assert_same(dp2["same_dp_at6"], dp1_at6, "DP=2 -> DP=2: resumed run")
    assert_same(dp2["resharded_at3"], dp1_at3, "DP=1 -> DP=2: state after load")
    assert_same(dp2["resharded_at6"], dp1_at6, "DP=1 -> DP=2: resumed run")


def test_resharding_over_data_parallelism_reads_only_this_ranks_tensor_parallel_shard():
    """TP2 x DP1 saved, TP2 x DP2 loading: every TP rank's store has the same identity, over its own params
    (the megatron binding names them with their shard); a rank reshards from its TP shard's states only."""
    from types import SimpleNamespace

    from miles_plugins.optimizers.streaming.bind.megatron_optimizer import name_shard
    from miles_plugins.optimizers.streaming.checkpoint.save_load import same_shard

    assert name_shard("pp1.chunk0.tp1.module.decoder.layers.0.mlp.linear_fc1.weight") == "pp1.tp1"
    assert name_shard("pp0.chunk1.ep3.etp0.module.decoder.layers.1.mlp.experts.weight1") == "pp0.ep3.etp0"
    assert name_shard("param3") == name_shard("x.y") == ""  # not the binding's form (a name read from disk)

    def saved(rank, tp, params):
        return (f"nvme_opt_state/rank{rank:05d}/opt0_0",
                {"entries": [{"name": f"pp0.chunk0.tp{tp}.{p}"} for p in params]})

    # TP rank 1 at DP 2 holds qkv and norm; the checkpoint's DP 1 states: TP rank 0's, TP rank 1's
    manifests = [saved(0, 0, ["qkv.weight", "norm.weight"]), saved(1, 1, ["qkv.weight", "norm.weight"])]
    tp1 = SimpleNamespace(model_params={"pp0.chunk0.tp1.qkv.weight": 8, "pp0.chunk0.tp1.norm.weight": 4},
                          shard_of=name_shard)
    assert same_shard(manifests, tp1) == [manifests[1]]
    # a DP rank of this shard whose slice holds a param this model lacks stays (the coverage check names it)
    larger = [saved(0, 1, ["qkv.weight"]), saved(1, 1, ["extra.weight"])]
    assert same_shard(larger, tp1) == larger
    assert same_shard(manifests, SimpleNamespace(model_params=tp1.model_params, shard_of=None)) == manifests
