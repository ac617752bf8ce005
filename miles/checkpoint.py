"""Checkpoints: the one place every save and load goes through.

Layout of ``--save`` (and what ``--load`` reads)::

    <save>/
      latest_checkpointed_rollout.txt     name of the newest complete checkpoint, e.g. "rollout_000002"
      rollout_000002/                     state after 2 completed rollouts (the next run starts at rollout 2)
        meta.json                         rollout id to resume at, data position, world size, flags
        model/                            HF folder (config, safetensors, tokenizer): rank 0
        optimizer/rank00000.pt            the sharded optimizer's per-rank state (not streamed)
        nvme_opt_state/rank00000/opt0_0/  the streamed optimizer state: ``store.save_to(<checkpoint>)``

A checkpoint becomes visible only when every rank wrote its part and the driver wrote ``meta.json``
and then replaced the ``latest`` marker (write + rename): a crash mid-save leaves the previous
checkpoint as the latest. ``--load`` accepts the save root (uses the marker, which must name a checkpoint folder
of this spelling directly inside it: :func:`resolve`) or one checkpoint folder; what it resumes is read and
checked before Ray starts (:func:`checked_resume_target`).

Saving a rollout that already has a complete checkpoint (a run resumed from an older checkpoint with
the same ``--save``) never removes it before its replacement is complete: ``prepare`` renames it to
``<name>.prev-<pid>-<start ticks>-<boot id>`` and, when ``latest`` named it, points ``latest`` at that name; ``publish`` points
``latest`` at the new one and removes the copy set aside. A crash in between leaves ``latest`` naming a
complete checkpoint (``resolve`` also finds the copy set aside when the crash fell between the rename and
the marker). The next save removes copies of dead processes whose replacement completed, and puts one
back in place of its replacement when that never completed (pointing ``latest`` back at it first when
``latest`` named the copy).

An interrupted save (Ctrl-C, SIGTERM, a crash) leaves a checkpoint folder without ``meta.json``.
``prepare`` marks every folder it makes with the record of the run that made it (``.miles-created``:
host, pid, run id), so such a folder is known as an unfinished save of this code:
:func:`remove_unpublished_saves` removes the driver's own at its teardown, once the ranks are gone, and
:func:`remove_interrupted_saves` those of processes that are no longer running at the next start (both
also put a copy set aside back in place, ``latest`` included). A folder this code did not make (another
name, no record) or that is complete (``meta.json``) is never removed: the start names the unfinished
ones it leaves, and ``prepare`` refuses to start a checkpoint at the name of one (or of a symbolic link). :func:`remove_beyond_latest` keeps the newest N complete checkpoints (``--save-keep-latest``).

Loading order in each rank: model weights -> ``optimizer.reload_model_params()`` (bound to the store's
``refresh_main_from_model_params`` when streaming, which routes the write through the store) -> the
optimizer state, either ``optimizer.load_state_dict`` or ``store.load_from(<checkpoint>)``.
``--no-load-optim`` and ``--finetune`` skip the optimizer state (``--finetune`` also restarts at
rollout 0 and at the start of the data). Optimizer state saved in the other streaming mode, or missing
from the checkpoint, is refused (naming ``--no-load-optim``): Adam never restarts from zero unasked.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from miles.untrusted_json import UntrustedJSONError, parse_bounded, read_regular_file
from miles_plugins.host.ownership import (
    CREATED_FILE,
    IDENTITY_TAG,
    OwnerRecord,
    ProcessIdentity,
    identity_alive,
    listing,
    make_directory,
    process_run_id,
    read_record,
)

if TYPE_CHECKING:
    from miles.config.run_config import RunConfig

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_rollout.txt"
META_FILE = "meta.json"
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
STREAMED_DIR = "nvme_opt_state"  # owned by the store: store.save_to(base) writes <base>/nvme_opt_state/...
FORMAT_VERSION = 1
LAYOUT_META = "parallel_layout"  # meta.json's record of the parallel layout (write_meta's extra)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as asked (the message names it and says why)."""


def checkpoint_name(completed_rollouts: int) -> str:
    return f"rollout_{completed_rollouts:06d}"


def checkpoint_path(save_dir: str, completed_rollouts: int) -> str:
    return os.path.join(save_dir, checkpoint_name(completed_rollouts))


def optimizer_file(base: str, rank: int) -> str:
    return os.path.join(base, OPTIMIZER_DIR, f"rank{rank:05d}.pt")


# ---- driver side ----------------------------------------------------------------------------------
_CHECKPOINT = re.compile(r"^rollout_(\d{6,})$")  # checkpoint_name's spelling
# a complete checkpoint kept while it is replaced, named by the process that set it aside
_SET_ASIDE = re.compile(rf"^(rollout_\d{{6,}})\.prev-({IDENTITY_TAG})$")


