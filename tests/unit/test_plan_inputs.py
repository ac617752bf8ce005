"""`miles plan` on bad input: every value it cannot plan with is refused with exit code 2 and one line on
stderr naming the value, within a second, never a traceback or a hang. CPU only."""

import json
import os
import subprocess
import sys
import time

import pytest

from miles.backends.megatron_backend.families import read_config
from miles.sizing.cli import main
from miles.sizing.presets import GLM5_744B, QWEN3_30B_A3B, preset_config

sys.path.insert(0, os.path.dirname(__file__))
from test_sizing import TINY_MOE  # noqa: E402

SMALL_DENSE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 128, "tie_word_embeddings": False}
ONE_GPU = ["--nodes", "1", "--gpus-per-node", "1"]
# Small stand-ins of the presets (every field the planner reads, fewer layers and experts): they plan in ms.
SMALL_MLA = {**GLM5_744B, "num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 8}
SMALL_GQA_MOE = {**QWEN3_30B_A3B, "num_hidden_layers": 4, "num_experts": 8}
SMALL_HYBRID = TINY_MOE  # the Qwen3.5 hybrid shape test_sizing plans
# Llama-3.1's rope scaling, which transformers builds and the megatron backend does not
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 5e5}
FLOORS = {"floor": {"concurrent": {"seconds": 17.17, "bytes_read": 18e9, "bytes_written": 18e9},
                    "sequential": {"seconds": 16.46, "read_seconds": 9.53, "write_seconds": 6.93,
                                   "bytes_read": 18e9, "bytes_written": 18e9}}}


# A model the megatron backend builds is read through its family, which imports torch and transformers' config
# classes (seconds, once a process): done here, so that the times below are the plan's, not those first imports'.
for _preset in ("llama-tiny", "qwen3-moe-tiny", "glm5-tiny", "qwen3.5-moe-tiny"):
    read_config(preset_config(_preset))


def run_plan(argv, capsys):
    """main(argv) in this process: (exit code, stderr, seconds). Parse errors exit through SystemExit."""
    capsys.readouterr()
    start = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    seconds = time.perf_counter() - start
    return code, capsys.readouterr().err, seconds


def assert_refused(code, err, seconds, *names):
    assert code == 2, f"exit {code}, stderr {err!r}"
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("miles plan: "), lines
    for name in names:
        assert name in lines[0], f"{name!r} not named in {lines[0]!r}"
    assert seconds < 1.0, f"took {seconds:.2f} s"


def write(tmp_path, name, content) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def config(tmp_path, base=SMALL_DENSE, **fields) -> list[str]:
    return ["--config", write(tmp_path, "config.json", {**base, **fields}), *ONE_GPU]


def bench(tmp_path, content) -> list[str]:
    return ["--params", "1B", *ONE_GPU, "--from-bench", write(tmp_path, "bench.json", content)]


def big_file(tmp_path) -> list[str]:
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"pad": "x" * (8 << 20)}))
    return ["--params", "1B", *ONE_GPU, "--from-bench", str(path)]


def directory(tmp_path) -> str:
    (tmp_path / "subdir").mkdir()
    return str(tmp_path / "subdir")


def fifo(tmp_path) -> list[str]:
    path = tmp_path / "fifo.json"
    os.mkfifo(path)
    return ["--params", "1B", *ONE_GPU, "--from-bench", str(path)]


