"""What the RL loop reports: the per-rollout record (JSONL + TensorBoard), its one-line log form, and
the end-of-run summary. Pure formatting over the ranks' step reports; ``miles.train`` calls it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
from typing import Any, Optional, Sequence

from miles.config import RunConfig
from miles.run_lifecycle import RunState
from miles_plugins.optimizers.streaming.units import GB

logger = logging.getLogger("miles.train")


def mean_of(values) -> float:
    values = [v for v in values if v is not None]
    return float(statistics.fmean(values)) if values else 0.0


class MetricsSink:
    """Metrics as JSONL (one record per rollout, each naming the run that wrote it: ``run_id``) and
    TensorBoard scalars when TensorBoard is installed.

    The file is appended to: every line a run did not itself write again stays. A resumed run (``--load``
    without ``--finetune``) re-runs the rollouts from ``start_rollout`` on, so the records of those rollouts
    written by ``superseded_runs`` (the runs whose history the resumed checkpoint continues) are replaced;
    a fresh or ``--finetune`` run passes none and drops nothing. One line says what was kept and replaced."""

    def __init__(self, path: str, tensorboard_dir: Optional[str], run_id: str,
                 superseded_runs: Sequence[str] = (), start_rollout: int = 0):
        self.path, self.run_id = path, run_id
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        _supersede_in_file(path, superseded_runs, start_rollout)
        self._fh = open(path, "a", buffering=1)
        self.tb = None
        self.tb_dir = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb_dir = tensorboard_dir or os.path.join(os.path.dirname(path), "tensorboard")
            self.tb = SummaryWriter(self.tb_dir)
        except Exception:  # TensorBoard not installed: JSONL only
            if tensorboard_dir:
                logger.warning("--tensorboard-dir %s: TensorBoard is not installed (pip install tensorboard); "
                               "metrics go to %s only", tensorboard_dir, path)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps({**record, "run_id": self.run_id}, sort_keys=True) + "\n")
        if self.tb is not None:
            step = record["rollout_id"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "rollout_id":
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._fh.close()
        if self.tb is not None:
            self.tb.close()


def superseded_lines(lines: Sequence[str], runs: Sequence[str], rollout_id: int) -> list[bool]:
    """For each line of a metrics file: True when it is a record of a rollout >= ``rollout_id`` written by
    one of ``runs`` (a resumed run writes it again). Anything else (other runs' records, records naming no
    run, lines that are not records) is not."""
    runs = set(runs)
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        out.append(isinstance(record, dict) and record.get("run_id") in runs
                   and isinstance(record.get("rollout_id"), int) and record["rollout_id"] >= rollout_id)
    return out


def _supersede_in_file(path: str, runs: Sequence[str], rollout_id: int) -> None:
    """Remove what :func:`superseded_lines` marks from the metrics file at ``path`` (replaced atomically),
    end its last line when a crash cut it short (the next record starts on a line of its own), and log one
    line on what was kept and removed. No file yet: nothing to do."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    if not lines:
        return
    marks = superseded_lines(lines, runs, rollout_id)
    kept = [line for line, superseded in zip(lines, marks) if not superseded]
    if kept and not kept[-1].endswith("\n"):
        kept[-1] += "\n"
    if len(kept) < len(lines) or kept[-1] != lines[-1]:
        target = os.path.realpath(path)  # a symbolic link the user made stays one: the file it names is replaced
        tmp = f"{target}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    superseded = len(lines) - len(kept)
    if superseded:
        logger.info("metrics: appending to %s; kept %d earlier line(s), replaced %d record(s) of rollouts >= %d "
                    "written by run(s) %s, whose history this resumed run continues (it writes them again)",
                    path, len(kept), superseded, rollout_id, ", ".join(sorted(set(runs))))
    else:
        logger.info("metrics: appending to %s; kept its %d earlier line(s)", path, len(kept))


