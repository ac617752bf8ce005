"""One arm of `miles bench megatron` (miles/bench/megatron.py), in a process of its own:

    python -m miles.bench.megatron_arm SPEC.json

Initializes torch.distributed (one rank, NCCL, a free localhost port) and megatron's parallel state
(TP = PP = 1), builds the GPTModel with the megatron trainer's builder, wraps it as the trainer does
(Float16Module, DDP with fp32 grad buffers, DistributedOptimizer), applies the arm (Megatron's CPU
offload, or the store bound as the trainer binds it), runs the steps and writes its result JSON to
spec["result"]: numbers, or {"ok": false, "error": ...} when Megatron or the store refuses the arm.
Imports megatron only inside functions (every module of the package imports on CPU).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
import traceback

import torch

from miles.process_memory import disk_write_bytes, peak_rss_bytes, rss_bytes

from .common import tree_file_bytes
from .megatron import PROGRESS_MARK, Shape, host_cache_mb, llama_config


def say(spec: dict, msg: str) -> None:
    print(f"{PROGRESS_MARK}{spec['name']}: {msg}", flush=True)


# ---- setup --------------------------------------------------------------------------------------------
def init_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=30))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def shutdown_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def init_weights(gpt, seed: int, std: float) -> None:
    """Deterministic random init, the same in every arm's process: N(0, std) for matrices, 1 for the
    norm weights, from one CUDA generator in named_parameters order (the builder leaves weights
    uninitialized: the trainer loads HF weights into them)."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    for _, p in gpt.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)


def build_model(spec: dict):
    """(GPTModel, DDP(Float16Module(GPTModel)), TransformerConfig), as MegatronTrainer._build wraps it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from miles.backends.megatron_backend.model import build_gpt_model

    torch.manual_seed(spec["seed"])
    model_parallel_cuda_manual_seed(spec["seed"])
    gpt, tconfig, _ = build_gpt_model(llama_config(Shape(**spec["shape"])), params_dtype=torch.bfloat16)
    gpt.cuda()
    init_weights(gpt, spec["seed"], 0.02)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=True)
    ddp = DistributedDataParallel(tconfig, ddp_config, Float16Module(tconfig, gpt))
    ddp.train()
    return gpt, ddp


def build_optimizer(spec: dict, ddp):
    """Megatron's optimizer as the trainer configures it; the cpu-offload arm adds Megatron's CPU offload
    and what it requires (megatron/training/arguments.py: --optimizer-cpu-offload needs
    --use-precision-aware-optimizer; optimizer/__init__.py: decoupled_weight_decay, the default)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    kwargs = dict(optimizer="adam", lr=spec["lr"], min_lr=spec["lr"], weight_decay=0.01, adam_beta1=0.9,
                  adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16,
                  use_distributed_optimizer=True)
    if spec["kind"] == "cpu-offload":
        kwargs.update(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True,
                      overlap_cpu_optimizer_d2h_h2d=True)
    config = OptimizerConfig(**kwargs)
    return get_megatron_optimizer(config, [ddp]), {k: v for k, v in kwargs.items() if k != "params_dtype"}


def members(opt) -> list:
    """The DistributedOptimizers of what get_megatron_optimizer returned (a ChainedOptimizer in 0.19)."""
    return list(getattr(opt, "chained_optimizers", [opt]))


def bf16_shards(opt) -> list:
    """This rank's shards of the bf16 params, in the optimizer's order (the order of its mains)."""
    return [s for m in members(opt) for group in m.shard_float16_groups for s in group]


def bind_store(spec: dict, opt, state_estimate: int):
    """The store bound to the optimizer the way the megatron trainer binds it (stream_optimizer_state with
    a StreamConfig: the store's defaults but the dir, host cache and device budget); its stores, one per
    non-stub chained member."""
    from miles_plugins.optimizers.nvme_stream import StreamConfig, stream_optimizer_state

    cache_mb = host_cache_mb(spec["tier_pct"], state_estimate)
    config = StreamConfig(dir=os.path.join(spec["dir"], spec["name"]), host_cache_mb=cache_mb,
                          device_budget_mb=spec.get("budget_mb"), rank=0)
    bound = stream_optimizer_state(opt, config=config)
    return list(getattr(bound, "stores", [bound])), cache_mb


