"""Flattened per-dtype weight buckets (miles/weights/buckets.py): packing order, alignment, the size bound,
large tensors alone, dtype grouping, non-contiguous sources, bit-exact round trips, spec validation."""

import json

import pytest
import torch

from miles.weights import BucketSpec, TensorSpec, iter_buckets, torch_dtype, unpack_bucket


def mixed_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed", torch.randn(33, 7, generator=g).to(torch.bfloat16)),
        ("norm", torch.randn(7, generator=g)),
        ("layer0.w", torch.randn(5, 11, generator=g).to(torch.bfloat16)),
        ("layer0.bias", torch.randn(3, generator=g)),
        ("step", torch.tensor(7, dtype=torch.int64)),
        ("layer1.w", torch.randn(9, 13, generator=g).to(torch.bfloat16)),
        ("empty", torch.empty(0, 4)),
    ]


def unpack_all(buckets):
    return {name: view.clone() for spec, flat in buckets for name, view in unpack_bucket(spec, flat)}


def test_round_trip_is_bit_exact_with_name_shape_dtype():
    tensors = mixed_tensors()
    got = unpack_all(iter_buckets(tensors, max_bytes=1024))
    assert list(sorted(got)) == sorted(n for n, _ in tensors)
    for name, t in tensors:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name], t), name


def test_each_bucket_holds_one_dtype_in_arrival_order_aligned_and_bounded():
    tensors = mixed_tensors()
    buckets = list(iter_buckets(tensors, max_bytes=1024, align=256))
    assert [spec.index for spec, _ in buckets] == list(range(len(buckets)))
    order = {name: i for i, (name, _) in enumerate(tensors)}
    for spec, flat in buckets:
        assert flat.dtype == torch.uint8 and flat.dim() == 1 and flat.numel() == spec.nbytes
        assert spec.nbytes <= 1024
        assert {t.dtype for t in spec.tensors} == {spec.dtype}
        assert [order[t.name] for t in spec.tensors] == sorted(order[t.name] for t in spec.tensors)
        assert all(t.offset % 256 == 0 for t in spec.tensors)
        assert [t.offset for t in spec.tensors] == sorted(t.offset for t in spec.tensors)
    by_dtype = {}
    for spec, _ in buckets:
        by_dtype.setdefault(spec.dtype, []).extend(t.name for t in spec.tensors)
    assert by_dtype["bfloat16"] == ["embed", "layer0.w", "layer1.w"]
    assert by_dtype["float32"] == ["norm", "layer0.bias", "empty"]
    assert by_dtype["int64"] == ["step"]


def test_bucket_closes_when_the_next_tensor_would_cross_the_bound():
    tensors = [(f"t{i}", torch.full((100,), float(i))) for i in range(5)]  # 400 B each, offsets 0, 512, ...
    specs = [spec for spec, _ in iter_buckets(tensors, max_bytes=1000, align=256)]
    assert [[t.name for t in s.tensors] for s in specs] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert [[t.offset for t in s.tensors] for s in specs] == [[0, 512], [0, 512], [0]]
    assert [s.nbytes for s in specs] == [912, 912, 400]


def test_a_tensor_larger_than_the_bound_is_a_bucket_of_its_own():
    tensors = [("small", torch.ones(10)), ("big", torch.arange(1000, dtype=torch.float32)),
               ("small2", torch.zeros(10))]
    buckets = list(iter_buckets(tensors, max_bytes=1024))
    names = [[t.name for t in spec.tensors] for spec, _ in buckets]
    assert ["big"] in names and len(names) == 2
    big_spec, big_flat = next(b for b in buckets if b[0].tensors[0].name == "big")
    assert big_spec.nbytes == 4000 and torch.equal(dict(unpack_bucket(big_spec, big_flat))["big"], tensors[1][1])


def test_non_contiguous_and_grad_sources_are_packed_by_value():
    base = torch.randn(8, 6)
    p = torch.nn.Parameter(torch.randn(4, 4))
    tensors = [("transposed", base.t()), ("strided", base[::2, 1::3]), ("param", p)]
    got = unpack_all(iter_buckets(tensors, max_bytes=1 << 20))
    for name, t in tensors:
        assert torch.equal(got[name], t.detach()), name
    assert not got["param"].requires_grad


