"""A step that would poison the policy is not applied: non-finite grads, or engine output that is not valid
training input (a NaN / infinite / positive log-prob, a token id outside the vocabulary). Weights and
optimizer state stay bit for bit what they were (the streamed state's bucket files included), the metrics
say why, and --max-consecutive-skipped-steps skips in a row stop the run."""

import glob
import math
import os
from types import SimpleNamespace

import pytest
import torch

from miles.backends.torch_backend.trainer import TorchTrainer
from miles.metrics import ROLLOUT_LINE_WIDTH, format_rollout_line
from miles.rl.loss import training_input_problem
from miles.train import SkippedStepsError, _Loop
from test_trainer_checkpoint import _args, _rendezvous, _same, trainers  # noqa: F401  (trainers: a fixture)
from test_trainer_checkpoint import _samples as trainer_samples


def _samples(logprob=-4.0):
    samples, advantages = trainer_samples()
    samples[2].response_logprobs[1] = logprob
    return samples, advantages


def _state(trainer):
    """Weights, fp32 masters and resident moments, cloned."""
    tensors = [v.detach().clone() for v in trainer.engine.model.state_dict().values()]
    opt = trainer.engine.optimizer
    tensors += [s.master.detach().clone() for s in opt.shards if s.master.untyped_storage().nbytes()]
    tensors += [v.detach().clone() for st in opt.inner.state.values() for v in st.values() if torch.is_tensor(v)]
    return tensors


def _bucket_files(trainer, tmp_path) -> dict[str, bytes]:
    trainer.store.flush()
    paths = sorted(glob.glob(os.path.join(tmp_path, "offload", "**", "bucket*.bin"), recursive=True))
    assert paths, "the streamed state's bucket files"
    return {p: open(p, "rb").read() for p in paths}


def _trainer(trainers, tmp_path, stream: bool) -> TorchTrainer:
    extra = ("--stream-optimizer-state-to-disk", "--offload-train-target", "disk") if stream else ()
    os.makedirs(tmp_path / "offload", exist_ok=True)
    t = TorchTrainer(_args(tmp_path, *extra), rank=0, world_size=1, rank_dir=str(tmp_path / "rank"))
    trainers.append(t)
    t.init(_rendezvous())
    return t


@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streamed"])
def test_non_finite_grads_leave_weights_and_state_untouched(tmp_path, trainers, stream):
    t = _trainer(trainers, tmp_path, stream)
    samples, adv = _samples()
    t.train(0, samples, adv)  # moments exist from here on
    before = _state(t)
    files = _bucket_files(t, tmp_path) if stream else None

    good_logprobs = t.engine.logprobs
    t.engine.logprobs = lambda batch, temperature: good_logprobs(batch, temperature) * float("nan")
    m = t.train(1, samples, adv)
    t.engine.logprobs = good_logprobs

    assert m["step_skipped"] == "non-finite gradients" and math.isnan(m["grad_norm"])
    assert _same(_state(t), before), "a skipped step changed weights or optimizer state"
    assert all(p.grad is None for p in t.engine.model.parameters()), "the poisoned grads are dropped"
    if stream:
        assert _bucket_files(t, tmp_path) == files, "a skipped step changed the streamed state's files"
        assert m["stream_bytes_read"] == 0 and m["stream_bytes_written"] == 0
    after = t.train(2, samples, adv)
    assert after["step_skipped"] is None and math.isfinite(after["grad_norm"])
    assert all(torch.isfinite(p).all() for p in t.engine.model.parameters())


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), 1e30])
def test_invalid_engine_log_prob_is_not_trained_on(tmp_path, trainers, bad):
    t = _trainer(trainers, tmp_path, stream=False)
    samples, adv = _samples()
    t.train(0, samples, adv)
    before = _state(t)
    bad_samples, _ = _samples(logprob=bad)
    m = t.train(1, bad_samples, adv)
    assert m["step_skipped"].startswith("rank 0: sample 2: rollout log-prob of response token 1 is")
    assert math.isnan(m["loss"]) and m["forward_backward_seconds"] < 1.0
    assert _same(_state(t), before)