# (id, argv from tmp_path, what the line must name). The first ten are the reported cases.
BAD_INPUTS = [
    ("params-inf", lambda t: ["--params", "inf", *ONE_GPU], ["--params", "inf"]),
    ("tp-0", lambda t: ["--params", "1B", *ONE_GPU, "--tp", "0"], ["--tp", "'0'"]),
    ("bucket-numel-0", lambda t: ["--params", "1B", *ONE_GPU, "--bucket-numel", "0"], ["--bucket-numel", "'0'"]),
    ("bench-not-json", lambda t: bench(t, "not json {"), ["--from-bench", "bench.json", "JSON"]),
    ("config-0-heads", lambda t: config(t, num_attention_heads=0), ["num_attention_heads", "0"]),
    ("params-1e30", lambda t: ["--params", "1e30", *ONE_GPU], ["--params", "1e30"]),
    ("config-1e9-layers", lambda t: config(t, num_hidden_layers=10**9), ["num_hidden_layers", "1000000000"]),
    ("bench-dev-zero", lambda t: ["--params", "1B", *ONE_GPU, "--from-bench", "/dev/zero"], ["/dev/zero"]),
    ("hbm-nan", lambda t: ["--params", "1B", *ONE_GPU, "--hbm-gb", "nan"], ["--hbm-gb", "nan"]),
    ("config-negative-hidden", lambda t: config(t, hidden_size=-64), ["hidden_size", "-64"]),
    # more numeric flags
    ("params-negative", lambda t: ["--params", "-5", *ONE_GPU], ["--params", "-5"]),
    ("params-not-a-count", lambda t: ["--params", "1.5X", *ONE_GPU], ["--params", "1.5X"]),
    ("params-over-bound", lambda t: ["--params", "2e15", *ONE_GPU], ["--params", "2e15", "1e+15"]),
    ("pp-0", lambda t: ["--params", "1B", *ONE_GPU, "--pp", "0"], ["--pp", "'0'"]),
    ("dp-0", lambda t: ["--params", "1B", *ONE_GPU, "--dp", "0"], ["--dp", "'0'"]),
    ("ep-negative", lambda t: ["--params", "1B", *ONE_GPU, "--ep", "-2"], ["--ep", "'-2'"]),
    ("nodes-0", lambda t: ["--params", "1B", "--nodes", "0", "--gpus-per-node", "1"], ["--nodes", "'0'"]),
    ("gpus-huge", lambda t: ["--params", "1B", "--nodes", "1", "--gpus-per-node", "10000000"],
     ["--gpus-per-node", "10000000"]),
    ("disk-read-0", lambda t: ["--params", "1B", *ONE_GPU, "--disk-read-gbps", "0"], ["--disk-read-gbps", "'0'"]),
    ("pcie-inf", lambda t: ["--params", "1B", *ONE_GPU, "--pcie-gbps", "inf"], ["--pcie-gbps", "inf"]),
    ("host-tier-negative", lambda t: ["--params", "1B", *ONE_GPU, "--host-tier-gb", "-1"], ["--host-tier-gb", "-1"]),
    ("reserve-nan", lambda t: ["--params", "1B", *ONE_GPU, "--reserve-gb", "nan"], ["--reserve-gb", "nan"]),
    ("device-budget-0", lambda t: ["--params", "1B", *ONE_GPU, "--device-budget-mb", "0"],
     ["--device-budget-mb", "'0'"]),
    ("host-ram-1e300", lambda t: ["--params", "1B", *ONE_GPU, "--host-ram-gb", "1e300"], ["--host-ram-gb", "1e300"]),
    ("checkpoint-copies-negative", lambda t: ["--params", "1B", *ONE_GPU, "--checkpoint-copies", "-1"],
     ["--checkpoint-copies", "-1"]),
    ("first-stage-layers-negative", lambda t: ["--params", "1B", "--nodes", "1", "--gpus-per-node", "2", "--pp", "2",
                                               "--decoder-first-pipeline-num-layers", "-1"],
     ["--decoder-first-pipeline-num-layers", "-1"]),
    ("bucket-numel-1-on-1T", lambda t: ["--params", "1T", *ONE_GPU, "--bucket-numel", "1"], ["--bucket-numel", "1"]),
    # the store fits buckets of 16K elements to 1 MiB: 61M of them for 1T params
    ("device-budget-1-on-1T", lambda t: ["--params", "1T", *ONE_GPU, "--device-budget-mb", "1"],
     ["--device-budget-mb 1", "16384 elements"]),
    # the store refuses a bucket its device budget cannot hold (the default: one 200M-element bucket)
    ("bucket-numel-over-the-budget", lambda t: ["--params", "1B", *ONE_GPU, "--bucket-numel", "300M"],
     ["bucket_numel=300000000", "--device-budget-mb", "--bucket-numel"]),
    # files
    ("bench-directory", lambda t: ["--params", "1B", *ONE_GPU, "--from-bench", directory(t)],
     ["--from-bench", "subdir"]),
    ("bench-fifo", fifo, ["--from-bench", "fifo.json"]),
    ("bench-too-big", big_file, ["--from-bench", "big.json", "MiB"]),
    ("bench-missing", lambda t: ["--params", "1B", *ONE_GPU, "--from-bench", str(t / "nope.json")], ["nope.json"]),
    ("bench-a-list", lambda t: bench(t, [1, 2]), ["bench.json", "floor"]),
    ("bench-deep", lambda t: bench(t, "[" * 200_000), ["bench.json", "JSON"]),
    ("bench-nan-seconds", lambda t: bench(t, json.dumps(FLOORS).replace("9.53", "NaN")),
     ["bench.json", "read_seconds", "nan"]),
    ("bench-negative-seconds", lambda t: bench(t, json.dumps(FLOORS).replace("17.17", "-17.17")),
     ["bench.json", "seconds", "-17.17"]),
    ("bench-string-bytes", lambda t: bench(t, json.dumps(FLOORS).replace("18000000000.0", '"lots"', 1)),
     ["bench.json", "bytes_read", "lots"]),
    ("bench-absurd-speed", lambda t: bench(t, json.dumps(FLOORS).replace("9.53", "1e-300")),
     ["bench.json", "--disk-read-gbps"]),
    ("config-missing", lambda t: ["--config", str(t / "nope.json"), *ONE_GPU], ["nope.json"]),
    ("config-not-json", lambda t: ["--config", write(t, "config.json", "{oops"), *ONE_GPU], ["config.json", "JSON"]),
    ("config-a-list", lambda t: ["--config", write(t, "config.json", [1]), *ONE_GPU], ["config.json", "object"]),
    ("config-dev-zero", lambda t: ["--config", "/dev/zero", *ONE_GPU], ["/dev/zero"]),
    ("json-out-directory", lambda t: ["--params", "1B", *ONE_GPU, "--json", directory(t)], ["--json", "subdir"]),
    # config fields
    ("config-hidden-string", lambda t: config(t, hidden_size="64"), ["hidden_size", "'64'"]),
    ("config-hidden-bool", lambda t: config(t, hidden_size=True), ["hidden_size", "True"]),
    ("config-hidden-fraction", lambda t: config(t, hidden_size=64.5), ["hidden_size", "64.5"]),
    ("config-hidden-huge", lambda t: config(t, hidden_size=10**7), ["hidden_size", "10000000"]),
    ("config-heads-not-dividing-hidden", lambda t: config(t, hidden_size=66), ["num_attention_heads", "66"]),
    ("config-kv-not-dividing-heads", lambda t: config(t, num_key_value_heads=3), ["num_key_value_heads", "3"]),
    ("config-kv-0", lambda t: config(t, num_key_value_heads=0), ["num_key_value_heads", "0"]),
    ("config-vocab-0", lambda t: config(t, vocab_size=0), ["vocab_size", "0"]),
    ("config-layers-0", lambda t: config(t, num_hidden_layers=0), ["num_hidden_layers", "0"]),
    ("config-tie-string", lambda t: config(t, tie_word_embeddings="no"), ["tie_word_embeddings", "'no'"]),
    ("config-experts-1e9", lambda t: config(t, SMALL_GQA_MOE, num_experts=10**9), ["num_experts", "1000000000"]),
    ("config-experts-x-layers", lambda t: config(t, SMALL_GQA_MOE, num_experts=8192, num_hidden_layers=10000),
     ["tensors"]),
    ("config-too-many-params", lambda t: config(t, hidden_size=10**6, intermediate_size=10**7,
                                                num_hidden_layers=10000), ["1e+15"]),
    ("config-layer-types-short", lambda t: config(t, SMALL_HYBRID, layer_types=["linear_attention"]),
     ["layer_types"]),
    ("config-mlp-only-layers-string", lambda t: config(t, SMALL_GQA_MOE, mlp_only_layers="0"), ["mlp_only_layers"]),
    ("config-model-type-number", lambda t: config(t, model_type=3), ["model_type", "3"]),
    ("config-shared-experts-string", lambda t: config(t, SMALL_MLA, n_shared_experts="2"), ["n_shared_experts"]),
    ("config-mtp-huge", lambda t: config(t, SMALL_HYBRID, mtp_num_hidden_layers=10**9), ["mtp_num_hidden_layers"]),
]


