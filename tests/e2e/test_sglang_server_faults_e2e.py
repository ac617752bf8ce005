"""What a run does when the sglang server it drives (--sglang-url) fails, on a local Ray cluster (CPU) against
the stand-in server of tests/fakes: killed in the middle of a rollout's generate, too slow for
--sglang-request-timeout, or refusing a weight update. Each run stops with one line naming the server and what
went wrong, logs no traceback, and keeps its checkpoints: the one published before, and the one the trainer was
finishing in the background (published, since the trainer is well)."""

import logging
import os
import time

import pytest

pytestmark = pytest.mark.e2e

FAKES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fakes")


def _fake_module():
    import sys

    sys.path.insert(0, FAKES)
    try:
        import fake_sglang
    finally:
        sys.path.remove(FAKES)
    return fake_sglang


def _server(fault: str, model_path: str):
    """The stand-in server; ``fault`` strikes at the third generate (kill, slow) or weight update (refuse), the
    calls of the third rollout and of the second rollout's push. Weight payloads are acknowledged unread: they
    are references into the trainer's process."""
    fake_sglang = _fake_module()

    class FaultyEngine(fake_sglang.FakeSglangEngine):
        server = None
        generates = updates = 0

        def generate(self, **kwargs):
            self.generates += 1
            if self.generates == 3 and fault == "kill":
                self.server.httpd.shutdown()
                self.server.httpd.socket.close()  # no new connection from now on
                raise SystemExit  # the handler's thread ends: the connection closes unanswered
            if self.generates == 3 and fault == "slow":
                time.sleep(4)
            return super().generate(**kwargs)

        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            self.updates += 1
            if self.updates == 3 and fault == "refuse":
                return False, "weights rejected: " + "x" * 5000  # longer than an error line may be
            self.weights_defined = True
            return True, "Success"

    engine = FaultyEngine(model_path=model_path, random_seed=1)
    server = fake_sglang.FakeSglangServer(engine)
    engine.server = server
    return server


# what the line says, and how many rollouts completed: a generate fails in rollout 3, the refused update is
# rollout 2's push. Either way the save of rollout 2 was under way: its checkpoint is the last complete one.
EXPECTED = {
    "kill": (r"generate failed: the server dropped the connection before answering in full \(RemoteDisconnected", 2),
    "slow": (r"generate failed: no complete answer within --sglang-request-timeout 2 s", 2),
    "refuse": (r"update_weights_from_tensor failed: HTTP 400: weights rejected: x{1900,}\.\.\. \(5018 characters\)", 1),
}
CHECKPOINTS = 2


# the "kill" stand-in ends its handler's thread by SystemExit on purpose (the connection closes unanswered)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_a_failing_server_stops_the_run_in_one_line_and_keeps_the_checkpoints(ray_cluster, tmp_path, monkeypatch,
                                                                               caplog, fault):
    import re

    from miles import checkpoint, progress
    from miles.config import parse_args
    from miles.models import write_random_model
    from miles.preflight import validate_args
    from miles.train import RunError, run

    monkeypatch.syspath_prepend(FAKES)  # the driver's validation finds "sglang"
    monkeypatch.setenv("PYTHONPATH", FAKES + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                              else ""))  # and the train ranks build sglang's buckets with it
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.5)
    model = write_random_model(str(tmp_path / "model"), "llama-tiny", dtype="fp32")
    save = tmp_path / "save"
    with _server(fault, model) as server:
        config = validate_args(parse_args([
            "--rollout-engine", "sglang", "--sglang-url", server.url, "--sglang-request-timeout", "2",
            "--hf-checkpoint", model, "--num-train-ranks", "1", "--colocate",
            "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
            "--offload-train-disk-dir", str(tmp_path / "offload"), "--num-rollout", "3", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--micro-batch-size", "2",
            "--save", str(save), "--save-interval", "1", "--metrics-file", str(tmp_path / "metrics.jsonl")]))
        with caplog.at_level(logging.INFO, logger="miles"), pytest.raises(RunError) as ei:
            run(config)
    message, (pattern, done), checkpoints = str(ei.value), EXPECTED[fault], CHECKPOINTS
    assert "\n" not in message and len(message) < 2600, message
    assert message.startswith(f"run stopped: sglang server {server.url}: "), message
    assert re.search(pattern, message), message
    latest = checkpoint.checkpoint_path(str(save), checkpoints)
    assert message.endswith(f" ({done}/3 rollouts done; checkpoint {latest} is the last complete one)"), message
    assert "The actor's traceback" not in caplog.text and "Traceback" not in caplog.text
    # the checkpoint published last is whole and is the one a resume takes; nothing half-written is left
    assert checkpoint.resolve(str(save)) == latest
    assert checkpoint.read_meta(latest)["next_rollout_id"] == checkpoints
    assert sorted(os.listdir(save)) == sorted([checkpoint.LATEST_FILE] + [checkpoint.checkpoint_name(k)
                                                                          for k in range(1, checkpoints + 1)])
    if fault == "slow":  # while it waited, the run said on which server
        assert f"generate on rollout engine 0 (sglang server {server.url}): still waiting after" in caplog.text