def _stream_record(ranks: list[dict], sleep: list[dict]) -> dict[str, Any]:
    """The rollout record's ``stream_*`` fields: the ranks' streamed optimizer I/O and where their state lives."""
    read = [int(r["stream_bytes_read"]) for r in ranks]
    written = [int(r["stream_bytes_written"]) for r in ranks]
    wall = max(float(r["stream_seconds"]) for r in ranks)
    rec = {
        "stream_bytes_read_per_rank": read,
        "stream_bytes_written_per_rank": written,
        "stream_read_gb": sum(read) / GB,
        "stream_written_gb": sum(written) / GB,
        "stream_disk_read_gb": sum(int(r["stream_disk_bytes_read"]) for r in ranks) / GB,
        "stream_disk_written_gb": sum(int(r["stream_disk_bytes_written"]) for r in ranks) / GB,
        "stream_tier_fill_gb": sum(int(r["stream_tier_fill_bytes"]) for r in ranks) / GB,
        "stream_seconds": wall,
        "stream_gbps": (sum(read) + sum(written)) / GB / wall if wall > 0 else 0.0,
        "stream_peak_resident_bytes": max(int(r["stream_peak_resident_bytes"]) for r in ranks),
        "stream_ram_state_gb": sum(int(r["stream_ram_state_bytes"]) for r in ranks) / GB,
        "stream_disk_state_gb": sum(int(r["stream_disk_state_bytes"]) for r in ranks) / GB,
        "stream_exposed_io_seconds": max(float(r["stream_io_seconds"]) for r in ranks),
        "stream_prefetched_buckets": min(int(r["stream_prefetched_buckets"]) for r in ranks),
    }
    # the rollout's optimizer I/O nobody hid: what its step waited for, plus what the sleep after it
    # waited for (the write-backs, with --stream-optimizer-state-flush-at-sleep)
    rec["stream_sleep_wait_seconds"] = max((s.get("store_wait_seconds", 0.0) for s in sleep), default=0.0)
    rec["stream_exposed_io_per_rollout_seconds"] = rec["stream_exposed_io_seconds"] + rec["stream_sleep_wait_seconds"]
    return rec


# What a sleep and a wake moved, by source (miles.backends.planned_sleep's per-rank keys), summed over the
# ranks into the record as sleep_<key> / wake_<key>
_SLEEP_SPLIT = ("moved_bytes", "kept_bytes", "discarded_bytes", "to_ram_bytes", "to_disk_bytes",
                "released_for_engine_bytes", "released_for_masters_bytes")
_WAKE_SPLIT = ("moved_bytes", "from_ram_bytes", "from_disk_bytes", "rebuilt_from_engine_bytes",
               "rebuilt_from_masters_bytes", "masters_read_bytes")


def _sleep_wake_record(sleep: list[dict], wake: list[dict]) -> dict[str, Any]:
    """``sleep_moved_bytes`` (written to host RAM or disk), ``wake_moved_bytes`` (copied back: rebuilt from
    the engine's copy or the store's masters, read from RAM or disk), and their split by source, over
    the ranks; the plan's mode, its notes (rank 0's: why a source was not used) and any shortfall."""
    rec: dict[str, Any] = {}
    for prefix, reports, keys in (("sleep", sleep, _SLEEP_SPLIT), ("wake", wake, _WAKE_SPLIT)):
        for key in keys:
            rec[f"{prefix}_{key}"] = int(sum(int(r.get(key, 0)) for r in reports if not r.get("skipped")))
    # megatron's grad buffers are dropped by the backend itself, before the plan: discarded all the same
    rec["sleep_discarded_bytes"] += int(sum(int(s.get("grad_bytes_dropped", 0)) for s in sleep))
    rec["sleep_plan"] = next((s["plan"] for s in sleep if s.get("plan")), None)
    rec["sleep_plan_notes"] = next((s["plan_notes"] for s in sleep if s.get("plan_notes")), [])
    rec["sleep_plan_shortfall_bytes"] = max((int(s.get("plan_shortfall_bytes", 0)) for s in sleep), default=0)
    return rec


def _mfu_record(ranks: list[dict], fwd_bwd: float) -> dict[str, Any]:
    """The model FLOPs of the ranks' forward/backward passes (miles.sizing.flops), the seconds they would
    take at the devices' bf16 peak (the work spread evenly), and the MFU that makes of the slowest rank's
    forward/backward: None where a rank's model or device could not be counted (a CPU)."""
    flops = [r.get("model_flops") for r in ranks]
    peaks = [r.get("device_peak_flops") for r in ranks]
    total = sum(flops) if all(f is not None for f in flops) else None
    at_peak = total / sum(peaks) if total is not None and all(p is not None for p in peaks) else None
    return {"train_model_flops": total, "forward_backward_floor_seconds": at_peak,
            "train_mfu": at_peak / fwd_bwd if at_peak is not None and fwd_bwd > 0 else None}


# What the ranks report of the train/rollout mismatch beside train_rollout_logprob_abs_diff
# (miles.backends.step.PolicyLoss.metrics; the tis_* keys only under --use-tis, the routing_replay_* keys only under
# --use-rollout-routing-replay): docs/advanced/train-rollout-mismatch.md
MISMATCH_KEYS = ("train_rollout_logprob_abs_diff_max", "train_rollout_kl", "tis_weight_mean", "tis_clipfrac",
                 "routing_replay_mismatch_first", "routing_replay_mismatch_last")


