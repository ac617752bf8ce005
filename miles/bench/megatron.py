"""`miles bench megatron`: Megatron's resident optimizer, Megatron's own CPU offload and the store, on one model.

One megatron-core GPTModel (random init, Llama-family shape from the flags: about 1.36B params by
default), bf16 params, fp32 main params + Adam moments, DDP with the DistributedOptimizer at DP = 1, on
one GPU. Every arm runs in its own process (the same interpreter), so the GPU peak and the host RSS are
the arm's own; every arm gets the same seed and the same synthetic gradients (a seeded generator per
step, written into the DDP grad buffers where a backward leaves them), and takes --warmup steps, then
--steps measured ones:

  resident      Megatron's DistributedOptimizer, state on the GPU
  cpu-offload   Megatron's optimizer_cpu_offload (HybridDeviceOptimizer, offload fraction 1.0, with the
                precision-aware optimizer and overlapped D2H/H2D it needs); an error Megatron raises is
                reported in place of numbers
  store-P       the store bound to the same optimizer (as the megatron trainer binds it), host cache P%
                of the state (--tiers), store defaults otherwise, files under --dir
  store-budget  the store with device_budget_mb = --budget-mb

Per arm: median optimizer.step() seconds (synchronized; the store's also end to end, until its
write-behind is in the files), the step's GPU peak over the pre-step allocation, the arm process's peak
and current host RSS, the bytes the store moved, and whether the final bf16 params (and the fp32 mains
where an arm holds them) are bit-identical to `resident`'s. Run it as a module or through `miles bench`
(never as a script: this file's name would shadow the megatron package):

    miles bench megatron --dir /nvme/bench --json out.json
    python -m miles.bench.megatron --dir /tmp/bm --layers 2 --hidden 256 --heads 4 --ffn 512 --vocab 1024
"""

from __future__ import annotations

import argparse
import contextlib
import collections
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import torch

from .common import Progress, run_standalone, write_json
from .megatron_report import compare_saved, ratios, report

NAME, HELP = "megatron", "Megatron's resident optimizer vs its CPU offload vs the store, one model, one GPU"
MiB = 1 << 20
ARM_GROUPS = ("resident", "cpu-offload", "store", "store-budget")
PROGRESS_MARK = "@@miles-bench-arm@@ "  # the arm process's progress lines start with this
HOST_CACHE_SLACK_MB = 64  # the 100% tier: room for the files' 4 KiB segment alignment, so every bucket fits


# ---- arguments ----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=2048, help="hidden size")
    p.add_argument("--layers", type=int, default=24, help="transformer layers (24 with the other defaults: "
                   "about 1.36B params, 16.4 GB of fp32 mains + moments)")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--query-groups", type=int, default=None, help="key/value heads (GQA; default: --heads)")
    p.add_argument("--ffn", type=int, default=5632, help="SwiGLU MLP hidden size")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (untied input and output embeddings)")
    p.add_argument("--seq-len", type=int, default=4096, help="max sequence length (rope: no params)")
    p.add_argument("--steps", type=int, default=4, help="measured optimizer steps per arm")
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps before the measured ones (the store's "
                   "first step reads mains only: moments do not exist yet)")
    p.add_argument("--tiers", default="0,50,100", help="host cache of the store arms, percent of the state; "
                   "one store arm per value")
    p.add_argument("--budget-mb", type=int, default=1024, help="device_budget_mb of the store-budget arm")
    p.add_argument("--arms", default=",".join(ARM_GROUPS), help="comma-separated subset of "
                   f"{', '.join(ARM_GROUPS)} ('store' is every --tiers arm); resident is the reference of "
                   "the bit-identity check")
    p.add_argument("--dir", default="miles-bench-megatron", help="directory on the disk under test: the store "
                   "arms' files and the arms' saved params (all removed at the end)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the weights and gradients, the same in every arm")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam's learning rate, the same in every arm")
    p.add_argument("--arm-timeout", type=float, default=0, help="seconds an arm may run before it is killed and "
                   "reported as failed (0: no limit)")
    p.add_argument("--after-load", action="store_true", help="store arms with a host tier: also time the "
                   "first step after a save + load, at once and once the tier's read-ahead (fill) has landed, "
                   "and report the bytes the save wrote to disk against the state's")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--verbose", action="store_true", help="echo the arms' whole output (Megatron's logs too), "
                   "not only their progress lines")


def main(argv=None) -> int:
    return run_standalone(sys.modules[__name__], argv)


# ---- pure helpers (tested on CPU) ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    query_groups: int
    ffn: int
    vocab: int
    seq_len: int


def param_count(shape: Shape) -> dict:
    """Params of the GPTModel the arms build (no biases, RMSNorm weights, SwiGLU fc1 = gate + up,
    untied embeddings), by part."""
    head_dim = shape.hidden // shape.heads
    attention = shape.hidden * (shape.heads + 2 * shape.query_groups) * head_dim + shape.heads * head_dim * shape.hidden
    mlp = 3 * shape.hidden * shape.ffn
    per_layer = attention + mlp + 2 * shape.hidden
    embeddings = 2 * shape.vocab * shape.hidden
    total = shape.layers * per_layer + embeddings + shape.hidden
    return {"per_layer": per_layer, "layers": shape.layers * per_layer, "embeddings": embeddings,
            "final_norm": shape.hidden, "total": total}