# ---- the steps ----------------------------------------------------------------------------------------
def fill_grads(ddp, params: list, step: int, seed: int) -> None:
    """What a backward leaves: fp32 grads in every param's main_grad (views of the DDP grad buffers),
    then DDP's grad sync. Deterministic per step, the same in every arm."""
    ddp.zero_grad_buffer()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed * 1_000_003 + step)
    with torch.no_grad():
        for p in params:
            p.main_grad.normal_(0.0, 1.0, generator=gen)
    ddp.finish_grad_sync()


def run_steps(spec: dict, ddp, opt, stores: list) -> list[dict]:
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    total = spec["warmup"] + spec["steps"]
    rows = []
    for i in range(total):
        row = timed_step(spec, ddp, opt, stores, params, i)
        row["measured"] = i >= spec["warmup"]
        rows.append(row)
        say(spec, f"step {i + 1}/{total}{'' if row['measured'] else ' (warm-up)'}: {row['summary']}")
    return rows


def timed_step(spec: dict, ddp, opt, stores: list, params: list, i: int) -> dict:
    """One optimizer step on step i's grads: its time, GPU peak over the pre-step allocation, and for the
    store its end-to-end time (flushed, page cache dropped) and bytes moved."""
    opt.zero_grad()
    fill_grads(ddp, params, i, spec["seed"])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    ok, grad_norm, _ = opt.step()
    torch.cuda.synchronize()
    row = {"step": i + 1, "seconds": time.perf_counter() - t0,
           "grad_norm": None if grad_norm is None else float(grad_norm), "pre_step_allocated": base}
    if not ok:
        raise RuntimeError(f"step {i + 1}: the Megatron optimizer skipped its step (non-finite grads)")
    msg = f"{row['seconds']:.3f} s"
    if stores:
        for store in stores:
            store.flush()  # the write-behind lands: the end-to-end time
            # fdatasync of buffered writes; the next step reads from the disk, not the page cache
            store.stager.drop_page_cache([b.file for b in store.buckets])
        torch.cuda.synchronize()
        row["end_to_end_seconds"] = time.perf_counter() - t0
        for key in ("bytes_read", "bytes_written", "disk_bytes_read", "cache_bytes_read", "disk_bytes_written",
                    "tier_fill_bytes"):
            row[key] = sum(getattr(s.stats.last_step, key, 0) for s in stores)
        row["store_peak_resident_bytes"] = max(s.stats.last_step.peak_resident_bytes for s in stores)
        msg += (f" returned, {row['end_to_end_seconds']:.3f} s end to end; read {row['bytes_read'] / 1e9:.2f} GB "
                f"(disk {row['disk_bytes_read'] / 1e9:.2f}, host cache {row['cache_bytes_read'] / 1e9:.2f}), "
                f"wrote {row['bytes_written'] / 1e9:.2f} GB (to disk during the step "
                f"{row['disk_bytes_written'] / 1e9:.2f} GB)")
    row["peak_bytes"] = torch.cuda.max_memory_allocated() - base
    row["rss_peak_bytes"] = peak_rss_bytes()  # where in the arm host memory peaked
    row["summary"] = msg + f"; GPU peak +{row['peak_bytes'] / 1e9:.3f} GB"
    return row