def test_token_outside_the_vocabulary_is_not_trained_on(tmp_path, trainers):
    t = _trainer(trainers, tmp_path, stream=False)
    samples, adv = _samples()
    before = _state(t)
    samples[1].response_ids[0] = t.engine.vocab_size()
    m = t.train(0, samples, adv)
    assert f"response_ids[0] = {t.engine.vocab_size()} is not a token id" in m["step_skipped"]
    assert _same(_state(t), before)


def _sample(prompt=(1, 2), response=(3, 4), logprobs=(-1.0, -0.5)):
    return SimpleNamespace(prompt_ids=list(prompt), response_ids=list(response), response_logprobs=list(logprobs))


def test_training_input_problem_names_the_first_bad_value():
    assert training_input_problem([_sample(), _sample(logprobs=(0.0, -3.0))], [1.0, -1.0], vocab_size=5) is None
    cases = [
        (_sample(logprobs=(-1.0, float("nan"))), "rollout log-prob of response token 1 is nan"),
        (_sample(logprobs=(float("inf"), -1.0)), "response token 0 is inf"),
        (_sample(logprobs=(-1.0, 1e-3)), "response token 1 is 0.001"),
        (_sample(logprobs=(-1.0,)), "1 rollout log-probs for 2 response tokens"),
        (_sample(response=(3, 5)), "response_ids[1] = 5 is not a token id of the vocabulary (0..4)"),
        (_sample(prompt=(-1, 2)), "prompt_ids[0] = -1 is not a token id"),
        (_sample(prompt=(1, 2.0)), "prompt_ids[1] = 2.0 is not a token id"),
    ]
    for bad, message in cases:
        problem = training_input_problem([_sample(), bad], [1.0, -1.0], vocab_size=5)
        assert problem is not None and problem.startswith("sample 1: ") and message in problem, (message, problem)
    problem = training_input_problem([_sample()], [float("nan")], vocab_size=5)
    assert problem == "sample 0: advantage is nan (finite expected; are the rewards finite?)"


def _record(rollout_id, skipped):
    return {"rollout_id": rollout_id, "step_skipped": skipped}


def test_consecutive_skips_stop_the_run_and_an_applied_step_resets_the_count():
    loop = _Loop.__new__(_Loop)
    loop.config = SimpleNamespace(training=SimpleNamespace(max_consecutive_skipped_steps=2))
    loop.skipped_in_a_row = 0
    loop.count_skipped_step(_record(0, "non-finite gradients"))
    loop.count_skipped_step(_record(1, None))
    loop.count_skipped_step(_record(2, "non-finite gradients"))
    with pytest.raises(SkippedStepsError, match=r"2 rollouts in a row skipped their optimizer step \(the last, "
                                                r"rollout 3: non-finite gradients\); weights and optimizer state "
                                                r"are unchanged since rollout 2 began"):
        loop.count_skipped_step(_record(3, "non-finite gradients"))


def test_max_consecutive_skipped_steps_is_validated(tmp_path):
    assert _args(tmp_path).training.max_consecutive_skipped_steps == 3
    from miles.config import ArgumentError

    with pytest.raises(ArgumentError, match="--max-consecutive-skipped-steps"):
        _args(tmp_path, "--max-consecutive-skipped-steps", "0")


def test_the_rollout_line_says_the_step_was_skipped():
    rec = {"rollout_id": 4, "reward_mean": 0.25, "loss": float("nan"), "train_seconds": 0.1,
           "forward_backward_seconds": 0.0, "optimizer_step_seconds": 0.0, "other_seconds": 0.1,
           "generate_seconds": 1.0, "sleep_seconds": 0.2, "wake_seconds": 0.3, "step_seconds": 1.7,
           "stream_read_gb": 0.0, "stream_written_gb": 0.0, "stream_disk_read_gb": 0.0, "stream_disk_written_gb": 0.0,
           "step_skipped": "rank 3: sample 17: rollout log-prob of response token 120 is nan (a finite number "
                           "<= 0 expected)", "checkpoint": "/ckpt/iter_5"}
    line = format_rollout_line(rec, 10)
    assert "STEP SKIPPED: rank 3: sample 17: rollout log-prob" in line and "streamed" not in line
    assert line.endswith("| saved") and len(line) <= ROLLOUT_LINE_WIDTH, line