def llama_config(shape: Shape) -> SimpleNamespace:
    """A transformers-like Llama config for miles.backends.megatron_backend.model.build_gpt_model (the
    megatron trainer's builder), without importing transformers."""
    return SimpleNamespace(model_type="llama", hidden_act="silu", hidden_size=shape.hidden,
                           intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                           num_attention_heads=shape.heads, num_key_value_heads=shape.query_groups,
                           vocab_size=shape.vocab, max_position_embeddings=shape.seq_len, rms_norm_eps=1e-5,
                           rope_theta=10000.0, initializer_range=0.02, tie_word_embeddings=False)


def host_cache_mb(tier_pct: int, state_bytes: int) -> int:
    """host_cache_mb (an int of MiB) of a store arm: tier_pct percent of the state; the 100% tier gets
    HOST_CACHE_SLACK_MB more so that every bucket's file fits."""
    if tier_pct <= 0:
        return 0
    return math.ceil(tier_pct * state_bytes / 100 / MiB) + (HOST_CACHE_SLACK_MB if tier_pct >= 100 else 0)


def parse_tiers(text: str) -> list[int]:
    try:
        tiers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--tiers {text!r}: give whole percents, comma-separated (e.g. 0,50,100)") from None
    if not tiers or any(t < 0 or t > 100 for t in tiers) or len(set(tiers)) != len(tiers):
        raise ValueError(f"--tiers {text!r}: give distinct whole percents from 0 to 100 (e.g. 0,50,100)")
    return tiers


def plan_arms(arms: str, tiers: list[int], budget_mb: int) -> list[dict]:
    """The arms to run, in order (resident first: it is the reference)."""
    chosen = [a.strip() for a in arms.split(",") if a.strip()]
    unknown = [a for a in chosen if a not in ARM_GROUPS]
    if unknown or not chosen:
        raise ValueError(f"--arms {arms!r}: choose from {', '.join(ARM_GROUPS)}")
    out = []
    if "resident" in chosen:
        out.append({"name": "resident", "kind": "resident"})
    if "cpu-offload" in chosen:
        out.append({"name": "cpu-offload", "kind": "cpu-offload"})
    if "store" in chosen:
        out += [{"name": f"store-{t}", "kind": "store", "tier_pct": t, "budget_mb": None} for t in tiers]
    if "store-budget" in chosen:
        out.append({"name": "store-budget", "kind": "store", "tier_pct": 0, "budget_mb": budget_mb})
    return out


def validate(args) -> tuple[Shape, list[dict]]:
    """(shape, arms) from the flags; ValueError says which flag is wrong and what to give."""
    groups = args.query_groups or args.heads
    for flag, value in (("--hidden", args.hidden), ("--layers", args.layers), ("--heads", args.heads),
                        ("--query-groups", groups), ("--ffn", args.ffn), ("--vocab", args.vocab),
                        ("--seq-len", args.seq_len), ("--steps", args.steps), ("--budget-mb", args.budget_mb)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.heads % groups:
        raise ValueError(f"--heads {args.heads} is not a multiple of --query-groups {groups}")
    if args.arm_timeout < 0:
        raise ValueError(f"--arm-timeout must be >= 0 (0: no limit), got {args.arm_timeout}")
    shape = Shape(args.hidden, args.layers, args.heads, groups, args.ffn, args.vocab, args.seq_len)
    return shape, plan_arms(args.arms, parse_tiers(args.tiers), args.budget_mb)


def missing_requirements() -> str | None:
    """None when this machine can run the arms, else one line saying what is missing and what to do."""
    missing = []
    if not torch.cuda.is_available():
        missing.append("no CUDA GPU is visible")
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        missing.append("megatron-core is not installed (it needs Python >= 3.12 and CUDA)")
    if not missing:
        return None
    return (f"needs a CUDA GPU and megatron-core, but {' and '.join(missing)}; run it on a GPU host with "
            "megatron-core installed (pip install -e '.[gpu,megatron]')")


# ---- the run ------------------------------------------------------------------------------------------
def run(args) -> int:
    try:
        shape, arms = validate(args)
    except ValueError as e:
        print(f"miles bench megatron: {e}", file=sys.stderr)
        return 2
    problem = missing_requirements()
    if problem:
        print(f"miles bench megatron: {problem}", file=sys.stderr)
        return 2
    say = Progress()
    root = os.path.abspath(args.dir)
    os.makedirs(root, exist_ok=True)
    # everything the arms write (store files, saved params, results) goes under a directory this run
    # made, removed whole at the end: a closed store leaves its directory behind
    work = tempfile.mkdtemp(prefix="run-", dir=root)
    counts = param_count(shape)
    results: dict = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "shape": dataclasses.asdict(shape),
                     "params_predicted": counts["total"], "params_breakdown": counts,
                     "device": "?", "torch": torch.__version__, "dir": root, "arms": {}}
    say(f"GPTModel {shape.layers} layers x hidden {shape.hidden} (heads {shape.heads}, kv {shape.query_groups}, "
        f"ffn {shape.ffn}, vocab {shape.vocab}): {counts['total']:,} params = {counts['total'] / 1e9:.3f}B; "
        f"fp32 mains + moments {12 * counts['total'] / 1e9:.2f} GB; store files in {root}")
    say(f"arms, each in its own process, {args.warmup} warm-up + {args.steps} measured steps: "
        f"{', '.join(a['name'] for a in arms)}")
    common = {"shape": dataclasses.asdict(shape), "seed": args.seed, "lr": args.lr, "steps": args.steps,
              "warmup": args.warmup, "dir": work, "after_load": args.after_load}
    reference = None
    try:
        for i, arm in enumerate(arms):
            say(f"arm {i + 1}/{len(arms)}: {arm['name']} ...")
            r = _measure_arm(common | arm, work, args, say, counts["total"], reference)
            if arm["name"] == "resident":
                reference = r if r.get("ok") else None
            results["arms"][arm["name"]] = r
            results["device"] = r.get("device") or results["device"]  # the parent creates no CUDA context
    finally:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):  # --dir itself only when the run left it empty: it may be the user's
            os.rmdir(root)
    results["ratios"] = ratios(results)
    results["report"] = report(results)
    print(results["report"], flush=True)
    write_json(args.json, results, say)
    failed = [n for n, r in results["arms"].items() if not r.get("ok") and n != "cpu-offload"]
    return 1 if failed else 0


