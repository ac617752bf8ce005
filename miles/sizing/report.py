"""An Estimate as a human table or as a JSON-ready dict (bytes as integers, seconds as floats)."""

from __future__ import annotations

import dataclasses

from miles_plugins.optimizers.streaming.config import DEFAULT_BUCKET_NUMEL

from .estimate import GB, GIB, RESIDENT_STATE_BYTES, Estimate, StageEstimate, short_decimal, store_device_bytes
from .store_plan import moment_bytes_per_param


def _size(nbytes: float) -> str:
    # Both units: published figures and tools mix them (nvidia-smi and torch print GiB, disks sell GB).
    return f"{nbytes / GB:.1f} GB ({nbytes / GIB:.1f} GiB)"


def _params(n: float) -> str:
    return f"{n / 1e9:.2f}B"


def _stage_dict(s: StageEstimate) -> dict:
    out = dataclasses.asdict(s)
    for name, store in (("dense_store", s.dense_store), ("expert_store", s.expert_store)):
        out[name]["payload_bytes"] = store.payload_bytes
    out.update(streamed_state_bytes=s.streamed_state_bytes, step_bytes=s.step_bytes,
               first_step_read_bytes=s.first_step_read_bytes)
    return out


def to_json(est: Estimate) -> dict:
    return {
        "model": est.model, "total_params": est.total_params, "dense_params": est.dense_params,
        "expert_params": est.expert_params,
        "parallel": dataclasses.asdict(est.parallel) | {"world": est.parallel.world, "edp": est.parallel.edp},
        "hardware": dataclasses.asdict(est.hardware), "training": dataclasses.asdict(est.training),
        "binding_stage": est.binding.stage, "mean_params_owned": est.mean_params_owned,
        "per_rank": _stage_dict(est.binding), "stages": [_stage_dict(s) for s in est.stages],
        "fit": dataclasses.asdict(est.fit), "disk_bytes_per_node": est.disk_bytes_per_node,
        "floors": dataclasses.asdict(est.floors),
    }


def _elements(n: float) -> str:
    return f"{short_decimal(n / 1e6)}M"


def _buckets(est: Estimate) -> str:
    """How the bucket size was chosen: given, or fitted by the stores to their device budget."""
    if est.training.bucket_numel is not None:
        return f"buckets of {_elements(est.training.bucket_numel)} elements"
    budget = f"buckets fitted to a device budget of {_size(est.binding.dense_store.device_budget_bytes)}"
    if est.hardware.device_budget_mb is not None:
        return f"{budget} (--device-budget-mb)"
    return f"{budget}: the store's default, what one bucket of {_elements(DEFAULT_BUCKET_NUMEL)} elements needs"


def _bucket_shape(store) -> str:
    return f"{_elements(store.bucket_numel)}, depth {store.depth}" if store.num_buckets else ""


def _row(label: str, dense, expert, total, width: int = 26) -> str:
    return f"  {label:34s} {dense:>{width}s} {expert:>{width}s} {total:>{width}s}".rstrip()


