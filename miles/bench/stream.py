"""`miles bench stream`: what a streamed optimizer step costs, against the disk it streams through.

One run, one directory, one store (mixed precision: bf16 model params, fp32 masters + Adam moments
stored as `--moment-dtype`: 12 bytes of streamed state per param with fp32 moments, 8 with bf16, ~6
with fp8):

  resident   an in-memory AdamW step over the same params (what the step would cost with no disk)
  floor      the raw disk alone: read the bytes a step reads (the store's own bucket segments) and write
             as many (to a scratch file beside them), chunked, O_DIRECT when available, no compute, no
             device; once with reads and writes at once, once reads then writes: the faster is the floor
  sync       the seed's synchronous engine (buffered I/O, one staging buffer)
  pipelined  the pipelined engine (worker threads, CUDA streams, O_DIRECT when available)
  +verify    (--verify) the pipelined engine with verify on, same files, measured in the same rounds
  exposed    with a synthetic forward/backward before every step: step wall time minus the resident
             step time, for (a) no read-ahead and writes waited inside the step, (b) read-ahead +
             write-behind, (c) (b) + a host-RAM cache for the buckets written last

Engine steps are measured cold and end to end: page cache dropped before (the sync engine's buffered
reads would otherwise come from RAM), and the time runs until every write is in the files (flush +
fdatasync: buffered writes that sit in the page cache have not cost the disk yet). On CUDA the device
memory peak of the pipelined step is printed beside the store's documented residency bound.

    miles bench stream --params 100M --device cpu --dir /var/tmp/bench --json out.json
    python -m miles.bench.stream --params 1.5B --device cuda --dir /mnt/nvme/bench
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import time

import torch

from miles.sizing.store_plan import moment_bytes_per_param
from miles.sizing.tensors import STAND_IN_TENSORS, stand_in_numels
from miles_plugins.optimizers.streaming.config import DEFAULT_CHUNK_MB, DEFAULT_DEPTH, DEFAULT_IO_THREADS, MOMENT_DTYPES
from miles_plugins.optimizers.streaming.units import GB, MiB

from .common import (MAX_FWD_BWD_SECONDS, FwdBwd, Progress, count_arg, device_arg, dir_arg, fractions_arg,
                     free_memory, log_store_lines, machine, median, number_arg, one_device, refuse_count_beyond,
                     run_standalone, sync_device, write_json)
from .floor import raw_floor


MIN_PARAMS = 10**6  # --params below it (less than 12 MB of state) measures no disk
MIN_PARAMS_WHY = "a smaller state, under 12 MB, times the store's fixed costs rather than the disk"


# ---- arguments ----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=count_arg("a whole param count of at least 1M, e.g. 100M or 1.5B", MIN_PARAMS,
                                              MIN_PARAMS_WHY), default="100M",
                   help="trained params (e.g. 100M, 1.5B; at least 1M); 12 B/param of state with fp32 moments")
    p.add_argument("--moment-dtype", default="fp32", choices=MOMENT_DTYPES,
                   help="storage of the Adam moments in the bucket files (the update math stays fp32)")
    p.add_argument("--device", type=device_arg, default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dir", type=dir_arg, default="miles-bench-stream", help="directory on the disk under test, "
                   "relative to the current directory unless absolute; made when missing. The bench's files are "
                   "removed at the end, and the directory too when this run made it")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--buckets", type=number_arg(int, "a bucket count, e.g. 8"), default=None, help="sets bucket_numel to params / N (the store then cuts at "
                   "least N buckets: more where a tensor straddles a bucket's end; default: the store fits "
                   "bucket_numel to the device budget)")
    p.add_argument("--bucket-numel", type=number_arg(int, "an element count, e.g. 25000000"), default=None, help="element budget per bucket (overrides --buckets)")
    p.add_argument("--device-budget-mb", type=number_arg(int, "MiB, e.g. 2048"), default=None, help="the store's device budget, MiB (default: "
                   "one bucket of the default element budget); bucket size and depth are fitted to it unless given")
    p.add_argument("--chunk-mb", type=number_arg(int, "MiB, e.g. 64"), default=DEFAULT_CHUNK_MB, help="the store's host staging chunk, MiB")
    p.add_argument("--depth", type=number_arg(int, "a read-ahead depth, e.g. 2", inclusive=True), default=None, help=f"read-ahead depth (default: the deepest up to "
                   f"{DEFAULT_DEPTH} that the device budget allows)")
    p.add_argument("--io-threads", type=number_arg(int, "a thread count, e.g. 2"), default=DEFAULT_IO_THREADS, help="the store's reader and writer threads, each")
    p.add_argument("--direct", choices=["auto", "on", "off"], default="auto", help="O_DIRECT for the floor and "
                   "the pipelined engine")
    p.add_argument("--repeat", type=number_arg(int, "a round count, e.g. 3"), default=1, help="rounds of (floors, sync step, pipelined step) and "
                   "measured iterations per exposed-I/O mode; medians are reported")
    p.add_argument("--fwd-bwd-seconds", type=number_arg(float, "seconds, e.g. 2.5", inclusive=True, high=MAX_FWD_BWD_SECONDS),
                   default=None, help="synthetic forward/backward before each "
                   "step of the exposed-I/O runs (default: the floor's time to read a step's bytes)")
    p.add_argument("--fwd-bwd", choices=["auto", "matmul", "sleep"], default="auto", help="what the synthetic "
                   "forward/backward does (auto: bf16 matmuls on CUDA, sleep on CPU, where it stands for device "
                   "compute that leaves the cores to the I/O threads)")
    p.add_argument("--host-cache-fractions", type=fractions_arg, default="0.5", help="host cache of run (c), as a fraction of the "
                   "state; a comma-separated list runs (c) once per value (e.g. 0.5,0.75)")
    p.add_argument("--only-exposed", action="store_true", help="skip the floor, sync and pipelined tables "
                   "(give --fwd-bwd-seconds)")
    p.add_argument("--skip-exposed", action="store_true", help="skip the exposed-I/O runs")
    p.add_argument("--skip-sync", action="store_true", help="skip the sync engine")
    p.add_argument("--verify", action="store_true", help="also measure the pipelined step with verify on (crc32 "
                   "of every chunk written, checked on reads from disk), in the same rounds, and print the ratio")
    p.add_argument("--quiet", action="store_true", help="no per-step log lines")


NAME, HELP = "stream", "streamed optimizer step vs the raw disk floor, sync vs pipelined"


def main(argv=None) -> int:
    return run_standalone(sys.modules[__name__], argv)


# ---- helpers ------------------------------------------------------------------------------------------
def make_state(total: int, device: torch.device, tensors: int = STAND_IN_TENSORS):
    """bf16 model params, fp32 masters (copies), fp32 grads on the masters; irregular sizes so that
    buckets split params."""
    sizes = stand_in_numels(total, tensors)  # `miles plan --params` plans these: the same buckets
    gen = torch.Generator(device=device).manual_seed(0)
    model, masters = [], []
    for n in sizes:
        m = torch.randn(n, generator=gen, device=device, dtype=torch.float32)
        model.append(m.to(torch.bfloat16))
        m.grad = torch.randn(n, generator=gen, device=device, dtype=torch.float32).mul_(1e-3)
        masters.append(m)
    return model, masters


def adamw(params):
    kwargs = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, **kwargs)


DIRECT_IO = {"auto": None, "on": True, "off": False}  # --direct as the store's direct_io
FLOOR_ORDERS = (("concurrent", True), ("sequential", False))


# ---- the run ------------------------------------------------------------------------------------------
def run(args) -> int:
    log_store_lines(args.quiet)
    say = Progress()
    device = one_device(args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    total = args.params
    root = args.dir
    check_size(args, total, device)
    made_root = not os.path.isdir(root)
    os.makedirs(root, exist_ok=True)
    try:
        results = measure(args, total, root, device, say)
    finally:
        if made_root:  # a directory the user gave stays, even empty
            try:
                os.rmdir(root)
            except OSError:
                pass
    report(results, say)
    write_json(args.json, results, say)
    return 0


def measure(args, total: int, root: str, device: torch.device, say) -> dict:
    """Every measurement of the run in ``root``, whose files it removes at the end (its results)."""
    results: dict = {"args": vars(args) | {"func": None}, "params": total} | machine(device) | {"dir": root}
    say(f"{total / 1e9:.3f}B params on {device} ({results['device']}), moments {args.moment_dtype}, in {root}; "
        f"chunk {args.chunk_mb} MiB")
    model, masters = make_state(total, device)
    results["resident_step_seconds"] = resident = resident_step(masters, device)
    say(f"resident optimizer step: {resident:.3f} s")
    store = build_store(args, total, root, model, masters, say)
    results |= {"state_bytes": store.stats.state_bytes, "bucket_numel": store.bucket_numel, "depth": store.depth,
                "device_budget_bytes": store.stats.device_budget_bytes}
    try:
        create_moments(store, say)
        results["direct_io"] = store.direct_io
        results |= measure_rounds(args, store, os.path.join(root, "floor.scratch"), device, say)
        if not args.skip_exposed:
            results["exposed"] = measure_exposed(args, store, device, resident, results["floor"], say)
        store.flush()
    finally:
        store.close()
    return results


# ---- setup: the size check, the resident step and the store --------------------------------------------
# what make_state and the resident step hold on the device at once: bf16 params, fp32 masters and grads (10 B),
# and the resident AdamW's two fp32 moments (8 B, freed after the resident step)
PARAMS_AND_GRADS_BYTES = 2 + 4 + 4
RESIDENT_STEP_BYTES = PARAMS_AND_GRADS_BYTES + 2 * 4


def check_size(args, total: int, device: torch.device) -> None:
    """Refuse --params, before anything is allocated or written, when the bench does not fit this machine:
    the device memory of the params, grads and the resident step, the host RAM of the exposed runs' cache
    (beside the params and grads on cpu), and the disk of the bucket files plus the floor's scratch file of
    as many bytes."""
    streamed = 4 + moment_bytes_per_param(args.moment_dtype)  # per param in the files: master + both moments
    fraction = 0.0 if args.skip_exposed else max(args.host_cache_fractions)
    cache = fraction * streamed
    cache_words = f"the exposed runs' host cache of --host-cache-fractions {fraction:g}: {cache:.3g} B/param"
    resident = (RESIDENT_STEP_BYTES, f"{RESIDENT_STEP_BYTES} B/param: bf16 params, fp32 masters and grads, and the "
                                     "resident step's Adam moments")
    needs = []
    if device.type == "cpu":
        beside_cache = (PARAMS_AND_GRADS_BYTES + cache, f"{PARAMS_AND_GRADS_BYTES} B/param of params and grads, and "
                                                        + cache_words)
        # one memory for both peaks: the resident step's, and the exposed runs' with the cache (whichever is larger)
        needs.append(("host memory", free_memory(device), *max(resident, beside_cache)))
    else:
        needs.append((f"memory on {device}", free_memory(device), *resident))
        if cache:
            needs.append(("host memory", free_memory(torch.device("cpu")), cache, cache_words))
    needs.append((f"disk under {args.dir}", shutil.disk_usage(nearest_directory(args.dir)).free, 2 * streamed,
                  f"the bucket files, {streamed:.3g} B/param, and the floor's scratch file of as many bytes"))
    for where, available, bytes_each, what in needs:
        refuse_count_beyond("--params", total, bytes_each, available, where, what)


def nearest_directory(path: str) -> str:
    """``path`` or the nearest of its parents that exists (the bench creates ``--dir`` when missing)."""
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def resident_step(masters, device: torch.device) -> float:
    """Seconds of an in-memory AdamW step over the masters: the median of 3, after one that creates the moments."""
    opt = adamw(masters)
    opt.step()  # creates the moments
    sync_device(device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        opt.step()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return median(times)


def build_store(args, total: int, root: str, model, masters, say):
    """The pipelined store over the masters (mains written; moments not yet created)."""
    from miles_plugins.optimizers.nvme_stream import NVMeOptimizerStateStore, StreamConfig, StreamEntry

    bucket_numel = args.bucket_numel or (math.ceil(total / args.buckets) if args.buckets else None)
    entries = [StreamEntry(main=m, group=0, model_view=p.view(-1)) for m, p in zip(masters, model)]
    t0 = time.perf_counter()
    config = StreamConfig(dir=root, chunk_mb=args.chunk_mb, bucket_numel=bucket_numel, rank=0, io_engine="pipelined",
                          depth=args.depth, io_threads=args.io_threads, direct_io=DIRECT_IO[args.direct],
                          moment_dtype=args.moment_dtype, device_budget_mb=args.device_budget_mb)
    store = NVMeOptimizerStateStore(entries, adamw(masters), config)
    say(f"store built in {time.perf_counter() - t0:.1f} s (mains written): {store.stats.num_buckets} buckets of "
        f"<= {store.bucket_numel / 1e6:.1f}M elements, depth {store.depth}, {store.stats.state_bytes / GB:.2f} GB; "
        f"device budget {store.stats.device_budget_bytes / GB:.3f} GB")
    return store


def create_moments(store, say) -> None:
    t0 = time.perf_counter()
    store.step()
    store.flush()
    say(f"step 1 (mains only, moments created): {time.perf_counter() - t0:.1f} s")


# ---- the rounds: the raw disk floors and the engines --------------------------------------------------
def measure_rounds(args, store, scratch_path: str, device: torch.device, say) -> dict:
    """{"floor": ..., engine label: ...}. The disk's speed drifts over minutes on shared hosts: every round
    measures the floors and each engine back to back, and ratios are also taken within each round."""
    ranges = floor_ranges(store)
    step_read = sum(n for _, _, n in ranges)
    arms = [] if args.only_exposed else engine_arms(args, store)
    rounds = 0 if args.only_exposed else args.repeat
    floor_runs: dict[str, list[dict]] = {}
    step_runs: dict[str, list[dict]] = {}
    with scratch_file(scratch_path, step_read):
        for r in range(rounds):
            if rounds > 1:
                say(f"round {r + 1} of {rounds}")
            for label, concurrent in FLOOR_ORDERS:
                floor_runs.setdefault(label, []).append(floor_once(args, ranges, scratch_path, label, concurrent, say))
            for label, what, io in arms:
                step_runs.setdefault(label, []).append(step_once(store, label, what, io, device, say))
    return {"floor": floor_summary(floor_runs, step_read)} | engine_summary(step_runs, floor_runs,
                                                                           device.type == "cuda")


def floor_ranges(store) -> list[tuple[str, int, int]]:
    """(path, offset, nbytes) of every bucket segment: the bytes a step reads."""
    return [(b.file.path, b.layout.segments[n].offset, b.layout.segments[n].nbytes)
            for b in store.buckets for n in b.segment_names]


@contextlib.contextmanager
def scratch_file(path: str, nbytes: int):
    """The floor writes as many bytes as a step reads into this file beside the store's: preallocated
    (rounded up to 4 KiB), and removed afterwards, also on error."""
    from miles_plugins.optimizers.streaming.io.stager import Stager

    try:
        Stager.close_descriptors(Stager.create_file(path, -(-nbytes // 4096) * 4096))
        yield
    finally:
        if os.path.exists(path):
            os.remove(path)


def engine_arms(args, store) -> list[tuple[str, str, dict]]:
    """(label, what, store.set_io arguments) of each engine measured in the rounds."""
    arms = []
    if not args.skip_sync:
        arms.append(("sync", "the seed's path: synchronous, buffered, one staging buffer",
                     dict(io_engine="sync", verify=False)))
    arms.append(("pipelined", f"depth {store.depth}, {args.io_threads}+{args.io_threads} I/O threads, "
                 f"{'O_DIRECT' if store.direct_io else 'buffered'}",
                 dict(io_engine="pipelined", depth=args.depth, write_behind=True, io_threads=args.io_threads,
                      direct_io=DIRECT_IO[args.direct], host_cache_mb=0, verify=False)))
    if args.verify:
        arms.append(("pipelined+verify", "the same with verify on: crc32 per chunk written and read",
                     arms[-1][2] | dict(verify=True)))
    return arms


def floor_once(args, ranges, scratch_path: str, label: str, concurrent: bool, say) -> dict:
    step_read = sum(n for _, _, n in ranges)
    say(f"raw disk floor ({label}): reading {step_read / GB:.2f} GB and writing as many ...")
    f = raw_floor(ranges, scratch_path, step_read, args.chunk_mb * MiB, threads=args.io_threads,
                  direct=DIRECT_IO[args.direct] is not False, concurrent=concurrent)
    extra = (f" (reads {f['read_seconds']:.2f} s, writes {f['write_seconds']:.2f} s)"
             if f["read_seconds"] is not None else "")
    say(f"  {f['seconds']:.2f} s, {2 * step_read / GB / f['seconds']:.2f} GB/s{extra}, "
        f"{'O_DIRECT' if f['direct'] else 'buffered'}")
    return f


def step_once(store, label: str, what: str, io: dict, device: torch.device, say) -> dict:
    """One engine step from cold files, timed until every write is in the files."""
    say(f"{label} engine ({what}) ...")
    files = [b.file for b in store.buckets]
    cuda = device.type == "cuda"
    turned_on = io["verify"] and not store.config.verify
    store.set_io(**io)
    if turned_on:  # verify checks what later writes record: this step's, so the measured reads are checked
        store.step()
    store.flush()
    store.stager.drop_page_cache(files)
    store.reset_stats()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    s = store.step()
    returned = time.perf_counter() - t0
    result = {"returned": returned, "bytes": s.bytes_read + s.bytes_written,
              "peak_resident_bytes": store.stats.peak_resident_bytes,
              "residency_bound_bytes": store.stats.residency_bound_bytes}
    if cuda:
        result["device_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    store.flush()
    store.stager.drop_page_cache(files)  # fdatasync: buffered writes must reach the disk too
    result["wall"] = time.perf_counter() - t0
    say(f"  {label} step {store.stats.steps}: {result['wall']:.2f} s end to end (returned after "
        f"{returned:.2f} s; read {s.bytes_read / GB:.2f} GB, wrote {s.bytes_written / GB:.2f} GB)")
    return result


def floor_summary(floor_runs: dict[str, list[dict]], step_read: int) -> dict:
    floors = {label: runs[-1] | {"seconds": median([f["seconds"] for f in runs]),
                                 "all_seconds": [f["seconds"] for f in runs]}
              for label, runs in floor_runs.items()}
    best = min((f["seconds"] for f in floors.values()), default=float("nan"))
    return floors | {"best_seconds": best, "bytes": 2 * step_read}


def engine_summary(step_runs: dict[str, list[dict]], floor_runs: dict[str, list[dict]], cuda: bool) -> dict:
    """Per engine: medians, and the ratios within each round (to that round's best floor, sync, verify off)."""
    round_floors = [min(f["seconds"] for f in fs) for fs in zip(*floor_runs.values())]
    out = {}
    for label, runs in step_runs.items():
        out[label] = {"seconds": median([x["wall"] for x in runs]),
                      "returned_seconds": median([x["returned"] for x in runs]),
                      "all_seconds": [x["wall"] for x in runs], "bytes": runs[-1]["bytes"],
                      "x_floor_by_round": [x["wall"] / f for x, f in zip(runs, round_floors)],
                      "peak_resident_bytes": max(x["peak_resident_bytes"] for x in runs),
                      "residency_bound_bytes": runs[-1]["residency_bound_bytes"]}
        if cuda:
            out[label]["device_peak_bytes"] = max(x["device_peak_bytes"] for x in runs)
    if "sync" in step_runs and "pipelined" in step_runs:
        out["pipelined"]["speedup_vs_sync_by_round"] = [
            s["wall"] / p["wall"] for s, p in zip(step_runs["sync"], step_runs["pipelined"])]
    if "pipelined+verify" in step_runs:
        out["pipelined+verify"]["x_pipelined_by_round"] = [
            v["wall"] / p["wall"] for v, p in zip(step_runs["pipelined+verify"], step_runs["pipelined"])]
    return out


# ---- exposed I/O with a synthetic forward/backward ----------------------------------------------------
def measure_exposed(args, store, device: torch.device, resident: float, floors: dict, say) -> dict:
    fwd_bwd = FwdBwd(device, args.fwd_bwd)
    seconds = args.fwd_bwd_seconds
    if seconds is None:
        if "sequential" not in floors:
            raise SystemExit("--only-exposed needs --fwd-bwd-seconds")
        seconds = floors["sequential"]["read_seconds"]
    files = [b.file for b in store.buckets]
    exposed = {"fwd_bwd_seconds": seconds, "fwd_bwd_kind": fwd_bwd.kind, "modes": {}}
    for name, what, io, prefetch in exposed_modes(args.host_cache_fractions, files):
        say(f"exposed I/O, {name} ({what}); forward/backward {seconds:.2f} s ({fwd_bwd.kind}) ...")
        store.set_io(io_engine="pipelined", depth=args.depth, io_threads=args.io_threads,
                     direct_io=DIRECT_IO[args.direct], verify=False, **io)
        store.stager.drop_page_cache(files)
        rows = [exposed_iteration(store, fwd_bwd, seconds, prefetch, resident, it, say)
                for it in range(1 + args.repeat)]
        measured = rows[1:]  # the first iteration fills the pipeline
        exposed["modes"][name] = {
            "what": what, "rows": rows, "step_seconds": median([r["step"] for r in measured]),
            "exposed_seconds": median([r["exposed"] for r in measured]),
            "iteration_seconds": median([r["iteration"] for r in measured])}
    return exposed


def exposed_modes(host_cache_fractions: list[float], files) -> list[tuple[str, str, dict, bool]]:
    """(name, what, store.set_io arguments, whether to prefetch) of runs (a), (b) and each (c)."""
    modes = [("plain", "no read-ahead, write-back waited in the step", dict(write_behind=False, host_cache_mb=0),
              False),
             ("ahead+behind", "read-ahead (prefetch) + write-behind", dict(write_behind=True, host_cache_mb=0), True)]
    for fraction in host_cache_fractions:
        # of the files' bytes (segments are 4 KiB aligned), so that 1 caches every bucket
        cache_mb = math.ceil(fraction * sum(f.nbytes for f in files) / MiB)
        modes.append((f"ahead+behind+cache{fraction:g}", f"+ host cache {cache_mb / 1024:.2f} GiB = {fraction:g} "
                      "of the state", dict(write_behind=True, host_cache_mb=cache_mb), True))
    return modes


def exposed_iteration(store, fwd_bwd: FwdBwd, seconds: float, prefetch: bool, resident: float, it: int,
                      say) -> dict:
    """Prefetch (if asked), the synthetic forward/backward, the step: iteration `it` of one mode."""
    t_it = time.perf_counter()
    started = store.prefetch() if prefetch else 0
    fb = fwd_bwd(seconds)
    t0 = time.perf_counter()
    s = store.step()
    wall = time.perf_counter() - t0
    row = {"fwd_bwd": fb, "step": wall, "exposed": wall - resident, "prefetch_started": started,
           "iteration": time.perf_counter() - t_it, "disk_read": s.disk_bytes_read,
           "cache_read": s.cache_bytes_read, "reused": s.reused_bytes, "pending_writes": s.pending_writes}
    say(f"  iteration {it + 1}: forward/backward {fb:.2f} s, step {wall:.2f} s (exposed "
        f"{wall - resident:.2f} s); disk read {s.disk_bytes_read / GB:.2f} GB, host cache "
        f"{s.cache_bytes_read / GB:.2f} GB, still resident {s.reused_bytes / GB:.2f} GB, "
        f"{s.pending_writes} writes behind")
    return row


def report(r: dict, say) -> None:
    floor = r["floor"]["best_seconds"]
    moments = r["args"].get("moment_dtype", "fp32")
    lines = [f"\n== miles bench stream: {r['params'] / 1e9:.3f}B params, {r['state_bytes'] / GB:.2f} GB of state "
             f"(fp32 masters, {moments} moments), "
             f"{r['device']}, torch {r['torch']}, {'O_DIRECT' if r.get('direct_io') else 'buffered'} ==",
             f"{'what':44s} {'seconds':>9s} {'GB':>8s} {'GB/s':>7s} {'x floor':>8s}"]

    def row(label, seconds, nbytes=0, ratio=True):
        gb = f"{nbytes / GB:8.2f} {nbytes / GB / seconds:7.2f}" if nbytes else f"{'-':>8s} {'-':>7s}"
        lines.append(f"{label:44s} {seconds:9.3f} {gb} " + (f"{seconds / floor:8.2f}" if ratio else f"{'-':>8s}"))

    for label, f in r["floor"].items():
        if isinstance(f, dict):
            row(f"raw disk floor, {label}", f["seconds"], r["floor"]["bytes"])
    row("resident optimizer step (in memory)", r["resident_step_seconds"], ratio=False)
    if "sync" in r:
        row("sync engine step (end to end)", r["sync"]["seconds"], r["sync"]["bytes"])
    if "pipelined" in r:
        p = r["pipelined"]
        row("pipelined engine step (end to end)", p["seconds"], p["bytes"])
        row("  of which the step returned after", p["returned_seconds"])
        lines.append(f"pipelined / floor = {p['seconds'] / floor:.3f}" + (
            f"; pipelined vs sync: {r['sync']['seconds'] / p['seconds']:.2f}x faster" if "sync" in r else ""))
        if len(p["all_seconds"]) > 1:
            def rounds(xs):
                return f"median {median(xs):.3f} ({', '.join(f'{x:.3f}' for x in xs)})"
            lines.append(f"within each round: pipelined / that round's floor {rounds(p['x_floor_by_round'])}" + (
                f"; pipelined vs sync {rounds(p['speedup_vs_sync_by_round'])}" if "speedup_vs_sync_by_round" in p else ""))
        if "pipelined+verify" in r:
            v = r["pipelined+verify"]
            row("pipelined engine step, verify on (end to end)", v["seconds"], v["bytes"])
            row("  of which the step returned after", v["returned_seconds"])
            ratios = v["x_pipelined_by_round"]
            lines.append(f"verify on / off, within each round: median {median(ratios):.3f} "
                         f"({', '.join(f'{x:.3f}' for x in ratios)}); step returned {v['returned_seconds']:.3f} s "
                         f"vs {p['returned_seconds']:.3f} s")
        budget = r["device_budget_bytes"]
        lines.append(f"residency: store peak {p['peak_resident_bytes'] / GB:.3f} GB, documented bound "
                     f"{p['residency_bound_bytes'] / GB:.3f} GB (min(2 x depth + 1, buckets) buckets), device budget "
                     f"{budget / GB:.3f} GB ({'within' if p['peak_resident_bytes'] <= budget else 'ABOVE'}); buckets "
                     f"of <= {r['bucket_numel'] / 1e6:.1f}M elements, depth {r['depth']}"
                     + (f"; device memory peak during the step {p['device_peak_bytes'] / GB:.3f} GB "
                        f"({'within' if p['device_peak_bytes'] <= p['residency_bound_bytes'] else 'ABOVE'} the bound)"
                        if "device_peak_bytes" in p else ""))
    if "exposed" in r:
        e = r["exposed"]
        lines.append(f"\nexposed I/O (step wall time - resident step {r['resident_step_seconds']:.3f} s), synthetic "
                     f"forward/backward of {e['fwd_bwd_seconds']:.2f} s ({e['fwd_bwd_kind']}) before each step:")
        lines.append(f"{'mode':22s} {'what':46s} {'step s':>8s} {'exposed s':>10s} {'iter s':>8s} {'vs plain':>9s}")
        plain = e["modes"]["plain"]["exposed_seconds"]
        for name, m in e["modes"].items():
            cut = f"{100 * (1 - m['exposed_seconds'] / plain):8.1f}%" if plain > 0 else f"{'-':>9s}"
            lines.append(f"{name:22s} {m['what']:46s} {m['step_seconds']:8.2f} {m['exposed_seconds']:10.2f} "
                         f"{m['iteration_seconds']:8.2f} {cut:>9s}")
    text = "\n".join(lines)
    print(text, flush=True)
    r["report"] = text


if __name__ == "__main__":
    sys.exit(main())
