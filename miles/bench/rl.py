"""`miles bench rl`: the colocated RL loop on one model, per phase against the phase's own floor.

Runs `miles train --colocate` once per arm, each in its own process (its own Ray cluster and GPU
context), for --rollouts rollouts, and reports per phase the median over the steady rollouts (all but
the first) next to the floor measured in this same run:

  phase          floor
  generate       (reported as tokens/s; no floor)
  train          forward/backward's model FLOPs at the GPU's bf16 peak (miles.sizing.flops; the MFU is
                 shown beside it) + the optimizer step as the train rank measured it; on CPU forward/
                 backward as measured
  weights        the handed-over bytes at the device's own copy bandwidth (cudaMemcpy device to device;
                 on CPU: memcpy)
  sleep / wake   the bytes the sleep plan moved, each over the link it crossed: to/from host RAM at pinned
                 PCIe bandwidth, to/from disk at the disk's own O_DIRECT write / read bandwidth (measured
                 under --dir), the masters a wake rebuilt weights from at pinned PCIe bandwidth, the
                 engine's copy at the device copy bandwidth; 0 when nothing had to move
  engine         the rollout engine's release + resume of its weights and KV cache (no floor)
  step           the sum of the floors above plus the generation itself

Arms (--arms, comma-separated):

  stream         --stream-optimizer-state-to-disk --offload-train-target=disk
                 --stream-optimizer-state-host-cache-mb auto --offload-train-plan offload-all
  resident-cpu   resident optimizer state, --offload-train-target=cpu --offload-train-plan offload-all
  resident-disk  resident optimizer state, --offload-train-target=disk --offload-train-plan offload-all
  stream-plan    the stream arm with --offload-train-plan auto (miles train's default: only what must
                 move moves; the other arms write every weight to the target at each sleep, the
                 baselines the plan is measured against)

    miles bench rl --preset llama-1b --dir /nvme/bench-rl --json rl.json
    miles bench rl --hf-checkpoint /models/qwen3-0.6b --arms stream --rollouts 6 --train-arg=--micro-batch-size=16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Optional

import torch

from miles.config.errors import ArgumentError
from miles.sizing.presets import PUBLISHED_PRESETS, RANDOM_MODEL_PRESETS, random_preset_arg

from .common import Progress, dir_arg, median, number_arg, run_standalone

NAME, HELP = "rl", "the colocated RL loop (generate, train, weights, sleep/wake) per phase against its floor"
_OFFLOAD_ALL = ["--offload-train-plan", "offload-all"]  # the baselines: every weight to the target at each sleep
ARMS = {
    "stream": ["--stream-optimizer-state-to-disk", "--offload-train-target=disk",
               "--stream-optimizer-state-host-cache-mb", "auto", *_OFFLOAD_ALL],
    "resident-cpu": ["--offload-train-target=cpu", *_OFFLOAD_ALL],
    "resident-disk": ["--offload-train-target=disk", *_OFFLOAD_ALL],
    # the stream arm with the sleep plan: against the stream arm, what the plan saves
    "stream-plan": ["--stream-optimizer-state-to-disk", "--offload-train-target=disk",
                    "--stream-optimizer-state-host-cache-mb", "auto", "--offload-train-plan", "auto"],
}
FLOOR_BYTES = 1 << 30  # what each bandwidth floor moves
ARM_MARKER = ".miles-bench-rl-arm"  # in each arm folder the bench made: a later run may replace it


def add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf-checkpoint", metavar="DIR", help="a HuggingFace model folder")
    model.add_argument("--preset", type=random_preset_arg, metavar="NAME",
                       help="a random-init model of scripts/make_random_model.py, written once under --dir: one of "
                       f"{', '.join(sorted(RANDOM_MODEL_PRESETS))}. The names are `miles plan --preset`'s, which "
                       f"also sizes {', '.join(PUBLISHED_PRESETS)}: published models' shapes, not written here")
    p.add_argument("--dir", type=dir_arg, required=True, help="scratch folder (made if missing): each arm runs in arm-<name>/ "
                                                "there (its log and metrics stay; its disk folder is removed when "
                                                "the arm ends; a later run replaces the folder)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms, of {', '.join(ARMS)} "
                                                          "(default: %(default)s)")
    p.add_argument("--rollouts", type=number_arg(int, "a rollout count of at least 2 (the first is not counted)",
                                                 low=2, inclusive=True), default=4, help="rollouts per arm; the first is not counted "
                                                           "(default: %(default)s)")
    p.add_argument("--train-backend", choices=("megatron", "torch"), default=None,
                   help="default: megatron on CUDA, torch otherwise")
    p.add_argument("--rollout-batch-size", type=int, default=16, help="prompts per rollout (default: %(default)s)")
    p.add_argument("--n-samples-per-prompt", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--rollout-max-response-len", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--train-arg", action="append", default=[], metavar="FLAG",
                   help="one more `miles train` flag for every arm, e.g. --train-arg=--micro-batch-size=16 "
                        "(repeatable)")
    p.add_argument("--arm-timeout", type=number_arg(float, "seconds, e.g. 900"), default=900.0, help="seconds per arm (default: %(default)s)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")


# ---- floors -------------------------------------------------------------------------------------------
def _rate(seconds: float, nbytes: int) -> float:
    return nbytes / seconds if seconds > 0 else float("inf")


def copy_rates(device: torch.device, nbytes: int = FLOOR_BYTES) -> dict[str, float]:
    """Bytes per second of a device-to-device copy and of pinned host<->device copies (CPU: memcpy)."""
    def timed(dst, src) -> float:
        dst.copy_(src)  # warm
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t) / 3

    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    rates = {"device_copy": _rate(timed(b, a), nbytes)}
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        rates["d2h_pinned"] = _rate(timed(host, a), nbytes)
        rates["h2d_pinned"] = _rate(timed(a, host), nbytes)
    else:
        rates["d2h_pinned"] = rates["h2d_pinned"] = rates["device_copy"]
    return rates


def disk_rates(directory: str, nbytes: int = FLOOR_BYTES) -> dict[str, float]:
    """The disk's own O_DIRECT write then read bandwidth under ``directory`` (:func:`miles.bench.floor.raw_floor`)."""
    from .floor import raw_floor

    path = os.path.join(directory, "disk-floor.bin")
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
    try:
        chunk = 64 << 20
        written = raw_floor([], path, nbytes, chunk, concurrent=False)
        read = raw_floor([(path, 0, nbytes)], path, 0, chunk, concurrent=False)
    finally:
        os.unlink(path)
    return {"disk_write": _rate(written["seconds"], nbytes), "disk_read": _rate(read["seconds"], nbytes)}


