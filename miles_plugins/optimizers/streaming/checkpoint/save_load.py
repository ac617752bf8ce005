"""Checkpoints of streamed optimizer state: manifest, atomic publish, verification, resharding.

Format, version 1. `store.save_to(base)` writes one directory per store, named by the store:
  <base>/nvme_opt_state/<store.relative_dir>/     (e.g. rank00000/opt0_0/)
    bucket00000.bin ...  byte copies of the live buckets ([main | exp_avg | exp_avg_sq], layout.py): of their
                         files, or of their host RAM for buckets that live there only (no file, no write-back)
    manifest.json        format, version, relative_dir, streams_main (false: plain fp32 Adam, moments only),
      segments     {segment: codec.describe()}: storage dtype, block size, scale layout
      entries      [{name, start, stop, full_numel, group}]: elements [start, stop) of the flattened
                   param `name` (null: no identity, resumes onto the same layout only; Megatron
                   checkpoints written before its binding named entries)
      group_steps  {group: largest Adam step} (a summary; the per-piece steps are the state)
      buckets      [{file, numel, file_bytes, crc32 (zlib, whole file), moments (false: never stepped,
                    moment segments hold nothing), segments {name: [offset, nbytes]},
                    pieces [[entry, start, stop, step or null (no Adam state yet)]]}]
      resident     {file, file_bytes, crc32} of resident_adam.pt, when the binding keeps a small resident
                   Adam (store.resident_adam: Megatron's native-fp32 params): its torch state_dict
      next_bucket_order, codec_rng   the next step's bucket order and {file, file_bytes, crc32, devices}
                   of codec_rng.pt, the stochastic-rounding generators' states (rng.py; absent in
                   checkpoints written before them, and codec_rng when no codec rounds stochastically)
      manifest_crc32  crc32 of the rest (json, sorted keys)

Atomic publish: files go to `<dir>.tmp-<pid>/`, each fsynced, the manifest last; the directory is then
renamed to `<dir>` and its parent fsynced. A kill at any point leaves what `<dir>` held before (nothing,
when each checkpoint has its own base) or the complete new one. A `.tmp-` leftover is never read; the
next save to that base removes it. Other bases (the previous checkpoint) are never touched.

No stall: save_to lands pending writes and the write-back images' dirty bytes in the files (buckets in host
RAM only have nothing to land: they are copied from RAM), snapshots the metadata and hands the copy to a thread
(reflink where the filesystem has it). Until a bucket is copied its live file has a `before_write`
guard: the first write to it (the next step) copies it first. Training waits only for buckets it is
about to overwrite. wait=False returns after the snapshot; wait_for_save() returns once published.
With verify on, the bytes copied are checked against verify's chunk checksums of the live file (taken
when the bucket is copied): a live file changed outside the store fails the save (StateCorruptionError,
nothing published; the store poisons itself).

Load trusts nothing in a manifest (checkpoints may come from elsewhere): the manifest's size and JSON
nesting are bounded before it is parsed, and every field is checked for type and range (manifest.py);
every file it lists must be a plain name inside the checkpoint directory (no absolute path, no `..`, no
symbolic link out) and is opened once, before any live file changes, as a regular file (O_NOFOLLOW: a
link is refused even inside the checkpoint), and read only through that descriptor; every declared size
is bounded by what this store's layout expects (a bucket file: its live file's bytes; codec_rng.pt:
RNG_RECORD_MAX_BYTES; resident_adam.pt: what the resident Adam's state can hold); and a resharded
checkpoint must hold exactly the model's params (`store.model_params`), named and sized alike. Each
violation is a CheckpointError, raised while the live state is still untouched.

Load checks format, mains and codecs, then restores the same layout (copying each file back, its
crc32 checked on the way, and the generators' states: bit-identical resume for every moment_dtype) or
reshards: it reads the manifests of this store identity on every rank (`rank*/opt{instance}_{part}`),
checks each named param range is covered exactly once, verifies the files it uses and copies element
ranges into place (fp32, bf16: bytes, bit-exact; fp16, fp8: decoded and re-quantized in the new
blocks, requantize.py; the noise restarts from the seeds). Moments saved in another format than the
store's (moment_dtype changed since the save) take the reshard path on any layout: decoded to fp32,
encoded in the store's format; the recorded format must fit each segment's bytes. Then it restores the
per-piece Adam steps and points the moments at the bucket buffers, so the first step streams them.
Nothing live is touched until every check has passed; the host tier's images are then dropped
without writing them back, since every file is rewritten. A load that fails after touching the live
files resets the store to fresh state (mains <- model params, no moments, noise from the seeds).
"""

