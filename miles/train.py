"""The RL loop: ``miles.train.run(args)`` (what ``miles train`` runs).

Per rollout (colocated sequence)::

    generate (engine awake) -> rewards -> GRPO advantages -> release engine memory -> wake trainer ->
    train (one optimizer step; streams the optimizer state with --stream-optimizer-state-to-disk) ->
    export weights -> save (every --save-interval rollouts and at the end) -> sleep trainer -> resume engine ->
    update engine weights

Without ``--colocate`` the engine keeps its memory; without ``--offload-train`` the trainer stays
awake. ``--load`` resumes the model, the optimizer state (the streamed state through
``store.load_from``), the rollout id and the data position.

Operator output goes through ``logging``: a tqdm progress bar over rollouts, one line per rollout
(reward, loss, step seconds, streamed GB and GB/s, sleep/wake seconds), metrics as JSONL
(``--metrics-file``, default ``<run dir>/metrics.jsonl``) and TensorBoard scalars when TensorBoard is
installed, and a summary at the end that says where the checkpoints are. A failing Ray actor stops
the run with the actor's traceback (:class:`RunError`); temporary directories are removed either way.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from typing import Any, Optional

from miles import checkpoint

logger = logging.getLogger("miles.train")
GB = 1e9


class RunError(RuntimeError):
    """The run stopped because an actor failed; the message carries the actor's traceback."""


# ---- small helpers ----------------------------------------------------------------------------------
def _configure_logging(level: str) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("miles").setLevel(getattr(logging, str(level or "INFO").upper(), logging.INFO))


def run_dir(args: Any) -> str:
    """Where this run's own files go by default: ``--save`` if given, else ``./runs/<timestamp>``."""
    if getattr(args, "save", None):
        return os.path.abspath(args.save)
    if not getattr(args, "_run_dir", None):
        args._run_dir = os.path.abspath(os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))
    return args._run_dir


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return float(statistics.fmean(values)) if values else 0.0


