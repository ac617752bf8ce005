"""The rollout-engine contract on sglang, on CPU, against the fake of tests/fakes/fake_sglang.py (its state
machine and answer shapes), in-process (the stand-in ``sglang`` package of tests/fakes) and over HTTP.
Where a real sglang is installed (``pip install --no-deps sglang==0.5.17``), its own FlattenedTensorBucket
builds the buckets of one test."""

import importlib.machinery
import importlib.util
import os
import sys
import threading
import time

import pytest
import torch

FAKES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fakes")


def _load_fake():  # by path, under the name the stand-in sglang package imports it by (tests/fakes stays off sys.path)
    if "fake_sglang" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fake_sglang", os.path.join(FAKES, "fake_sglang.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["fake_sglang"] = module
        spec.loader.exec_module(module)
    return sys.modules["fake_sglang"]


fake_sglang = _load_fake()

from miles.config import parse_args  # noqa: E402
from miles.preflight import Environment, validate_args  # noqa: E402
from miles.preflight.validation import ArgumentError  # noqa: E402
from miles.rollout import RolloutEngine, SamplingParams  # noqa: E402

STREAM = ["--colocate", "--stream-optimizer-state-to-disk", "--offload-train-target", "disk"]


def _payloads():
    from miles.rollout.sglang.payloads import SglangPayloads

    return SglangPayloads(fake_sglang.FakeFlattenedTensorBucket, fake_sglang.FakeSerializer)


@pytest.fixture()
def stub_sglang(monkeypatch):
    """``import sglang`` gives the stand-in package; ``set_version(v)`` picks the version it emulates."""
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for k in saved:
        del sys.modules[k]
    monkeypatch.syspath_prepend(FAKES)

    def set_version(version):
        monkeypatch.setenv("MILES_FAKE_SGLANG_VERSION", version)
        sys.modules.pop("sglang", None)  # the package reads its version when imported

    yield set_version
    for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def _in_process(stub_sglang, version="0.5.17", tp_size=1):
    from miles.rollout.sglang.engine import SglangRolloutEngine
    from miles.rollout.sglang.transport import InProcessSglang

    stub_sglang(version)
    transport = InProcessSglang({"model_path": None, "tp_size": tp_size, "random_seed": 3})
    return SglangRolloutEngine(transport, tp_size=tp_size), transport.engine


@pytest.fixture()
def http_engine():
    """``make(version, tp_size)`` -> (client, fake engine) over HTTP; servers stop at teardown."""
    from miles.rollout.sglang.engine import SglangRolloutEngine
    from miles.rollout.sglang.transport import HttpSglang

    servers = []

    def make(version="0.5.17", tp_size=1):
        fake = fake_sglang.FakeSglangEngine(version=version, tp_size=tp_size, random_seed=5)
        server = fake_sglang.FakeSglangServer(fake).__enter__()
        servers.append(server)
        return SglangRolloutEngine(HttpSglang(server.url, timeout_s=30), tp_size=tp_size, payloads=_payloads()), fake

    yield make
    for s in servers:
        s.__exit__(None, None, None)


def _weights():
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(8, 4, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.randn(4, generator=g)),
            ("lm_head.weight", torch.randn(8, 4, generator=g).to(torch.bfloat16))]


def _trainer_payloads(engine, named):
    """What the trainer's push builds for an sglang engine (miles.weights.push): sglang's own bucket of the
    bf16 tensors, serialized once per tensor-parallel rank."""
    payloads = engine._payload_builder()
    bucket = payloads.bucket([(n, t) for n, t in named if t.dtype == torch.bfloat16])
    return bucket, payloads.serialize(bucket, engine.tp_size)