# ---- one arm ------------------------------------------------------------------------------------------
def arm_command(arm: str, model: str, backend: str, args, arm_dir: str) -> list[str]:
    return [sys.executable, "-m", "miles.cli", "train", "--colocate", "--train-backend", backend,
            "--hf-checkpoint", model, "--num-rollout", str(args.rollouts),
            "--rollout-batch-size", str(args.rollout_batch_size),
            "--n-samples-per-prompt", str(args.n_samples_per_prompt),
            "--rollout-max-response-len", str(args.rollout_max_response_len),
            "--offload-train-disk-dir", os.path.join(arm_dir, "disk"),
            "--metrics-file", os.path.join(arm_dir, "metrics.jsonl"), *ARMS[arm], *args.train_arg]


def _counted(records: list[dict]) -> bool:
    """Every record has the model FLOPs at the device's peak (a GPU whose peak is known)."""
    return all(r.get("forward_backward_floor_seconds") is not None for r in records)


def _train_floor(record: dict) -> float:
    """The train call's floor: the model FLOPs of forward/backward at the device's bf16 peak
    (miles.sizing.flops) plus the optimizer step as the rank timed it; where the FLOPs are not counted (a
    CPU), forward/backward as timed."""
    fwd_bwd = record.get("forward_backward_floor_seconds")
    return (record["forward_backward_seconds"] if fwd_bwd is None else fwd_bwd) + record["optimizer_step_seconds"]


