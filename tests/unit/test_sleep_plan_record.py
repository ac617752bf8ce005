"""The rollout record and line say what each sleep and wake moved, and from where."""

from types import SimpleNamespace

from miles.metrics import ROLLOUT_LINE_WIDTH, format_rollout_line, rollout_record

GB = 10**9


def _rank():
    return {"loss": -0.0123456, "grad_norm": 1.0, "clipfrac": 0.0, "train_rollout_logprob_abs_diff": 0.0,
            "host_rss_peak_bytes": 2 << 30, "forward_backward_seconds": 20.45, "optimizer_step_seconds": 9.37,
            "train_seconds": 30.6,
            "stream_bytes_read": 123 << 30, "stream_bytes_written": 123 << 30, "stream_disk_bytes_read": 100 << 30,
            "stream_disk_bytes_written": 100 << 30, "stream_tier_fill_bytes": 0, "stream_seconds": 50.0,
            "stream_io_seconds": 10.0, "stream_peak_resident_bytes": 1, "stream_prefetched_buckets": 2,
            "stream_ram_state_bytes": 3 << 30, "stream_disk_state_bytes": 1 << 30}


def _record(sleep, wake):
    timings = {"generate_seconds": 40.2, "train_seconds": 31.2, "sleep_seconds": 5.61, "wake_seconds": 4.27,
               "step_seconds": 95.3}
    handoff = [{"weight_handoff_seconds": 1.234, "weight_handoff_bytes": 1, "weight_handoff_buckets": 1,
                "weight_handoff_largest_bucket_bytes": 1, "weight_handoff_through_host": False}]
    return rollout_record(99, [1.0], [SimpleNamespace(response_ids=[1])], [_rank(), _rank()], wake, sleep,
                          timings, "/ckpt/rollout_000100", handoff)


def test_record_sums_the_ranks_split_by_source():
    sleep = [{"rank": r, "plan": "auto", "moved_bytes": 3 * GB, "kept_bytes": 1 * GB, "discarded_bytes": 0,
              "to_ram_bytes": 2 * GB, "to_disk_bytes": 1 * GB, "released_for_engine_bytes": 0,
              "released_for_masters_bytes": 18 * GB, "plan_notes": ["engine copy not used: sglang"],
              "grad_bytes_dropped": 4 * GB, "plan_shortfall_bytes": 0} for r in range(2)]
    wake = [{"rank": r, "moved_bytes": 21 * GB, "from_ram_bytes": 2 * GB, "from_disk_bytes": 1 * GB,
             "rebuilt_from_engine_bytes": 0, "rebuilt_from_masters_bytes": 18 * GB} for r in range(2)]
    rec = _record(sleep, wake)
    assert rec["sleep_moved_bytes"] == 6 * GB and rec["wake_moved_bytes"] == 42 * GB
    assert rec["sleep_to_ram_bytes"] == 4 * GB and rec["sleep_to_disk_bytes"] == 2 * GB
    assert rec["sleep_kept_bytes"] == 2 * GB and rec["sleep_discarded_bytes"] == 8 * GB
    assert rec["wake_rebuilt_from_masters_bytes"] == 36 * GB and rec["wake_rebuilt_from_engine_bytes"] == 0
    assert rec["sleep_plan"] == "auto" and rec["sleep_plan_notes"] == ["engine copy not used: sglang"]
    line = format_rollout_line(rec, 1000)  # everything on: no room for the sources, nor the bytes
    assert len(line) <= ROLLOUT_LINE_WIDTH and "sleep 5.61 wake 4.27" in line, (len(line), line)
    rec.pop("checkpoint")
    rec.pop("stream_read_gb")
    assert "sleep 5.61 (6.00 GB) wake 4.27 (42.0 GB)" in format_rollout_line(rec, 1000)  # room for the bytes
    rec.pop("weight_handoff_seconds")
    rec.update(sleep_to_ram_bytes=6 * GB, sleep_to_disk_bytes=0, wake_from_ram_bytes=6 * GB, wake_from_disk_bytes=0)
    line = format_rollout_line(rec, 1000)  # room for the bytes and where they went
    assert "sleep 5.61 (6.00 GB ram) wake 4.27 (42.0 GB masters 36.0 ram 6.00)" in line
    assert len(line) <= ROLLOUT_LINE_WIDTH, (len(line), line)


