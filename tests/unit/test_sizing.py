"""`miles plan`: the reference configurations' published figures, agreement with a real store's plan, the step
floor of the H200 bench, and the errors users see. CPU only; no Ray, no GPU."""

import json

import pytest
import torch

from miles.sizing.cli import disk_speeds_from_bench, main
from miles.sizing.estimate import GB, GIB, Hardware, SizingError, Training, estimate
from miles.sizing.model_params import model_tensors
from miles.sizing.presets import PRESETS, QWEN3_30B_A3B
from miles.sizing.sharding import LayoutError, Parallelism, rank_shards, stage_tensors
from miles.sizing.store_plan import plan_store
from miles.sizing.tensors import flat_model
from miles_plugins.optimizers.nvme_stream import DEFAULT_BUCKET_NUMEL, stream_optimizer_state


def within(value, published, tolerance):
    return abs(value - published) <= tolerance * published


def glm(mtp=True):
    model = model_tensors(PRESETS["glm5-744b"], "glm5-744b", tp=8, mtp=mtp)
    # GB300 trays hold 4 GPUs: 8 nodes x 4 = the 32 ranks of TP8 x PP4 x DP1. 78 layers over 4 stages: Megatron's
    # uneven first/last counts (the first stage's 3 dense layers are light, the last carries MTP).
    par = Parallelism(tp=8, pp=4, dp=1, ep=8, first_stage_layers=22, last_stage_layers=18)
    return estimate(model, par, Hardware(nodes=8, gpus_per_node=4, hbm_gb=276.6))


def qwen35(gpus, moment_dtype="fp32"):
    """The published run's stores: buckets of the store's default size, DEFAULT_BUCKET_NUMEL elements (given
    explicitly: left to the store, it fits smaller ones to its default device budget)."""
    model = model_tensors(PRESETS["qwen3.5-35b-a3b"], "qwen3.5-35b-a3b")
    return estimate(model, Parallelism(dp=gpus, ep=gpus), Hardware(nodes=1, gpus_per_node=gpus, hbm_gb=141),
                    Training(moment_dtype=moment_dtype, bucket_numel=DEFAULT_BUCKET_NUMEL))


# ---- architectures -----------------------------------------------------------------------------------------
def test_preset_totals_match_the_published_sizes():
    assert within(model_tensors(PRESETS["glm5-744b"], mtp=False).total(), 744e9, 0.01)
    assert within(model_tensors(QWEN3_30B_A3B).total(), 30.5e9, 0.01)
    qwen35_text = model_tensors(PRESETS["qwen3.5-35b-a3b"], mtp=False).total()
    assert 33e9 < qwen35_text < 35e9  # 35B includes the vision tower, which is not counted


