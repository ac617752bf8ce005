"""Host safety of the ownership layer: a sweep enters only what its run made and survives unreadable
entries; a dead run is told from a live one by its process identity (pid, start time, boot id), not by a
pid that another process may have been given since."""

import json
import logging
import os
import socket
import time
import uuid

import pytest

from miles import checkpoint
from miles_plugins.optimizers.streaming.checkpoint import save_load
from miles_plugins.host import ownership
from miles_plugins.host.ownership import (CREATED_FILE, ProcessIdentity, claim_directory,
                                                             identity_alive, make_directory, read_record, sweep)


def _scans(monkeypatch, unreadable=()):
    """Record every directory os.scandir is asked to list; the `unreadable` ones raise PermissionError
    (tests run as root, where chmod 000 does not stop a read)."""
    seen = []
    real = os.scandir

    def scandir(path="."):
        if isinstance(path, int):  # shutil.rmtree lists by descriptor
            return real(path)
        seen.append(os.path.abspath(path))
        if os.path.abspath(path) in unreadable:
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    return seen


def test_sweep_leaves_an_unreadable_and_a_foreign_tree_unentered(tmp_path, monkeypatch):
    root = tmp_path / "root"  # existed before the run
    lost = root / "lost+found"
    lost.mkdir(parents=True)
    lost.chmod(0)
    deep = root / "datasets" / "a" / "b"
    deep.mkdir(parents=True)
    (deep / "shard.bin").write_bytes(b"keep")
    make_directory(str(root / "trainer" / "cell0_rank0"), "me")
    (root / "trainer" / "cell0_rank0" / "offload.bin").write_bytes(b"x")
    (root / "notes.txt").write_text("keep")
    seen = _scans(monkeypatch, unreadable={str(lost)})

    result = sweep(str(root), "me")

    assert not (root / "trainer").exists() and str(root / "trainer") in result.removed
    assert (deep / "shard.bin").read_bytes() == b"keep" and (root / "notes.txt").exists() and lost.is_dir()
    assert f"{lost} (not made by this run)" in result.left
    assert f"{root / 'datasets'} (not made by this run)" in result.left and str(root / "notes.txt") in result.left
    assert not any(p.startswith((str(lost), str(root / "datasets"))) for p in seen)  # never entered


def test_sweep_reports_a_directory_of_its_run_it_cannot_read_and_goes_on(tmp_path, monkeypatch):
    root = tmp_path / "root"
    make_directory(str(root / "trainer" / "cell0_rank0"), "me")
    make_directory(str(root / "trainer" / "cell0_rank1"), "me")
    stuck = str(root / "trainer" / "cell0_rank0")
    _scans(monkeypatch, unreadable={stuck})

    result = sweep(str(root), "me")

    assert any(e.startswith(f"{stuck} (cannot be read") for e in result.left)
    assert str(root / "trainer" / "cell0_rank1") in result.removed and os.path.isdir(stuck)


# ---- process identity -------------------------------------------------------------------------------
def _parent() -> ProcessIdentity:
    parent = ProcessIdentity.of(os.getppid())
    assert parent is not None and parent.start_ticks is not None and parent.boot_id is not None
    return parent


def test_a_live_pid_counts_alive_only_with_its_own_start_time_and_boot():
    parent = _parent()
    assert identity_alive(parent)
    assert not identity_alive(ProcessIdentity(parent.pid, parent.start_ticks + 1, parent.boot_id))  # pid reused
    assert not identity_alive(ProcessIdentity(parent.pid, parent.start_ticks, str(uuid.uuid4())))  # another boot
    assert identity_alive(ProcessIdentity(parent.pid))  # an older, pid-only record: kept, as before


def test_identity_reads_a_fake_proc_whose_command_name_holds_parentheses(tmp_path):
    (tmp_path / "4242").mkdir()
    boot = str(uuid.uuid4())
    (tmp_path / "sys/kernel/random").mkdir(parents=True)
    (tmp_path / "sys/kernel/random/boot_id").write_text(boot + "\n")
    fields = ["S"] + ["0"] * 18 + ["987654"] + ["0"] * 30  # field 22 (starttime) is the 20th after the name
    (tmp_path / "4242" / "stat").write_text(f"4242 (a) b (c)) {' '.join(fields)}\n")
    assert ProcessIdentity.of(4242, proc=str(tmp_path)) == ProcessIdentity(4242, 987654, boot)
    assert ProcessIdentity.of(4243, proc=str(tmp_path)) is None


def test_identity_tags_round_trip_and_refuse_what_is_no_tag():
    me = ProcessIdentity.current()
    assert ProcessIdentity.from_tag(me.tag()) == me and me.is_current()
    assert ProcessIdentity.from_tag("123") == ProcessIdentity(123)
    assert ProcessIdentity.from_tag("notapid") is None and ProcessIdentity.from_tag("12-34") is None


