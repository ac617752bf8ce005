"""`miles bench checkpoint`: what saving streamed optimizer state costs, against a plain copy of its files.

One run, one scratch directory, one store (ZeRO-1 sharded mixed-precision Adam over fp32 params: fp32
masters + 2 moments stream, 12 bytes of state per param). Each round measures, from cold files (write-
behind drained, the live files flushed and dropped from the page cache):

  step alone      one optimizer step with no save in flight
  plain copy      the same bucket files copied with shutil.copyfile (copy_file_range/sendfile, in the
                  kernel) and fsynced one by one: what any copy of these bytes costs on this disk
  save (waited)   store.save_to(dir, wait=True): copies with checksums, fsyncs, manifest, atomic rename
  save (background) store.save_to(dir, wait=False), then the next step (a) right away, the worst case,
                  and (b) after a simulated forward/backward; the caller's blocked time, when the save
                  was published, the next step's time and how much of it waited for copy-before-
                  overwrite (a step waits only for buckets it would overwrite before they are copied)

The disk's speed drifts over minutes on shared hosts: with --repeat N every round measures everything
back to back, plain copy and waited save swap order every other round, the report gives medians and
the waited save / plain copy ratio within each round. The scratch directory (live files, copies,
checkpoints) is removed at the end, also on error; --dir itself too when the run created it.

    miles bench checkpoint --gb 2 --dir /var/tmp/ckbench --repeat 3 --json out.json
    python -m miles.bench.checkpoint --gb 0.5 --device cuda --dir /mnt/nvme/ckbench
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

from miles.config.errors import ArgumentError
from miles_plugins.optimizers.streaming.units import GB, MiB

from .common import (MAX_FWD_BWD_SECONDS, FwdBwd, Progress, device_arg, dir_arg, log_store_lines, machine, median,
                     number_arg, one_device, parse_count, run_standalone, sync_device, write_json)

STATE_BYTES_PER_PARAM = 12  # fp32 master + 2 fp32 moments
PROG = "miles bench checkpoint"


# ---- arguments ----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gb", type=number_arg(float, "the streamed state in GB, e.g. 2"), default=1.0,
                   help="streamed state in GB (12 B/param: fp32 masters + 2 moments)")
    p.add_argument("--device", type=device_arg, default="cpu", help="where the params live: cpu (default) or cuda")
    p.add_argument("--dir", type=dir_arg, default="miles-bench-checkpoint", help="directory on the disk under test (created); "
                   "the run works in a fresh scratch directory inside it and removes it at the end")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--bucket-numel", type=number_arg(parse_count, "an element count per bucket, e.g. 25M"),
                   default=25_000_000, help="element budget per bucket (e.g. 25M; default 25M)")
    p.add_argument("--repeat", type=number_arg(int, "a round count, e.g. 3"), default=1,
                   help="rounds of (step alone, plain copy, waited save, background saves); medians are reported")
    p.add_argument("--fwd-bwd-seconds", type=number_arg(float, "seconds, e.g. 2.5", inclusive=True,
                                                        high=MAX_FWD_BWD_SECONDS), default=None,
                   help="simulated forward/backward between a background save and the next step (default: "
                   "1.2 x the first round's waited save)")
    p.add_argument("--fwd-bwd", choices=["auto", "matmul", "sleep"], default="auto", help="what the simulated "
                   "forward/backward does (auto: bf16 matmuls on CUDA, sleep on CPU, where it stands for device "
                   "compute that leaves the disk idle)")
    p.add_argument("--quiet", action="store_true", help="no store log lines (the bench's own lines stay)")


NAME, HELP = "checkpoint", "checkpoint save of streamed state vs a plain copy of its files"


def main(argv=None) -> int:
    return run_standalone(sys.modules[__name__], argv)


# ---- helpers ------------------------------------------------------------------------------------------
def _check_room(root: str, state_bytes: int) -> None:
    """The live files plus one copy of them (plain copy or checkpoint) sit on the disk at once."""
    need = 2 * state_bytes + 64 * MiB
    free = shutil.disk_usage(root).free
    if free < need:
        raise SystemExit(f"{PROG}: {root} has {free / GB:.2f} GB free, the run needs about {need / GB:.2f} GB (the "
                         f"live state and one copy of it, {state_bytes / GB:.2f} GB each); give a --dir on a disk "
                         "with more room or a smaller --gb")


def _plain_copy(files, dst_dir: str) -> float:
    t0 = time.perf_counter()
    os.makedirs(dst_dir)
    for f in files:  # shutil.copyfile: copy_file_range/sendfile, in the kernel
        dst = os.path.join(dst_dir, os.path.basename(f.path))
        shutil.copyfile(f.path, dst)
        with open(dst, "rb+") as h:
            os.fsync(h.fileno())
    return time.perf_counter() - t0


class _Live:
    """The run's params, their optimizer and its store over the live files."""

    def __init__(self, params: list, opt, store, device: torch.device):
        self.params, self.opt, self.store, self.device = params, opt, store, device
        self.files = [b.file for b in store.buckets]
        self.state_bytes = sum(f.nbytes for f in self.files)

    def step(self) -> float:
        """One optimizer step, its write-behind included, in seconds."""
        for p in self.params:
            p.grad = torch.ones_like(p)
        sync_device(self.device)
        t = time.perf_counter()
        self.opt.step()
        self.store.stager.drain()  # count the step's write-behind too
        sync_device(self.device)
        return time.perf_counter() - t

    def cold(self) -> None:
        """Write-behind drained, the live files flushed and dropped from the page cache."""
        self.store.stager.drain()
        self.store.stager.drop_page_cache(self.files)


