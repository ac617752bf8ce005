"""Soak (issue 13): random `kill -9` points across step, save, sleep and resume, at DP=2 over gloo.

    python -m pytest -m slow tests/soak -q            # MILES_SOAK_KILLS=100 (default), MILES_SOAK_SEED=0
    MILES_SOAK_HOST_CACHE_MB=1 python -m pytest -m slow tests/soak -q   # the whole state in the host tier
    MILES_SOAK_HOST_TIER_FRACTION=0.5 python -m pytest -m slow tests/soak -q   # half in RAM, half in files

A job is two forked ranks (torch's ShardedMixedPrecisionAdam, its state streamed with verify on) that
train STEPS steps and, every SAVE_EVERY steps, checkpoint (rank 0: model weights; each rank: its
streamed state, in the background; "sleep": flush; then both: wait for the save; rank 0 publishes
`latest`). A launch resumes from `latest`. One rank SIGKILLs itself at its k-th kill point (k random
over a whole run's points: every pread/pwrite of the I/O engine, every point of a save or load that
test_checkpoint.inject_faults marks, every phase boundary); the parent then SIGKILLs the other rank
wherever it is, as a scheduler ends a job. Launches repeat until a run completes (an episode), and
episodes until MILES_SOAK_KILLS kills have happened. Checked:
  - every resume holds exactly the uninterrupted run's state at that checkpoint (torch.equal on
    model params, mains, both moments and Adam steps, of both ranks);
  - every completed run ends bit-identical to the uninterrupted run;
  - after each episode nothing is left under the store root, and the checkpoint base holds only
    complete checkpoints (no `.tmp` anything).
"""

import os
import random
import shutil
import signal
import sys
import time
import traceback

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))

from test_checkpoint import assert_same, build, gather, inject_faults, set_grads, state_parts  # noqa: E402

from miles_plugins.optimizers.streaming.io import engine as engine_mod  # noqa: E402

pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("MILES_SOAK_KILLS", "100"))
SEED = int(os.environ.get("MILES_SOAK_SEED", "0"))
# 1 MiB holds this test's whole state: the write-back tier, whose bucket files lag until flush and save
HOST_CACHE_MB = int(os.environ.get("MILES_SOAK_HOST_CACHE_MB", "0"))
# A partial tier: this fraction of each rank's state in host RAM only (whole buckets), the rest in files with
# no images. The state (~0.2 MB a rank) is below host_cache_mb's unit, so the budget is set in bytes.
HOST_TIER_FRACTION = float(os.environ.get("MILES_SOAK_HOST_TIER_FRACTION", "0"))
STEPS, SAVE_EVERY, WORLD = 6, 2, 2
LAUNCH_TIMEOUT = 120


# ---- one rank of one launch (a forked child) -------------------------------------------------------
def _kill_points(rank, kill_rank, kill_at):
    """A counter of kill points; SIGKILL this process at the kill_at-th one (when it is the rank to die)."""
    calls = [0]

    def point():
        calls[0] += 1
        if rank == kill_rank and calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def then_point(fn):
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs)
            point()
            return result
        return wrapped

    inject_faults(point)  # inside saves and loads
    engine_mod.pread_into = then_point(engine_mod.pread_into)  # inside steps, flushes, refreshes
    engine_mod.pwrite_all = then_point(engine_mod.pwrite_all)
    return point, calls


def _replace(path, write):
    """Write `path` through a fixed temporary name and a rename (a rerun overwrites what a kill left)."""
    write(path + ".tmp")
    os.replace(path + ".tmp", path)


def _dump(out, name, value):
    _replace(os.path.join(out, name), lambda p: torch.save(value, p))


def _snapshot(store, params):
    store.flush()
    return {"parts": state_parts(store), "params": [p.detach().clone() for p in params]}


def _rank_main(rank, rendezvous, live, base, out, kill_rank, kill_at, reference):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    point, calls = _kill_points(rank, kill_rank, kill_at)
    params, opt, store = build("sharded", live, verify=True, host_cache_mb=HOST_CACHE_MB)
    point()
    start = 0
    latest = os.path.join(base, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            start = int(f.read())
        checkpoint = os.path.join(base, f"iter_{start}")
        with torch.no_grad():
            for p, w in zip(params, torch.load(os.path.join(checkpoint, "model.pt"))):
                p.copy_(w)
        opt.reload_model_params()
        assert store.load_from(checkpoint), f"{checkpoint} has no streamed state"
        point()
        _dump(out, f"resumed{rank}.pt", {"iteration": start, **_snapshot(store, params)})
    for k in range(start, STEPS):
        set_grads(params, k, rank, WORLD)
        opt.param_groups[1]["lr"] = 3e-3 if k < 3 else 1e-3
        opt.step()
        point()
        if (k + 1) % SAVE_EVERY:
            continue
        checkpoint = os.path.join(base, f"iter_{k + 1}")
        os.makedirs(checkpoint, exist_ok=True)
        if rank == 0:
            _replace(os.path.join(checkpoint, "model.pt"), lambda p: torch.save([q.detach() for q in params], p))
        store.save_to(checkpoint, wait=False)
        point()
        store.flush()  # sleep
        point()
        store.wait_for_save()
        dist.barrier()
        if rank == 0:
            _replace(latest, lambda p: open(p, "w").write(str(k + 1)))
        dist.barrier()
        point()
        if reference:
            _dump(out, f"iter{k + 1}_{rank}.pt", _snapshot(store, params))
    _dump(out, f"final{rank}.pt", {**_snapshot(store, params), "points": calls[0]})
    store.close()
    dist.destroy_process_group()


def _fork_rank(rank, rendezvous, live, base, out, *args):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _rank_main(rank, rendezvous, live, base, out, *args)
            code = 0
        except BaseException:  # the survivor of a kill usually ends here (gloo: peer gone); kept for the parent
            with open(os.path.join(out, f"error{rank}.txt"), "w") as f:
                f.write(traceback.format_exc())
        finally:
            os._exit(code)
    return pid


# ---- the parent -------------------------------------------------------------------------------------
def _launch(tmp, live, base, out, launch, kill_rank=-1, kill_at=0, reference=False):
    """Run both ranks; returns True if they completed, False if the chosen rank was killed (the other
    one is then killed too). Any other ending fails the test."""
    os.makedirs(out, exist_ok=True)
    rendezvous = os.path.join(tmp, f"rendezvous{launch}")
    pids = [_fork_rank(r, rendezvous, live, base, out, kill_rank, kill_at, reference) for r in range(WORLD)]
    deadline, status = time.monotonic() + LAUNCH_TIMEOUT, {}
    while len(status) < WORLD:
        for r, pid in enumerate(pids):
            if r not in status and (done := os.waitpid(pid, os.WNOHANG))[0]:
                status[r] = done[1]
        killed = [r for r, s in status.items() if os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL]
        if killed or time.monotonic() > deadline:
            for r, pid in enumerate(pids):
                if r not in status:
                    os.kill(pid, signal.SIGKILL)
                    status[r] = os.waitpid(pid, 0)[1]
        time.sleep(0.005)
    if os.path.exists(rendezvous):
        os.unlink(rendezvous)
    errors = {}
    for r in range(WORLD):
        path = os.path.join(out, f"error{r}.txt")
        if os.path.exists(path):
            with open(path) as f:
                errors[r] = f.read()
            os.unlink(path)
    if all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in status.values()):
        return True
    assert kill_rank >= 0 and os.WIFSIGNALED(status[kill_rank]) and os.WTERMSIG(status[kill_rank]) == signal.SIGKILL, \
        f"launch {launch} (kill rank {kill_rank} at point {kill_at}) ended otherwise: {status}\n{errors}"
    return False