def phase_report(records: list[dict], target: str, rates: dict[str, float]) -> dict[str, dict]:
    """Median seconds and floor per phase over ``records`` (the steady rollouts of one arm; pure)."""
    def med(key):
        return median([r[key] for r in records])

    tokens = [r["samples"] * r["response_len_mean"] for r in records]
    out = {
        "generate": {"seconds": med("generate_seconds"), "floor": None,
                     "tokens_per_second": median([t / r["generate_seconds"] for t, r in zip(tokens, records)])},
        "train": {"seconds": med("train_seconds"), "floor": median([_train_floor(r) for r in records]),
                  "rank_seconds": med("train_rank_seconds"), "forward_backward": med("forward_backward_seconds"),
                  "optimizer_step": med("optimizer_step_seconds"), "other": med("other_seconds"),
                  "mfu": median([r["train_mfu"] for r in records]) if _counted(records) else None,
                  # the forward/backward's device peak (weights, grads, activations), where a GPU reports one
                  "peak_gb": max(r["forward_backward_device_peak_gb"] for r in records)
                  if all("forward_backward_device_peak_gb" in r for r in records) else None},
        "weights": {"seconds": med("weight_sync_seconds"), "rank_seconds": med("weight_handoff_seconds"),
                    "floor": med("weight_handoff_bytes") / rates["device_copy"],
                    "bytes": med("weight_handoff_bytes"), "buckets": med("weight_handoff_buckets")},
        "sleep": moved_phase(records, "sleep", target, rates),
        "wake": moved_phase(records, "wake", target, rates),
    }
    out["engine"] = {"seconds": med("engine_release_seconds") + med("engine_resume_seconds"), "floor": None}
    out["step"] = {"seconds": med("step_seconds"),
                   "floor": out["generate"]["seconds"] + sum(out[k]["floor"] for k in ("train", "weights", "sleep",
                                                                                       "wake"))}
    for phase in out.values():
        floor = phase["floor"]
        phase["ratio"] = phase["seconds"] / floor if floor else None
    return out


# The links a sleep's and a wake's bytes cross, by the record's split (miles.metrics: sleep_* / wake_*):
# (record key, rate key, how the phase line names it)
SLEEP_LINKS = (("sleep_to_ram_bytes", "d2h_pinned", "ram"), ("sleep_to_disk_bytes", "disk_write", "disk"))
WAKE_LINKS = (("wake_from_ram_bytes", "h2d_pinned", "ram"), ("wake_from_disk_bytes", "disk_read", "disk"),
              ("wake_masters_read_bytes", "h2d_pinned", "masters"),  # the fp32 masters the rebuild read
              ("wake_rebuilt_from_engine_bytes", "device_copy", "engine"))


def moved_phase(records: list[dict], phase: str, target: str, rates: dict[str, float]) -> dict:
    """A sleep or wake phase: its median seconds, and its floor: the bytes the plan moved over each link
    they crossed at that link's bandwidth (0 when nothing had to move). Records without the split (before
    the sleep plan) count ``offload_bytes`` over the target's link."""
    links = SLEEP_LINKS if phase == "sleep" else WAKE_LINKS
    if f"{phase}_moved_bytes" not in records[0]:
        rate = {"sleep": {"cpu": "d2h_pinned", "disk": "disk_write"},
                "wake": {"cpu": "h2d_pinned", "disk": "disk_read"}}[phase][target]
        name = "ram" if target == "cpu" else "disk"
        links = ((("offload_bytes", rate, name)),)
    by_link = {name: median([r.get(key, 0) for r in records]) for key, _, name in links}
    floor = sum(by_link[name] / rates[rate] for _, rate, name in links)
    moved = median([r.get(f"{phase}_moved_bytes", r.get("offload_bytes", 0)) for r in records])
    return {"seconds": median([r[f"{phase}_seconds"] for r in records]), "floor": floor, "bytes": moved,
            "by_link": by_link}


