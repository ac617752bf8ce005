"""A checkpoint must cover exactly this store's params (issue 13 item 3) for every binding.

Before: only the plain-Adam binding listed its params; the ZeRO-1 sharded binding listed none, so a
checkpoint of a 3-layer model loaded into a 2-layer one and `load_from` returned True. Now the sharded
binding lists every param of the model (`ShardedMixedPrecisionAdam.params`, all ranks' together) and
the load refuses, naming the first difference, at DP=1 and DP=2. Same-size resume and resharding across
DP sizes are test_checkpoint.py and test_checkpoint_reshard.py (they run with the list in place).
"""

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402

from test_checkpoint import (  # noqa: E402,F401  (_restarted_process: autouse fixture)
    SHAPES, _restarted_process, build, in_child, in_children, save, train)
from miles_plugins.optimizers.streaming.errors import CheckpointError  # noqa: E402

THREE_LAYERS, TWO_LAYERS = SHAPES, SHAPES[:4]  # the 2-layer model lacks the last two params
REFUSAL = (r"holds 6 params \(14153 elements\), this model 4 \(6175 elements\); first difference: "
           r"param4: 7967 elements in the checkpoint, absent now")


def _train_save(root, base, shapes):
    params, opt, store = build("sharded", root, shapes=shapes)
    train(params, opt, range(2))
    save(params, store, base)
    return opt.dp_world_size


def _load_refused(root, base, shapes):
    params, opt, store = build("sharded", root, shapes=shapes)
    with pytest.raises(CheckpointError, match=REFUSAL):
        store.load_from(base)
    return opt.dp_world_size


def test_sharded_checkpoint_of_a_larger_model_is_refused_at_dp1(tmp_path):
    in_child(_train_save, tmp_path / "live", str(tmp_path / "ckpt"), THREE_LAYERS)
    assert in_child(_load_refused, tmp_path / "live", str(tmp_path / "ckpt"), TWO_LAYERS) == 1


def _dp2_rank(rank, port, tmp, action, shapes):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        return action(os.path.join(tmp, "live"), os.path.join(tmp, "ckpt"), shapes)
    finally:
        dist.destroy_process_group()


def _dp2(tmp, action, shapes):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return in_children(_dp2_rank, [(r, port, str(tmp), action, shapes) for r in range(2)])


def test_sharded_checkpoint_of_a_larger_model_is_refused_on_every_rank_at_dp2(tmp_path):
    assert _dp2(tmp_path, _train_save, THREE_LAYERS) == [2, 2]
    assert sorted(os.listdir(tmp_path / "ckpt" / "nvme_opt_state")) == ["rank00000", "rank00001"]
    assert _dp2(tmp_path, _load_refused, TWO_LAYERS) == [2, 2]