def prepare(save_dir: str, completed_rollouts: int, run_id: Optional[str] = None) -> str:
    """Create the folder of a new checkpoint, marked as made by ``run_id`` (default: this process's) in this
    process. A complete checkpoint already there is set aside, still loadable, until ``publish`` replaces
    it (module doc); an unfinished one that an interrupted save of this code left (its maker's record
    names a process of this host that is gone) is removed. Anything else at that name (a symbolic link, a
    file, a folder without that record or of a live maker) is a CheckpointError: nothing is removed."""
    os.makedirs(save_dir, exist_ok=True)
    _tidy_set_aside(save_dir)
    base = checkpoint_path(save_dir, completed_rollouts)
    if not os.path.islink(base) and os.path.exists(os.path.join(base, META_FILE)):
        _set_aside(save_dir, base)
    elif os.path.lexists(base):
        record, why = _why_unfinished_stays(base, _maker_is_gone)
        if why is not None:
            raise CheckpointError(f"cannot start the checkpoint {base}: it {why}, and a save never removes what an "
                                  "interrupted save of this code did not leave; move it away, or save elsewhere "
                                  "(--save)")
        shutil.rmtree(base)
        logger.info("removed %s, left unfinished by an interrupted save (made by %s)", base, record.describe())
    make_directory(base, run_id or process_run_id(), parents=0)
    return base


def _set_aside(save_dir: str, base: str) -> None:
    """Rename the complete checkpoint ``base`` to ``<base>.prev-<identity tag>``, then point ``latest`` there if it
    named ``base``: ``latest`` never names a checkpoint that is being rewritten."""
    aside = f"{base}.prev-{ProcessIdentity.current().tag()}"
    named = _latest_name(save_dir) == os.path.basename(base)
    os.rename(base, aside)
    _fsync_dir(save_dir)
    logger.info("kept %s as %s until its replacement is complete", base, aside)
    if named:
        _atomic_write(os.path.join(save_dir, LATEST_FILE), os.path.basename(aside) + "\n")


MARKER_MAX_BYTES = 4096  # the latest marker holds one checkpoint's name


def _latest_name(save_dir: str) -> Optional[str]:
    """The name ``save_dir``'s latest marker holds, None when it has none (read as untrusted input)."""
    marker = os.path.join(save_dir, LATEST_FILE)
    raw = _read_untrusted(marker, MARKER_MAX_BYTES)
    if raw is None:
        return None
    try:
        return raw.decode().strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{marker} is not text, so not the marker this code writes: move it away, or "
                              "resume from one checkpoint folder (--load <folder>/rollout_NNNNNN)") from None


def _read_untrusted(path: str, limit: int) -> Optional[bytes]:
    """A small file of a checkpoint folder (which may come from anywhere), None when it does not exist: a FIFO,
    device or directory is refused before a byte is read, a file over ``limit`` bytes before it is read."""
    try:
        return read_regular_file(path, limit)
    except FileNotFoundError:
        return None
    except (OSError, UntrustedJSONError) as e:
        raise CheckpointError(f"{path}: {e.strerror if isinstance(e, OSError) else e}; a checkpoint holds regular "
                              "files this code wrote: move it away, or resume from another checkpoint") from None


