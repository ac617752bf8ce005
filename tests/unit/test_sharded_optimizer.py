"""ShardedMixedPrecisionAdam: bit-exact against plain AdamW at DP=1 and DP=2 (gloo, two processes).

The DP=2 workers are this file run as a script (robust to pytest's import mode and rootdir)."""
import copy
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam  # noqa: E402

# Odd sizes so params straddle rank boundaries and the last rank needs padding; mixed dtypes
# (an fp32 "router bias", an fp16 param) exercise the byte-packed all-gather.
SHAPES = [(7, 3), (5,), (13,), (3, 3, 2), (1,), (11,)]
DTYPES = [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]
STEPS = 6


def make_params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in zip(SHAPES, DTYPES)]


def groups_of(params):
    return [{"params": params[:3], "lr": 1e-2, "weight_decay": 0.1},
            {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0}]


def has_grad(step, rank, idx):
    if idx == 4 and step == 2:
        return False  # None on every rank: Adam must skip the param this step
    if idx == 5 and step == 0:
        return False  # first grad arrives late: its step counter lags the others
    if idx == 1 and rank == 0 and step in (1, 3):
        return False  # None on one rank only: that rank contributes zeros
    return True


def grad(step, rank, idx):
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + idx)
    return (torch.randn(SHAPES[idx], generator=g) * (0.1 + idx)).to(DTYPES[idx])


def set_grads(params, step, rank):
    for i, p in enumerate(params):
        p.grad = grad(step, rank, i) if has_grad(step, rank, i) else None


def reference(world, steps=STEPS):
    """Plain torch AdamW over fp32 copies, fed the fp32 average of every rank's grads."""
    ref = [p.detach().float().clone() for p in make_params()]
    opt = torch.optim.AdamW(groups_of(ref))
    for k in range(steps):
        for i, r in enumerate(ref):
            if not any(has_grad(k, rank, i) for rank in range(world)):
                r.grad = None
                continue
            acc = torch.zeros(SHAPES[i])
            for rank in range(world):
                if has_grad(k, rank, i):
                    acc = acc + grad(k, rank, i).float()
            r.grad = acc / world if world > 1 else acc
        opt.step()
    return ref


def test_dp1_bit_exact_with_adamw():
    params = make_params()
    opt = ShardedMixedPrecisionAdam(groups_of(params))
    assert opt.param_groups is opt.inner.param_groups
    assert [len(g["params"]) for g in opt.param_groups] == [3, 3]
    for k in range(STEPS):
        set_grads(params, k, 0)
        opt.step()
    ref = reference(world=1)
    for p, s, r in zip(params, opt.shards, ref):
        assert s.param is p and (s.start, s.stop) == (0, p.numel())
        assert s.master.dtype == torch.float32 and torch.equal(s.master, r.view(-1))
        assert torch.equal(p.detach(), r.to(p.dtype))


def test_editing_lr_takes_effect():
    params = make_params()
    opt = ShardedMixedPrecisionAdam(groups_of(params))
    opt.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in params]
    set_grads(params, 0, 0)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params[:3], before[:3]))
    assert not torch.equal(params[3], before[3])


def test_reload_model_params_and_zero_grad():
    params = make_params()
    opt = ShardedMixedPrecisionAdam(groups_of(params))
    set_grads(params, 0, 0)
    opt.step()
    with torch.no_grad():
        for p in params:
            p.copy_(torch.full_like(p, 0.5))
    opt.reload_model_params()
    assert all(torch.equal(s.master, torch.full((s.stop - s.start,), 0.5)) for s in opt.shards)
    opt.zero_grad()
    assert all(p.grad is None for p in params) and all(s.master.grad is None for s in opt.shards)


