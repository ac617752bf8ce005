"""`miles bench megatron`'s arithmetic, free of megatron and of the GPU: the bit-identity check on the
arms' saved tensors, the ratios the comparison is about, and the printed table. Arm results are the
dicts miles/bench/megatron_arm.py writes (tests build fake ones)."""

from __future__ import annotations

import torch

from .common import median

GB = 1e9


# ---- bit identity -------------------------------------------------------------------------------------
def _compare_files(ref_path: str, path: str) -> dict:
    ref = torch.load(ref_path, map_location="cpu", mmap=True, weights_only=True)
    got = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    missing = sorted(set(ref) ^ set(got))
    differing, first, max_diff = 0, None, 0.0
    for name in ref:
        if name not in got:
            continue
        a, b = ref[name], got[name]
        if a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b):
            continue
        differing += 1
        first = first or name
        if a.shape == b.shape:
            max_diff = max(max_diff, (a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
        else:
            max_diff = float("inf")
    return {"identical": not differing and not missing, "tensors": len(ref), "differing": differing,
            "missing": missing[:5], "first_differing": first, "max_abs_diff": max_diff}


def compare_saved(ref_params: str | None, params: str | None, ref_mains: str | None = None,
                  mains: str | None = None) -> dict:
    """torch.equal, tensor by tensor, of an arm's saved final bf16 params (and fp32 mains, when both it
    and the reference saved them) against the reference's. {"identical": bool, "params": {...},
    "mains": {...} or None}; identical means the params are, and the mains too where compared."""
    out = {"params": _compare_files(ref_params, params) if ref_params and params else None,
           "mains": _compare_files(ref_mains, mains) if ref_mains and mains else None}
    compared = [c for c in (out["params"], out["mains"]) if c is not None]
    out["identical"] = bool(compared) and all(c["identical"] for c in compared)
    return out


def identical_text(value) -> str:
    if value is None:
        return "n/a"
    if value == "reference":
        return "(reference)"
    p, m = value.get("params"), value.get("mains")
    what = "params + fp32 mains" if m is not None else "bf16 params"
    if value["identical"]:
        return f"yes ({what})"
    bad = [(label, c) for label, c in (("params", p), ("mains", m)) if c is not None and not c["identical"]]
    return "no (" + "; ".join(f"{label}: {c['differing']}/{c['tensors']} differ, max |d| {c['max_abs_diff']:.3g}"
                              for label, c in bad) + ")"


# ---- numbers ------------------------------------------------------------------------------------------
def summarize(r: dict) -> dict | None:
    """The medians and peaks of one arm's measured steps; None for a failed arm."""
    if not r or not r.get("ok"):
        return None
    rows = [s for s in r["rows"] if s["measured"]]
    out = {"step": median([s["seconds"] for s in rows]), "peak": max(s["peak_bytes"] for s in rows),
           "rss_peak": r["rss_peak_bytes"], "rss": r["rss_bytes"], "state": r["state_bytes"]}
    if all("end_to_end_seconds" in s for s in rows):
        out["e2e"] = median([s["end_to_end_seconds"] for s in rows])
        out["read"] = median([s["bytes_read"] for s in rows])
        out["written"] = median([s["bytes_written"] for s in rows])
        for key in ("disk_bytes_read", "cache_bytes_read", "disk_bytes_written"):
            if all(key in s for s in rows):
                out[key] = median([s[key] for s in rows])
    return out


def state_bytes(results: dict) -> int | None:
    """The optimizer state's bytes: the resident arm's (fp32 mains + moments), else any arm's."""
    arms = results["arms"]
    for name in ["resident"] + sorted(arms):
        s = summarize(arms.get(name))
        if s:
            return s["state"]
    return None


def ratios(results: dict) -> dict:
    """The ratios the comparison is about; a value is None when an arm it needs is missing or failed."""
    s = {name: summarize(r) for name, r in results["arms"].items()}

    def get(name, key):
        return (s.get(name) or {}).get(key)

    def div(a, b):
        return a / b if a is not None and b else None

    budget_mb = (results["arms"].get("store-budget") or {}).get("budget_mb")
    return {
        "store_100_over_cpu_offload_step": div(get("store-100", "step"), get("cpu-offload", "step")),
        "store_100_end_to_end_over_cpu_offload_step": div(get("store-100", "e2e"), get("cpu-offload", "step")),
        "store_100_rss_peak_over_state": div(get("store-100", "rss_peak"), get("store-100", "state")),
        "store_50_over_store_0_step": div(get("store-50", "step"), get("store-0", "step")),
        "store_50_over_store_0_end_to_end": div(get("store-50", "e2e"), get("store-0", "e2e")),
        "store_budget_peak_over_budget": div(get("store-budget", "peak"), budget_mb * (1 << 20) if budget_mb else None),
        "store_0_peak_over_resident_peak": div(get("store-0", "peak"), get("resident", "peak")),
    }


# ---- the printed report -------------------------------------------------------------------------------
def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def table(results: dict) -> list[str]:
    arms = results["arms"]
    base, off = summarize(arms.get("resident")), summarize(arms.get("cpu-offload"))
    head = (f"{'arm':14s} {'step s':>8s} {'e2e s':>8s} {'x resident':>10s} {'x cpu-offl':>10s} {'peak GB':>8s} "
            f"{'RSS GB':>7s} {'moved GB (r+w)':>15s}  bit-identical to resident")
    lines = [head]
    for name, r in arms.items():
        s = summarize(r)
        if s is None:
            lines.append(f"{name:14s} FAILED: {str(r.get('error'))[:150]}")
            continue
        moved = f"{s['read'] / GB:.2f}+{s['written'] / GB:.2f}" if "read" in s else "-"
        lines.append(
            f"{name:14s} {s['step']:8.3f} {_f(s.get('e2e'), '8.3f'):>8s} "
            f"{_f(s['step'] / base['step'] if base else None, '10.2f'):>10s} "
            f"{_f(s['step'] / off['step'] if off else None, '10.2f'):>10s} {s['peak'] / GB:8.3f} "
            f"{s['rss_peak'] / GB:7.2f} {moved:>15s}  {identical_text(r.get('identical'))}")
    return lines


def report(results: dict) -> str:
    shape, arms = results["shape"], results["arms"]
    state = state_bytes(results)
    params = next((r["params"] for r in arms.values() if r.get("ok")), results["params_predicted"])
    lines = [f"\n== miles bench megatron: GPTModel {params / 1e9:.3f}B params ({shape['layers']} layers, hidden "
             f"{shape['hidden']}), bf16 params, fp32 mains + Adam moments "
             f"{_f(state / GB if state else None, '.2f', '?')} GB, DistributedOptimizer at DP=1, "
             f"{results['device']}, torch {results['torch']} =="]
    lines += table(results)
    r = ratios(results)

    def say(label, key, unit="x"):
        value = r[key]
        lines.append(f"  {label:58s} " + ("n/a (an arm it needs is missing or failed)" if value is None
                                          else f"{value:.3f}{unit}"))

    lines.append("ratios:")
    say("store 100% tier step / cpu-offload step", "store_100_over_cpu_offload_step")
    say("  (store 100% end to end / cpu-offload step)", "store_100_end_to_end_over_cpu_offload_step")
    say("host RSS peak of the store 100% arm / state bytes", "store_100_rss_peak_over_state")
    say("store 50% step / store 0% step", "store_50_over_store_0_step")
    say("  (the same, end to end)", "store_50_over_store_0_end_to_end")
    say("store-budget step peak / its device budget", "store_budget_peak_over_budget")
    say("store default (0% arm) step peak / resident step peak", "store_0_peak_over_resident_peak")
    for name, a in arms.items():
        if a.get("ok") and a.get("store"):
            st = a["store"]
            lines.append(f"  {name}: {st['num_buckets']} buckets of <= {st['bucket_numel'] / 1e6:.1f}M elements, "
                         f"depth {st['depth']}, device budget {st['device_budget_bytes'] / GB:.3f} GB, bound "
                         f"{st['residency_bound_bytes'] / GB:.3f} GB, host cache {a['host_cache_mb']} MiB, "
                         f"{'O_DIRECT' if st.get('direct_io') else 'buffered'}")
            s = summarize(a)
            if "disk_bytes_read" in s:
                lines.append(f"    per step: read {s['disk_bytes_read'] / GB:.2f} GB from disk and "
                             f"{s.get('cache_bytes_read', 0) / GB:.2f} GB from the host cache; "
                             + (f"{s['disk_bytes_written'] / GB:.2f} GB written to disk since the previous step "
                                "returned (the bench's flush after that step included)" if "disk_bytes_written" in s
                                else "written back on flush"))
            if a.get("after_load"):
                lines.append("    " + after_load_text(a["after_load"]))
        elif not a.get("ok"):
            lines.append(f"  {name} failed: {a.get('error')}")
    base_rss = [f"{n} {a['rss_before_optimizer_bytes'] / GB:.2f}" for n, a in arms.items()
                if a.get("ok") and a.get("rss_before_optimizer_bytes") is not None]
    if base_rss:
        lines.append("  host RSS with the model built, before the optimizer (GB): " + ", ".join(base_rss))
    stages = [f"{n} {_rss_stages(a)}" for n, a in arms.items() if a.get("ok") and a.get("rss_peak_after_optimizer_bytes")]
    if stages:
        lines.append("  host RSS peak after the optimizer / after binding the store / after each step (GB): "
                     + "; ".join(stages))
    lines.append("step s: optimizer.step() between torch.cuda.synchronize() calls (median of the measured steps); "
                 "e2e s: the store's step until its writes are in the files (store.flush(): write-behind and the host "
                 "tier's dirty images; then fdatasync), no "
                 "read-ahead (no forward/backward to hide it behind); peak GB: max_memory_allocated during the "
                 "step over the allocation before it; RSS GB: the arm process's peak resident set, VmHWM (its CUDA context and "
                 "model build included); moved: the store's bytes read + written per step (cpu-offload's "
                 "grads-down / params-up traffic is not counted).")
    return "\n".join(lines)


def after_load_text(al: dict) -> str:
    """The --after-load line of a store arm: the first step after a load, at once and after the fill."""
    now, later = al["at_once"], al["after_fill"]
    return (f"first step after a load: at once {now['seconds']:.3f} s (disk {now['disk_bytes_read'] / GB:.2f} GB, "
            f"host cache {now['cache_bytes_read'] / GB:.2f} GB); after the tier's read-ahead landed "
            f"({al['fill_seconds']:.2f} s after the load) {later['seconds']:.3f} s (disk "
            f"{later['disk_bytes_read'] / GB:.2f} GB, host cache {later['cache_bytes_read'] / GB:.2f} GB); "
            f"ratio {later['seconds'] / now['seconds']:.3f}x; load {al['after_fill_load_seconds']:.2f} s; "
            + save_text(al))


def save_text(al: dict) -> str:
    """What the --after-load save wrote: the disk's bytes (the process's write_bytes) against the state's."""
    text = f"save {al['save_seconds']:.2f} s"
    if al.get("state_bytes"):
        state = al["state_bytes"]
        text += f", checkpoint files {al['save_checkpoint_bytes'] / GB:.2f} GB for {state / GB:.2f} GB of state"
        if al.get("save_disk_write_bytes") is not None:
            text += (f", {al['save_disk_write_bytes'] / GB:.2f} GB written to disk "
                     f"({al['save_disk_write_bytes'] / state:.3f}x the state)")
    return text


def _rss_stages(arm: dict) -> str:
    marks = [arm.get("rss_peak_after_optimizer_bytes"), arm.get("rss_peak_after_bind_bytes")]
    marks += [r.get("rss_peak_bytes") for r in arm.get("rows", [])]
    return " / ".join("-" if m is None else f"{m / GB:.2f}" for m in marks)