def _tidy_set_aside(save_dir: str, replaced: Optional[str] = None, finished: bool = False) -> None:
    """Copies set aside by processes that are gone (or of ``replaced``, just published): removed when their
    checkpoint was replaced by a complete one, put back in place of a replacement that never completed
    (``latest`` pointed back first when it names the copy). The copy ``latest`` names stays while its
    replacement is complete but unpublished, or being saved by this process (unless ``finished``: it
    saves nothing more). Only names of ``_SET_ASIDE``'s form are touched."""
    latest = _latest_name(save_dir)
    for name in sorted(os.listdir(save_dir)):
        match = _SET_ASIDE.match(name)
        if match is None:
            continue
        original, setter = match.group(1), ProcessIdentity.from_tag(match.group(2))
        mine = setter.is_current()
        if original != replaced and not mine and identity_alive(setter):
            continue  # another live process's save in progress
        aside, target = os.path.join(save_dir, name), os.path.join(save_dir, original)
        replaced_complete = not os.path.islink(target) and os.path.exists(os.path.join(target, META_FILE))
        if name == latest and (replaced_complete or (mine and not finished)):
            continue
        if replaced_complete:
            shutil.rmtree(aside)
            logger.info("removed %s: %s replaced it", aside, target)
        elif original != replaced:
            why = _why_unfinished_stays(target, _maker_is_gone)[1] if os.path.lexists(target) else None
            if why is not None:
                logger.warning("left %s set aside: %s, in its place, %s; move that away and the next save puts "
                               "the copy back", aside, target, why)
                continue
            if name == latest:
                # first the marker (resolve finds the copy under the original's name), then the rename back
                _atomic_write(os.path.join(save_dir, LATEST_FILE), original + "\n")
            if os.path.lexists(target):
                shutil.rmtree(target)  # the replacement's save died before its meta was written
            os.rename(aside, target)
            logger.warning("put %s back as %s: its replacement never completed", aside, target)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_meta(base: str, *, next_rollout_id: int, data_state: dict[str, Any], world_size: int,
               runs: Sequence[str] = (), extra: Optional[dict[str, Any]] = None) -> None:
    """``runs``: the run ids whose rollouts lead to this checkpoint, oldest first (the runs it resumed,
    then the saving one): a run resumed from it re-runs what they wrote after it (:func:`runs_of`)."""
    meta = {"format": FORMAT_VERSION, "next_rollout_id": int(next_rollout_id), "data_state": data_state,
            "world_size": int(world_size), "runs": list(runs), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    meta.update(extra or {})
    _atomic_write(os.path.join(base, META_FILE), json.dumps(meta, indent=2, sort_keys=True))


def runs_of(meta: dict[str, Any]) -> list[str]:
    """The ``runs`` a checkpoint's meta names (write_meta); none when it names none (written before the
    field) or the field is not a list of run ids, which is logged: then no earlier record is superseded."""
    runs = meta.get("runs", [])
    if isinstance(runs, list) and all(isinstance(r, str) for r in runs):
        return runs
    logger.warning("the checkpoint's %s names its runs as %.200r, not a list of run ids: ignored", META_FILE, runs)
    return []


def publish(save_dir: str, base: str) -> None:
    """Make ``base`` the latest checkpoint (after every rank saved and the meta was written)."""
    if not os.path.exists(os.path.join(base, META_FILE)):
        raise CheckpointError(f"refusing to publish {base}: it has no {META_FILE}")
    _atomic_write(os.path.join(save_dir, LATEST_FILE), os.path.basename(base) + "\n")
    _tidy_set_aside(save_dir, replaced=os.path.basename(base))


def remove_beyond_latest(save_dir: str, keep_latest: int, protect: Sequence[str] = ()) -> list[str]:
    """Remove the complete checkpoints of ``save_dir`` beyond the newest ``keep_latest`` (by rollout
    number), except the one ``latest`` names and those in ``protect`` (paths, compared with symbolic links
    resolved). Only real folders of :func:`checkpoint_name`'s spelling that hold ``meta.json`` count; the
    copies ``prepare`` sets aside are not checkpoints here. Returns the removed paths, oldest first; a
    folder that cannot be removed is logged and left."""
    if keep_latest < 1:
        raise ValueError(f"keep_latest must be >= 1 (got {keep_latest}): at least the latest checkpoint stays")
    complete = [name for name in _checkpoint_folders(save_dir) if os.path.isfile(
        os.path.join(save_dir, name, META_FILE))]
    kept = set(complete[-keep_latest:]) | {_latest_name(save_dir)}
    protected = {os.path.realpath(p) for p in protect}
    removed = []
    for name in complete:
        path = os.path.join(save_dir, name)
        if name in kept or os.path.realpath(path) in protected:
            continue
        try:
            # meta.json first: a removal cut short leaves an unfinished folder, never a complete-looking one
            os.unlink(os.path.join(path, META_FILE))
            _fsync_dir(path)
            shutil.rmtree(path)
        except OSError as e:
            logger.warning("could not remove the old checkpoint %s (%s); remove it by hand", path, e)
            continue
        removed.append(path)
    if removed:
        logger.info("removed %d checkpoint(s) older than the newest %d under %s: %s", len(removed), keep_latest,
                    save_dir, listing(removed))
    return removed


def _checkpoint_folders(save_dir: str) -> list[str]:
    """Names of the real folders (not links) of ``save_dir`` spelled as checkpoints, oldest rollout first."""
    found = []
    for name in os.listdir(save_dir):
        match = _CHECKPOINT.match(name)
        path = os.path.join(save_dir, name)
        if match is not None and os.path.isdir(path) and not os.path.islink(path):
            found.append((int(match.group(1)), name))
    return [name for _, name in sorted(found)]


def remove_interrupted_saves(save_dir: Optional[str]) -> list[str]:
    """At the start of a run: what interrupted saves left under ``save_dir`` (None: no --save, nothing to
    do). Copies set aside by dead processes go back in place, and unfinished checkpoint folders (no
    ``meta.json``) that ``prepare`` made in a process of this host that is no longer running are removed
    (one line logged). The unfinished folders left (being written by a live process, made on another host,
    or not made by this code) are named in one warning. Returns the removed paths."""
    if not save_dir or not os.path.isdir(save_dir):
        return []
    _tidy_set_aside(save_dir)
    removed, left = _remove_unfinished(save_dir, _maker_is_gone)
    if left:
        logger.warning("left %d unfinished checkpoint folder(s) (no %s) under %s: %s. Remove them by hand once no "
                       "run writes there", len(left), META_FILE, save_dir, listing(left))
    return removed


def remove_unpublished_saves(save_dir: Optional[str]) -> list[str]:
    """At the end of a run, once its ranks have stopped (None: no --save, nothing to do): the unfinished
    checkpoint folders this process made (saves it did not publish) are removed, and the copies it set
    aside go back in place, ``latest`` included. Returns the removed paths."""
    if not save_dir or not os.path.isdir(save_dir):
        return []
    _tidy_set_aside(save_dir, finished=True)
    return _remove_unfinished(save_dir, _maker_is_this_process)[0]


def _maker_is_this_process(record: OwnerRecord) -> bool:
    return record.host == socket.gethostname() and record.pid == os.getpid()


def _maker_is_gone(record: OwnerRecord) -> bool:
    return record.host == socket.gethostname() and (record.identity().is_current()
                                                    or not identity_alive(record.identity()))


def _why_unfinished_stays(path: str, removable: Callable[[OwnerRecord], bool]
                          ) -> tuple[Optional[OwnerRecord], Optional[str]]:
    """For the entry at a checkpoint's name without ``meta.json``: its maker's record (None without one)
    and why it must stay (None: a folder this code made, whose maker's record ``removable`` accepts). A
    symbolic link is never followed, and nothing without the record is this code's to remove."""
    if os.path.islink(path):
        return None, f"is a symbolic link (to {os.readlink(path)}), which a save never follows"
    if not os.path.isdir(path):
        return None, "is not a folder"
    record = read_record(os.path.join(path, CREATED_FILE))
    if record is None:
        return None, f"has no record of the run that made it ({CREATED_FILE})"
    if removable(record):
        return record, None
    if record.host != socket.gethostname():
        return record, f"was made by {record.describe()}: this host cannot tell whether it still runs"
    return record, f"is being saved by {record.describe()}, still running"


def _remove_unfinished(save_dir: str, removable: Callable[[OwnerRecord], bool]) -> tuple[list[str], list[str]]:
    """Remove the checkpoint folders of ``save_dir`` without ``meta.json`` whose maker's record ``removable``
    accepts (one line logged). Returns the removed paths and, for each other unfinished folder, why it stays."""
    removed, described, left = [], [], []
    for name in _checkpoint_folders(save_dir):
        path = os.path.join(save_dir, name)
        if os.path.lexists(os.path.join(path, META_FILE)):
            continue
        record, why = _why_unfinished_stays(path, removable)
        if why is not None:
            left.append(f"{path} ({why})")
            continue
        try:
            shutil.rmtree(path)
        except OSError as e:
            left.append(f"{path} (cannot be removed: {e})")
            continue
        removed.append(path)
        described.append(f"{path} (made by {record.describe()})")
    if removed:
        logger.info("removed %d unfinished checkpoint folder(s) left by interrupted saves: %s", len(removed),
                    listing(described))
    return removed, left


def resolve(load_dir: str) -> Optional[str]:
    """The checkpoint folder that ``--load load_dir`` means, or None when there is none yet: ``load_dir`` itself
    when it holds meta.json, else the folder its latest marker names. The marker is untrusted: it must name, in
    the form this code writes (:func:`checkpoint_name`, or a copy ``prepare`` set aside), a real folder (not a
    symbolic link) directly inside ``load_dir``; anything else is a CheckpointError."""
    if not os.path.isdir(load_dir):
        return None
    if os.path.lexists(os.path.join(load_dir, META_FILE)):
        return load_dir
    name = _latest_name(load_dir)
    if name is None:
        return None
    marker = os.path.join(load_dir, LATEST_FILE)
    if not (_CHECKPOINT.fullmatch(name) or _SET_ASIDE.fullmatch(name)):
        raise CheckpointError(f"{marker} names {name[:100]!r}, not a checkpoint folder of the form this code writes "
                              f"(rollout_NNNNNN, directly inside {load_dir}): the file was edited or is not ours. "
                              f"Pass --load one checkpoint folder (e.g. {checkpoint_path(load_dir, 2)}), or write "
                              "its name into the marker")
    base = os.path.join(load_dir, name)
    if _is_real_folder(base) and os.path.lexists(os.path.join(base, META_FILE)):
        return base
    if os.path.islink(base):
        raise CheckpointError(f"{marker} names {base}, a symbolic link (to {os.readlink(base)!r}), which a load never "
                              "follows: pass --load the checkpoint folder itself")
    # a crash between setting the checkpoint aside and pointing the marker at it (prepare)
    aside = [os.path.join(load_dir, n) for n in sorted(os.listdir(load_dir))
             if (m := _SET_ASIDE.fullmatch(n)) and m.group(1) == name and _is_real_folder(os.path.join(load_dir, n))
             and os.path.lexists(os.path.join(load_dir, n, META_FILE))]
    if not aside:
        raise CheckpointError(f"{marker} names {name!r}, but {base} is no complete checkpoint (no folder with a "
                              f"{META_FILE}): pass --load one complete checkpoint folder of {load_dir}")
    logger.warning("%s names %s, whose save was interrupted: loading %s, set aside for it", marker, name, aside[-1])
    return aside[-1]


def _is_real_folder(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


META_MAX_BYTES = 16 << 20  # a meta.json holds flags, the data position and run ids: kilobytes
META_MAX_DEPTH = 8  # write_meta nests 2 levels (data_state, parallel_layout)
META_MAX_VALUES = 1 << 16  # a run id per run that led to the checkpoint, and a few dozen fields


def read_meta(base: str) -> dict[str, Any]:
    """``base``'s meta.json, read as untrusted input: a regular file, bounded in size, a JSON object whose every
    field write_meta writes has its type and range (:func:`_meta_problem`), or CheckpointError."""
    path = os.path.join(base, META_FILE)
    raw = _read_untrusted(path, META_MAX_BYTES)
    if raw is None:
        raise CheckpointError(f"{base} has no {META_FILE}: it is no complete checkpoint. Resume from another "
                              "checkpoint, or start fresh without --load")
    try:
        meta = parse_bounded(raw, META_MAX_DEPTH, META_MAX_VALUES)
    except UntrustedJSONError as e:
        problem = f"is not valid JSON of a checkpoint ({e})"
    else:
        problem = (_meta_problem(meta) if isinstance(meta, dict)
                   else f"holds a JSON {type(meta).__name__}, not an object")
        if problem is None:
            return meta
    raise CheckpointError(f"{path} {problem}: it is not a checkpoint this code wrote, or was edited. Resume from "
                          "another checkpoint, or start fresh without --load")


def _is_count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


# meta.json's fields as write_meta writes them: name -> (whether it holds, what it must be). Only
# next_rollout_id is required: checkpoints of earlier builds lack the others.
_META_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format": (lambda v: v == FORMAT_VERSION and _is_count(v, 0), f"{FORMAT_VERSION}, the format this code reads"),
    "next_rollout_id": (lambda v: _is_count(v, 0), "a whole number >= 0"),
    "data_state": (lambda v: isinstance(v, dict), "an object"),
    "world_size": (lambda v: _is_count(v, 1), "a whole number >= 1"),
    "runs": (lambda v: isinstance(v, list) and all(isinstance(r, str) for r in v), "a list of run ids (strings)"),
    "time": (lambda v: isinstance(v, str), "a string"),
    "streamed_optimizer_state": (lambda v: isinstance(v, bool), "true or false"),
    LAYOUT_META: (lambda v: isinstance(v, dict), "an object"),
}
_DATA_STATE_COUNTS = ("consumed_prompts", "num_prompts")  # _DataCursor.state(): whole numbers >= 0
# layout_meta's sizes, each a whole number >= 1; an even pipeline split records no stage's layer count (null)
_STAGE_LAYERS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
_LAYOUT_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "world_size", *_STAGE_LAYERS)