def test_nothing_moved_says_zero_and_offload_all_says_its_target():
    kept = [{"rank": 0, "plan": "auto", "moved_bytes": 0, "kept_bytes": 5 * GB}]
    rec = _record(kept, [{"rank": 0, "moved_bytes": 0}])
    assert rec["sleep_moved_bytes"] == 0 == rec["wake_moved_bytes"] and rec["sleep_kept_bytes"] == 5 * GB
    forced = _record([{"rank": 0, "plan": "offload-all", "moved_bytes": 2 * GB, "to_disk_bytes": 2 * GB}],
                     [{"rank": 0, "moved_bytes": 2 * GB, "from_disk_bytes": 2 * GB}])
    for key in ("checkpoint", "stream_read_gb", "weight_handoff_seconds"):  # room on the line
        rec.pop(key)
        forced.pop(key)
    assert "sleep 5.61 (0.00 GB) wake 4.27 (0.00 GB)" in format_rollout_line(rec, 1000)
    assert "sleep 5.61 (2.00 GB disk) wake 4.27 (2.00 GB disk)" in format_rollout_line(forced, 1000)


def _bench_record(**moved):
    rec = {"samples": 4, "response_len_mean": 10.0, "generate_seconds": 2.0, "train_seconds": 1.5,
           "forward_backward_seconds": 1.0, "optimizer_step_seconds": 0.2, "train_rank_seconds": 1.3,
           "other_seconds": 0.1, "weight_sync_seconds": 0.2, "weight_handoff_seconds": 0.1,
           "weight_handoff_bytes": 4e9, "weight_handoff_buckets": 8, "offload_bytes": 0, "sleep_seconds": 0.01,
           "wake_seconds": 0.5, "engine_release_seconds": 0.1, "engine_resume_seconds": 0.1, "step_seconds": 6.0}
    for phase, keys in (("sleep", ("moved_bytes", "to_ram_bytes", "to_disk_bytes")),
                        ("wake", ("moved_bytes", "from_ram_bytes", "from_disk_bytes", "masters_read_bytes",
                                  "rebuilt_from_masters_bytes", "rebuilt_from_engine_bytes"))):
        for key in keys:
            rec[f"{phase}_{key}"] = moved.get(f"{phase}_{key}", 0)
    return rec


def test_bench_floors_are_the_bytes_the_plan_moved_over_their_links():
    from miles.bench.rl import format_report, phase_report

    rates = {"device_copy": 2e12, "d2h_pinned": 50e9, "h2d_pinned": 25e9, "disk_write": 2e9, "disk_read": 1e9}
    kept = phase_report([_bench_record()], "disk", rates)
    assert kept["sleep"]["floor"] == 0 and kept["wake"]["floor"] == 0 and kept["sleep"]["ratio"] is None
    rec = _bench_record(sleep_moved_bytes=3e9, sleep_to_ram_bytes=1e9, sleep_to_disk_bytes=2e9,
                        wake_moved_bytes=5e9, wake_from_ram_bytes=1e9, wake_from_disk_bytes=2e9,
                        wake_rebuilt_from_masters_bytes=2e9, wake_masters_read_bytes=4e9)
    report = phase_report([rec], "disk", rates)
    assert report["sleep"]["floor"] == 1e9 / 50e9 + 2e9 / 2e9
    assert report["wake"]["floor"] == 1e9 / 25e9 + 2e9 / 1e9 + 4e9 / 25e9  # masters: their fp32 bytes over PCIe
    assert report["wake"]["bytes"] == 5e9
    text = format_report({"model": "m", "backend": "torch", "workload": "w", "rates": rates,
                          "arms": [{"arm": "stream", "rollouts": 2, "reward_first": 0.0, "reward_last": 0.0,
                                    "phases": report},
                                   {"arm": "kept", "rollouts": 2, "reward_first": 0.0, "reward_last": 0.0,
                                    "phases": kept}]})
    assert "(5.000 GB moved: ram 1.000, disk 2.000, masters 4.000 GB)" in text
    assert "floor   0.000 s  ratio      -  (0.000 GB moved)" in text