def test_config_json_path_gives_the_same_plan_as_the_preset(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_30B_A3B))
    common = ["--nodes", "1", "--gpus-per-node", "8", "--ep", "8", "--json", "-"]
    assert main(["--config", str(path), *common]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main(["--preset", "qwen3-30b-a3b", *common]) == 0
    from_preset = json.loads(capsys.readouterr().out)
    assert from_file["per_rank"] == from_preset["per_rank"]
    assert from_file["per_rank"]["expert_store"]["num_buckets"] == 96  # 3.62B elements in buckets fitted to 40M


# ---- the published figures ---------------------------------------------------------------------------------
def test_glm5_744b_on_32_gb300_needs_streaming():
    published_params, published_state = 23.25e9, 279e9  # per rank; = 744B / 32 ranks, x 12 B
    # Without MTP the mean is 744B / 32 plus the tensors every TP rank holds a copy of (MLA down
    # projections, the sparse-attention indexer, routers, norms): +2%.
    no_mtp = glm(mtp=False)
    assert within(no_mtp.mean_params_owned, published_params, 0.03)
    assert no_mtp.mean_params_owned > published_params
    est = glm()
    assert within(est.mean_params_owned, published_params, 0.10)
    assert within(est.binding.params_owned, published_params, 0.10)  # the largest stage decides the fit
    assert within(est.binding.resident_state_bytes, published_state, 0.10)
    assert est.binding.resident_state_bytes > 276.6 * GB  # the state alone exceeds the HBM
    assert (est.fit.resident, est.fit.streaming, est.fit.verdict) == (False, True, "streaming")


def test_qwen35_on_8_h200_expert_and_dense_stores():
    est = qwen35(8)
    expert, dense = est.binding.expert_store, est.binding.dense_store
    assert expert.num_buckets == 21 and within(expert.state_bytes / GIB, 46.1, 0.01)
    assert within(dense.state_bytes / GIB, 3.5, 0.10)
    # Published: 1 dense bucket. 3.5 GiB of fp32 state is ~311M elements, over the 200M budget: a store
    # that never exceeds its budget plans 2 (docs/advanced/planning.md).
    assert dense.num_buckets == 2
    # The first step reads the mains only: 1/3 of the volume with fp32 moments (published: 15.4 of 46.1).
    assert within(expert.main_bytes / GIB, 15.4, 0.01)


@pytest.mark.parametrize("moment_dtype, published_gib", [("bf16", 30.8), ("fp8e4m3", 23.1)])
def test_qwen35_narrow_moments_shrink_the_expert_state(moment_dtype, published_gib):
    assert within(qwen35(8, moment_dtype).binding.expert_store.state_bytes / GIB, published_gib, 0.01)


def test_qwen35_with_4_training_gpus_doubles_the_state():
    expert = qwen35(4).binding.expert_store
    assert within(expert.num_buckets, 41, 0.10) and within(expert.state_bytes / GIB, 92.2, 0.01)


# ---- the plan is the store's plan --------------------------------------------------------------------------
TINY_MOE = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_hidden_layers": 4, "full_attention_interval": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "attn_output_gate": True,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "vocab_size": 200, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "mtp_num_hidden_layers": 1,
}


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("moment_dtype", ["fp32", "fp8e4m3"])
def test_bucket_count_and_bytes_equal_a_real_store(tmp_path, ep, moment_dtype):
    model = model_tensors(TINY_MOE, "tiny")
    par = Parallelism(dp=ep, ep=ep)
    shard = rank_shards(model, par)[0]
    tensors = stage_tensors(model, par)[0]
    mine = set(range(8 // ep))  # expert-parallel rank 0 holds the first experts of every layer
    # DP = EP here, so the expert state is not sharded further (expert-DP 1): one store per part, over the
    # tensors' full shapes. (The dense optimizer's DP shard is a slice of a flat buffer, not shapes.)
    parts = {"dense": ([t for t in tensors if t.expert is None], shard.dense_local),
             "expert": ([t for t in tensors if t.expert in mine], shard.expert_entries)}
    bucket_numel = 20_000
    for name, (part, entries) in parts.items():
        params = [torch.nn.Parameter(torch.zeros(t.shape)) for t in part]
        assert [p.numel() for p in params] == list(entries)
        store = stream_optimizer_state(torch.optim.AdamW(params), dir=str(tmp_path / f"{name}{ep}{moment_dtype}"),
                                       bucket_numel=bucket_numel, moment_dtype=moment_dtype)
        try:
            # A plain AdamW over fp32 params streams the moments only (the params are the masters).
            planned = plan_store(entries, moment_dtype, bucket_numel, streams_main=False)
            assert planned.num_buckets > 1
            assert (store.stats.num_buckets, store.stats.state_bytes) == (planned.num_buckets, planned.state_bytes)
        finally:
            store.close()


# ---- step floor -------------------------------------------------------------------------------------------
# docs/benchmarks.md, H200: 1.5B params, 18 GB of fp32 state; the pipelined streamed step's median 17.91 s.
MEASURED_STEP = 17.91
BENCH_RUN_1 = {"floor": {"concurrent": {"seconds": 17.17, "bytes_read": 18e9, "bytes_written": 18e9},
                         "sequential": {"seconds": 16.46, "read_seconds": 9.53, "write_seconds": 6.93,
                                        "bytes_read": 18e9, "bytes_written": 18e9}}}


def bench_config(**hw):
    return estimate(flat_model(1_500_000_000), Parallelism(), Hardware(nodes=1, gpus_per_node=1, **hw),
                    Training(bucket_numel=62_500_000))


# Disk speeds: what the same host's disk moved reading and writing at once (2.1 GB/s), and the bench file of
# run 1 (its concurrent floor; and its sequential read and write times alone).
@pytest.mark.parametrize("disk", [{"disk_combined_gbps": 2.1},
                                  disk_speeds_from_bench(BENCH_RUN_1),
                                  {k: v for k, v in disk_speeds_from_bench(BENCH_RUN_1).items()
                                   if k != "disk_combined_gbps"}])
def test_step_floor_of_the_h200_bench_is_within_15_percent_of_the_measured_step(disk):
    est = bench_config(**disk)
    assert within(est.binding.streamed_state_bytes, 18e9, 0.001)
    assert within(est.floors.steady_seconds, MEASURED_STEP, 0.15)
    assert est.floors.first_seconds < est.floors.steady_seconds  # the first step reads a third


def test_host_tier_takes_its_bytes_off_the_disk():
    est = bench_config(disk_combined_gbps=2.1, host_tier_gb=9.0)
    tier = est.floors.tier_bytes_per_rank  # whole buckets, as the store places them: up to 9 GB of state
    assert 8e9 < tier <= est.floors.ram_bytes_per_rank <= 9e9
    assert est.floors.tiered_seconds == pytest.approx(2 * (18e9 - tier) / 2.1e9 + tier / 50e9)


def test_from_bench_file_sets_the_disk_speeds(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH_RUN_1))
    assert main(["--params", "1.5B", "--nodes", "1", "--gpus-per-node", "1", "--bucket-numel", "62.5M",
                 "--from-bench", str(path), "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["disk_combined_gbps"] == pytest.approx(36 / 17.17)
    assert out["floors"]["steady_seconds"] == pytest.approx(17.17)


# ---- errors -----------------------------------------------------------------------------------------------
def test_a_bench_file_without_floors_is_refused_with_what_to_pass(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"floor": {"best_seconds": 1.0}}))
    assert main(["--params", "1B", "--nodes", "1", "--gpus-per-node", "1", "--from-bench", str(path)]) == 2
    assert "floor.sequential" in capsys.readouterr().err


def test_gpu_count_must_match_the_layout(capsys):
    assert main(["--preset", "glm5-744b", "--nodes", "8", "--gpus-per-node", "8", "--tp", "8", "--pp", "4",
                 "--dp", "1", "--ep", "8"]) == 2
    err = capsys.readouterr().err
    assert "64 GPUs" in err and "= 32" in err


def test_expert_parallelism_must_fit_a_stage():
    model = model_tensors(QWEN3_30B_A3B)
    with pytest.raises(LayoutError, match="--expert-model-parallel-size 16 x --expert-tensor-parallel-size 1 = 16 "
                       "does not divide the 8 ranks of one pipeline stage"):
        estimate(model, Parallelism(dp=8, ep=16), Hardware(nodes=1, gpus_per_node=8))
    with pytest.raises(SizingError, match="grad-dtype"):
        estimate(model, Parallelism(dp=8, ep=8), Hardware(nodes=1, gpus_per_node=8), Training(grad_dtype="fp8"))


def test_the_plan_refuses_a_pipeline_split_megatron_would_not_build_and_takes_its_flags(capsys):
    glm5 = ["--preset", "glm5-744b", "--nodes", "8", "--gpus-per-node", "4", "--tensor-model-parallel-size", "8",
            "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8"]
    assert main(glm5) == 2
    assert "--decoder-first-pipeline-num-layers 20 --decoder-last-pipeline-num-layers 20" in capsys.readouterr().err
    assert main([*glm5, "--decoder-first-pipeline-num-layers", "22", "--decoder-last-pipeline-num-layers", "18"]) == 0
    assert "TP8 PP4 DP1 EP8" in capsys.readouterr().out


def test_unknown_preset_names_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--preset", "nope", "--nodes", "1"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