from __future__ import annotations

import errno
import glob
import json
import logging
import os
import threading
import time
import zlib
from io import BytesIO

import torch

from ..codec import codec_from_description
from ..errors import CheckpointError, StateCorruptionError, StoreConfigError
from ..io import stager as io
from ..layout import MAIN, STREAMED_DIR, bucket_filename
from . import requantize
from . import rng as codec_rng
from .manifest import ManifestError, check_manifest, check_nesting
from .reshard import ReshardError, entry_meta, plan_reshard, segment_names

logger = logging.getLogger(__name__)
FORMAT, VERSION = "miles-streamed-optimizer-state", 1
MANIFEST, RESIDENT = "manifest.json", "resident_adam.pt"


def build_manifest(store) -> dict:
    buckets, group_steps = [], {}
    for b in store.buckets:
        pieces = []
        for piece, step in zip(b.pieces, b.adam_steps()):
            pieces.append([piece.entry, piece.start, piece.stop, step])
            g = str(store.entries[piece.entry].group)
            group_steps[g] = max(group_steps.get(g, 0), step or 0)
        buckets.append({"file": bucket_filename(b.index), "numel": b.numel, "file_bytes": b.file.nbytes,
                        "crc32": None, "moments": b.moments_on_disk, "pieces": pieces,
                        "segments": {n: [s.offset, s.nbytes] for n, s in b.layout.segments.items()}})
    return {"format": FORMAT, "version": VERSION, "relative_dir": store.relative_dir,
            "streams_main": store.streams_main,
            "segments": {n: store.codecs[n].describe() for n in segment_names(store)},
            "entries": [entry_meta(e) for e in store.entries], "group_steps": group_steps, "buckets": buckets}


def enclosing_checkpoint(path: str) -> tuple[str, str] | None:
    """(checkpoint base, why) when `path` lies in a checkpoint of streamed state, else None: the nearest
    folder, `path` itself or one above it, that is named nvme_opt_state (its parent is the checkpoint)
    or holds `nvme_opt_state/rank*/*/manifest.json`. Both the path as given and its real path are walked."""
    for candidate in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
        folder = candidate
        while True:
            if os.path.basename(folder) == STREAMED_DIR:
                return os.path.dirname(folder), f"{folder} is a checkpoint's {STREAMED_DIR} folder"
            if io.glob_paths(os.path.join(glob.escape(folder), STREAMED_DIR, "rank*", "*", MANIFEST)):
                return folder, f"{folder} holds {STREAMED_DIR}/ with a manifest"
            parent = os.path.dirname(folder)
            if parent == folder:
                break
            folder = parent
    return None


