"""Actor lines travel with the call's reply and are logged by the driver in order (no Ray: the actor's
handler and the driver's re-emit, in one process)."""

import logging

import pytest


class _Stderr:
    """What the actor printed to stderr so far (the logging handler writes to the current sys.stderr)."""

    def __init__(self, capsys):
        self.capsys = capsys
        self.text = ""

    def getvalue(self) -> str:
        self.text += self.capsys.readouterr().err
        return self.text


@pytest.fixture()
def actor_logs(capsys):
    from miles.logging_setup import configure_logging
    from miles.ray.actor_logs import ActorLogs

    configure_logging("INFO")
    logs = ActorLogs("rank 0")
    try:
        yield logs, _Stderr(capsys)
    finally:
        logs.close()


def _work(n):
    logging.getLogger("miles.models").info("policy model: tiny %d", n)
    logging.getLogger("miles_plugins.optimizers.streaming.store").info("optimizer step %d streamed", n)
    logging.getLogger("miles.checkpoint").warning("disk nearly full")
    return n * 2


def test_a_calls_info_lines_come_back_with_its_result_and_are_not_printed_by_the_actor(actor_logs):
    logs, stderr = actor_logs
    reply = logs.call(_work, 3)
    assert reply.result == 6 and reply.label == "rank 0"
    assert [line.message for line in reply.lines] == ["policy model: tiny 3", "optimizer step 3 streamed"]
    assert [line.name for line in reply.lines] == ["miles.models", "miles_plugins.optimizers.streaming.store"]
    printed = stderr.getvalue()
    assert "policy model" not in printed and "streamed" not in printed
    assert "WARNING miles.checkpoint: disk nearly full" in printed  # warnings still print at once


def test_lines_outside_a_call_print_as_before(actor_logs):
    logs, stderr = actor_logs
    logging.getLogger("miles.models").info("constructor line")
    assert "constructor line" in stderr.getvalue()
    logs.call(_work, 1)
    logging.getLogger("miles.models").info("after the call")
    assert "after the call" in stderr.getvalue()


def test_a_call_that_raises_prints_the_lines_it_kept(actor_logs):
    logs, stderr = actor_logs

    def failing():
        logging.getLogger("miles.checkpoint").info("saving rank 0 part")
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        logs.call(failing)
    assert "INFO miles.checkpoint: saving rank 0 part" in stderr.getvalue()


def test_the_driver_logs_every_actors_lines_in_time_order_with_label_and_own_time(caplog):
    from miles.ray.actor_logs import ActorLine, ActorReply, emit_lines

    rank0 = ActorReply(None, "rank 0", (ActorLine(100.0, logging.INFO, "miles.models", "policy model: a"),
                                        ActorLine(102.5, logging.INFO, "miles.checkpoint", "saving b")))
    rank1 = ActorReply(None, "rank 1", (ActorLine(101.0, logging.INFO, "miles.models", "policy model: c"),))
    with caplog.at_level(logging.INFO, logger="miles"):
        emit_lines([rank0, rank1])
    assert [r.getMessage() for r in caplog.records] == ["[rank 0] policy model: a", "[rank 1] policy model: c",
                                                         "[rank 0] saving b"]
    assert [r.created for r in caplog.records] == [100.0, 101.0, 102.5]
    assert [r.name for r in caplog.records] == ["miles.models", "miles.models", "miles.checkpoint"]
    assert caplog.records[2].msecs == pytest.approx(500.0)


def test_unwrap_replies_returns_results_and_passes_plain_values_through(caplog):
    from miles.ray.actor_logs import ActorLine, ActorReply, unwrap_replies

    reply = ActorReply({"loss": 1.0}, "engine 0", (ActorLine(1.0, logging.INFO, "miles.rollout", "generated"),))
    with caplog.at_level(logging.INFO, logger="miles"):
        assert unwrap_replies([reply, 7]) == [{"loss": 1.0}, 7]
    assert [r.getMessage() for r in caplog.records] == ["[engine 0] generated"]


def test_an_actor_and_the_driver_in_one_round_trip(actor_logs, caplog):
    from miles.ray.actor_logs import unwrap_replies

    logs, _ = actor_logs
    reply = logs.call(_work, 5)
    with caplog.at_level(logging.INFO, logger="miles"):
        assert unwrap_replies([reply]) == [10]
    assert "[rank 0] policy model: tiny 5" in [r.getMessage() for r in caplog.records]


def test_the_actor_methods_the_driver_calls_report_their_lines():
    from miles.ray.rollout_manager import RolloutEngineActor
    from miles.ray.train_actor import TrainActor

    driver_called = {TrainActor: ["info", "rendezvous", "init", "train", "join_weight_group", "push_weights", "save",
                                  "finish_save", "load", "sleep", "wake", "shutdown"],
                     RolloutEngineActor: ["info", "generate", "release_memory_occupation",
                                          "resume_memory_occupation", "begin_weight_update", "end_weight_update",
                                          "init_weights_update_group", "close"]}
    for cls, names in driver_called.items():
        plain = [n for n in names if not hasattr(getattr(cls, n), "__wrapped__")]
        assert not plain, f"{cls.__name__} methods that return without their log lines: {plain}"
    # called by other actors (the train ranks), whose callers want the plain result
    assert not hasattr(RolloutEngineActor.update_weights_from_tensor, "__wrapped__")
    assert not hasattr(RolloutEngineActor.update_weights_from_distributed, "__wrapped__")
