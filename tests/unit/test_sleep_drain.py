"""Sleep and the streamed state's disk writes: by default the trainer's sleep waits only for the copies
off the device (release_device) and the write-backs land during generation; with
--stream-optimizer-state-flush-at-sleep it waits for the disk (flush). Either way the wait is counted
in the rollout's exposed optimizer I/O."""

from types import SimpleNamespace

import pytest

from miles.backends.sleep import settle_store_for_sleep
from miles.metrics import format_rollout_line, rollout_record


class _Store:
    def __init__(self):
        self.calls = []

    def flush(self):
        self.calls.append("flush")

    def release_device(self):
        self.calls.append("release_device")


@pytest.mark.parametrize("flush, call", [(False, "release_device"), (True, "flush")])
def test_sleep_settles_the_store_as_configured(flush, call):
    store = _Store()
    out = settle_store_for_sleep(store, flush)
    assert store.calls == [call] and out["store_wait_seconds"] >= 0


def test_no_store_no_wait():
    assert settle_store_for_sleep(None, True) == {}


def test_flag_reaches_the_config(make_config):
    on = make_config("--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
                     "--stream-optimizer-state-flush-at-sleep")
    assert on.optimizer.stream_optimizer_state_flush_at_sleep is True


def test_flag_without_streaming_is_rejected(make_config):
    with pytest.raises(Exception, match="stream-optimizer-state-flush-at-sleep"):
        make_config("--stream-optimizer-state-flush-at-sleep")


def test_exposed_io_per_rollout_adds_the_sleep_wait():
    rank = {"loss": 0.0, "grad_norm": 0.0, "clipfrac": 0.0, "train_rollout_logprob_abs_diff": 0.0,
            "host_rss_peak_bytes": 2 << 30, "optimizer_step_seconds": 1.0, "forward_backward_seconds": 0.5, "train_seconds": 1.6,
            "stream_bytes_read": 10, "stream_bytes_written": 10,
            "stream_seconds": 1.0, "stream_io_seconds": 0.25, "stream_peak_resident_bytes": 1,
            "stream_prefetched_buckets": 0, "stream_disk_bytes_read": 4 << 30, "stream_disk_bytes_written": 6 << 30,
            "stream_tier_fill_bytes": 0, "stream_ram_state_bytes": 0, "stream_disk_state_bytes": 20}
    sleep = [{"rank": 0, "bytes": 1, "seconds": 0.1, "store_wait_seconds": 0.5}]
    samples = [SimpleNamespace(response_ids=[1, 2])]
    rec = rollout_record(0, [1.0], samples, [rank], wake=[], sleep=sleep,
                         timings={"step_seconds": 2.0, "generate_seconds": 0.5, "train_seconds": 1.0,
                                  "sleep_seconds": 0.6, "wake_seconds": 0.1},
                         saved=None)
    assert rec["stream_sleep_wait_seconds"] == 0.5
    assert rec["stream_exposed_io_per_rollout_seconds"] == 0.75
    assert "(disk 4.29+6.44)" in format_rollout_line(rec, 1) and rec["stream_tier_fill_gb"] == 0


@pytest.mark.parametrize("flush, call", [(False, "release_device"), (True, "flush")])
def test_megatron_store_set_settles_every_store(flush, call):
    """The megatron trainer's stores (one per chained optimizer member) take the same sleep call: the
    flush arm once failed on the H200 because the set had lost its flush()."""
    from miles_plugins.optimizers.nvme_stream import StoreGroup

    stores = [_Store(), _Store()]
    settle_store_for_sleep(StoreGroup(stores), flush)
    assert [s.calls for s in stores] == [[call], [call]]


def test_stream_metrics_sum_the_stores_of_a_rank():
    """One function gives both backends their stream_* metrics: sums over the stores, the largest peak."""
    from miles.backends.step import stream_step_metrics

    def store(read, peak, ram):
        last = SimpleNamespace(bytes_read=read, bytes_written=2 * read, wall_seconds=1.0, io_seconds=0.5,
                               buckets=3, prefetched_buckets=1, disk_bytes_read=read - 1, disk_bytes_written=read,
                               tier_fill_bytes=1)
        return SimpleNamespace(stats=SimpleNamespace(last_step=last, peak_resident_bytes=peak, state_bytes=100,
                                                     ram_state_bytes=ram))

    m = stream_step_metrics([store(10, 7, 100), store(5, 9, 40)])
    assert m["stream_bytes_read"] == 15 and m["stream_bytes_written"] == 30 and m["stream_buckets"] == 6
    assert m["stream_io_seconds"] == 1.0 and m["stream_peak_resident_bytes"] == 9
    assert m["stream_disk_bytes_read"] == 13 and m["stream_disk_bytes_written"] == 15 and m["stream_tier_fill_bytes"] == 2
    assert m["stream_ram_state_bytes"] == 140 and m["stream_disk_state_bytes"] == 60  # where the state lives