BACKGROUND_MODES = (("right_away", "next step right away (worst case)"),
                    ("after_fwd_bwd", "next step after forward/backward"))


# ---- the run ------------------------------------------------------------------------------------------
def run(args) -> int:
    log_store_lines(args.quiet)
    say = Progress()
    device = one_device(args.device)
    n = _param_count(args.gb)
    root, created_root = _make_root(args.dir)
    scratch = tempfile.mkdtemp(prefix="miles-bench-checkpoint-", dir=root)
    results: dict = ({"args": vars(args) | {"func": None}, "params": n, "bucket_numel": args.bucket_numel}
                     | machine(device) | {"dir": scratch})
    live = None
    try:
        _check_room(root, STATE_BYTES_PER_PARAM * n)
        say(f"{n / 1e6:.1f}M fp32 params on {device} ({results['device']}), {STATE_BYTES_PER_PARAM * n / GB:.2f} GB "
            f"of streamed state in {scratch}; buckets of <= {args.bucket_numel / 1e6:.1f}M elements; "
            f"{args.repeat} round(s)")
        live = _build(n, device, os.path.join(scratch, "live"), args.bucket_numel, say)
        results |= {"state_bytes": live.state_bytes, "num_buckets": len(live.files),
                    "io_engine": live.store.stats.io_engine}
        t0 = time.perf_counter()
        live.step()
        live.step()
        say(f"2 warm-up steps (the first creates the moments): {time.perf_counter() - t0:.1f} s")
        results |= _measure_rounds(args, live, scratch, say)
    finally:
        _remove(live, scratch, root if created_root else None)
    say(f"removed {scratch}" + (f" and {root}" if created_root and not os.path.exists(root) else ""))
    report(results)
    write_json(args.json, results, say)
    return 0


def _param_count(gb: float) -> int:
    n = int(gb * GB / STATE_BYTES_PER_PARAM)
    if n < 4:
        raise ArgumentError(f"--gb {gb:g} is {n} params, too few to split over 4 tensors; give at least "
                         f"--gb {4 * STATE_BYTES_PER_PARAM / GB:.1e}")
    return n


def _make_root(directory: str) -> tuple[str, bool]:
    """--dir (absolute, checked by dir_arg), created when missing; and whether this run created it."""
    created_root = not os.path.exists(directory)
    os.makedirs(directory, exist_ok=True)
    return directory, created_root