def first_steps_after_load(spec: dict, ddp, opt, stores: list) -> dict:
    """The first step after a resume, for a store with a host tier: save the state, load it back (the
    load drops the tier's images; store.fill_host_tier reads them back on the I/O threads), then step
    at once; load again, wait until the fill has landed (in `miles train` the first rollout's
    generation runs meanwhile), then step. Both steps take the same grads from the same state."""
    import shutil

    params = [p for p in ddp.module.parameters() if p.requires_grad]
    base = os.path.join(spec["dir"], f"{spec['name']}-after-load")
    out: dict = {}
    try:
        written0, t0 = disk_write_bytes(), time.perf_counter()
        for store in stores:
            store.save_to(base)
        out["save_seconds"] = time.perf_counter() - t0
        written = disk_write_bytes()
        # what the save put on the disk (live write-back + checkpoint files), against the state it saves
        out["save_disk_write_bytes"] = None if written is None or written0 is None else written - written0
        out["save_checkpoint_bytes"] = tree_file_bytes(base)
        out["state_bytes"] = sum(store.stats.state_bytes for store in stores)
        index = spec["warmup"] + spec["steps"]
        for label, wait_for_fill in (("at_once", False), ("after_fill", True)):
            t0 = time.perf_counter()
            for store in stores:
                store.load_from(base)
            out[f"{label}_load_seconds"] = time.perf_counter() - t0
            if wait_for_fill:
                t0 = time.perf_counter()
                for store in stores:
                    store.stager.wait_all()
                out["fill_seconds"] = time.perf_counter() - t0
            row = out[label] = timed_step(spec, ddp, opt, stores, params, index)
            say(spec, f"first step after a load, {label.replace('_', ' ')}"
                + (f" (the fill took {out['fill_seconds']:.2f} s more)" if wait_for_fill else "")
                + f": {row['summary']}; read ahead into the tier {row['tier_fill_bytes'] / 1e9:.2f} GB")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


# ---- final values -------------------------------------------------------------------------------------
def main_params(spec: dict, opt) -> tuple[list | None, str]:
    """The fp32 mains, in the order of the optimizer's shards, where they are cheap to reach."""
    if spec["kind"] == "resident":
        return ([main for m in members(opt) for group in m.shard_fp32_from_float16_groups for main in group],
                "DistributedOptimizer.shard_fp32_from_float16_groups")
    if spec["kind"] == "cpu-offload":
        mains = []
        for m in members(opt):
            fp32_of = getattr(m.optimizer, "param_to_fp32_param", None)  # HybridDeviceOptimizer's fp32 copies
            if fp32_of is None:
                return None, f"{type(m.optimizer).__name__} has no param_to_fp32_param"
            try:
                mains += [fp32_of[s] for group in m.shard_float16_groups for s in group]
            except (KeyError, RuntimeError):  # RuntimeError: a tensor key compared by value
                return None, "a bf16 shard has no fp32 copy in HybridDeviceOptimizer.param_to_fp32_param"
        return mains, "HybridDeviceOptimizer.param_to_fp32_param"
    return None, "on disk in the store's files (not read back)"


def save_final(spec: dict, gpt, opt) -> dict:
    params = {name: p.detach().to("cpu", copy=True) for name, p in gpt.named_parameters()}
    torch.save(params, spec["saved_params"])
    del params
    mains, where = main_params(spec, opt)
    out = {"saved_params": spec["saved_params"], "saved_mains": None, "mains_from": where}
    if mains is not None:
        torch.save({f"{i:06d}": m.detach().to("cpu", copy=True) for i, m in enumerate(mains)}, spec["saved_mains"])
        out["saved_mains"] = spec["saved_mains"]
    return out


def store_info(stores: list) -> dict:
    """The stores' stats (one store for a dense model: summed / the largest over several)."""
    sts = [s.stats for s in stores]
    return {"stores": len(stores), "num_buckets": sum(st.num_buckets for st in sts),
            "bucket_numel": max(st.bucket_numel for st in sts), "depth": max(st.depth for st in sts),
            "state_bytes": sum(st.state_bytes for st in sts),
            "device_budget_bytes": max(st.device_budget_bytes for st in sts),
            "residency_bound_bytes": max(st.residency_bound_bytes for st in sts),
            "peak_resident_bytes": max(st.peak_resident_bytes for st in sts),
            "host_cache_bytes": sum(st.host_cache_bytes for st in sts),
            "staging_bytes": sum(st.staging_bytes for st in sts), "direct_io": all(s.direct_io for s in stores)}