# ---- save -----------------------------------------------------------------------------------------
class SaveJob:
    """One save in flight: live bucket files -> `<dir>.tmp-<pid>/` -> manifest -> rename to `<dir>`."""

    def __init__(self, store, base: str):
        t0 = time.perf_counter()
        self.store, self.final = store, os.path.join(os.path.abspath(base), STREAMED_DIR, store.relative_dir)
        self.tmp = f"{self.final}.tmp-{io.ProcessIdentity.current().tag()}"
        store.stager.write_back()  # write-behind and dirty host images must be in the files we copy
        self.manifest = build_manifest(store)
        self.resident = None  # the small always-resident Adam (native-fp32 params) is in memory: snapshot it now
        if _resident(store) is not None:
            buf = BytesIO()
            torch.save(_resident(store).state_dict(), buf)
            self.resident = buf.getvalue()
            self.manifest["resident"] = {"file": RESIDENT, "file_bytes": len(self.resident),
                                         "crc32": zlib.crc32(self.resident)}
        rng_fields, self.rng = codec_rng.snapshot(store)  # the noise as of now: the next step draws more
        self.manifest.update(rng_fields)
        _remove_abandoned_temporaries(self.final)
        io.make_dirs(self.tmp)
        self.order = [b.index for b in store.pipeline.next_order()]  # the order the next step overwrites them in
        self.locks = {i: threading.Lock() for i in self.order}
        self.fds, self.done, self.error, self.use_reflink = {}, set(), None, True
        self.checks = {}  # bucket -> verify's check of a reflinked copy, run when the clone is checksummed
        self.stats = {"path": self.final, "bytes": sum(b.file.nbytes for b in store.buckets),
                      "reflinked_buckets": 0, "stalled_seconds": 0.0, "copied_by_writer": 0}
        for b in store.buckets:
            b.file.before_write = lambda i=b.index: self._guard(i)
        self.t0 = t0
        self.thread = threading.Thread(target=self._run, name="nvme-opt-checkpoint", daemon=True)
        self.thread.start()
        self.stats["blocked_seconds"] = time.perf_counter() - t0

    def _guard(self, i: int) -> None:
        t = time.perf_counter()
        self.stats["copied_by_writer"] += self._copy(i)
        self.stats["stalled_seconds"] += time.perf_counter() - t

    def _copy(self, i: int) -> bool:
        with self.locks[i]:
            if i in self.done:
                return False
            file = self.store.buckets[i].file
            try:
                if self.error is None:
                    fd = self.fds[i] = io.open_new(os.path.join(self.tmp, bucket_filename(i)))
                    # verify: the bytes copied must be those the store wrote. Its record is taken now: the
                    # next write to the bucket (right after this copy) replaces it
                    check = file.checksums.in_order_check()
                    crc = None  # reflinked: checksummed (and checked) later from the clone, off the training path
                    # a bucket in host RAM only is copied from its memory file straight into the checkpoint:
                    # its bytes are written once, and no reflink is tried (RAM has no extents to share)
                    if file.home is None and self.use_reflink and io.reflink(file.fd, fd):
                        self.checks[i] = check
                    else:
                        self.use_reflink = self.use_reflink and file.home is not None
                        crc = io.copy_with_crc(file.fd, fd, file.nbytes, inspect=check)
                    self.manifest["buckets"][i]["crc32"] = crc
            except Exception as e:  # training goes on; wait_for_save() reports it
                self.error = self.error or e
            finally:
                self.done.add(i)
                file.before_write = None
            return True

    def _run(self) -> None:
        try:
            for i in self.order:
                self._copy(i)
            if self.error is not None:
                raise self.error
            for i in sorted(self.fds):
                meta = self.manifest["buckets"][i]
                if meta["crc32"] is None:
                    meta["crc32"] = io.copy_with_crc(self.fds[i], None, meta["file_bytes"], inspect=self.checks[i])
                    self.stats["reflinked_buckets"] += 1
                io.close_fd(self.fds.pop(i), sync=True)
            for name, data in ((RESIDENT, self.resident), (codec_rng.FILE, self.rng)):
                if data is not None:
                    io.write_file_durable(os.path.join(self.tmp, name), data)
            body = json.dumps(self.manifest, sort_keys=True)
            text = json.dumps({**self.manifest, "manifest_crc32": zlib.crc32(body.encode())}, indent=1)
            io.write_file_durable(os.path.join(self.tmp, MANIFEST), text.encode())
            io.fsync_dir(self.tmp)
            io.publish_dir(self.tmp, self.final)
            self.stats["seconds"] = time.perf_counter() - self.t0
        except BaseException as e:
            self.error = self.error or e
            for fd in self.fds.values():
                io.close_fd(fd)
            io.remove_tree(self.tmp)
        finally:
            for b in self.store.buckets:
                b.file.before_write = None

    def wait(self) -> dict:
        self.thread.join()
        if isinstance(self.error, StateCorruptionError):  # a live file changed on disk: the store poisons itself
            raise StateCorruptionError(f"saving optimizer state to {self.final} failed, nothing was published: "
                                       f"{self.error}") from self.error
        if self.error is not None:
            raise CheckpointError(f"saving optimizer state to {self.final} failed: {self.error!r}") from self.error
        return self.stats