def _meta_problem(meta: dict[str, Any]) -> Optional[str]:
    """What is wrong with the first field of ``meta`` that is not as write_meta writes it (None: nothing)."""
    if "next_rollout_id" not in meta:
        return "has no next_rollout_id (the rollout to resume at)"
    for name, (holds, must_be) in _META_FIELDS.items():
        if name in meta and not holds(meta[name]):
            return _field_problem(name, meta[name], must_be)
    data_state, layout = meta.get("data_state", {}), meta.get(LAYOUT_META, {})
    for name in _DATA_STATE_COUNTS:
        if name in data_state and not _is_count(data_state[name], 0):
            return _field_problem(f"data_state.{name}", data_state[name], "a whole number >= 0")
    for name in _LAYOUT_SIZES:
        nullable = name in _STAGE_LAYERS
        if name in layout and not (_is_count(layout[name], 1) or (nullable and layout[name] is None)):
            return _field_problem(f"{LAYOUT_META}.{name}", layout[name],
                                  "a whole number >= 1" + (", or null" if nullable else ""))
    return None


def _field_problem(name: str, value: Any, must_be: str) -> str:
    shown = repr(value)
    return f"has {name} {shown if len(shown) <= 80 else shown[:80] + '...'}, which must be {must_be}"


def resume_target(load: Optional[str], load_optim: bool, layout) -> Optional[tuple[str, dict[str, Any]]]:
    """What ``--load load`` resumes: the checkpoint folder and its meta.json (checked: :func:`read_meta`), or
    None (no --load, or no checkpoint there). With ``load_optim``, the optimizer state's layout is checked
    against ``layout`` here, before anything starts (:func:`check_resume_layout`)."""
    if not load:
        return None
    base = resolve(load)
    if base is None:
        return None
    meta = read_meta(base)
    if load_optim:  # before any rank loads: the state's TP/PP shards fit one layout only
        check_resume_layout(base, meta, layout)
    return base, meta