# ---- the arm ------------------------------------------------------------------------------------------
def run_arm(spec: dict) -> dict:
    result = {k: spec.get(k) for k in ("name", "kind", "tier_pct", "budget_mb")}
    result.update(ok=False, error=None, torch=torch.__version__)
    stores: list = []
    try:
        result["device"] = torch.cuda.get_device_name(0)
        import megatron.core

        result["megatron_core"] = getattr(megatron.core, "__version__", "?")
        say(spec, "initializing torch.distributed (NCCL, 1 rank) and megatron's parallel state")
        init_distributed()
        t0 = time.perf_counter()
        gpt, ddp = build_model(spec)
        result["params"] = sum(p.numel() for p in gpt.parameters())
        result["build_seconds"] = time.perf_counter() - t0
        result["rss_before_optimizer_bytes"] = rss_bytes()
        say(spec, f"GPTModel of {result['params']:,} params built and wrapped in {result['build_seconds']:.1f} s")
        t0 = time.perf_counter()
        try:
            opt, result["optimizer_config"] = build_optimizer(spec, ddp)
        except Exception as e:  # noqa: BLE001 - the cpu-offload arm reports what Megatron refuses
            raise RuntimeError(f"get_megatron_optimizer refused this arm: {type(e).__name__}: {e}") from e
        result["optimizer"] = f"{type(opt).__name__}[" + ", ".join(
            f"{type(m).__name__}({type(m.optimizer).__name__})" for m in members(opt)) + "]"
        result["rss_peak_after_optimizer_bytes"] = peak_rss_bytes()
        n = result["streamed_numel"] = sum(s.numel() for s in bf16_shards(opt))
        result["state_bytes"] = 12 * n  # fp32 mains + exp_avg + exp_avg_sq of the bf16 params
        if spec["kind"] == "store":
            stores, result["host_cache_mb"] = bind_store(spec, opt, 12 * n)
            result["rss_peak_after_bind_bytes"] = peak_rss_bytes()
            result["store"] = store_info(stores)
            result["state_bytes"] = result["store"]["state_bytes"]
        result["optimizer_seconds"] = time.perf_counter() - t0
        say(spec, f"{result['optimizer']} ready in {result['optimizer_seconds']:.1f} s"
            + (f"; store: {result['store']['num_buckets']} buckets, depth {result['store']['depth']}, "
               f"{result['store']['state_bytes'] / 1e9:.2f} GB, host cache {result['host_cache_mb']} MiB, "
               f"device budget {result['store']['device_budget_bytes'] / 1e9:.3f} GB" if stores else ""))
        result["rows"] = run_steps(spec, ddp, opt, stores)
        result["rss_peak_bytes"], result["rss_bytes"] = peak_rss_bytes(), rss_bytes()
        if stores:
            result["store"] = store_info(stores)
        say(spec, f"host RSS peak {result['rss_peak_bytes'] / 1e9:.2f} GB, now {result['rss_bytes'] / 1e9:.2f} GB; "
            "saving the final params")
        result.update(save_final(spec, gpt, opt))
        if spec.get("after_load") and stores and result["host_cache_mb"]:
            result["after_load"] = first_steps_after_load(spec, ddp, opt, stores)
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported in place of numbers; the run goes on
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        print(result["traceback"], flush=True)
    finally:
        for store in stores:
            try:
                store.close()
            except Exception as e:  # noqa: BLE001
                result["close_error"] = f"{type(e).__name__}: {e}"
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run_arm(spec)
    with open(spec["result"], "w") as f:
        json.dump(result, f, indent=1, default=str)
    say(spec, "done" if result["ok"] else f"failed: {result['error']}")
    sys.stdout.flush()
    sys.stderr.flush()
    # NCCL / gloo threads can abort the interpreter's teardown (tests/gpu/multigpu_megatron.py); the result
    # is written, so leave without it.
    try:
        shutdown_distributed()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