def _build(n: int, device: torch.device, live_dir: str, bucket_numel: int, say) -> _Live:
    """n fp32 params in 4 tensors, their sharded Adam, its state streamed to files in live_dir."""
    from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam
    from miles_plugins.optimizers.nvme_stream import stream_optimizer_state

    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n // 4, generator=gen, device=device)) for _ in range(4)]
    opt = ShardedMixedPrecisionAdam([{"params": params, "lr": 1e-3}])
    t0 = time.perf_counter()
    live = _Live(params, opt, stream_optimizer_state(opt, dir=live_dir, bucket_numel=bucket_numel), device)
    say(f"store built in {time.perf_counter() - t0:.1f} s (masters written): {len(live.files)} buckets, "
        f"{live.state_bytes / GB:.2f} GB in files, {live.store.stats.io_engine} I/O")
    return live


def _measure_rounds(args, live: _Live, scratch: str, say) -> dict:
    fwd_bwd = FwdBwd(live.device, args.fwd_bwd)
    gap = args.fwd_bwd_seconds
    rounds = []
    for r in range(args.repeat):
        say(f"round {r + 1} of {args.repeat}")
        row = _saves_waited(live, r, scratch, say)
        if gap is None:
            gap = 1.2 * row["save_wait"]
        row["background"] = {key: _save_in_background(live, what, 0.0 if key == "right_away" else gap, fwd_bwd,
                                                      os.path.join(scratch, "ck"), row["step_alone"], say)
                             for key, what in BACKGROUND_MODES}
        rounds.append(row)
    return _summary(rounds, gap, fwd_bwd.kind)


def _saves_waited(live: _Live, r: int, scratch: str, say) -> dict:
    """Round r's step alone, plain copy and waited save, each from cold files."""
    live.cold()
    row: dict = {"step_alone": live.step()}
    say(f"  one step alone (cold files): {row['step_alone']:.2f} s")
    # the disk drifts: alternate which goes first, so a slow trend weighs on both alike
    for measure in ((_copy_once, _save_once) if r % 2 == 0 else (_save_once, _copy_once)):
        live.cold()
        row |= measure(live, scratch, say)
    row["save_vs_copy"] = row["save_wait"] / row["plain_copy"]
    say(f"  save_to(wait=True) / plain copy in this round: {row['save_vs_copy']:.3f}")
    return row


def _copy_once(live: _Live, scratch: str, say) -> dict:
    plain = os.path.join(scratch, "plain")
    seconds = _plain_copy(live.files, plain)
    shutil.rmtree(plain)
    say(f"  plain copy of the same files (shutil.copyfile + fsync each): {seconds:.2f} s, "
        f"{live.state_bytes / GB / seconds:.2f} GB/s")
    return {"plain_copy": seconds}


def _save_once(live: _Live, scratch: str, say) -> dict:
    ck = os.path.join(scratch, "ck")
    t = time.perf_counter()
    stats = live.store.save_to(ck)
    seconds = time.perf_counter() - t
    shutil.rmtree(ck)
    say(f"  save_to(wait=True): {seconds:.2f} s, {live.state_bytes / GB / seconds:.2f} GB/s"
        + (f" ({stats['reflinked_buckets']} buckets reflinked)" if stats["reflinked_buckets"] else ""))
    return {"save_wait": seconds, "save_wait_stats": stats}


def _save_in_background(live: _Live, what: str, fwd_bwd_s: float, fwd_bwd: FwdBwd, ck: str, alone: float,
                        say) -> dict:
    """save_to(ck, wait=False) from cold files, fwd_bwd_s of forward/backward, the next step."""
    live.cold()
    t = time.perf_counter()
    live.store.save_to(ck, wait=False)
    blocked = time.perf_counter() - t
    slept = fwd_bwd(fwd_bwd_s) if fwd_bwd_s > 0 else 0.0  # the disk is left to the save meanwhile
    during = live.step()
    stats = live.store.wait_for_save()
    shutil.rmtree(ck)
    b = {"blocked": blocked, "fwd_bwd": slept, "published": stats["seconds"], "next_step": during,
         "stalled": stats["stalled_seconds"], "copied_by_writer": stats["copied_by_writer"],
         "next_step_vs_alone": during / alone}
    say(f"  save_to(wait=False): blocked {blocked:.3f} s; published {b['published']:.2f} s after the call; "
        f"{what}, {slept:.2f} s later: {during:.2f} s (alone {alone:.2f} s), "
        f"{b['stalled']:.2f} s of it waiting for copy-before-overwrite ({b['copied_by_writer']}/"
        f"{len(live.files)} buckets copied by the step)")
    return b