def _colocated_push(engine, version, named):
    """The colocated order's push: release all, resume weights, one versioned update, resume kv_cache."""
    engine.release_memory_occupation()
    engine.resume_memory_occupation(["weights"])
    engine.begin_weight_update(version)
    bucket, payloads = _trainer_payloads(engine, named)
    stats = engine.update_weights_from_tensor(payloads, load_format="flattened_bucket")
    del bucket
    done = engine.end_weight_update(version)
    engine.resume_memory_occupation(["kv_cache"])
    return stats, done


# ------------------------------------------------------------------------------------------ generate


def test_generate_maps_output_token_logprobs_into_samples(stub_sglang):
    engine, fake = _in_process(stub_sglang)
    assert isinstance(engine, RolloutEngine)
    samples = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.7, max_new_tokens=6, n=2, seed=11))
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1] and [s.index for s in samples] == [0, 1, 2, 3]
    for s in samples:
        assert s.prompt_ids == ([1, 2, 3] if s.prompt_index == 0 else [4, 5])
        assert len(s.response_ids) == len(s.response_logprobs) >= 1
        assert s.finish_reason in ("stop", "length") and s.weight_version == 0
        prev = s.prompt_ids[-1]
        for token, lp in zip(s.response_ids, s.response_logprobs):  # log_softmax(logits / T) of the chosen token
            assert lp == pytest.approx(float(torch.log_softmax(fake.table[prev] / 0.7, -1)[token]), abs=1e-6)
            prev = token
    # sample k of a seeded call: its own seed, so the two samples of a prompt differ, and a repeat is identical
    again = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.7, max_new_tokens=6, n=2, seed=11))
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]
    seeds = [sp["sampling_seed"] for sp in _last_generate_params(fake)]
    assert len(set(seeds)) == 4
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=3), return_logprob=False)[0].response_logprobs == []


def _last_generate_params(fake):
    return fake.last_generate_params


@pytest.fixture(autouse=True)
def _record_generate_params(monkeypatch):
    original = fake_sglang.FakeSglangEngine.generate

    def recording(self, *args, **kwargs):
        self.last_generate_params = kwargs.get("sampling_params")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(fake_sglang.FakeSglangEngine, "generate", recording)


def test_samples_from_outputs_refuses_mismatched_answers():
    from miles.rollout.sglang.engine import samples_from_outputs
    from miles.rollout.sglang.transport import SglangCallError

    out = {"text": "a", "output_ids": [3, 4], "meta_info": {"finish_reason": {"type": "length", "length": 2},
                                                             "output_token_logprobs": [[-0.5, 3, None], [-0.1, 4, None]]}}
    (s,) = samples_from_outputs([out], [[1]], 1, True, 7)
    assert s.response_ids == [3, 4] and s.response_logprobs == [-0.5, -0.1] and s.weight_version == 7
    with pytest.raises(SglangCallError, match="generate failed: expected 2 outputs"):
        samples_from_outputs([out], [[1]], 2, True, 0)
    bad = {**out, "output_ids": [3, 5]}
    with pytest.raises(SglangCallError, match="differ from the token ids of output_token_logprobs"):
        samples_from_outputs([bad], [[1]], 1, True, 0)
    aborted = {**out, "meta_info": {**out["meta_info"], "finish_reason": {"type": "abort", "message": "oom"}}}
    with pytest.raises(SglangCallError, match="aborted the request: oom"):
        samples_from_outputs([aborted], [[1]], 1, True, 0)


# ------------------------------------------------------------------------------------------ memory


def test_kv_cache_resumed_before_generate(http_engine):
    engine, fake = http_engine()
    engine.release_memory_occupation(["kv_cache"])
    assert fake.resident == {"weights": True, "kv_cache": False, "cuda_graph": False}
    with pytest.raises(RuntimeError, match=r"\['kv_cache'\] released; call resume_memory_occupation"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert not [c for c in fake.calls if c[0] == "generate"]
    engine.resume_memory_occupation(["kv_cache"])
    assert fake.resident["kv_cache"] and fake.resident["cuda_graph"]
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))


