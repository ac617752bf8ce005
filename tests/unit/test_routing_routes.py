"""Routes (R3): the compact dtype, pickle / JSON round trips exact, and malformed routes refused with the value
named, alone and inside recorded rollouts (--save/--load-debug-rollout-data)."""

import base64
import json
import pickle

import numpy as np
import pytest

from miles.rollout.recorded import ReplayShape, RolloutDataError, write_rollout
from miles.rollout.types import Sample
from miles.routing import Routes, RoutesError, RouteShape
from miles.routing.routes import id_dtype

SHAPE = RouteShape(num_experts=8, top_k=2, layers=3)


def _ids(tokens, shape=SHAPE, seed=0):
    """[tokens, layers, top_k] distinct expert ids per token, drawn at random."""
    rng = np.random.default_rng(seed)
    draws = rng.random((tokens, shape.layers, shape.num_experts)).argsort(axis=-1)
    return draws[..., :shape.top_k]


@pytest.mark.parametrize("num_experts, dtype, itemsize", [(8, "uint8", 1), (256, "uint8", 1), (257, "int16", 2),
                                                         (32768, "int16", 2), (32769, "int32", 4)])
def test_ids_take_the_smallest_dtype_and_round_trip_exactly(num_experts, dtype, itemsize):
    shape = RouteShape(num_experts=num_experts, top_k=4, layers=3)
    ids = _ids(5, shape)
    ids[0, 0] = [num_experts - 1, 0, 1, 2]  # the largest id survives the compact dtype
    routes = Routes.from_expert_ids(ids, shape)
    assert id_dtype(num_experts) == np.dtype(dtype)
    assert shape.bytes_per_token == 3 * 4 * itemsize == len(routes.ids) // 5
    assert routes.tokens == 5
    assert np.array_equal(routes.expert_ids().numpy(), ids)
    assert pickle.loads(pickle.dumps(routes)) == routes
    assert Routes.from_json(json.loads(json.dumps(routes.to_json())), shape, sequence_tokens=6) == routes


def test_routes_cover_a_sequence_or_all_but_its_last_token():
    routes = Routes.from_expert_ids(_ids(4), SHAPE)
    assert routes.check(SHAPE, 4) is routes and routes.check(SHAPE, 5) is routes
    for tokens in (3, 6):
        with pytest.raises(RoutesError, match=f"routes of 4 tokens for a sequence of {tokens} tokens"):
            routes.check(SHAPE, tokens)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(num_experts=16), r"routes of RouteShape\(num_experts=16.*the model's are"),
    (lambda d: d.update(layers=0), "layers must be an int in 1..1024, got 0"),
    (lambda d: d.update(top_k=True), "top_k must be an int"),
    (lambda d: d.update(top_k=9), "top_k 9 is more than the 8 experts"),
    (lambda d: d.pop("ids"), "routes must be an object of num_experts, top_k, layers and ids"),
    (lambda d: d.update(extra=1), "routes must be an object of"),
    (lambda d: d.update(ids=[1, 2]), "ids must be a base64 string of at most 40 characters"),
    (lambda d: d.update(ids="A" * 44), "at most 40 characters"),
    (lambda d: d.update(ids="!!!!"), "not valid base64"),
    (lambda d: d.update(ids=base64.b64encode(bytes(7)).decode()), "7 bytes is no whole number of tokens of 6 bytes"),
    (lambda d: d.update(ids=base64.b64encode(bytes(6) * 2).decode()), "routes of 2 tokens for a sequence of 5"),
    (lambda d: d.update(ids=base64.b64encode(bytes([0, 1, 2, 3, 4, 8] * 4)).decode()), "expert id 8 is outside 0..7"),
    (lambda d: d.update(ids=base64.b64encode(bytes([0, 1, 2, 3, 4, 5] * 3 + [0, 1, 6, 6, 4, 5])).decode()),
     "token 3, MoE layer 1 names expert 6 twice"),
])
def test_malformed_routes_are_refused_naming_the_value(change, message):
    doc = Routes.from_expert_ids(_ids(4), SHAPE).to_json()
    change(doc)
    with pytest.raises(RoutesError, match=message):
        Routes.from_json(doc, SHAPE, sequence_tokens=5)


def test_routes_of_a_tensor_with_another_shape_are_refused():
    with pytest.raises(RoutesError, match=r"ids of shape \(4, 2, 2\), expected \[tokens, 3, 2\]"):
        Routes.from_expert_ids(np.zeros((4, 2, 2), dtype=np.int64), SHAPE)
    ids = _ids(1)
    ids[0, 2, 1] = -1
    with pytest.raises(RoutesError, match="expert id -1 is outside 0..7"):
        Routes.from_expert_ids(ids, SHAPE)