def _remove_abandoned_temporaries(final: str) -> None:
    """Remove `<final>.tmp-<pid>` folders of saves whose process is dead on this host (killed mid-save);
    a live pid's folder is a save in progress (another process) and stays."""
    for stale in io.glob_paths(f"{final}.tmp-*"):
        saver = io.ProcessIdentity.from_tag(stale.rsplit(".tmp-", 1)[1])
        if saver is not None and not saver.is_current() and io.identity_alive(saver):
            logger.info("leaving %s: process %s is alive and may still be saving there", stale, saver.pid)
            continue
        logger.info("removing %s, left by an interrupted save", stale)
        io.remove_tree(stale)


# ---- load -----------------------------------------------------------------------------------------
def _resident(store):
    """The torch optimizer of the store's resident Adam (native-fp32 params), or None."""
    return None if store.resident_adam is None else store.resident_adam.optimizer


# A generator state is a few KiB (CPU mt19937: ~5 KiB; CUDA Philox: 16 B); a record holds one per noisy
# segment and device, plus torch.save's framing. Anything larger is not a record of this store.
RNG_RECORD_MAX_BYTES = 64 * (len(torch.Generator().get_state()) + 4096)
_MANIFEST_BYTES_PER_ITEM = 4096  # a manifest's entry or piece is ~100 bytes of JSON


def _manifest_limit(store) -> int:
    """The most bytes a manifest of this store's size may hold (ranks of one store are of similar size)."""
    items = len(store.entries) + sum(len(b.pieces) for b in store.buckets) + len(store.buckets)
    return max(1 << 20, _MANIFEST_BYTES_PER_ITEM * items)


def _confined(directory: str, name, root: str) -> str:
    """`directory/name` for a file a manifest lists: a plain file name whose real path is inside the
    checkpoint `root`. Raises CheckpointError otherwise (nothing is opened or stat'ed first)."""
    if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name or "\0" in name:
        raise CheckpointError(f"{directory}: the manifest lists the file {name!r}; a checkpoint's files are plain "
                              "names inside its directory (no absolute path, no '..'): the manifest is corrupt or "
                              "was edited; resume from another checkpoint")
    path = os.path.join(directory, name)
    real_root = os.path.realpath(root)
    if os.path.commonpath([os.path.realpath(path), real_root]) != real_root:
        raise CheckpointError(f"{path} leads outside the checkpoint {root} (a symbolic link out of it); a "
                              "checkpoint's files must be inside it: resume from another checkpoint")
    return path


def _check_listed_files(m: dict, directory: str, root: str) -> None:
    for meta in m["buckets"] + [m[k] for k in ("resident", "codec_rng") if m.get(k) is not None]:
        _confined(directory, meta["file"], root)


def _read_manifest(directory: str, root: str, store) -> dict:
    """The manifest of `directory` (inside the checkpoint `root`): size and nesting bounded before it is
    parsed, checksummed, every field checked (manifest.py), every file it lists confined to the checkpoint."""
    path = _confined(directory, MANIFEST, root)
    try:
        text = io.read_regular(path, _manifest_limit(store))
        check_nesting(text)
        m = json.loads(text)
        if not isinstance(m, dict):
            raise ValueError(f"it holds a JSON {type(m).__name__}, not an object")
        if m.pop("manifest_crc32", None) != zlib.crc32(json.dumps(m, sort_keys=True).encode()):
            raise ValueError("its checksum does not match")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: manifest is truncated or unreadable ({e}); this checkpoint of "
                              "optimizer state is incomplete or corrupt: resume from another checkpoint") from e
    try:
        check_manifest(m)
    except ManifestError as e:
        raise CheckpointError(f"{path}: {e}; the manifest is corrupt or was edited: resume from another "
                              "checkpoint") from None
    _check_listed_files(m, directory, root)
    return m


