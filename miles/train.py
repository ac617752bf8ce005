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

import logging
import os
import time
from typing import Any, Optional

from miles import checkpoint
from miles.metrics import MetricsSink, format_rollout_line, log_summary, rollout_record

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

        sink = MetricsSink(metrics_path, getattr(args, "tensorboard_dir", None))
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
    log_summary(args, summary)
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
            record = rollout_record(rollout_id, rewards, samples, ranks, wake, sleep, timings, saved)
            sink.write(record)
            summary["records"].append(record)
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:+.3g}")
            logger.info(format_rollout_line(record, num_rollout))
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