@pytest.mark.parametrize("argv, names", [(a, n) for _, a, n in BAD_INPUTS], ids=[i for i, _, _ in BAD_INPUTS])
def test_bad_input_is_one_line_naming_the_value_within_a_second(tmp_path, capsys, argv, names):
    assert_refused(*run_plan(argv(tmp_path), capsys), *names)


# The reported cases, through the installed entry point in a fresh process (the hangs among them included).
@pytest.mark.parametrize("argv, names", [(a, n) for _, a, n in BAD_INPUTS[:10]], ids=[i for i, _, _ in BAD_INPUTS[:10]])
def test_bad_input_through_the_command_line(tmp_path, argv, names):
    try:
        done = subprocess.run([sys.executable, "-m", "miles.sizing.cli", *argv(tmp_path)], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("miles plan hung")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith("miles plan: ") and all(name in line for name in names), line


# Every field of the small stand-ins replaced by values a config.json should not hold: each is planned
# (a value the planner can use) or refused in one line naming the field, never a traceback.
ODD_VALUES = [0, -1, 10**12, "8", True, 2.5, [3], {"a": 1}]


@pytest.mark.parametrize("base", [SMALL_DENSE, SMALL_MLA, SMALL_GQA_MOE, SMALL_HYBRID],
                         ids=["dense", "mla", "gqa-moe", "hybrid"])
def test_every_config_field_with_odd_values_plans_or_is_refused_naming_it(tmp_path, capsys, base):
    for key in base:
        for value in ODD_VALUES:
            code, err, seconds = run_plan(config(tmp_path, base, **{key: value}), capsys)
            if code != 0:  # named, unless the value left out a field the model then needs ("has no ...")
                assert_refused(code, err, seconds)
                assert key in err or "has no" in err, err
            assert seconds < 1.0


def test_the_small_stand_ins_plan(tmp_path, capsys):
    for base in (SMALL_DENSE, SMALL_MLA, SMALL_GQA_MOE, SMALL_HYBRID):
        code, err, _ = run_plan(config(tmp_path, base), capsys)
        assert code == 0, err


def test_a_fifo_or_device_is_never_opened_for_reading(tmp_path, capsys):
    # A FIFO with no writer would block an ordinary open() forever.
    code, err, seconds = run_plan(fifo(tmp_path), capsys)
    assert_refused(code, err, seconds, "not a regular file")


def test_the_largest_config_within_the_bounds_still_plans_in_seconds(tmp_path, capsys):
    # 2000 layers of 58 experts (246k tensors): just under the tensor bound, planned (not refused) in seconds.
    wide = {**SMALL_GQA_MOE, "num_hidden_layers": 2000, "num_experts": 58}
    code, err, seconds = run_plan([*config(tmp_path, wide), "--json", "-"], capsys)
    assert code == 0, err
    assert seconds < 15


def test_a_model_the_megatron_backend_builds_is_planned_as_its_family_reads_it(tmp_path, capsys):
    """What the trainer would refuse, the plan refuses in its words; a model type no family builds is sized as
    transformers lays it out, for the torch backend's data-parallel layout only."""
    llama3 = {**SMALL_DENSE, "model_type": "llama", "rope_scaling": LLAMA3_ROPE}
    path = tmp_path / "llama3.json"
    path.write_text(json.dumps(llama3))
    code, err, _ = run_plan(["--config", str(path), *ONE_GPU], capsys)
    assert code == 2 and "rope type 'llama3' is not supported by the Megatron backend" in err, err
    assert "--train-backend megatron would refuse it too" in err, err
    mistral = tmp_path / "mistral.json"
    mistral.write_text(json.dumps({**SMALL_DENSE, "model_type": "mistral"}))
    code, err, _ = run_plan(["--config", str(mistral), "--nodes", "1", "--gpus-per-node", "2", "--tp", "2"], capsys)
    assert code == 2 and "model_type 'mistral' is not built by --train-backend megatron" in err, err
    assert "--tp 2 needs it" in err, err
    code, err, _ = run_plan(["--config", str(mistral), *ONE_GPU], capsys)
    assert code == 0 and "sized as transformers lays it out" in err, err