def _check_format(m: dict, directory: str, store) -> str | None:
    """Raise where this store cannot read the checkpoint at all. Returns what differs in the moments'
    storage formats (moment_dtype changed since the save: the load converts them), or None."""
    if (m["format"], m["version"]) != (FORMAT, VERSION):
        raise CheckpointError(f"{directory}: format {m['format']!r} version {m['version']}, this build reads "
                              f"{FORMAT!r} version {VERSION}")
    if m["streams_main"] != store.streams_main:
        what = lambda s: "fp32 masters and moments" if s else "moments only (plain fp32 Adam)"  # noqa: E731
        raise CheckpointError(f"{directory}: checkpoint holds {what(m['streams_main'])}, this store streams "
                              f"{what(store.streams_main)}")
    changed = []
    for name in segment_names(store):  # manifest.py checked that the manifest describes exactly these
        saved, live = m["segments"][name], store.codecs[name].describe()
        decoder = store.codecs[name]
        if saved != live:
            if name == MAIN:
                raise CheckpointError(f"{directory}: {name} is stored as {saved} in the checkpoint, as {live} by "
                                      "this store; this build cannot convert it")
            try:
                decoder = codec_from_description(saved)
            except StoreConfigError as e:
                raise CheckpointError(f"{directory}: {e}") from None
            changed.append(f"{name} {saved.get('name')} -> {live['name']}")
        for sb in m["buckets"]:  # the bytes must be what the recorded format says, or they decode to garbage
            if sb["segments"][name][1] != decoder.encoded_nbytes(sb["numel"]):
                raise CheckpointError(
                    f"{directory}: {name} of {sb['file']} holds {sb['segments'][name][1]} bytes, but its recorded "
                    f"format {saved.get('name')} stores {sb['numel']} elements in "
                    f"{decoder.encoded_nbytes(sb['numel'])}; "
                    "the manifest does not describe the file: the checkpoint is corrupt")
    return f"moment storage changed since the save ({', '.join(changed)})" if changed else None


def _same_entry(saved: dict, live: dict) -> bool:
    if saved["name"] is None:  # saved before its binding gave identities (Megatron): sizes and group
        return (saved["stop"] - saved["start"], saved["group"]) == (live["stop"] - live["start"], live["group"])
    return saved == live


def _layout_diff(m: dict, store) -> str | None:
    """The first difference between the checkpoint's layout and this store's, or None."""
    entries = [entry_meta(e) for e in store.entries]
    show = lambda e: f"{e['name']}[{e['start']}:{e['stop']}] of {e['full_numel']} (group {e['group']})"  # noqa: E731
    for i, (saved, live) in enumerate(zip(m["entries"], entries)):
        if not _same_entry(saved, live):
            return f"entry {i}: {show(saved)} in checkpoint, {show(live)} now"
    if len(m["entries"]) != len(entries):
        return f"{len(m['entries'])} entries in checkpoint, {len(entries)} now"
    if len(m["buckets"]) != len(store.buckets):
        return f"{len(m['buckets'])} buckets in checkpoint, {len(store.buckets)} now"
    for b, sb in zip(store.buckets, m["buckets"]):
        if sb["numel"] != b.numel:
            return f"bucket {b.index}: {sb['numel']} elements in checkpoint, {b.numel} now"
        if ([p[:3] for p in sb["pieces"]] != [[p.entry, p.start, p.stop] for p in b.pieces]
                or sb["segments"] != {n: [s.offset, s.nbytes] for n, s in b.layout.segments.items()}):
            return f"bucket {b.index}: its pieces or segment offsets differ"
    return None