def test_at_most_one_open_bucket_per_dtype_is_held():
    """Buckets are yielded as soon as they are full: the iterator never runs far ahead of its consumer."""
    pulled = []

    def source():
        for i in range(6):
            pulled.append(i)
            yield f"t{i}", torch.full((100,), float(i))

    it = iter_buckets(source(), max_bytes=1000)
    first, _ = next(it)
    assert [t.name for t in first.tensors] == ["t0", "t1"] and pulled == [0, 1, 2]


def test_unpack_gives_views_into_the_flat():
    spec, flat = next(iter_buckets([("a", torch.zeros(4)), ("b", torch.zeros(3, 2))], max_bytes=4096))
    views = dict(unpack_bucket(spec, flat))
    views["b"].fill_(1.0)
    assert flat[256:256 + 24].view(torch.float32).eq(1.0).all()
    assert views["b"].shape == (3, 2)


def test_device_argument_places_the_flat():
    spec, flat = next(iter_buckets([("a", torch.ones(3))], max_bytes=4096, device=torch.device("meta")))
    assert flat.device.type == "meta" and spec.nbytes == 12


def test_duplicate_names_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="duplicate.*'a'"):
        list(iter_buckets([("a", torch.ones(1)), ("a", torch.ones(2))], max_bytes=1024))
    with pytest.raises(ValueError, match="max_bytes"):
        list(iter_buckets([("a", torch.ones(1))], max_bytes=0))
    with pytest.raises(ValueError, match="align"):
        list(iter_buckets([("a", torch.ones(1))], max_bytes=1024, align=3))


def test_unpack_refuses_a_short_or_wrongly_typed_flat():
    spec, flat = next(iter_buckets([("a", torch.ones(8))], max_bytes=4096))
    with pytest.raises(ValueError, match="too small"):
        list(unpack_bucket(spec, flat[:16]))
    with pytest.raises(ValueError, match="uint8"):
        list(unpack_bucket(spec, flat.view(torch.float32)))


def test_torch_dtype_names():
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="'float33'"):
        torch_dtype("float33")


def test_spec_dict_round_trip_through_json():
    for spec, _ in iter_buckets(mixed_tensors(), max_bytes=1024):
        d = json.loads(json.dumps(spec.to_dict()))
        assert BucketSpec.from_dict(d) == spec


def good_dict():
    return {"index": 0, "dtype": "bfloat16", "nbytes": 512 + 6,
            "tensors": [{"name": "a", "shape": [2, 3], "dtype": "bfloat16", "offset": 0, "nbytes": 12},
                        {"name": "b", "shape": [3], "dtype": "bfloat16", "offset": 512, "nbytes": 6}]}


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(index=-1), "index"),
    (lambda d: d.update(index=True), "index"),
    (lambda d: d.update(dtype="floatX"), "dtype"),
    (lambda d: d.update(nbytes="518"), "nbytes"),
    (lambda d: d.update(tensors="a"), "tensors"),
    (lambda d: d.pop("nbytes"), "nbytes"),
    (lambda d: d["tensors"][0].update(name=3), r"tensors\[0\].name"),
    (lambda d: d["tensors"][0].update(shape=[2, -3]), r"tensors\[0\].shape"),
    (lambda d: d["tensors"][0].update(dtype="float32"), r"tensors\[0\].dtype"),
    (lambda d: d["tensors"][0].update(nbytes=13), r"tensors\[0\].nbytes"),
    (lambda d: d["tensors"][1].update(offset=513), r"tensors\[1\].offset"),
    (lambda d: d["tensors"][1].update(offset=514), r"tensors\[1\].offset"),   # past nbytes
    (lambda d: d["tensors"][1].update(offset=10), r"tensors\[1\].offset"),    # overlaps a
    (lambda d: d["tensors"][1].update(name="a"), r"tensors\[1\].name"),
    (lambda d: d.update(extra=1), "extra"),
])
def test_from_dict_names_the_bad_field(edit, field):
    d = good_dict()
    BucketSpec.from_dict(d)
    edit(d)
    with pytest.raises(ValueError, match=field):
        BucketSpec.from_dict(d)


def test_specs_are_frozen_value_objects():
    t = TensorSpec(name="a", shape=(2,), dtype="float32", offset=0, nbytes=8)
    with pytest.raises(AttributeError):
        t.offset = 4
    assert BucketSpec(index=0, dtype="float32", nbytes=8, tensors=(t,)).tensors[0] == t