def _summary(rounds: list[dict], gap: float, fwd_bwd_kind: str) -> dict:
    """The rounds, their medians and the ratios within each round."""
    out: dict = {"rounds": rounds, "fwd_bwd_seconds": gap, "fwd_bwd_kind": fwd_bwd_kind}
    for key in ("step_alone", "plain_copy", "save_wait", "save_vs_copy"):
        out[key] = {"seconds" if key != "save_vs_copy" else "ratio": median([x[key] for x in rounds]),
                    "all": [x[key] for x in rounds]}
    out["save_vs_copy"]["of_medians"] = out["save_wait"]["seconds"] / out["plain_copy"]["seconds"]
    out["background"] = {
        key: {"what": what, "gap_seconds": 0.0 if key == "right_away" else gap}
        | {f: median([x["background"][key][f] for x in rounds])
           for f in ("blocked", "fwd_bwd", "published", "next_step", "stalled")}
        | {f: [x["background"][key][f] for x in rounds] for f in ("next_step_vs_alone", "copied_by_writer")}
        for key, what in BACKGROUND_MODES}
    return out


def _remove(live: _Live | None, scratch: str, root: str | None) -> None:
    """Close the store, remove the scratch directory, and root when given and left empty."""
    if live is not None:
        live.store.close()
    shutil.rmtree(scratch, ignore_errors=True)
    if root is not None:
        try:
            os.rmdir(root)
        except OSError:
            pass


def report(r: dict) -> None:
    state = r["state_bytes"]
    copy = r["plain_copy"]["seconds"]
    alone = r["step_alone"]["seconds"]
    n_rounds = len(r["rounds"])
    lines = [f"\n== miles bench checkpoint: {state / GB:.2f} GB of fp32 state in {r['num_buckets']} buckets, "
             f"{r['device']}, torch {r['torch']}, {r['io_engine']} I/O, {n_rounds} round(s), medians ==",
             f"{'what':52s} {'seconds':>9s} {'GB/s':>7s} {'x copy':>7s} {'x alone':>8s}"]

    def row(label, seconds, rate=False, vs_copy=False, vs_alone=False):
        lines.append(f"{label:52s} {seconds:9.3f} "
                     + (f"{state / GB / seconds:7.2f} " if rate else f"{'-':>7s} ")
                     + (f"{seconds / copy:7.2f} " if vs_copy else f"{'-':>7s} ")
                     + (f"{seconds / alone:8.2f}" if vs_alone else f"{'-':>8s}"))

    row("one optimizer step alone (cold files)", alone, vs_alone=True)
    row("plain copy (shutil.copyfile + fsync each file)", copy, rate=True, vs_copy=True)
    row("save_to(wait=True)", r["save_wait"]["seconds"], rate=True, vs_copy=True)
    for key, b in r["background"].items():
        gap = f"{b['gap_seconds']:.2f} s {r['fwd_bwd_kind']}" if b["gap_seconds"] else "none"
        lines.append(f"save_to(wait=False), {b['what']}; forward/backward: {gap}")
        row("  caller blocked", b["blocked"])
        row("  published, after the call", b["published"])
        row("  next step", b["next_step"], vs_alone=True)
        row("  of which waiting for copy-before-overwrite", b["stalled"])
    s = r["save_vs_copy"]
    lines.append(f"save_to(wait=True) / plain copy = {s['of_medians']:.3f}")
    if n_rounds > 1:
        lines.append(f"within each round: save_to(wait=True) / plain copy median {s['ratio']:.3f} "
                     f"({', '.join(f'{x:.3f}' for x in s['all'])}); plain copy "
                     f"{', '.join(f'{x:.2f}' for x in r['plain_copy']['all'])} s, waited save "
                     f"{', '.join(f'{x:.2f}' for x in r['save_wait']['all'])} s")
        lines.append("within each round: next step / that round's step alone: " + "; ".join(
            f"{key.replace('_', ' ')} median {median(b['next_step_vs_alone']):.2f} "
            f"({', '.join(f'{x:.2f}' for x in b['next_step_vs_alone'])})" for key, b in r["background"].items()))
    text = "\n".join(lines)
    print(text, flush=True)
    r["report"] = text


if __name__ == "__main__":
    sys.exit(main())