def to_text(est: Estimate) -> str:
    p, hw, tr, s, fit, fl = est.parallel, est.hardware, est.training, est.binding, est.fit, est.floors
    mom = moment_bytes_per_param(tr.moment_dtype)
    d, e = s.dense_store, s.expert_store
    lines = [
        f"miles plan: {est.model}, {_params(est.total_params)} params ({_params(est.dense_params)} dense, "
        f"{_params(est.expert_params)} in routed experts)",
        f"layout: {hw.nodes} node(s) x {hw.gpus_per_node} GPUs, TP{p.tp} PP{p.pp} DP{p.dp} EP{p.ep} ETP{p.etp} "
        f"(expert-DP {p.edp}); {short_decimal(hw.hbm_gb)} GB HBM, {short_decimal(hw.host_ram_gb)} GB RAM per node",
        f"training: bf16 weights, {tr.grad_dtype} grads, Adam moments stored as {tr.moment_dtype} "
        f"({4 + mom:.2f} B/param streamed), {_buckets(est)}",
        "",
        f"per rank, pipeline stage {s.stage + 1} of {p.pp} (the largest; mean over stages "
        f"{_params(est.mean_params_owned)} params owned):",
        _row("", "dense", "expert", "total"),
        _row("params held (weights, grads)", _params(s.dense_local), _params(s.expert_local), _params(s.params_local)),
        _row("params owned (optimizer state)", _params(s.dense_owned), _params(s.expert_owned),
             _params(s.params_owned)),
        _row("weights (bf16)", "", "", _size(s.weight_bytes)),
        _row(f"grads ({tr.grad_dtype})", "", "", _size(s.grad_bytes)),
        _row(f"resident Adam state ({RESIDENT_STATE_BYTES} B/param)", _size(RESIDENT_STATE_BYTES * s.dense_owned),
             _size(RESIDENT_STATE_BYTES * s.expert_owned), _size(s.resident_state_bytes)),
        _row(f"streamed state ({tr.moment_dtype} moments)", _size(d.state_bytes), _size(e.state_bytes),
             _size(s.streamed_state_bytes)),
        _row("buckets (one store each)", str(d.num_buckets), str(e.num_buckets), str(d.num_buckets + e.num_buckets)),
        _row("elements per bucket, depth", _bucket_shape(d), _bucket_shape(e), ""),
        _row("on the GPU in a step (the larger)", _size(d.residency_bound_bytes), _size(e.residency_bound_bytes),
             _size(store_device_bytes(s))),
        "",
        f"fits: resident {'yes' if fit.resident else 'no'}, Megatron CPU offload "
        f"{'yes' if fit.cpu_offload else 'no'}, streaming {'yes' if fit.streaming else 'no'}  ->  {fit.verdict}",
        f"  {fit.reason}",
        f"  HBM per GPU: resident {_size(fit.device_bytes['resident'])}, CPU offload "
        f"{_size(fit.device_bytes['cpu-offload'])}, streaming {_size(fit.device_bytes['streaming'])} "
        f"(each includes a {hw.reserve_bytes / GB:.1f} GB reserve for activations)",
        "",
        f"disk per node ({hw.gpus_per_node} ranks): streamed state {_size(est.disk_bytes_per_node['streamed_state'])}"
        f" + trainer offload {_size(est.disk_bytes_per_node['trainer_offload'])} + checkpoint copy "
        f"{_size(est.disk_bytes_per_node['checkpoint_copies'])} = {_size(est.disk_bytes_per_node['total'])}"
        + (f" of {short_decimal(hw.disk_gb)} GB" if hw.disk_gb else ""),
        f"streamed per step and rank: first step read {_size(s.first_step_read_bytes)} (mains only) + write "
        f"{_size(s.step_bytes)}; then read {_size(s.step_bytes)} + write {_size(s.step_bytes)}",
        f"step-time floor ({hw.gpus_per_node} ranks share a node's disk; {fl.disk_model}):",
        f"  first step {fl.first_seconds:.1f} s, then {fl.steady_seconds:.1f} s per step",
    ]
    if fl.tier_bytes_per_rank:
        lines.append(f"  with a host tier of {short_decimal(hw.host_tier_gb)} GB per rank "
                     f"({_size(fl.tier_bytes_per_rank)} of each step from RAM at {short_decimal(hw.pcie_gbps)} GB/s): "
                     f"{fl.tiered_seconds:.1f} s per step")
    if hw.host_tier_gb:
        lines.append(f"state per rank with the host tier: {_size(fl.ram_bytes_per_rank)} in host RAM (whole buckets, no "
                     f"files), {_size(fl.disk_bytes_per_rank)} in files on disk")
    if hw.disk_gb and est.disk_bytes_per_node["total"] > hw.disk_gb * GB:
        lines.append(f"WARNING: the node needs {_size(est.disk_bytes_per_node['total'])} of disk but has "
                     f"{short_decimal(hw.disk_gb)} GB: use fewer checkpoint copies on the local disk or more nodes")
    return "\n".join(lines)