def checked_resume_target(config: "RunConfig") -> Optional[tuple[str, dict[str, Any]]]:
    """What the run's ``--load`` resumes (:func:`resume_target`), read before Ray and the actors start (miles.train,
    ``miles train --dry-run``) and refused there when the run could not resume it: a folder that holds files but
    no checkpoint (unless it is the run's --save folder too, where nothing saved yet means a fresh start, as in
    Megatron), a checkpoint at or past --num-rollout (nothing left to run), or optimizer state saved in the other
    streaming mode. A fresh start with --load is logged in one line."""
    ckpt = config.checkpoint
    target = resume_target(ckpt.load, ckpt.loads_optimizer_state, config.parallel_layout)
    if target is None:
        if ckpt.load:
            why = _why_nothing_to_resume(ckpt.load, ckpt.save)  # or a CheckpointError: not a fresh start
            logger.warning("--load %s: %s; this run starts fresh at rollout 0", ckpt.load, why)
        return None
    base, meta = target
    if not ckpt.finetune and meta["next_rollout_id"] >= config.rollout.num_rollout:
        done = meta["next_rollout_id"]
        raise CheckpointError(f"{base} resumes at rollout {done} and --num-rollout is {config.rollout.num_rollout}: "
                              f"its run already did every rollout, so nothing is left to run. Raise --num-rollout "
                              f"above {done} to train on (or pass --finetune to restart the count at 0)")
    if ckpt.loads_optimizer_state:
        check_streaming_mode(base, meta, config.optimizer.stream_optimizer_state_to_disk)
    return target