def test_release_and_resume_are_idempotent_per_tag_over_strict_sglang(http_engine):
    engine, fake = http_engine()
    assert engine.release_memory_occupation() == {"weights": 0, "kv_cache": 0}
    assert engine.release_memory_occupation(["weights"]) == {"weights": 0}  # already released: sglang not asked
    assert engine.resume_memory_occupation(["weights"]) == {"weights": 0}
    assert engine.resume_memory_occupation(["weights"]) == {"weights": 0}
    assert fake.calls == [("release", ["weights", "kv_cache", "cuda_graph"]), ("resume", ["weights"])]
    with pytest.raises(TypeError, match="pass \\['weights'\\]"):
        engine.release_memory_occupation("weights")


def test_release_only_when_idle(http_engine):
    engine, fake = http_engine()
    fake.generate_gate = threading.Event()
    worker = threading.Thread(target=engine.generate, args=([[1, 2]], SamplingParams(max_new_tokens=2)))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while fake.running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake.running == 1
        with pytest.raises(RuntimeError, match="cannot release .* while generate runs"):
            engine.release_memory_occupation()
        with pytest.raises(AssertionError, match="only when idle"):  # and sglang itself refuses it
            fake.release_memory_occupation(["kv_cache"])
    finally:
        fake.generate_gate.set()
        worker.join(10)
    assert engine.release_memory_occupation(["kv_cache"]) == {"kv_cache": 0}


# ------------------------------------------------------------------------------------------ weights


def test_weights_resumed_before_an_update(http_engine):
    engine, fake = http_engine()
    engine.release_memory_occupation()
    with pytest.raises(RuntimeError, match=r"weights are released; call resume_memory_occupation\(\['weights'\]\)"):
        engine.begin_weight_update(1)
    engine.resume_memory_occupation(["weights"])
    engine.resume_memory_occupation(["kv_cache"])
    with pytest.raises(fake_sglang_error(), match="generate failed: .*undefined weights"):
        engine.generate([[1]], SamplingParams(max_new_tokens=1))  # sglang's resumed weights are undefined


def fake_sglang_error():
    from miles.rollout.sglang.transport import SglangCallError

    return SglangCallError


@pytest.mark.parametrize("tp_size", [1, 2])
def test_colocated_push_lands_bit_exact_one_payload_per_tp_rank(http_engine, tp_size):
    engine, fake = http_engine(tp_size=tp_size)
    named = _weights()
    stats, done = _colocated_push(engine, 1, named)
    bf16 = [(n, t) for n, t in named if t.dtype == torch.bfloat16]
    assert stats == {"tensors": 0, "bytes": 0}  # the trainer's payloads pass through unopened: it counts them
    assert done == {"version": 1, "tensors": 0, "bytes": 0}
    assert [c[1] for c in fake.calls if c[0] == "update_weights_from_tensor"] == [
        {"payloads": tp_size, "load_format": "flattened_bucket", "flush_cache": False}]
    for name, tensor in bf16:
        assert torch.equal(fake.weights[name], tensor)
    samples = engine.generate([[1]], SamplingParams(max_new_tokens=2))
    assert samples[0].weight_version == 1
    assert fake.calls[-1][0] == "flush_cache"  # once after the session, before the first generate
    # pairs (load_format None) take the same route, every dtype in one bucket
    engine.begin_weight_update(2)
    assert engine.update_weights_from_tensor(named, load_format=None)["tensors"] == 3
    engine.end_weight_update(2)
    assert torch.equal(fake.weights["model.norm.weight"], named[1][1])


def test_one_payload_per_tp_rank_is_what_sglang_takes(http_engine):
    engine, fake = http_engine(tp_size=2)
    one = _payloads().build(_weights(), tp_size=1)
    engine.begin_weight_update(1)
    with pytest.raises(ValueError, match="one per tensor-parallel rank: 2 expected, got 1"):
        engine.update_weights_from_tensor(one.payloads)
    # and the fake refuses a wrong count on its own
    assert fake.update_weights_from_tensor(one.payloads, load_format="flattened_bucket") == (
        False, "expected one payload per TP rank (2), got 1")
    two = _payloads().build(_weights(), tp_size=2)
    assert engine.update_weights_from_tensor(two.payloads) == {"tensors": 0, "bytes": 0}
    engine.end_weight_update(1)
    assert torch.equal(fake.weights["model.norm.weight"], _weights()[1][1])