# ---- a step that leaves non-finite weights ------------------------------------------------------------


def _infinite_lr(trainer):
    """What --lr inf did before validation refused it: the next applied step turns every weight into NaN."""
    for group in trainer.engine.optimizer.param_groups:
        group["lr"] = float("inf")


@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streamed"])
def test_a_step_that_leaves_non_finite_weights_reaches_no_checkpoint_or_engine(tmp_path, trainers, stream):
    from miles.backends.rank import NonFiniteWeightsError

    t = _trainer(trainers, tmp_path, stream)
    samples, adv = _samples()
    assert t.train(0, samples, adv)["weights_finite"] is True
    _infinite_lr(t)
    m = t.train(1, samples, adv)
    assert m["step_skipped"] is None and m["weights_finite"] is False
    assert not all(torch.isfinite(p).all() for p in t.engine.model.parameters()), "the injected step did poison"
    with pytest.raises(NonFiniteWeightsError, match=r"rank 0: rollout 1's optimizer step left non-finite weights; "
                                                    r"refusing to save them"):
        t.save(str(tmp_path / "ckpt" / "iter_2"))
    assert not os.path.exists(tmp_path / "ckpt"), "nothing of the checkpoint was written"
    with pytest.raises(NonFiniteWeightsError, match="refusing to hand them to the rollout engines"):
        t.push_weights([], [], payload="hf", tp_size=1)
    with pytest.raises(NonFiniteWeightsError, match="refusing to train on them"):
        t.train(2, samples, adv)


def test_the_weight_check_covers_every_trained_weight_in_slices(monkeypatch):
    from miles.backends import engine

    monkeypatch.setattr(engine, "_FINITE_CHECK_ELEMENTS", 3)  # slices of 3: the bad element sits in a later one
    weights = [torch.zeros(2, 4), torch.zeros(7)]
    assert engine.tensors_finite(weights, torch.device("cpu"))
    for value in (float("nan"), float("inf"), float("-inf")):
        weights[1][5] = value
        assert not engine.tensors_finite(weights, torch.device("cpu")), value
        weights[1][5] = 0.0
    assert engine.tensors_finite([], torch.device("cpu"))


def _loop_after(records, latest=None, loaded=None, save=None, load=None, lr=1e-2):
    """A _Loop whose run recorded ``records`` (its state as the driver keeps it), without Ray."""
    from miles.run_lifecycle import RunState

    loop = _Loop.__new__(_Loop)
    loop.config = SimpleNamespace(optimizer=SimpleNamespace(lr=lr),
                                  checkpoint=SimpleNamespace(save=save, load=load),
                                  training=SimpleNamespace(max_consecutive_skipped_steps=10))
    loop.state = RunState(run_dir="/run", metrics_file="/run/m.jsonl", records=list(records),
                          latest_checkpoint=latest, loaded_checkpoint=loaded)
    loop.pending = None
    loop.skipped_in_a_row = 0
    return loop


def _rank(finite, grad_norm=0.5):
    return {"weights_finite": finite, "grad_norm": grad_norm, "step_skipped": None}


def test_non_finite_weights_stop_the_run_naming_the_rollout_and_the_good_checkpoint():
    from miles.train import NonFiniteStepError

    loop = _loop_after([], latest="/ckpt/iter_2", save="/ckpt", lr=3.0)
    loop.stop_if_weights_not_finite(2, [_rank(True), _rank(True)])  # a good step goes on
    with pytest.raises(NonFiniteStepError) as e:
        loop.stop_if_weights_not_finite(2, [_rank(False, float("inf")), _rank(False, float("inf"))])
    assert str(e.value) == (
        "rollout 2: the optimizer step left non-finite weights (NaN or inf; grad norm inf); they were not saved or "
        "handed to the rollout engines. the latest checkpoint, /ckpt/iter_2, holds the weights before it: resume "
        "with --load /ckpt and a lower --lr (now 3), or check the rewards and --clip-grad")
    fresh = _loop_after([], lr=3.0)
    with pytest.raises(NonFiniteStepError, match="no checkpoint holds earlier weights of this run: start again with "
                                                 r"a lower --lr \(now 3\)"):
        fresh.stop_if_weights_not_finite(0, [_rank(False)])
    resumed = _loop_after([], loaded="/old/iter_4", load="/old")
    with pytest.raises(NonFiniteStepError, match="the latest checkpoint, /old/iter_4, .* --load /old "):
        resumed.stop_if_weights_not_finite(5, [_rank(False)])