def _load(out, name):
    return [torch.load(os.path.join(out, f"{name}{r}.pt"), weights_only=False) for r in range(WORLD)]


def _merged(dumps):
    return gather([d["parts"] for d in dumps], dumps[0]["params"])


def _check_resume(out, reference, what):
    """Both ranks resumed (their dumps exist): the state must be the reference's at that checkpoint."""
    paths = [os.path.join(out, f"resumed{r}.pt") for r in range(WORLD)]
    if not all(os.path.exists(p) for p in paths):
        return 0
    dumps = _load(out, "resumed")
    for p in paths:
        os.unlink(p)
    iteration = dumps[0]["iteration"]
    assert {d["iteration"] for d in dumps} == {iteration}
    assert_same(_merged(dumps), reference[iteration], f"{what}: resumed from iter_{iteration}")
    return 1


def _check_nothing_left(live, base):
    assert os.listdir(live) == [], f"left under the store root: {os.listdir(live)}"
    for dirpath, dirnames, filenames in os.walk(base):
        stray = [n for n in dirnames + filenames if ".tmp" in n]
        assert not stray, f"left in the checkpoint base: {[os.path.join(dirpath, n) for n in stray]}"
    iterations = sorted(n for n in os.listdir(base) if n.startswith("iter_"))
    assert iterations == [f"iter_{k}" for k in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)], iterations
    for it in iterations:
        for r in range(WORLD):
            assert os.path.exists(os.path.join(base, it, "nvme_opt_state", f"rank{r:05d}", "opt0_0", "manifest.json"))
        assert os.path.exists(os.path.join(base, it, "model.pt"))


def test_random_kill9_across_step_save_sleep_and_resume(tmp_path, monkeypatch):
    if HOST_TIER_FRACTION:  # the forked ranks inherit it
        from miles_plugins.optimizers.streaming.store import NVMeOptimizerStateStore
        monkeypatch.setattr(NVMeOptimizerStateStore, "_host_cache_bytes",
                            lambda self, config: int(HOST_TIER_FRACTION * self.stats.state_bytes))
    tmp = str(tmp_path)
    live, base, out = (os.path.join(tmp, n) for n in ("live", "ckpt", "out"))
    os.makedirs(live)
    assert _launch(tmp, live, os.path.join(tmp, "ref_ckpt"), out, "ref", reference=True)
    reference = {k: _merged(_load(out, f"iter{k}_")) for k in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)}
    final = _load(out, "final")
    points = min(d["points"] for d in final)  # a whole run's kill points (rank 1's may differ slightly)
    assert points > 50, points  # the tier has fewer: its steps make no pread/pwrite
    shutil.rmtree(os.path.join(tmp, "ref_ckpt"))
    rng = random.Random(SEED)
    kills = resumes = episodes = launch = 0
    started = time.monotonic()
    while kills < KILLS:
        episodes += 1
        shutil.rmtree(base, ignore_errors=True)
        while True:
            launch += 1
            kill = (rng.randrange(WORLD), rng.randint(1, points)) if kills < KILLS else (-1, 0)
            what = f"episode {episodes}, launch {launch} (rank {kill[0]} killed at point {kill[1]} of ~{points})"
            completed = _launch(tmp, live, base, out, launch, *kill)
            resumes += _check_resume(out, reference, what)
            if completed:
                break
            kills += 1
        assert_same(_merged(_load(out, "final")), reference[STEPS], f"episode {episodes}: completed run")
        _check_nothing_left(live, base)
    print(f"\nsoak: {kills} kill -9 points in {episodes} episodes ({launch} launches of 2 ranks), {resumes} resumes "
          f"checked bit-identical, every completed run bit-identical, nothing left behind; "
          f"{time.monotonic() - started:.0f} s", flush=True)
    assert resumes > 0