def test_sessions_on_the_server_from_0_5_21(stub_sglang):
    named = _weights()
    new, fake_new = _in_process(stub_sglang, "0.5.21")
    assert fake_new.update_weights_from_tensor(_payloads().build(named, 1).payloads, "flattened_bucket") == (
        False, "an update must sit between begin_weight_update and end_weight_update")
    fake_new.calls.clear()
    _colocated_push(new, 4, named)
    assert [c[0] for c in fake_new.calls if c[0] in ("begin", "end", "update_weights_from_tensor")] == [
        "begin", "update_weights_from_tensor", "end"]
    old, fake_old = _in_process(stub_sglang, "0.5.17")
    assert fake_old.update_weights_from_tensor(_payloads().build(named, 1).payloads, "flattened_bucket") == (
        True, "Success")  # 0.5.17 takes updates outside a session
    _colocated_push(old, 4, named)
    assert not [c for c in fake_old.calls if c[0] in ("begin", "end")]
    assert old.get_weight_version() == new.get_weight_version() == 4
    _, payloads = _trainer_payloads(old, named)
    with pytest.raises(RuntimeError, match="outside a weight update; call begin_weight_update"):
        old.update_weights_from_tensor(payloads)  # the contract's session holds on every version


def test_server_errors_surface_naming_the_call(http_engine, stub_sglang):
    from miles.rollout.sglang.transport import HttpSglang, SglangCallError

    engine, fake = http_engine()
    fake.resident["kv_cache"] = False  # behind the client's back
    with pytest.raises(SglangCallError, match=r"sglang server http://127\.0\.0\.1:\d+: generate failed: HTTP 400: "
                                              r"RuntimeError: generate with \['kv_cache'\] released"):
        engine.generate([[1]], SamplingParams(max_new_tokens=1))
    local, local_fake = _in_process(stub_sglang)
    local_fake.resident["weights"] = False
    local.begin_weight_update(1)
    with pytest.raises(SglangCallError, match="in-process.*update_weights_from_tensor failed: weights are released"):
        local.update_weights_from_tensor(_weights(), load_format=None)
    with pytest.raises(SglangCallError, match="cannot reach the server"):
        HttpSglang("http://127.0.0.1:1", timeout_s=5)


def test_version_detected_and_tp_size_checked(http_engine):
    from miles.rollout.sglang import needs_weight_session, parse_version
    from miles.rollout.sglang.engine import SglangRolloutEngine
    from miles.rollout.sglang.transport import HttpSglang

    assert parse_version("0.5.21.post1") == (0, 5, 21) and parse_version("0.5") == (0, 5, 0)
    assert not needs_weight_session((0, 5, 17)) and needs_weight_session((0, 5, 21))
    with pytest.raises(ValueError, match="'dev'.*MAJOR.MINOR"):
        parse_version("dev")
    engine, fake = http_engine(version="0.5.23", tp_size=2)
    assert engine.sessions_on_server and "sglang 0.5.23" in engine.get_description()
    with pytest.raises(ValueError, match="runs with tp_size 2, and --sglang-tp-size is 1: pass --sglang-tp-size 2"):
        SglangRolloutEngine(HttpSglang(engine.transport.url, timeout_s=30), tp_size=1)


# ------------------------------------------------------------------------------------------ real sglang classes