def rollout_record(rollout_id, rewards, samples, ranks, wake, sleep, timings, saved,
                   handoff=()) -> dict[str, Any]:
    """One rollout's record: the driver's ``timings`` (``*_seconds`` as the driver saw them) and the ranks'
    own reports (``ranks``: each rank's train metrics, ``handoff``: each rank's weight-handoff stats)."""
    r0 = ranks[0]
    fwd_bwd = max(r["forward_backward_seconds"] for r in ranks)
    step = max(r["optimizer_step_seconds"] for r in ranks)
    train_rank = max(r["train_seconds"] for r in ranks)
    rec: dict[str, Any] = {
        "rollout_id": rollout_id,
        "reward_mean": mean_of(rewards),
        "reward_std": float(statistics.pstdev(rewards)) if len(rewards) > 1 else 0.0,
        "response_len_mean": mean_of([len(s.response_ids) for s in samples]),
        "samples": len(samples),
        "loss": r0["loss"],
        "grad_norm": r0["grad_norm"],
        # why this rollout's optimizer step was not applied (None: it was): every rank skips together
        "step_skipped": next((r["step_skipped"] for r in ranks if r.get("step_skipped")), None),
        "clipfrac": r0["clipfrac"],
        "train_rollout_logprob_abs_diff": r0["train_rollout_logprob_abs_diff"],
        # the rest of the train/rollout mismatch, as every rank reports it (the same on all: reduced over them)
        **{key: r0[key] for key in MISMATCH_KEYS if key in r0},
        # the slowest rank's train call and its parts: forward/backward, the optimizer step, the rest
        "forward_backward_seconds": fwd_bwd,
        "optimizer_step_seconds": step,
        "train_rank_seconds": train_rank,
        "other_seconds": max(r["train_seconds"] - r["forward_backward_seconds"] - r["optimizer_step_seconds"]
                             for r in ranks),
        **timings,
        # what the ranks themselves spent moving memory (the *_seconds above are seen from the driver)
        "sleep_rank_seconds": max((s.get("seconds", 0.0) for s in sleep), default=0.0),
        "wake_rank_seconds": max((w.get("seconds", 0.0) for w in wake), default=0.0),
        "offload_bytes": int(sum(s.get("bytes", 0) for s in sleep if not s.get("skipped"))),
        "checkpoint": saved,
    }
    if handoff:  # each rank's share of the weight handoff (by reference or broadcast)
        rec["weight_handoff_seconds"] = max(h["weight_handoff_seconds"] for h in handoff)
        rec["weight_handoff_bytes"] = max(int(h["weight_handoff_bytes"]) for h in handoff)
        rec["weight_handoff_buckets"] = max(int(h["weight_handoff_buckets"]) for h in handoff)
        rec["weight_handoff_largest_bucket_bytes"] = max(int(h["weight_handoff_largest_bucket_bytes"]) for h in handoff)
        # a rank whose buckets CUDA refused to export handed them over through host shared memory instead
        rec["weight_handoff_through_host"] = any(h["weight_handoff_through_host"] for h in handoff)
    rec["host_rss_peak_gb"] = max(int(r["host_rss_peak_bytes"]) for r in ranks) / GB  # the largest rank's
    if "optimizer_step_device_peak_bytes" in r0:
        rec["optimizer_step_device_peak_gb"] = max(int(r["optimizer_step_device_peak_bytes"]) for r in ranks) / GB
    if "forward_backward_device_peak_bytes" in r0:
        rec["forward_backward_device_peak_gb"] = max(int(r["forward_backward_device_peak_bytes"]) for r in ranks) / GB
    rec.update(_mfu_record(ranks, fwd_bwd))
    if "micro_batches" in r0:  # how the samples were batched: the most micro-batches a rank ran, the padded tokens
        rec["train_micro_batches"] = max(int(r["micro_batches"]) for r in ranks)
        rec["train_padded_tokens"] = sum(int(r["padded_tokens"]) for r in ranks)
    if any("device_used_bytes_asleep" in s for s in sleep):  # GPU backends: device memory in use while asleep
        rec["device_used_gb_asleep"] = max(s.get("device_used_bytes_asleep", 0) for s in sleep) / GB
    if "stream_bytes_read" in r0:
        rec.update(_stream_record(ranks, sleep))
    if sleep or wake:
        rec.update(_sleep_wake_record(sleep, wake))
    return rec


ROLLOUT_LINE_WIDTH = 180  # two lines of a 90-column terminal at most; the rest is in the metrics file