# ------------------------------------------------------------------------------------------ recorded rollouts


def _samples(with_routes=True):
    samples = []
    for i in range(4):
        prompt, response = [1, 2 + i // 2], [5, 6, 7][: 1 + i % 3]
        routes = Routes.from_expert_ids(_ids(len(prompt) + len(response) - 1, seed=i), SHAPE) if with_routes else None
        samples.append(Sample(index=i, prompt_index=i // 2, prompt_ids=prompt, response_ids=response,
                              response_logprobs=[-0.5] * len(response), response_text=f"r{i}", finish_reason="stop",
                              weight_version=1, reward=1.0, routes=routes))
    return samples


def _shape(template, routes=SHAPE):
    return ReplayShape(template=template, prompts=2, samples_per_prompt=2, max_response_len=8, vocab_size=100,
                       max_positions=1024, model="the tiny MoE", routes=routes)


def _rewrite(path, change):
    doc = json.loads(open(path).read())
    change(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def test_recorded_rollouts_keep_their_routes(tmp_path):
    template = str(tmp_path / "r_{rollout_id}.json")
    write_rollout(template, 0, _samples())
    assert _shape(template).read(0) == _samples()
    write_rollout(template, 1, _samples(with_routes=False))
    assert _shape(template).read(1) == _samples(with_routes=False)
    assert "routes" not in json.loads(open(tmp_path / "r_1.json").read())["samples"][0]


def test_a_recorded_rollout_bounds_its_routes_by_the_model(tmp_path):
    template = str(tmp_path / "r_{rollout_id}.json")
    path = write_rollout(template, 0, _samples())
    with pytest.raises(RolloutDataError, match="sample 0: carries routes, but the tiny MoE has no MoE router"):
        _shape(template, routes=None).read(0)
    with pytest.raises(RolloutDataError, match=r"sample 0: routes of RouteShape\(num_experts=8, top_k=2, layers=3\), "
                                               r"the model's are RouteShape\(num_experts=8, top_k=2, layers=4\)"):
        _shape(template, routes=RouteShape(num_experts=8, top_k=2, layers=4)).read(0)

    def out_of_range(doc):
        routes = doc["samples"][2]["routes"]
        ids = bytearray(base64.b64decode(routes["ids"]))
        ids[-1] = 200
        routes["ids"] = base64.b64encode(bytes(ids)).decode()
    _rewrite(path, out_of_range)
    with pytest.raises(RolloutDataError, match=r"r_0.json: sample 2: routes: expert id 200 is outside 0..7: replay "
                                               "with the model of the run that recorded it"):
        _shape(template).read(0)


def test_a_recorded_rollout_with_routes_for_some_samples_only_is_refused(tmp_path):
    template = str(tmp_path / "r_{rollout_id}.json")
    path = write_rollout(template, 0, _samples())
    _rewrite(path, lambda doc: doc["samples"][3].pop("routes"))
    with pytest.raises(RolloutDataError, match="sample 3 lacks routes and sample 0 has"):
        _shape(template).read(0)


def test_a_recorded_rollout_with_routes_of_the_wrong_length_is_refused(tmp_path):
    template = str(tmp_path / "r_{rollout_id}.json")
    samples = _samples()
    samples[1].routes = Routes.from_expert_ids(_ids(7), SHAPE)
    write_rollout(template, 0, samples)
    with pytest.raises(RolloutDataError, match="sample 1: routes ids must be a base64 string of at most 32 characters"):
        _shape(template).read(0)


def test_the_file_bound_grows_with_the_routes_a_model_records():
    assert _shape("x").max_file_bytes - _shape("x", routes=None).max_file_bytes == 4 * 4 * 4 * (1024 * 6 // 3)


def test_a_replay_of_an_moe_model_expects_its_route_shape(tmp_path):
    from miles.config import parse_args
    from miles.models import random_model_config
    from miles.preflight import validate_args

    config = validate_args(parse_args(["--tiny-model", "--offload-train-disk-dir", str(tmp_path / "d"),
                                       "--load-debug-rollout-data", str(tmp_path / "r_{rollout_id}.json")]))
    glm = random_model_config("glm5-tiny", 100).to_dict()  # 3 layers, the first dense
    assert ReplayShape.of_run(config, glm, "glm5-tiny").routes == RouteShape(num_experts=8, top_k=2, layers=2)
    llama = random_model_config("llama-tiny", 100).to_dict()
    assert ReplayShape.of_run(config, llama, "llama-tiny").routes is None