def _real_bucket_class():
    """sglang's own FlattenedTensorBucket when a real sglang is installed (found without running its heavy
    package __init__), else None."""
    paths = [p for p in sys.path if os.path.abspath(p or ".") != FAKES]
    spec = importlib.machinery.PathFinder.find_spec("sglang", paths)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "srt", "weight_sync", "tensor_bucket.py")
    if not os.path.isfile(path):
        return None
    module_spec = importlib.util.spec_from_file_location("_real_sglang_tensor_bucket", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # its metadata class must be importable by name to be pickled
    module_spec.loader.exec_module(module)
    return module.FlattenedTensorBucket


def test_payloads_built_with_sglangs_own_bucket_class(http_engine):
    from miles.rollout.sglang.payloads import SglangPayloads

    real = _real_bucket_class()
    if real is None:
        pytest.skip("no real sglang installed (pip install --no-deps sglang==0.5.17 to run this)")
    engine, fake = http_engine()
    fake.bucket_cls = real
    engine._payloads = SglangPayloads(real, fake_sglang.FakeSerializer)
    named = _weights()
    _colocated_push(engine, 1, named)
    for name, tensor in named:
        if tensor.dtype == torch.bfloat16:
            assert torch.equal(fake.weights[name], tensor)
    flat = SglangPayloads(real, fake_sglang.FakeSerializer).bucket(named).flat
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for _, t in named)


# ------------------------------------------------------------------------------------------ flags, actor


def _env(modules=("sglang",), tmp="/tmp"):
    return Environment(python_version=(3, 11), cuda_available=lambda: False, has_module=lambda m: m in modules,
                       scratch_root=tmp, run_id="RUN", cpu_count=lambda: 64, host_memory_available=lambda: 1 << 40)


def _model(tmp_path):
    from miles.models import write_random_model

    folder = str(tmp_path / "model")
    if not os.path.isdir(folder):
        write_random_model(folder, "llama-tiny", dtype="fp32")
    return folder


def _validate(tmp_path, *argv, modules=("sglang",)):
    argv = ["--rollout-engine", "sglang", "--hf-checkpoint", _model(tmp_path), *STREAM,
            "--metrics-file", str(tmp_path / "m.jsonl"), *argv]
    return validate_args(parse_args(argv), _env(modules, str(tmp_path / "scratch")))


def test_sglang_flags_parse_into_the_run_config(tmp_path):
    from miles.rollout.sglang.engine import server_args

    config = _validate(tmp_path, "--sglang-mem-fraction-static", "0.6", "--sglang-server-arg",
                       "attention_backend=triton", "--sglang-server-arg", "disable_cuda_graph=true")
    r = config.rollout
    assert (r.rollout_engine, r.sglang_tp_size, r.sglang_mem_fraction_static, r.sglang_url) == ("sglang", 1, 0.6, ())
    assert r.sglang_server_arg == ("attention_backend=triton", "disable_cuda_graph=true")
    args = server_args(config, "/m", engine_id=2)
    assert args == {"model_path": "/m", "tp_size": 1, "enable_memory_saver": True, "base_gpu_id": 0,
                    "random_seed": 44, "dtype": "float32", "skip_server_warmup": True, "mem_fraction_static": 0.6,
                    "attention_backend": "triton", "disable_cuda_graph": True}
    url = _validate(tmp_path, "--sglang-url", "http://127.0.0.1:30000/", "--sglang-tp-size", "2").rollout
    assert (url.sglang_url, url.sglang_tp_size) == (("http://127.0.0.1:30000/",), 2)
    two = _validate(tmp_path, "--sglang-url", "http://node0:30000", "--sglang-url", "http://node1:30000",
                    "--num-rollout-engines", "2", "--num-train-ranks", "2").rollout
    assert two.sglang_url == ("http://node0:30000", "http://node1:30000")  # engine i drives the i-th