def _unreadable(path: str, error: OSError) -> CheckpointError:
    what = "missing from" if error.errno == errno.ENOENT else "not a plain file of"
    return CheckpointError(f"{path}: {what} the checkpoint ({error.strerror}); resume from another checkpoint")


def _open_listed(path: str, expected: int, opened: dict[str, int]) -> int:
    """Open a file the manifest lists (its name already confined) as a regular file, never following a
    link, and check its size; the descriptor goes into `opened` (path -> fd, the caller closes them), and
    the load reads the file only through it. Raises CheckpointError."""
    if path in opened:
        return opened[path]
    try:
        fd, size = io.open_regular(path)
    except OSError as e:
        raise _unreadable(path, e) from None
    opened[path] = fd
    if size != expected:
        raise CheckpointError(f"{path}: {size} bytes, the manifest says {expected} (truncated or corrupt)")
    return fd


def _read_verified(directory: str, meta: dict, limit: int) -> bytes:
    """A small file the manifest lists ({file, file_bytes, crc32}, its name already confined), its
    declared size bounded by `limit` before anything is read, its size and checksum checked."""
    path = os.path.join(directory, meta["file"])
    declared = meta["file_bytes"]
    if not isinstance(declared, int) or not 0 <= declared <= limit:
        raise CheckpointError(f"{path}: the manifest declares {declared!r} bytes, but a file of its kind holds at "
                              f"most {limit} for this store; the manifest is corrupt or was edited")
    try:
        data = io.read_regular(path, limit)
    except OSError as e:
        raise _unreadable(path, e) from None
    if len(data) != declared:
        raise CheckpointError(f"{path}: {len(data)} bytes, the manifest says {declared} (truncated or corrupt)")
    if zlib.crc32(data) != meta["crc32"]:
        raise CheckpointError(f"{path}: checksum mismatch; the file is corrupt")
    return data


def _rng_record(directory: str, m: dict, store):
    """The saved next bucket order and stochastic-rounding generators (every codec: fp32 moments have an
    order and no generators), verified; None where the checkpoint records neither."""
    try:
        descending = codec_rng.parse_order(m.get("next_bucket_order"))
    except codec_rng.RngRecordError as e:
        raise CheckpointError(f"{os.path.join(directory, MANIFEST)}: {e}; the manifest is corrupt or was edited: "
                              "resume from another checkpoint, or without this optimizer state") from None
    listed = m.get("codec_rng")
    data = None if listed is None else _read_verified(directory, listed, RNG_RECORD_MAX_BYTES)
    try:
        return codec_rng.parse(data, descending, store)
    except codec_rng.RngRecordError as e:
        raise CheckpointError(f"{os.path.join(directory, listed['file'] if listed else MANIFEST)}: the record of "
                              f"the stochastic-rounding generators is corrupt or does not fit this store ({e}); "
                              "resume from another checkpoint, or without this optimizer state") from None


def _copy_checked(fd: int, path: str, expected_crc: int, nbytes: int, dst_fd: int | None) -> None:
    """Copy (dst_fd None: only read) the whole checkpoint file open as `fd`, checking its crc32."""
    crc = io.copy_with_crc(fd, dst_fd, nbytes)
    if crc != expected_crc:
        raise CheckpointError(f"{path}: checksum mismatch (crc32 {crc:08x}, manifest {expected_crc:08x}); "
                              "the file is corrupt")


def _resident_limit(resident) -> int:
    """The most bytes the resident Adam's saved state may hold: two fp32 moments per param, plus framing."""
    params = [p for g in resident.param_groups for p in g["params"]]
    return (1 << 20) + sum(8 * p.numel() + 4096 for p in params)