def arm_dir_of(directory: str, arm: str) -> str:
    """The arm's folder under --dir. SystemExit when something is there that this bench did not make (a
    folder without its marker, a file, a link): the bench removes only its own folders."""
    arm_dir = os.path.join(directory, f"arm-{arm}")
    if os.path.lexists(arm_dir) and (os.path.islink(arm_dir) or not os.path.isfile(os.path.join(arm_dir, ARM_MARKER))):
        raise SystemExit(f"miles bench rl: {arm_dir} exists and was not made by miles bench rl; move it away or "
                         "choose another --dir")
    return arm_dir


def run_arm(arm: str, model: str, backend: str, args, rates: dict[str, float], say) -> dict:
    arm_dir = arm_dir_of(args.dir, arm)
    shutil.rmtree(arm_dir, ignore_errors=True)  # an earlier run's, by its marker
    os.makedirs(arm_dir)
    open(os.path.join(arm_dir, ARM_MARKER), "w").close()
    log = os.path.join(arm_dir, "train.log")
    say(f"{arm}: miles train ... ({args.rollouts} rollouts; output in {log})")
    with open(log, "w") as out:
        try:
            rc = subprocess.run(arm_command(arm, model, backend, args, arm_dir), stdout=out, stderr=subprocess.STDOUT,
                                timeout=args.arm_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    records = []
    metrics = os.path.join(arm_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
    if rc != 0 or len(records) < 2:
        with open(log) as f:
            tail = f.read()[-2000:]
        return {"arm": arm, "error": f"exit {rc}, {len(records)} rollout record(s); the log's end:\n{tail}"}
    target = "cpu" if arm == "resident-cpu" else "disk"
    return {"arm": arm, "rollouts": len(records), "phases": phase_report(records[1:], target, rates),
            "reward_first": records[0]["reward_mean"], "reward_last": records[-1]["reward_mean"],
            "losses": [r["loss"] for r in records], "rewards": [r["reward_mean"] for r in records]}


def _same(a: float, b: float) -> bool:
    """Equal bit for bit as numbers: two NaNs (a skipped step's loss) count as the same."""
    return a == b or (math.isnan(a) and math.isnan(b))


def series_agreement(arms: list[dict]) -> Optional[str]:
    """Whether the arms trained alike: every arm runs the same training on the same seed and differs only in
    where the state lives between steps, so their loss and reward series should be equal bit for bit. One line
    saying so, or naming the first rollout where each arm departs from the first arm; None with fewer than two
    arms that finished (pure)."""
    done = [a for a in arms if "losses" in a]
    if len(done) < 2:
        return None
    ref, departures = done[0], []
    rollouts = min(len(a["losses"]) for a in done)
    for arm in done[1:]:
        first = next((i for i in range(rollouts) if not (_same(arm["losses"][i], ref["losses"][i])
                                                         and _same(arm["rewards"][i], ref["rewards"][i]))), None)
        if first is not None:
            departures.append(f"{arm['arm']} departs from {ref['arm']} at rollout {first} (loss {arm['losses'][first]!r} "
                              f"vs {ref['losses'][first]!r}, reward {arm['rewards'][first]!r} vs {ref['rewards'][first]!r})")
    names = ", ".join(a["arm"] for a in done)
    if not departures:
        return f"exactness: losses and rewards of {names} equal bit for bit over {rollouts} rollouts"
    return "exactness: " + "; ".join(departures)


# ---- report -------------------------------------------------------------------------------------------
def format_report(result: dict) -> str:
    lines = [f"miles bench rl: {result['model']} ({result['backend']}), {result['workload']}",
             "floors: " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in result["rates"].items())]
    for arm in result["arms"]:
        if "error" in arm:
            lines.append(f"{arm['arm']}: FAILED {arm['error']}")
            continue
        lines.append(f"{arm['arm']} (median of rollouts 2..{arm['rollouts']}; reward {arm['reward_first']:.3f} -> "
                     f"{arm['reward_last']:.3f}):")
        for name, ph in arm["phases"].items():
            ratio = "     -" if ph["ratio"] is None else f"{ph['ratio']:6.2f}"  # a floor of 0: nothing had to move
            floor = "" if ph["floor"] is None else f"  floor {ph['floor']:7.3f} s  ratio {ratio}"
            extra = ""
            if name == "generate":
                extra = f"  {ph['tokens_per_second']:.0f} tokens/s"
            elif name == "train":
                mfu = f", MFU {100 * ph['mfu']:.1f}%" if ph["mfu"] is not None else ""
                peak = f", peak {ph['peak_gb']:.1f} GB" if ph.get("peak_gb") is not None else ""
                extra = (f"  (rank: fwd/bwd {ph['forward_backward']:.3f}{mfu}{peak} + optimizer {ph['optimizer_step']:.3f} + "
                         f"other {ph['other']:.3f})")
            elif name == "weights":
                extra = f"  ({ph['bytes'] / 1e9:.3f} GB in {ph['buckets']:.0f} buckets; rank {ph['rank_seconds']:.3f} s)"
            elif name in ("sleep", "wake"):
                links = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in ph["by_link"].items() if v)
                extra = f"  ({ph['bytes'] / 1e9:.3f} GB moved{': ' + links + ' GB' if links else ''})"
            lines.append(f"  {name:9s} {ph['seconds']:7.3f} s{floor}{extra}")
    agreement = series_agreement(result["arms"])
    if agreement is not None:
        lines.append(agreement)
    return "\n".join(lines)