def _why_nothing_to_resume(load: str, save: Optional[str]) -> str:
    """Why ``--load load``, where :func:`resolve` found no checkpoint, starts fresh: it is ``save``'s folder too, or
    holds nothing but what unfinished saves left. A CheckpointError when it should not: a folder of other files
    (a mistyped --load would cost a run), or of complete checkpoints that no marker names."""
    if save and os.path.realpath(save) == os.path.realpath(load):
        return "no checkpoint saved there yet (it is also --save, where this run saves its checkpoints)"
    if not os.path.lexists(load):
        return "no such folder, so no checkpoint to resume"
    try:
        others = sorted(name for name in os.listdir(load) if not _made_by_a_save(load, name))
    except OSError as e:
        raise CheckpointError(f"{load}: cannot list the folder ({e.strerror}): pass --load a folder this run may "
                              "read") from None
    if others:
        shown = [name if name.isprintable() else ascii(name) for name in others]
        raise CheckpointError(f"{load} holds no checkpoint (no {LATEST_FILE}, no {META_FILE}) but other files: "
                              f"{listing(shown)}. Pass --load the folder --save wrote (or one checkpoint folder in it, "
                              "e.g. <save>/rollout_000010), or drop --load to start fresh")
    unpublished = [name for name in _checkpoint_folders(load) if os.path.lexists(os.path.join(load, name, META_FILE))]
    if unpublished:
        raise CheckpointError(f"{load} has no {LATEST_FILE}, but complete checkpoints that a save did not get "
                              f"to publish: {listing(unpublished)}. Pass --load {os.path.join(load, unpublished[-1])} "
                              "to resume the newest, or drop --load to start fresh")
    return f"no checkpoint saved there yet (no {LATEST_FILE})"


def _made_by_a_save(directory: str, name: str) -> bool:
    """``name`` in ``directory`` is what a save of this code leaves before its first checkpoint is published: an
    unfinished checkpoint folder, a copy set aside, or the marker's temporary file."""
    if name.startswith(f"{LATEST_FILE}.tmp"):
        return True
    return bool(_CHECKPOINT.fullmatch(name) or _SET_ASIDE.fullmatch(name)) and _is_real_folder(
        os.path.join(directory, name))


def _atomic_write(path: str, text: str) -> None:
    _remove_abandoned_temporaries(path)
    tmp = f"{path}.tmp{ProcessIdentity.current().tag()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_abandoned_temporaries(path: str) -> None:
    """A writer killed between write and rename leaves ``<path>.tmp<pid>`` behind for good: remove those
    whose pid is dead on this host. A live pid is another process's write in progress: left alone."""
    directory, prefix = os.path.split(path)
    prefix += ".tmp"
    for name in os.listdir(directory or "."):
        writer = ProcessIdentity.from_tag(name[len(prefix):]) if name.startswith(prefix) else None
        if writer is not None and not identity_alive(writer):
            os.unlink(os.path.join(directory, name))
            logger.info("removed %s, left by process %s, which is no longer running", os.path.join(directory, name),
                        writer.pid)


# ---- rank side ------------------------------------------------------------------------------------
def save_train_state(base: str, *, model, optimizer, store, rank: int, world_size: int,
                     tokenizer=None, wait: bool = True) -> dict[str, Any]:
    """Write this rank's part of a checkpoint: the model (rank 0) and the optimizer state.

    With ``wait=False`` the streamed optimizer state is copied in the background (the store snapshots
    it and training goes on; the next step waits only for buckets it overwrites before they are
    copied): ``info["pending"]`` is then True and :func:`finish_train_state` must return before the
    checkpoint may be published."""
    import torch

    start = time.perf_counter()
    info: dict[str, Any] = {"rank": rank}
    if rank == 0:
        model_dir = os.path.join(base, MODEL_DIR)
        os.makedirs(model_dir, exist_ok=True)
        _save_model(model, model_dir)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            try:
                tokenizer.save_pretrained(model_dir)
            except Exception:  # a tokenizer that cannot serialize must not fail the checkpoint
                logger.warning("could not save the tokenizer to %s", model_dir, exc_info=True)
    info["pending"] = False
    if store is not None:
        if wait:
            store.save_to(base)  # the bucket files are the state
        else:
            store.save_to(base, wait=False)
            info["pending"] = True
        info["optimizer"] = "streamed"
    elif optimizer is not None:
        os.makedirs(os.path.join(base, OPTIMIZER_DIR), exist_ok=True)
        torch.save(optimizer.state_dict(), optimizer_file(base, rank))
        info["optimizer"] = "state_dict"
    info["seconds"] = time.perf_counter() - start
    return info