def test_the_checkpoint_copying_from_before_a_non_finite_step_is_published_first(monkeypatch):
    from miles import train
    from miles.train import NonFiniteStepError

    published = []
    monkeypatch.setattr(train, "_publish", lambda config, group, pending, state: (
        published.append(pending["base"]), setattr(state, "latest_checkpoint", pending["base"])))
    loop = _loop_after([], latest="/ckpt/iter_1", save="/ckpt")
    loop.train_group = None
    loop.pending = {"base": "/ckpt/iter_2", "completed": 2}
    with pytest.raises(NonFiniteStepError, match="the latest checkpoint, /ckpt/iter_2, holds the weights before it"):
        loop.stop_if_weights_not_finite(2, [_rank(False)])
    assert published == ["/ckpt/iter_2"] and loop.pending is None


def test_a_run_whose_every_step_was_skipped_does_not_end_as_if_it_trained():
    all_skipped = [_record(0, "non-finite gradients"), _record(1, "rank 0: sample 3: advantage is nan")]
    with pytest.raises(SkippedStepsError) as e:
        _loop_after(all_skipped).stop_if_nothing_trained()
    assert str(e.value) == (
        "none of this run's 2 rollout(s) applied an optimizer step (the last, rollout 1: rank 0: sample 3: advantage "
        "is nan); the weights are the ones the run started from. Check the rollout engine's log-probs and the "
        "rewards, or lower --lr")
    _loop_after([_record(0, "non-finite gradients"), _record(1, None)]).stop_if_nothing_trained()  # one applied
    _loop_after([]).stop_if_nothing_trained()  # nothing left to do (a finished run resumed) is no failure


def test_the_run_summary_counts_applied_and_skipped_steps(caplog):
    import logging

    from miles.metrics import log_summary
    from miles.run_lifecycle import RunState

    records = [{"rollout_id": i, "reward_mean": 0.5, "step_seconds": 1.0, "step_skipped": skipped}
               for i, skipped in enumerate([None, "non-finite gradients", None])]
    state = RunState(run_dir="/run", metrics_file="/run/m.jsonl", records=records, seconds=3.0)
    config = SimpleNamespace(checkpoint=SimpleNamespace(save=None, save_interval=None))
    with caplog.at_level(logging.INFO, logger="miles"):
        log_summary(config, state)
    assert "\n  optimizer steps: 2 applied, 1 skipped\n" in caplog.text


@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_checkpoint_holding_non_finite_weights_is_refused_at_load(tmp_path, trainers, stream, bad):
    """What an older version saved after a diverged step: the load names the checkpoint and the way out, while the
    checkpoint before it loads."""
    from miles import checkpoint

    old = _trainer(trainers, tmp_path / "old", stream)
    old.train(0, *_samples())
    good = checkpoint.prepare(str(tmp_path / "ckpt"), 1)
    old.save(good)
    checkpoint.write_meta(good, next_rollout_id=1, data_state={}, world_size=1)
    with torch.no_grad():
        next(old.engine.model.parameters()).view(-1)[3] = bad
    base = checkpoint.prepare(str(tmp_path / "ckpt"), 2)
    old.save(base)  # this trainer never saw the step that made the value, so it saves it
    checkpoint.write_meta(base, next_rollout_id=2, data_state={}, world_size=1)
    old.shutdown()

    new = _trainer(trainers, tmp_path / "new", stream)
    assert new.load(good, load_optimizer=True)["optimizer"] in ("state_dict", "streamed")
    with pytest.raises(checkpoint.CheckpointError) as e:
        new.load(base, load_optimizer=True)
    assert str(e.value) == (
        f"{base} holds non-finite model weights (NaN or inf, as loaded on train rank(s) 0): it was saved after a step "
        "that diverged. Resume from an earlier checkpoint (--load <its folder>) with a lower --lr, or start without "
        "--load")