def run(args) -> int:
    say = Progress()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ArgumentError(f"--arms {args.arms!r}: unknown arm(s) {unknown or arms}; choose from {', '.join(ARMS)}")
    for arm in arms:  # before anything is made or runs
        arm_dir_of(args.dir, arm)
    os.makedirs(args.dir, exist_ok=True)
    cuda = torch.cuda.is_available()
    backend = args.train_backend or ("megatron" if cuda else "torch")
    model = args.hf_checkpoint
    if model is None:
        from miles.models import write_random_model

        model = os.path.join(args.dir, args.preset)
        if not os.path.isdir(model):
            say(f"writing the random-init {args.preset} to {model}")
            write_random_model(model, args.preset)
    say("measuring the floors (copy bandwidths, the disk under --dir)")
    device = torch.device("cuda" if cuda else "cpu")
    rates = {**copy_rates(device), **disk_rates(args.dir)}
    if cuda:
        torch.cuda.empty_cache()
    workload = (f"{args.rollout_batch_size} prompts x {args.n_samples_per_prompt} samples x "
                f"{args.rollout_max_response_len} tokens, {args.rollouts} rollouts")
    result = {"model": model, "backend": backend, "workload": workload, "rates": rates, "train_args": args.train_arg,
              "arms": []}
    for arm in arms:  # each arm's numbers as soon as it is done (a long run may be cut short)
        result["arms"].append(run_arm(arm, model, backend, args, rates, say))
        shutil.rmtree(os.path.join(args.dir, f"arm-{arm}", "disk"), ignore_errors=True)
        say(format_report({**result, "arms": result["arms"][-1:]}).split("\n", 2)[-1])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    print(format_report(result), flush=True)
    return 1 if any("error" in a for a in result["arms"]) else 0


if __name__ == "__main__":
    sys.exit(run_standalone(sys.modules[__name__]))