def finish_train_state(store) -> Optional[dict[str, Any]]:
    """Wait until this rank's background save (if any) is published; raises if it failed."""
    if store is None:
        return None
    stats = store.wait_for_save()
    return dict(stats) if stats else None


def _save_model(model, model_dir: str) -> None:
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(model_dir, safe_serialization=True)
    else:
        import torch

        torch.save(model.state_dict(), os.path.join(model_dir, "model.pt"))


def load_model_weights(model, model_dir: str) -> int:
    """Copy the weights saved in ``model_dir`` into ``model`` in place (storages are kept, which the
    offloader and the optimizer's views rely on). Returns the number of tensors loaded."""
    import torch

    if _is_transformers_model(model):
        state = _read_transformers_model(model, model_dir)
    else:
        state = _read_model_state(model_dir)  # raw HF names (the Megatron trainer's view maps them)
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise CheckpointError(f"{model_dir} has weights the model does not: {result.unexpected_keys[:5]}")
    if result.missing_keys:
        current = model.state_dict()
        loaded = {current[k].untyped_storage()._cdata for k in state if k in current}
        untied = [k for k in result.missing_keys if current[k].untyped_storage()._cdata not in loaded]
        if untied:
            raise CheckpointError(f"{model_dir} lacks weights of the model: {untied[:5]}")
    del torch
    return len(state)


def _is_transformers_model(model) -> bool:
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _read_transformers_model(model, model_dir: str) -> dict:
    """The folder as transformers loads it into ``model``'s class, as that model's state dict. Its checkpoint
    conversions apply: transformers 5 keeps a MoE layer's experts fused (``experts.gate_up_proj``) and saves
    them per expert (``experts.0.gate_proj.weight``), which the saved files' raw names would not match. Holds a
    second copy of the model on the CPU while loading."""
    loaded, info = type(model).from_pretrained(model_dir, config=model.config, dtype="auto", local_files_only=True,
                                               output_loading_info=True)
    if info.get("unexpected_keys"):
        raise CheckpointError(f"{model_dir} has weights the model does not: {sorted(info['unexpected_keys'])[:5]}")
    wrong = sorted(info.get("missing_keys") or []) + sorted(k for k, *_ in info.get("mismatched_keys") or [])
    if wrong:
        raise CheckpointError(f"{model_dir} lacks weights of the model, or holds them in other shapes: {wrong[:5]}")
    return loaded.state_dict()


def _read_model_state(model_dir: str) -> dict:
    import glob

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        from safetensors.torch import load_file

        state: dict = {}
        for f in files:
            state.update(load_file(f))
        return state
    pt = os.path.join(model_dir, "model.pt")
    if os.path.exists(pt):
        return _load_tensors(pt)
    raise CheckpointError(f"no model weights in {model_dir}")


def _load_tensors(path: str, hint: str = ""):
    """A torch file of tensors and plain containers (an optimizer's state_dict). weights_only: a pickle
    that would build any other object, or run code, is refused before it does."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be loaded safely: it holds more than tensors and plain containers, "
                              f"or is corrupt ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}). "
                              f"Resume from a checkpoint this project wrote{hint}") from None


def load_train_state(base: str, *, model, optimizer, store, rank: int, world_size: int,
                     load_optimizer: bool) -> dict[str, Any]:
    """Load this rank's part of a checkpoint. Returns what was loaded."""
    start = time.perf_counter()
    meta = read_meta(base)
    n = load_model_weights(model, os.path.join(base, MODEL_DIR))
    if optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # masters <- the loaded weights (through the store when bound)
    info: dict[str, Any] = {"rank": rank, "model_tensors": n, "optimizer": "skipped"}
    if load_optimizer:
        if check_streaming_mode(base, meta, store is not None) is None:
            logger.warning("rank %d: %s holds no optimizer state (it was saved without any): fresh optimizer state",
                           rank, base)
            info["optimizer"] = "absent: fresh optimizer state"
        elif store is not None:  # the store reshards its own state when the data-parallel size changed
            from miles_plugins.optimizers.nvme_stream import CheckpointError as StoreCheckpointError

            try:
                found = store.load_from(base)
            except StoreCheckpointError as e:
                raise CheckpointError(f"{e}. To resume the weights alone, with fresh optimizer state, pass "
                                      "--no-load-optim") from e
            if not found:
                raise _incomplete(base, f"its streamed optimizer state ({os.path.join(base, STREAMED_DIR)})")
            info["optimizer"] = "streamed"
        else:
            saved_world = meta.get("world_size")
            if saved_world is not None and int(saved_world) != world_size:
                raise CheckpointError(
                    f"{base} was saved by {saved_world} train ranks and this run has {world_size}: the sharded "
                    "optimizer state only resumes onto the same data-parallel size (use --no-load-optim to "
                    "load the weights alone)")
            path = optimizer_file(base, rank)
            if not os.path.exists(path):
                raise _incomplete(base, f"the optimizer state of rank {rank} ({path})")
            optimizer.load_state_dict(_load_tensors(path, ", or pass --no-load-optim to load the weights alone"))
            info["optimizer"] = "state_dict"
    info["seconds"] = time.perf_counter() - start
    return info