def _short(x: float) -> str:
    """A figure in at most 4-5 characters: 2 decimals below 10, 1 below 100, none above."""
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


@dataclasses.dataclass(frozen=True)
class _LineDetail:
    """What a rollout line shows beyond its fixed figures: what each sleep and wake moved (``moved``: by
    source "sources", "bytes" only, or None), the train call's split, the streamed bytes' disk share, and
    the mismatch in words or compact (``lp 0.062 max 1.2`` or ``lp 0.062/1.2``)."""

    moved: Optional[str]
    train_split: bool = True
    stream_disk: bool = True
    compact_mismatch: bool = False


# From the most to the least detail: the first that fits is the line
_LINE_DETAILS = (_LineDetail("sources"), _LineDetail("bytes"), _LineDetail(None),
                 _LineDetail(None, stream_disk=False), _LineDetail(None, stream_disk=False, train_split=False),
                 _LineDetail(None, stream_disk=False, train_split=False, compact_mismatch=True))


def format_rollout_line(rec: dict[str, Any], num_rollout: int) -> str:
    """The rollout's one log line (at most ROLLOUT_LINE_WIDTH characters): reward, loss, the train/rollout
    mismatch of an applied step (:func:`_mismatch`), where the step's seconds went (the train call:
    forward/backward, optimizer step, and the rest of the call, or on a GPU forward/backward's MFU in its
    place), the streamed GB read + written (of which disk) and a saved checkpoint; a skipped optimizer step
    says so in place of the mismatch and the stream figures (nothing measured, nothing streamed); what each
    sleep and wake moved and from where, the disk's share of the streamed bytes and the train call's split,
    as much of them as the width leaves room for (:data:`_LINE_DETAILS`). Every field, and more, is in the
    metrics record."""
    for detail in _LINE_DETAILS:
        line = _rollout_line(rec, num_rollout, detail)
        if len(line) <= ROLLOUT_LINE_WIDTH:
            return line
    return line


def _mismatch(rec: dict[str, Any], compact: bool) -> str:
    """`` | lp 0.062 max 1.2 kl 0.0041 tis 0.98 cut 1.2% r3 1.6%..39.8%`` (compact: `` | lp 0.062/1.2 kl 0.0041
    tis 0.98/1.2% r3 1.6%..39.8%``): the mean and largest |trainer - rollout log-prob|, the KL estimate, under
    --use-tis the mean truncated weight and the share of weights truncated, and under
    --use-rollout-routing-replay the share of tokens whose natural route differed from the replayed one in the
    first and the last MoE layer; nothing for a skipped step."""
    if rec.get("step_skipped"):
        return ""
    text = f" | lp {rec['train_rollout_logprob_abs_diff']:.2g}"
    if "train_rollout_logprob_abs_diff_max" in rec:
        text += f"{'/' if compact else ' max '}{rec['train_rollout_logprob_abs_diff_max']:.2g}"
    if "train_rollout_kl" in rec:
        text += f" kl {rec['train_rollout_kl']:.2g}"
    if "tis_weight_mean" in rec:
        text += f" tis {rec['tis_weight_mean']:.2f}{'/' if compact else ' cut '}{100 * rec['tis_clipfrac']:.1f}%"
    if "routing_replay_mismatch_first" in rec:
        text += (f" r3 {100 * rec['routing_replay_mismatch_first']:.1f}%.."
                 f"{100 * rec['routing_replay_mismatch_last']:.1f}%")
    return text


def _rollout_line(rec: dict[str, Any], num_rollout: int, detail: _LineDetail) -> str:
    # forward/backward's MFU where it is counted (a GPU), in place of the rest of the call (train - fb - opt)
    rest = (f"mfu {100 * rec['train_mfu']:.0f}%" if rec.get("train_mfu") is not None
            else f"other {_short(rec['other_seconds'])}")
    train = f"train {_short(rec['train_seconds'])}"
    if detail.train_split:
        train += (f" (fb {_short(rec['forward_backward_seconds'])} opt {_short(rec['optimizer_step_seconds'])} "
                  f"{rest})")
    seconds = [f"gen {_short(rec['generate_seconds'])}", train]
    if "weight_handoff_seconds" in rec:
        seconds.append(f"weights {_short(rec['weight_handoff_seconds'])}")
    seconds.append(f"sleep {_short(rec['sleep_seconds'])}{_moved(rec, 'sleep', detail.moved)} "
                   f"wake {_short(rec['wake_seconds'])}{_moved(rec, 'wake', detail.moved)}")
    parts = [f"rollout {rec['rollout_id'] + 1}/{num_rollout} reward {rec['reward_mean']:.3f} loss {rec['loss']:+.3g}"
             + _mismatch(rec, detail.compact_mismatch),
             f"{_short(rec['step_seconds'])}s: " + " ".join(seconds)]
    if not rec.get("step_skipped") and "stream_read_gb" in rec:
        disk = (f" (disk {_short(rec['stream_disk_read_gb'])}+{_short(rec['stream_disk_written_gb'])})"
                if detail.stream_disk else "")
        parts.append(f"streamed {_short(rec['stream_read_gb'])}+{_short(rec['stream_written_gb'])} GB{disk}")
    if rec.get("checkpoint"):
        parts.append("saved")
    if rec.get("step_skipped"):  # what fits of the reason; all of it is in the record and the warning after the line
        room = ROLLOUT_LINE_WIDTH - len(" | ".join(parts)) - len(" | STEP SKIPPED: ")
        parts.insert(2, "STEP SKIPPED: " + _clip(rec["step_skipped"], max(room, 16)))
    return " | ".join(parts)