def _plan_same_layout(store, m: dict, own: str, sources: dict[str, int]):
    """A load onto the saved layout: whole-file copies. Every file is opened and its size checked, the
    small ones read and verified, before anything live changes."""
    resident, resident_state = _resident(store), None
    if (resident is None) != (m.get("resident") is None):
        has = m.get("resident") is not None
        raise CheckpointError(f"{own}: the checkpoint {'holds' if has else 'lacks'} the state of a resident Adam "
                              f"(native-fp32 params), which this store {'lacks' if has else 'has'}")
    copies = []
    for b, sb in zip(store.buckets, m["buckets"]):
        path = os.path.join(own, sb["file"])
        if sb["file_bytes"] != b.file.nbytes:
            raise CheckpointError(f"{path}: the manifest declares {sb['file_bytes']!r} bytes, bucket {b.index} of "
                                  f"this layout holds {b.file.nbytes}; the manifest is corrupt or was edited")
        _open_listed(path, sb["file_bytes"], sources)
        copies.append((path, sb["crc32"], 0, b.file.fd, 0, sb["file_bytes"]))
    if resident is not None:
        data = _read_verified(own, m["resident"], _resident_limit(resident))
        try:
            resident_state = torch.load(BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # weights_only refuses anything but tensors and plain containers
            raise CheckpointError(f"{os.path.join(own, m['resident']['file'])}: not a state of the resident Adam "
                                  f"this build writes ({type(e).__name__}: {e}); resume from another "
                                  "checkpoint") from None
    rng = _rng_record(own, m, store)
    steps = [[p[3] for p in sb["pieces"]] for sb in m["buckets"]]
    return copies, [], steps, [sb["moments"] for sb in m["buckets"]], resident_state, rng


def _install(store, copies, requants, steps, moments, resident_state, rng, diff, sources) -> None:
    """Write the checkpoint's state into the live files and buckets. A failure here resets the store to
    fresh state (the live files are partly rewritten)."""
    resident = _resident(store)
    try:
        for path, crc, src_off, dst_fd, dst_off, nbytes in copies:
            if diff is None:
                _copy_checked(sources[path], path, crc, nbytes, dst_fd)  # a whole file, checked on the way
            else:
                io.copy_with_crc(sources[path], dst_fd, nbytes, src_off, dst_off)
        requantize.apply(store, requants, sources)
        for b, s, mo in zip(store.buckets, steps, moments):
            b.install_moments(s, mo)
        if resident_state is not None:
            resident.load_state_dict(resident_state)
        codec_rng.restore(store, rng, f"not the saved layout or formats: {diff}" if diff is not None
                          else "the checkpoint predates the record of the generators")
    except BaseException:
        logger.error("loading optimizer state failed after the live files were rewritten: resetting the store %s "
                     "to fresh state", store.relative_dir)
        for b in store.buckets:
            b.reset_state()
        if resident is not None:
            resident.state.clear()
        codec_rng.reset(store)
        store.refresh_main_from_model_params()
        raise


def load(store, base: str) -> bool:
    root = os.path.join(os.path.abspath(base), STREAMED_DIR)
    if not io.glob_paths(root):
        logger.warning("%s has no streamed optimizer state (%s): the optimizer state starts fresh", base, root)
        return False
    own = os.path.join(root, store.relative_dir)
    m = _read_manifest(own, base, store) if io.glob_paths(os.path.join(own, MANIFEST)) else None
    diff = _layout_diff(m, store) if m is not None else f"no {STREAMED_DIR}/{store.relative_dir} in the checkpoint"
    if m is not None:
        converted = _check_format(m, own, store)
        # another moment_dtype than the save's: decoded and encoded again, through the reshard plan
        diff = "; ".join(d for d in (converted, diff) if d) or None
    sources: dict[str, int] = {}  # every checkpoint file the load reads, opened before a live file changes
    try:
        copies, requants, steps, moments, resident_state, rng = (
            _plan_same_layout(store, m, own, sources) if diff is None else _reshard(store, base, own, diff, sources))
        # the checkpoint passed its checks: every file is rewritten from here on, so the host tier's dirty
        # images are dropped unwritten (a load that fails its checks above leaves the live state as it was)
        store.stager.drain(write_back=False)
        store.stager.files_rewritten([b.file for b in store.buckets])
        _install(store, copies, requants, steps, moments, resident_state, rng, diff, sources)
    finally:
        for fd in sources.values():
            io.close_fd(fd)
    logger.info("loaded streamed optimizer state from %s (group steps %s)", root,
                m["group_steps"] if m is not None and diff is None else "resharded")
    return True


def _check_coverage(manifests: list[tuple[str, dict]], store) -> None:
    """The checkpoint must hold exactly the model's params (store.model_params: name -> elements), no
    more and no fewer, of the same sizes. None: the binding cannot list them (Megatron), not checked."""
    entries = [e for _, m in manifests for e in m["entries"]]
    if store.model_params is None or any(e["name"] is None for e in entries):
        return  # nameless entries (older Megatron checkpoints): plan_reshard refuses them, saying why
    saved = {e["name"]: e["full_numel"] for e in entries}
    if saved == store.model_params:
        return
    names = sorted(set(saved) | set(store.model_params), key=lambda n: (len(n), n))
    first = next(n for n in names if saved.get(n) != store.model_params.get(n))
    show = lambda size: "absent" if size is None else f"{size} elements"  # noqa: E731
    raise ReshardError(f"the checkpoint holds {len(saved)} params ({sum(saved.values())} elements), this model "
                       f"{len(store.model_params)} ({sum(store.model_params.values())} elements); first difference: "
                       f"{first}: {show(saved.get(first))} in the checkpoint, {show(store.model_params.get(first))} "
                       "now. Load a checkpoint of this model")


def same_shard(manifests: list[tuple[str, dict]], store) -> list[tuple[str, dict]]:
    """The saved states of this store's model shard. Under tensor or pipeline parallelism every TP/PP rank has a
    store of the same identity over other params (the binding's names carry the shard, ``store.shard_of``):
    data parallelism reshards among the states of this store's shard only. Without ``shard_of`` or
    ``model_params``, or with nameless entries, every state is kept."""
    if store.shard_of is None or store.model_params is None:
        return manifests
    mine = {store.shard_of(name) for name in store.model_params}
    return [(d, m) for d, m in manifests
            if any(e["name"] is None or store.shard_of(e["name"]) in mine for e in m["entries"])]


def _reshard(store, base: str, own: str, diff: str, sources: dict[str, int]):
    """Plan the copies from every rank's state of this store identity; open (into `sources`) and verify
    every file they read."""
    root = os.path.join(os.path.abspath(base), STREAMED_DIR)
    identity = os.path.basename(store.relative_dir)
    paths = io.glob_paths(os.path.join(root, "rank*", identity, MANIFEST))
    try:
        if _resident(store) is not None:
            raise ReshardError("the resident Adam over native-fp32 params does not reshard")
        if not paths:
            leftovers = io.glob_paths(os.path.join(root, "rank*", identity + ".*"))
            raise ReshardError(f"no complete state of store {identity} under {root}"
                               + (f" (an interrupted save left {leftovers})" if leftovers else ""))
        manifests = []
        for path in paths:
            manifests.append((os.path.dirname(path), _read_manifest(os.path.dirname(path), base, store)))
            _check_format(manifests[-1][1], manifests[-1][0], store)
        manifests = same_shard(manifests, store)
        _check_coverage(manifests, store)
        copies, requants, steps, moments, used = plan_reshard(store, manifests)
    except ReshardError as e:
        raise CheckpointError(f"{own}: the checkpoint differs from this store ({diff}) and cannot be mapped "
                              f"onto it: {e}") from None
    for path, meta in sorted(used.items()):  # every file we read from, before touching the live files
        _copy_checked(_open_listed(path, meta["file_bytes"], sources), path, meta["crc32"], meta["file_bytes"], None)
    logger.info("resharding streamed optimizer state from %s (%s)%s", root, diff,
                f"; re-quantizing {len(requants)} block-scaled moment ranges" if requants else "")
    return copies, requants, steps, moments, None, None