_STREAMING_MODES = {True: "streamed to disk (--stream-optimizer-state-to-disk)",
                    False: "in memory (without --stream-optimizer-state-to-disk)"}
_TO_STREAMING_MODE = {True: "add --stream-optimizer-state-to-disk --offload-train-target=disk",
                      False: "drop --stream-optimizer-state-to-disk"}


def check_streaming_mode(base: str, meta: dict[str, Any], streamed: bool) -> Optional[bool]:
    """Refuse to resume the optimizer state of ``base`` into a run that keeps it in the other mode (``streamed``:
    this run streams it to disk), naming the flag: it would restart Adam from zero. Returns how the checkpoint
    saved its state (:func:`_saved_streamed`; None: it holds none)."""
    saved = _saved_streamed(base, meta)
    if saved is not None and saved != streamed:
        raise CheckpointError(
            f"{base} holds optimizer state {_STREAMING_MODES[saved]} and this run keeps it "
            f"{_STREAMING_MODES[streamed]}: resuming across a change of streaming mode would restart Adam from zero. "
            f"To resume it, {_TO_STREAMING_MODE[saved]}; or pass --no-load-optim to resume the weights alone with "
            "fresh optimizer state")
    return saved


def _saved_streamed(base: str, meta: dict[str, Any]) -> Optional[bool]:
    """How the checkpoint ``base`` saved its optimizer state: True streamed (``nvme_opt_state/``), False as
    per-rank state_dicts (``optimizer/``), None when it holds none (saved without optimizer state). A
    checkpoint whose folder of state is gone still says which it was in its meta (``streamed_optimizer_state``)."""
    if os.path.isdir(os.path.join(base, STREAMED_DIR)):
        return True
    if os.path.isdir(os.path.join(base, OPTIMIZER_DIR)):
        return False
    saved = meta.get("streamed_optimizer_state")
    return saved if isinstance(saved, bool) else None


# ---- the parallel layout a checkpoint's optimizer state was cut for ----------------------------------------
# The sizes that cut the optimizer state into differently shaped shards (data parallelism does not: the store
# reshards over it), by Megatron flag; a checkpoint without the record was saved at TP = PP = 1, even stages.
_SHARD_SHAPING = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                  "expert_tensor_parallel_size": 1, "decoder_first_pipeline_num_layers": None,
                  "decoder_last_pipeline_num_layers": None}


def layout_meta(layout) -> dict[str, Any]:
    """The meta.json record of a :class:`~miles.parallel.layout.ParallelLayout` (Megatron's flag names)."""
    return {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
            "expert_model_parallel_size": layout.ep, "expert_tensor_parallel_size": layout.etp,
            "decoder_first_pipeline_num_layers": layout.first_stage_layers,
            "decoder_last_pipeline_num_layers": layout.last_stage_layers, "world_size": layout.world}


def check_resume_layout(base: str, meta: dict[str, Any], layout) -> None:
    """Refuse to load ``base``'s optimizer state into a run whose tensor/pipeline layout differs from the one it
    was saved with, naming the flags that would resume it (the weights are saved whole and load anywhere)."""
    saved = meta.get(LAYOUT_META) or {}
    now = layout_meta(layout)
    differ = [name for name, default in _SHARD_SHAPING.items() if saved.get(name, default) != now[name]]
    if not differ:
        return
    flags = lambda record: " ".join(f"--{n.replace('_', '-')} {record.get(n, _SHARD_SHAPING[n])}"  # noqa: E731
                                    for n in differ if record.get(n, _SHARD_SHAPING[n]) is not None) or "(unset)"
    saved_flags = flags(saved)
    raise CheckpointError(
        f"{base} holds optimizer state sharded for {saved_flags} and this run has {flags(now)}: the state of a "
        "tensor- or pipeline-parallel shard resumes only onto the same layout (a change of data-parallel size is "
        f"resharded). Resume with {saved_flags} (and --num-train-ranks a multiple of TP x PP), or pass "
        "--no-load-optim to load the weights alone (saved whole) with fresh optimizer state")


def _incomplete(base: str, what: str) -> CheckpointError:
    return CheckpointError(f"{base} lacks {what}, which its save wrote: the checkpoint is incomplete. Resume from "
                           "another checkpoint, or pass --no-load-optim to resume the weights alone with fresh "
                           "optimizer state")