def _load_tokenizer(args: Any):
    """The policy's tokenizer in the driver (prompts are encoded and rewards judged here)."""
    from miles.models import build_tiny_tokenizer, resolve_policy_source

    src = resolve_policy_source(args, convert=True)
    if src.kind == "tiny":
        tok = build_tiny_tokenizer()
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(src.path, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


class _DataCursor:
    """The prompt stream as a position: prompt k of the (epoch-shuffled) stream is ``get_batch(k, 1)``,
    so resuming at a saved position continues exactly where the saved run stopped, whatever the batch
    size."""

    def __init__(self, source, position: int = 0):
        self.source = source
        self.position = position

    def next_batch(self, batch_size: int) -> list:
        if self.position % batch_size == 0:  # the usual case: one call of the source's own batching
            items = self.source.get_batch(self.position // batch_size, batch_size)
        else:  # resumed with a different batch size: prompt by prompt
            items = [self.source.get_batch(k, 1)[0] for k in range(self.position, self.position + batch_size)]
        self.position += batch_size
        return items

    def state(self) -> dict[str, Any]:
        return {"consumed_prompts": self.position, "num_prompts": len(self.source)}


class _MetricsSink:
    def __init__(self, path: str, tensorboard_dir: Optional[str]):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
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
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        if self.tb is not None:
            step = record["rollout_id"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "rollout_id":
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._fh.close()
        if self.tb is not None:
            self.tb.close()


def _should_save(args: Any, completed: int) -> bool:
    """Every --save-interval rollouts, and after the last one (with --save)."""
    if not getattr(args, "save", None):
        return False
    interval = getattr(args, "save_interval", None)
    return (bool(interval) and completed % int(interval) == 0) or completed == int(getattr(args, "num_rollout", 0))


def _shards(samples: list, advantages: list[float], world: int) -> list[tuple[list, list[float]]]:
    n = len(samples)
    per, extra = divmod(n, world)
    out, start = [], 0
    for r in range(world):
        stop = start + per + (1 if r < extra else 0)
        out.append((samples[start:stop], advantages[start:stop]))
        start = stop
    return out


def _init_ray(args: Any) -> bool:
    """Connect to ``RAY_ADDRESS`` or start a local cluster (returns True when this call started Ray)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:  # a private single-node cluster for this run, bound to loopback
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False, log_to_driver=True)
    return True


# ---- the loop -----------------------------------------------------------------------------------------
def run(args: Any) -> dict[str, Any]:
    """Run the RL loop; returns a summary dict (also logged). Raises :class:`RunError` when an actor fails."""
    _configure_logging(getattr(args, "log_level", "INFO"))
    if not getattr(args, "validated", False):
        from miles.config import validate_args

        args = validate_args(args)

    import ray

    from miles.models import prepare_policy
    from miles.ray import actor_factory, layout
    from miles.ray.errors import ActorFailure
    from miles.ray.placement_group import create_placement_group, remove
    from miles.ray.rollout_manager import RolloutManager
    from miles.ray.train_group import RayTrainGroup

    t_run = time.perf_counter()
    rdir = run_dir(args)
    os.makedirs(rdir, exist_ok=True)
    metrics_path = os.path.abspath(getattr(args, "metrics_file", None) or os.path.join(rdir, "metrics.jsonl"))
    source = prepare_policy(args)  # one-time model conversion happens here, not in every actor
    tokenizer = _load_tokenizer(args)
    from miles.rl import compute_rewards, encode_prompts, grpo_advantages, make_prompt_source
    from miles.rollout.types import SamplingParams

    started_ray = _init_ray(args)
    pg = train_group = rollout = sink = None
    failure: Optional[BaseException] = None
    summary: dict[str, Any] = {"run_dir": rdir, "metrics_file": metrics_path, "checkpoints": [],
                               "latest_checkpoint": None, "records": []}
    try:
        pg, use_gpu, bundles = create_placement_group(args)
        train_group = RayTrainGroup(args, pg, use_gpu)
        rollout = RolloutManager(args, pg, use_gpu)
        logger.info("starting %d train actor(s) and %d rollout engine(s) (each imports torch and builds the "
                    "model: this takes a while on a small machine)", len(train_group.actors), len(rollout.engines))
        infos = train_group.init()
        engine_infos = rollout.init()
        summary["train_ranks"], summary["rollout_engines"] = infos, engine_infos
        info0 = infos[0]
        logger.info("policy: %s | %.2fM params, %s on %s | %d train ranks (%s), %d rollout engine(s)%s",
                    source.description, info0["num_params"] / 1e6, info0["dtype"], info0["device"], len(infos),
                    info0["backend"], len(engine_infos), " colocated" if getattr(args, "colocate", False) else "")
        if info0.get("store"):
            st = info0["store"]
            logger.info("streamed optimizer state: %d bucket(s), %.3f GB per rank under %s",
                        st["num_buckets"], st["state_bytes"] / GB, layout.optimizer_state_root(args))
        if layout.offload_enabled(args):
            logger.info("trainer offload: target %s%s", layout.offload_target(args),
                        f", per-rank directories under {layout.trainer_root(args)}"
                        if layout.uses_rank_dirs(args) else "")

        # ---- resume
        start_rollout, data_position = 0, 0
        if getattr(args, "load", None):
            base = checkpoint.resolve(args.load)
            if base is None:
                logger.warning("--load %s: no checkpoint there yet, starting fresh", args.load)
            else:
                meta = checkpoint.read_meta(base)
                load_optim = not (getattr(args, "no_load_optim", False) or getattr(args, "finetune", False))
                loaded = train_group.load(base, load_optim)
                if not getattr(args, "finetune", False):
                    start_rollout = int(meta["next_rollout_id"])
                    data_position = int(meta.get("data_state", {}).get("consumed_prompts", 0))
                logger.info("loaded %s: model%s; resuming at rollout %d, prompt %d", base,
                            f", optimizer ({loaded[0]['optimizer']})" if load_optim else " only (optimizer skipped)",
                            start_rollout, data_position)
                summary["loaded_checkpoint"] = base
                summary["load_info"] = loaded
        summary["start_rollout"] = start_rollout
        cursor = _DataCursor(make_prompt_source(args), data_position)

        # engines start from the trainer's weights (matters after --load or with a pretrained model)
        rollout.update_weights(train_group.export_weights(), version=start_rollout)
        if layout.offload_enabled(args):
            train_group.sleep()

        sink = _MetricsSink(metrics_path, getattr(args, "tensorboard_dir", None))
        summary["tensorboard_dir"] = sink.tb_dir if sink.tb is not None else None
        num_rollout = int(getattr(args, "num_rollout", 1))
        n_per_prompt = int(getattr(args, "n_samples_per_prompt", 1))
        colocate = bool(getattr(args, "colocate", False))
        record = _loop(args, range(start_rollout, num_rollout), cursor, tokenizer, train_group, rollout, sink,
                       summary, colocate, n_per_prompt, encode_prompts, compute_rewards, grpo_advantages,
                       SamplingParams)
        summary["last_record"] = record
    except ActorFailure as e:
        failure = e
        logger.error("run stopped: %s failed on %s. The actor's traceback:\n%s", e.what, e.actor,
                     e.remote_traceback)
    except BaseException as e:
        failure = e
        raise
    finally:
        _teardown(args, train_group, rollout, pg, sink, started_ray, failed=failure is not None,
                  remove_pg=remove, actor_factory=actor_factory)
    summary["seconds"] = time.perf_counter() - t_run
    if failure is not None:
        raise RunError(f"run stopped: {failure}") from failure
    _log_summary(args, summary)
    return summary


def _loop(args, rollout_ids, cursor, tokenizer, train_group, rollout, sink, summary, colocate, n_per_prompt,
          encode_prompts, compute_rewards, grpo_advantages, SamplingParams) -> Optional[dict]:
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from miles.ray import layout

    offload = layout.offload_enabled(args)
    streaming = bool(getattr(args, "stream_optimizer_state_to_disk", False))
    batch_size = int(getattr(args, "rollout_batch_size", 1))
    num_rollout = int(getattr(args, "num_rollout", 1))
    record = None
    pending = None  # a checkpoint whose streamed optimizer state is still being copied
    with logging_redirect_tqdm(), tqdm(rollout_ids, desc="rollouts", unit="rollout", initial=rollout_ids.start,
                                       total=num_rollout, dynamic_ncols=True) as bar:
        for rollout_id in bar:
            t0 = time.perf_counter()
            items = cursor.next_batch(batch_size)
            prompt_ids = encode_prompts(tokenizer, [it.prompt for it in items])
            samples = rollout.generate(prompt_ids, SamplingParams.from_args(args, rollout_id))
            t_gen = time.perf_counter() - t0
            answers = [items[s.prompt_index].answer for s in samples]
            rewards = compute_rewards([s.response_text for s in samples], answers)
            advantages = [float(a) for a in grpo_advantages(rewards, n_per_prompt)]
            for s, r, a in zip(samples, rewards, advantages):
                s.reward, s.advantage = r, a

            t = time.perf_counter()
            if colocate:
                rollout.release_memory()
            t_release = time.perf_counter() - t
            t = time.perf_counter()
            wake = train_group.wake() if offload else []
            t_wake = time.perf_counter() - t
            t = time.perf_counter()
            ranks = train_group.train(rollout_id, _shards(samples, advantages, train_group.world_size))
            weights = train_group.export_weights()
            t_train = time.perf_counter() - t
            if pending is not None:  # the previous checkpoint's streamed state copied during this step
                _publish(args, train_group, pending, summary)
                pending = None

            completed = rollout_id + 1
            saved = None
            t_save = 0.0
            if _should_save(args, completed):
                t = time.perf_counter()
                # streamed state: copy in the background while the next rollout runs, publish after its
                # step; the last checkpoint of the run (nothing to overlap with) is waited for at once
                background = streaming and completed < num_rollout
                pending = _save(args, train_group, completed, cursor, wait=not background)
                saved = pending["base"]
                if not background:
                    _publish(args, train_group, pending, summary, waited=True)
                    pending = None
                t_save = time.perf_counter() - t

            t = time.perf_counter()
            sleep = train_group.sleep() if offload else []
            t_sleep = time.perf_counter() - t
            t = time.perf_counter()
            if colocate:
                rollout.resume_memory()
            t_resume = time.perf_counter() - t
            t = time.perf_counter()
            rollout.update_weights(weights, version=completed)
            t_sync = time.perf_counter() - t

            timings = {"generate_seconds": t_gen, "engine_release_seconds": t_release, "wake_seconds": t_wake,
                       "train_seconds": t_train, "save_seconds": t_save, "sleep_seconds": t_sleep,
                       "engine_resume_seconds": t_resume, "weight_sync_seconds": t_sync,
                       "step_seconds": time.perf_counter() - t0}
            record = _record(rollout_id, rewards, samples, ranks, wake, sleep, timings, saved)
            sink.write(record)
            summary["records"].append(record)
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:+.3g}")
            logger.info(_format_line(record, num_rollout))
    if pending is not None:
        _publish(args, train_group, pending, summary)
    return record


def _save(args, train_group, completed: int, cursor: _DataCursor, wait: bool) -> dict[str, Any]:
    base = checkpoint.prepare(args.save, completed)
    train_group.save(base, wait)
    return {"base": base, "completed": completed, "data_state": cursor.state()}


def _publish(args, train_group, pending: dict[str, Any], summary: dict[str, Any], waited: bool = False) -> None:
    """Every rank's part is on disk: write the meta, then point ``latest`` at the checkpoint."""
    if not waited:
        train_group.finish_save()
    base = pending["base"]
    checkpoint.write_meta(base, next_rollout_id=pending["completed"], data_state=pending["data_state"],
                          world_size=train_group.world_size,
                          extra={"streamed_optimizer_state": bool(getattr(args, "stream_optimizer_state_to_disk", False))})
    checkpoint.publish(args.save, base)
    summary["checkpoints"].append(base)
    summary["latest_checkpoint"] = base
    logger.info("checkpoint complete: %s%s", base,
                "" if waited else " (optimizer state copied in the background during the next rollout)")


def _record(rollout_id, rewards, samples, ranks, wake, sleep, timings, saved) -> dict[str, Any]:
    r0 = ranks[0]
    rec: dict[str, Any] = {
        "rollout_id": rollout_id,
        "reward_mean": _mean(rewards),
        "reward_std": float(statistics.pstdev(rewards)) if len(rewards) > 1 else 0.0,
        "response_len_mean": _mean([len(s.response_ids) for s in samples]),
        "samples": len(samples),
        "loss": r0["loss"],
        "grad_norm": r0["grad_norm"],
        "clipfrac": r0["clipfrac"],
        "train_rollout_logprob_abs_diff": r0["train_rollout_logprob_abs_diff"],
        "optimizer_step_seconds": max(r["optimizer_step_seconds"] for r in ranks),
        **timings,
        # what the ranks themselves spent moving memory (the *_seconds above are seen from the driver)
        "sleep_rank_seconds": max((s.get("seconds", 0.0) for s in sleep), default=0.0),
        "wake_rank_seconds": max((w.get("seconds", 0.0) for w in wake), default=0.0),
        "offload_bytes": int(sum(s.get("bytes", 0) for s in sleep if not s.get("skipped"))),
        "checkpoint": saved,
    }
    if "stream_bytes_read" in r0:
        read = [int(r["stream_bytes_read"]) for r in ranks]
        written = [int(r["stream_bytes_written"]) for r in ranks]
        wall = max(float(r["stream_seconds"]) for r in ranks)
        rec.update({
            "stream_bytes_read_per_rank": read,
            "stream_bytes_written_per_rank": written,
            "stream_read_gb": sum(read) / GB,
            "stream_written_gb": sum(written) / GB,
            "stream_seconds": wall,
            "stream_gbps": (sum(read) + sum(written)) / GB / wall if wall > 0 else 0.0,
            "stream_peak_resident_bytes": max(int(r["stream_peak_resident_bytes"]) for r in ranks),
            "stream_exposed_io_seconds": max(float(r["stream_io_seconds"]) for r in ranks),
            "stream_prefetched_buckets": min(int(r["stream_prefetched_buckets"]) for r in ranks),
        })
    return rec


def _format_line(rec: dict[str, Any], num_rollout: int) -> str:
    parts = [f"rollout {rec['rollout_id'] + 1}/{num_rollout}",
             f"reward {rec['reward_mean']:.3f}",
             f"loss {rec['loss']:+.4g}",
             f"step {rec['step_seconds']:.2f}s (gen {rec['generate_seconds']:.2f}s, train {rec['train_seconds']:.2f}s)"]
    if "stream_read_gb" in rec:
        parts.append(f"streamed {rec['stream_read_gb']:.3f} GB read + {rec['stream_written_gb']:.3f} GB written "
                     f"in {rec['stream_seconds']:.2f}s ({rec['stream_gbps']:.2f} GB/s)")
    parts.append(f"sleep {rec['sleep_seconds']:.2f}s wake {rec['wake_seconds']:.2f}s "
                 f"({rec['offload_bytes'] / GB:.3f} GB offloaded)")
    if rec.get("checkpoint"):
        parts.append(f"saving {rec['checkpoint']}")
    return " | ".join(parts)


def _teardown(args, train_group, rollout, pg, sink, started_ray, failed, remove_pg, actor_factory) -> None:
    import ray

    grace = 5.0 if failed else 60.0  # a failed run may have ranks stuck in a collective: do not wait long
    if train_group is not None:
        train_group.shutdown(timeout_s=grace)
    if rollout is not None:
        rollout.shutdown(timeout_s=grace)
    if pg is not None:
        remove_pg(pg)
    leftovers = actor_factory.remove_rank_dirs(args)
    dirs = actor_factory.rank_dirs(args)
    if leftovers:
        logger.info("removed directories the actors left behind: %s", ", ".join(leftovers))
    if dirs:
        logger.info("per-rank directories removed: %s", ", ".join(d for d in dirs if not os.path.exists(d)))
    if sink is not None:
        sink.close()
    if started_ray:
        ray.shutdown()


def _log_summary(args, summary: dict[str, Any]) -> None:
    recs = summary["records"]
    lines = ["run finished in %.1f s: %d rollout(s) (%s)" % (
        summary["seconds"], len(recs),
        f"rollouts {recs[0]['rollout_id']}..{recs[-1]['rollout_id']}" if recs else "nothing left to do")]
    if recs:
        lines.append("  reward: first %.3f, last %.3f; mean step %.2f s" % (
            recs[0]["reward_mean"], recs[-1]["reward_mean"], _mean(r["step_seconds"] for r in recs)))
        if "stream_read_gb" in recs[-1]:
            lines.append("  streamed optimizer state: %.3f GB read, %.3f GB written in total, last step %.2f GB/s" % (
                sum(r["stream_read_gb"] for r in recs), sum(r["stream_written_gb"] for r in recs),
                recs[-1]["stream_gbps"]))
    if summary["checkpoints"]:
        lines.append(f"  checkpoints: {', '.join(summary['checkpoints'])}")
        lines.append(f"  latest checkpoint: {summary['latest_checkpoint']} (resume with --load {args.save})")
    elif getattr(args, "save", None):
        lines.append(f"  no checkpoint written (--save {args.save}, --save-interval {getattr(args, 'save_interval', None)})")
    else:
        lines.append("  no checkpoints (--save not given)")
    lines.append(f"  metrics: {summary['metrics_file']}" +
                 (f", TensorBoard: {summary['tensorboard_dir']}" if summary.get("tensorboard_dir") else ""))
    logger.info("\n".join(lines))