def test_state_dict_roundtrip():
    a_params, b_params = make_params(), make_params()
    a = ShardedMixedPrecisionAdam(groups_of(a_params))
    b = ShardedMixedPrecisionAdam(groups_of(b_params))
    for k in range(3):
        set_grads(a_params, k, 0)
        a.step()
    with torch.no_grad():
        for pa, pb in zip(a_params, b_params):
            pb.copy_(pa)
    # deepcopy stands in for torch.save/torch.load: torch's load_state_dict aliases state tensors.
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for k in range(3, STEPS):
        set_grads(a_params, k, 0)
        set_grads(b_params, k, 0)
        a.step()
        b.step()
    assert all(torch.equal(sa.master, sb.master) for sa, sb in zip(a.shards, b.shards))
    bad = a.state_dict()
    bad["layout"] = {**bad["layout"], "dp_world_size": 4}
    with pytest.raises(ValueError, match="different sharding layout"):
        b.load_state_dict(bad)


@pytest.mark.parametrize("make, match", [
    (lambda: ShardedMixedPrecisionAdam([]), "empty parameter list"),
    (lambda: ShardedMixedPrecisionAdam([{"params": []}]), "empty parameter list"),
    (lambda: ShardedMixedPrecisionAdam([torch.zeros(2), torch.zeros(2, device="meta")]), "more than one device"),
    (lambda: ShardedMixedPrecisionAdam([torch.zeros(2)], optimizer_cls=torch.optim.SGD), "not an Adam-family"),
    (lambda: ShardedMixedPrecisionAdam([torch.zeros(2)], amsgrad=True), "amsgrad"),
    (lambda: ShardedMixedPrecisionAdam([{"params": [torch.zeros(2)], "amsgrad": True}]), "amsgrad"),
    (lambda: ShardedMixedPrecisionAdam([torch.zeros(2, dtype=torch.float8_e4m3fn)]), "float8_e4m3fn"),
    (lambda: ShardedMixedPrecisionAdam([torch.zeros(3, 2).t()]), "not contiguous"),
    (lambda: ShardedMixedPrecisionAdam([torch.zeros(2)] * 2), "more than once"),
])
def test_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ----------------------------------------------------------------------------- DP=2 over gloo
def _worker(rank, port, out):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    params = make_params()
    opt = ShardedMixedPrecisionAdam(groups_of(params))
    assert opt.dp_world_size == 2 and opt.dp_rank == rank
    for k in range(STEPS):
        set_grads(params, k, rank)
        opt.step()
    torch.save({"params": [p.detach() for p in params],
                "shards": [(s.index, s.start, s.stop, s.master) for s in opt.shards]}, out)
    dist.barrier()  # neither rank tears its pairs down while the other still uses them
    dist.destroy_process_group()
    # gloo's threads sometimes abort the interpreter's own teardown afterwards ("terminate called without
    # an active exception", exit -6) though all work is done and saved: the saved file is what is checked.
    sys.stdout.flush()
    os._exit(0)


def test_dp2_gloo_matches_dp1_on_averaged_grads(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(tmp_path / f"r{r}.pt")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, out.decode()[-4000:]
    results = [torch.load(tmp_path / f"r{r}.pt") for r in range(2)]
    ref = reference(world=2)
    for i, (r, dtype) in enumerate(zip(ref, DTYPES)):
        # Every rank holds the full params, equal to the reference masters cast to the model dtype.
        for res in results:
            assert torch.equal(res["params"][i], r.to(dtype)), f"param {i}"
        # The ranks' masters tile the param exactly once and match the reference bit for bit.
        covered = torch.zeros(r.numel(), dtype=torch.int32)
        for res in results:
            for idx, a, b, master in res["shards"]:
                if idx == i:
                    covered[a:b] += 1
                    assert torch.equal(master, r.view(-1)[a:b]), f"param {i} [{a}:{b}]"
        assert covered.eq(1).all(), f"param {i} coverage {covered.tolist()}"
    assert all(len(res["shards"]) < len(SHAPES) for res in results)  # state really is sharded


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