@pytest.mark.parametrize("argv, message", [
    ([], "--rollout-engine sglang: sglang is not installed here. Fix: pip install --no-deps sglang==0.5.17 into an "
         "environment with torch==2.11.0"),
])
def test_sglang_not_installed_says_what_to_install(tmp_path, argv, message):
    with pytest.raises(ArgumentError) as e:
        _validate(tmp_path, *argv, modules=())
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--sglang-server-arg", "attention-backend=triton"], "the key 'attention-backend' is not an sglang ServerArgs"),
    (["--sglang-server-arg", "attention_backend"], "is not KEY=VALUE"),
    (["--sglang-server-arg", "tp_size=2"], "miles sets tp_size from --sglang-tp-size"),
    (["--sglang-server-arg", "a=1", "--sglang-server-arg", "a=2"], "sets a twice"),
    (["--sglang-mem-fraction-static", "1.5"], "--sglang-mem-fraction-static must be in (0, 1) (got 1.5)"),
    (["--sglang-tp-size", "0"], "--sglang-tp-size must be an int >= 1 (got 0)"),
    (["--sglang-tp-size", "2"], "an in-process sglang engine gets one GPU from Ray"),
    (["--sglang-url", "ftp://host:1"], "--sglang-url 'ftp://host:1': it is not http(s)://HOST[:PORT]"),
    (["--sglang-url", "http://h:1/generate"], "it has a path"),
    (["--sglang-url", "http://h:1", "--sglang-mem-fraction-static", "0.5"], "has no effect with --sglang-url"),
    (["--sglang-url", "http://h:1", "--num-rollout-engines", "2", "--num-train-ranks", "2"],
     "--sglang-url names 1 server(s) (http://h:1), and --num-rollout-engines is 2: each rollout engine drives one "
     "server. Fix: pass --num-rollout-engines 1, or one --sglang-url per rollout engine."),
    (["--sglang-url", "http://h:1", "--sglang-url", "http://h:1/", "--num-rollout-engines", "2",
      "--num-train-ranks", "2"], "names the server http://h:1 more than once"),
])
def test_sglang_flags_validated_at_the_boundary(tmp_path, argv, message):
    with pytest.raises(ArgumentError) as e:
        _validate(tmp_path, *argv)
    assert message in str(e.value)


def test_sglang_flags_refused_without_the_sglang_engine(tmp_path):
    # an sglang engine on another GPU takes the weights by broadcast (miles.weights.push): no --colocate needed
    assert not validate_args(parse_args(["--rollout-engine", "sglang", "--hf-checkpoint", _model(tmp_path),
                                         "--metrics-file", str(tmp_path / "m.jsonl")]),
                             _env(tmp=str(tmp_path))).cluster.colocate
    assert _validate(tmp_path, "--weight-sync", "distributed").rollout.weight_sync == "distributed"
    with pytest.raises(ArgumentError, match="--sglang-tp-size has no effect: --rollout-engine is embedded"):
        validate_args(parse_args(["--sglang-tp-size", "2", "--metrics-file", str(tmp_path / "m.jsonl")]),
                      _env(tmp=str(tmp_path)))
    with pytest.raises(ArgumentError, match="tiny random model, which has none"):
        validate_args(parse_args(["--rollout-engine", "sglang", "--tiny-model", *STREAM,
                                  "--metrics-file", str(tmp_path / "m.jsonl")]), _env(tmp=str(tmp_path)))
    with pytest.raises(ArgumentError, match="requires --offload-train-target=disk"):  # colocation's pairing holds
        _validate(tmp_path, "--offload-train-target", "cpu")


def test_rollout_engine_actor_builds_the_engine_the_flag_names(tmp_path, stub_sglang):
    from miles.ray.rollout_manager import build_engine
    from miles.rollout.sglang.engine import SglangRolloutEngine

    stub_sglang("0.5.17")
    config = _validate(tmp_path)
    engine = build_engine(config, engine_id=0)
    assert isinstance(engine, SglangRolloutEngine)
    import sglang

    assert sglang.ENGINES[-1].server_args["model_path"] == config.model.hf_checkpoint
    engine.close()
    assert sglang.ENGINES[-1].shut_down