def _measure_arm(spec: dict, work: str, args, say, params: int, reference: dict | None) -> dict:
    """One arm run in its own process, its final params compared with the resident arm's (``reference``,
    None when it failed or did not run) and then removed; its result with ``arm_seconds`` and ``identical``."""
    name = spec["name"]
    spec = spec | {"saved_params": os.path.join(work, f"{name}.params.pt"),
                   "saved_mains": os.path.join(work, f"{name}.mains.pt"),
                   "result": os.path.join(work, f"{name}.result.json")}
    t0 = time.perf_counter()
    r = run_arm(spec, work, say, verbose=args.verbose, timeout=args.arm_timeout or None)
    r["arm_seconds"] = time.perf_counter() - t0
    if r.get("ok") and r.get("params") != params:
        say(f"  note: the model has {r['params']:,} params, the shape formula says {params:,}")
    if name == "resident":
        r["identical"] = "reference"
    elif r.get("ok") and reference is not None:
        say(f"  comparing {name}'s final params with resident's ...")
        r["identical"] = compare_saved(reference.get("saved_params"), r.get("saved_params"),
                                       reference.get("saved_mains"), r.get("saved_mains"))
    else:
        r["identical"] = None
    if name != "resident":
        _remove(r.get("saved_params"), r.get("saved_mains"))
    say(f"arm {name} " + (f"done in {r['arm_seconds']:.0f} s" if r.get("ok")
                          else f"FAILED after {r['arm_seconds']:.0f} s: {r.get('error')}"))
    return r


def _remove(*paths) -> None:
    for path in paths:
        if path and os.path.exists(path):
            os.remove(path)


def _package_root() -> str:
    import miles

    return os.path.dirname(os.path.dirname(os.path.abspath(miles.__file__)))


def exit_reason(returncode: int) -> str:
    """How an arm's process ended, in words: a negative status is the signal that killed it."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = (" (what Linux's out-of-memory killer sends when host memory runs out: `dmesg` names the process)"
            if -returncode == signal.SIGKILL else "")
    return f"was killed by {name}{hint}"


def run_arm(spec: dict, workdir: str, say, *, verbose: bool = False, timeout: float | None = None) -> dict:
    """Run one arm in a fresh process of this interpreter; its result dict, or {"ok": False, "error": ...}
    when it died without writing one (the error holds its exit status and last output lines)."""
    spec_path = os.path.join(workdir, f"{spec['name']}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "miles.bench.megatron_arm", spec_path], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
    killed = threading.Event()

    def kill():
        killed.set()
        proc.kill()

    timer = threading.Timer(timeout, kill) if timeout else None
    if timer:
        timer.start()
    tail: collections.deque[str] = collections.deque(maxlen=30)
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(PROGRESS_MARK):
                say("  " + line[len(PROGRESS_MARK):])
            else:
                tail.append(line)
                if verbose:
                    print(f"  | {line}", flush=True)
        rc = proc.wait()
    finally:
        if timer:
            timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if os.path.exists(spec["result"]):
        with open(spec["result"]) as f:
            return json.load(f)
    why = f"killed after {timeout:.0f} s (--arm-timeout)" if killed.is_set() else exit_reason(rc)
    last = " | ".join(l for l in list(tail)[-8:] if l.strip())
    return {"name": spec["name"], "kind": spec["kind"], "ok": False,
            "error": f"the arm's process {why} without a result; last output: {last}"}


if __name__ == "__main__":
    sys.exit(main())
