"""Weight-handoff bucket files in /dev/shm never outlive their handoff: released on every path of the push
(an engine that fails, an interrupt), and those of a producer killed mid-handoff (SIGKILL: nothing of it
runs) removed by the next process's first share, by their names only (miles/weights/transport.py)."""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from miles.weights import iter_buckets, share_bucket, transport
from miles_plugins.host.ownership import ProcessIdentity

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A train rank's push (miles.weights.push.push_weights) into a fake engine: ray.get stands for the wait
# for the engine's answer. argv[1]: "block" (no answer ever comes) or "ack" (the engine answers at once).
_PUSH = """
import os, sys, time
import ray, torch
from miles.weights.push import push_weights

class Method:
    def remote(self, payloads, load_format):
        return payloads[0]

class Engine:
    update_weights_from_tensor = Method()

def wait(refs):
    print(refs[0].handle, flush=True)
    if sys.argv[1] == "block":
        time.sleep(600)

ray.get = wait
push_weights([("w", torch.ones(4096))], payload="miles_flat_bucket", ipc_engines=[Engine()],
             max_bucket_bytes=1 << 20)
print("done", flush=True)
"""


def _push(mode):
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.Popen([sys.executable, "-c", _PUSH, mode], stdout=subprocess.PIPE, text=True, env=env,
                            cwd=REPO)


def test_a_producer_killed_mid_handoff_leaves_a_file_the_next_start_removes():
    killed, alive = _push("block"), _push("block")
    try:
        killed_file, alive_file = killed.stdout.readline().strip(), alive.stdout.readline().strip()
        assert os.path.dirname(killed_file) == transport.default_shm_dir() and os.path.exists(killed_file)
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert os.path.exists(killed_file), "SIGKILL runs nothing: the file outlives its maker"

        next_start = _push("ack")
        next_file = next_start.stdout.readline().strip()
        assert next_start.stdout.readline().strip() == "done" and next_start.wait(30) == 0
        assert not os.path.exists(killed_file), "the next start's first share removes the dead maker's file"
        assert os.path.exists(alive_file), "a file of a live maker stays"
        assert not os.path.exists(next_file)
    finally:
        for child in (killed, alive):
            if child.poll() is None:
                child.kill()
                child.wait(30)
        leftovers = transport.sweep_dead_files(transport.default_shm_dir())
    assert alive_file in leftovers and not os.path.exists(alive_file)


class _Engine:
    """A fake engine handle: records the payload it was sent."""

    def __init__(self):
        self.sent = []
        self.update_weights_from_tensor = self

    def remote(self, payloads, load_format):
        self.sent += payloads
        return payloads[0]


@pytest.mark.parametrize("error", [RuntimeError("engine 0 died"), KeyboardInterrupt()])
def test_an_exception_during_the_wait_still_removes_the_file(monkeypatch, error):
    import ray

    from miles.weights.push import push_weights

    def wait(refs):
        assert os.path.exists(refs[0].handle)
        raise error

    monkeypatch.setattr(ray, "get", wait)
    engine = _Engine()
    with pytest.raises(type(error)):
        push_weights([("w", torch.ones(64))], payload="miles_flat_bucket", ipc_engines=[engine],
                     max_bucket_bytes=1 << 20)
    assert len(engine.sent) == 1 and engine.sent[0].kind == "shm_file"
    assert not os.path.exists(engine.sent[0].handle), "released although the wait raised"


# ---- the names the sweep takes, and only those ----------------------------------------------------------
def _me():
    maker = transport._maker(os.getpid())
    assert maker is not None, "this host's /proc gives the process identity"
    identity, namespace = maker
    return SimpleNamespace(pid=identity.pid, start_ticks=identity.start_ticks, boot_id=identity.boot_id,
                           pid_namespace=namespace)


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_files_are_named_by_pid_start_time_boot_and_pid_namespace(tmp_path):
    me = _me()
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert (me.pid, me.start_ticks, me.boot_id, me.pid_namespace) == (
        os.getpid(), start, boot, os.stat("/proc/self/ns/pid").st_ino)
    spec, flat = next(iter_buckets([("a", torch.ones(3))], max_bytes=1024))
    shared = share_bucket(spec, flat, shm_dir=str(tmp_path))
    try:
        name = os.path.basename(shared.handle)
        assert name.startswith(f"miles-weights-{me.pid}-{start}-{boot}-{me.pid_namespace}-")
        assert transport._FILE_NAME.fullmatch(name)
    finally:
        shared.release()


def test_sweep_removes_only_files_of_makers_that_are_gone(tmp_path, caplog):
    me = _me()

    def name(pid=me.pid, start=me.start_ticks, boot=me.boot_id, ns=me.pid_namespace, counter=0):
        return f"miles-weights-{pid}-{start}-{boot}-{ns}-{counter}"

    dead = [name(pid=_dead_pid(), start=1), name(start=me.start_ticks + 1, counter=3)]  # the 2nd: a reused pid
    kept = [name(), name(pid=os.getppid(), start=ProcessIdentity.of(os.getppid()).start_ticks),  # live makers
            name(boot="00000000-0000-0000-0000-000000000000", pid=_dead_pid()),  # another boot or host: its pids are not ours to look up
            name(ns=me.pid_namespace + 1, pid=_dead_pid()),  # another container's pid namespace
            f"miles-weights-{_dead_pid()}-0",  # the old form, without a start time: cannot be told
            name(pid=_dead_pid()) + ".bak", "results.csv"]
    for n in dead + kept:
        (tmp_path / n).write_bytes(b"\0" * 16)
    not_regular = [name(pid=_dead_pid(), counter=7), name(pid=_dead_pid(), counter=8)]
    os.symlink(tmp_path / "results.csv", tmp_path / not_regular[0])
    os.mkdir(tmp_path / not_regular[1])
    kept += not_regular

    with caplog.at_level("INFO", logger="miles.weights.transport"):
        removed = transport.sweep_dead_files(str(tmp_path))

    assert sorted(removed) == sorted(str(tmp_path / n) for n in dead)
    left = set(os.listdir(tmp_path))
    assert left == set(kept)
    assert len(caplog.records) == 1 and "killed mid-handoff" in caplog.records[0].getMessage()
    assert transport.sweep_dead_files(str(tmp_path)) == [] and len(caplog.records) == 1


def test_a_process_sweeps_a_directory_at_its_first_share_there_only(tmp_path, monkeypatch):
    swept = []
    monkeypatch.setattr(transport, "sweep_dead_files", swept.append)
    monkeypatch.setattr(transport, "_swept_dirs", set())
    spec, flat = next(iter_buckets([("a", torch.ones(3))], max_bytes=1024))
    for _ in range(3):
        share_bucket(spec, flat, shm_dir=str(tmp_path)).release()
    assert swept == [str(tmp_path)]