def _marker(directory, run_id: str, identity: ProcessIdentity) -> None:
    directory.mkdir(parents=True)
    record = {"host": socket.gethostname(), "pid": identity.pid, "run_id": run_id, "since": time.time()}
    if identity.start_ticks is not None:
        record |= {"start_ticks": identity.start_ticks, "boot_id": identity.boot_id}
    (directory / CREATED_FILE).write_text(json.dumps(record))


def test_a_rank_directory_left_by_a_dead_run_whose_pid_was_reused_is_wiped_at_claim(tmp_path, caplog):
    parent = _parent()
    rank_dir = tmp_path / "trainer" / "cell0_rank0"
    _marker(rank_dir, "dead-run", ProcessIdentity(parent.pid, parent.start_ticks + 1, parent.boot_id))
    (rank_dir / "offload.bin").write_bytes(b"stale")
    with caplog.at_level(logging.WARNING, logger=ownership.__name__):
        lock = claim_directory(str(rank_dir), "new-run", "rank 0 directory")
    try:
        assert not (rank_dir / "offload.bin").exists() and read_record(str(rank_dir / CREATED_FILE)).run_id == "new-run"
        assert "no longer running" in caplog.text and str(rank_dir) in caplog.text
    finally:
        lock.release()


@pytest.mark.parametrize("identity", [lambda p: ProcessIdentity(p.pid), lambda p: p], ids=["pid-only", "live"])
def test_a_rank_directory_of_a_live_or_undecidable_maker_is_not_wiped(tmp_path, identity):
    rank_dir = tmp_path / "cell0_rank0"
    _marker(rank_dir, "running-run", identity(_parent()))
    (rank_dir / "offload.bin").write_bytes(b"theirs")
    claim_directory(str(rank_dir), "new-run").release()
    assert (rank_dir / "offload.bin").read_bytes() == b"theirs"
    assert read_record(str(rank_dir / CREATED_FILE)).run_id == "running-run"


def test_a_directory_with_no_marker_is_never_wiped_at_claim(tmp_path):
    rank_dir = tmp_path / "cell0_rank0"
    rank_dir.mkdir()
    (rank_dir / "data.bin").write_bytes(b"user")
    claim_directory(str(rank_dir), "new-run").release()
    assert (rank_dir / "data.bin").read_bytes() == b"user" and not (rank_dir / CREATED_FILE).exists()


def test_new_records_carry_the_identity_and_old_ones_still_parse(tmp_path):
    make_directory(str(tmp_path / "d"), "me")
    record = read_record(str(tmp_path / "d" / CREATED_FILE))
    assert record.identity() == ProcessIdentity.current()
    old = {"host": "h", "pid": 7, "run_id": "r", "since": 1.0}
    (tmp_path / "old").write_text(json.dumps(old))
    assert read_record(str(tmp_path / "old")).identity() == ProcessIdentity(7)
    (tmp_path / "bad").write_text(json.dumps(old | {"start_ticks": 1, "boot_id": "../../etc"}))
    assert read_record(str(tmp_path / "bad")) is None


def test_checkpoint_temporaries_of_a_reused_pid_are_removed_and_a_live_writers_stay(tmp_path):
    parent = _parent()
    target = tmp_path / checkpoint.LATEST_FILE
    reused = tmp_path / f"{target.name}.tmp{ProcessIdentity(parent.pid, parent.start_ticks + 1, parent.boot_id).tag()}"
    live = tmp_path / f"{target.name}.tmp{parent.tag()}"
    for f in (reused, live):
        f.write_text("x")
    checkpoint._atomic_write(str(target), "rollout_000001\n")
    assert not reused.exists() and live.exists() and target.read_text() == "rollout_000001\n"


def test_a_set_aside_checkpoint_of_a_reused_pid_is_put_back(tmp_path):
    parent = _parent()
    dead = ProcessIdentity(parent.pid, parent.start_ticks, str(uuid.uuid4()))  # the same pid, a boot ago
    aside = tmp_path / f"rollout_000001.prev-{dead.tag()}"
    aside.mkdir()
    (aside / checkpoint.META_FILE).write_text("{}")
    checkpoint._tidy_set_aside(str(tmp_path))
    assert (tmp_path / "rollout_000001" / checkpoint.META_FILE).exists() and not aside.exists()


def test_an_optimizer_save_temporary_of_a_reused_pid_is_removed(tmp_path):
    parent = _parent()
    final = tmp_path / "nvme_opt_state"
    other = ProcessIdentity(parent.pid, parent.start_ticks + 1, parent.boot_id)
    reused = tmp_path / f"nvme_opt_state.tmp-{other.tag()}"
    live = tmp_path / f"nvme_opt_state.tmp-{parent.tag()}"
    for d in (reused, live):
        d.mkdir()
    save_load._remove_abandoned_temporaries(str(final))
    assert not reused.exists() and live.exists()