_MOVED_FROM = {"sleep": (("to_ram_bytes", "ram"), ("to_disk_bytes", "disk")),
               "wake": (("rebuilt_from_engine_bytes", "engine"), ("rebuilt_from_masters_bytes", "masters"),
                        ("from_ram_bytes", "ram"), ("from_disk_bytes", "disk"))}


def _moved(rec: dict[str, Any], phase: str, detail) -> str:
    """`` (1.2 GB masters)`` (detail "sources"), `` (1.2 GB)`` ("bytes"): what the sleep or wake moved, and
    from where; nothing when not recorded or detail is None."""
    if f"{phase}_moved_bytes" not in rec or detail is None:
        return ""
    if detail == "bytes":
        return f" ({_short(rec[f'{phase}_moved_bytes'] / GB)} GB)"
    sources = [(name, rec[f"{phase}_{key}"]) for key, name in _MOVED_FROM[phase] if rec.get(f"{phase}_{key}")]
    where = " ".join(f"{name} {_short(n / GB)}" for name, n in sources) if len(sources) > 1 else \
        (sources[0][0] if sources else "")
    return f" ({_short(rec[f'{phase}_moved_bytes'] / GB)} GB{' ' + where if where else ''})"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def log_summary(config: RunConfig, state: RunState) -> None:
    recs = state.records
    ckpt = config.checkpoint
    lines = ["run finished in %.1f s: %d rollout(s) (%s)" % (
        state.seconds, len(recs),
        f"rollouts {recs[0]['rollout_id']}..{recs[-1]['rollout_id']}" if recs else "nothing left to do")]
    if recs:
        lines.append("  reward: first %.3f, last %.3f; mean step %.2f s" % (
            recs[0]["reward_mean"], recs[-1]["reward_mean"], mean_of(r["step_seconds"] for r in recs)))
        skipped = sum(1 for r in recs if r.get("step_skipped"))
        lines.append(f"  optimizer steps: {len(recs) - skipped} applied, {skipped} skipped")
        measured = [r for r in recs if not r.get("step_skipped") and "train_rollout_kl" in r]
        if measured:  # the applied steps' train/rollout mismatch (a skipped step measured nothing)
            lines.append("  train/rollout log-probs: mean |diff| first %.3g, last %.3g; largest %.3g; KL first "
                         "%.3g, last %.3g" % (
                             measured[0]["train_rollout_logprob_abs_diff"],
                             measured[-1]["train_rollout_logprob_abs_diff"],
                             max(r["train_rollout_logprob_abs_diff_max"] for r in measured),
                             measured[0]["train_rollout_kl"], measured[-1]["train_rollout_kl"]))
        if "stream_read_gb" in recs[-1]:
            lines.append("  streamed optimizer state: %.3f GB read, %.3f GB written in total, last step %.2f GB/s" % (
                sum(r["stream_read_gb"] for r in recs), sum(r["stream_written_gb"] for r in recs),
                recs[-1]["stream_gbps"]))
    if state.checkpoints:
        lines.append(f"  checkpoints: {', '.join(state.checkpoints)}")
        lines.append(f"  latest checkpoint: {state.latest_checkpoint} (resume with --load {ckpt.save})")
    elif ckpt.save:
        lines.append(f"  no checkpoint written (--save {ckpt.save}, --save-interval {ckpt.save_interval})")
    else:
        lines.append("  no checkpoints (--save not given)")
    lines.append(f"  metrics: {state.metrics_file}" +
                 (f", TensorBoard: {state.tensorboard_dir}" if state.tensorboard_dir else ""))
    logger.info("\n".join(lines))
