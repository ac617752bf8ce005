"""Checkpoints of narrow moments (bf16, fp16, fp8e4m3, fp8e5m2).

Resume at the same data-parallel size (DP=1 plain AdamW and ZeRO-1, DP=2 ZeRO-1) is bit-identical: the
checkpoint records the stochastic-rounding generators and the next step's bucket order (codec_rng.py),
taken at the snapshot, also when the copy runs in the background. A corrupt record is a CheckpointError
naming the file; a checkpoint without the record (written before it existed) still loads, and the
noise restarts from the seeds (logged).

Resume on another data-parallel size (DP=2 -> DP=1, DP=1 -> DP=2): bf16 moments are byte copies
(equal to the saved ones, bit for bit); block-scaled ones (fp16, fp8) are decoded and re-quantized in
the new blocks (requantize.py). Their bytes equal a direct encode of the saved decoded moments in the
new layout: the same scales and, per element, the same code (fp16, nearest rounding) or a neighbouring
one (fp8, stochastic rounding), i.e. within one quantization step. Training goes on finite.
"""

import json
import os
import pathlib
import socket
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402

from miles_plugins.optimizers.streaming.checkpoint import rng as codec_rng  # noqa: E402
from miles_plugins.optimizers.streaming.codec import (  # noqa: E402
    BlockScaledCodec, codec_from_description, make_moment_codecs)
from miles_plugins.optimizers.streaming.layout import MOMENTS  # noqa: E402
from miles_plugins.optimizers.streaming.checkpoint.requantize import block_window  # noqa: E402
from miles_plugins.optimizers.streaming.io.stager import StoreConfigError  # noqa: E402
from test_checkpoint import (  # noqa: E402,F401  (_restarted_process: autouse fixture)
    CheckpointError, _expect_error, _restarted_process, assert_same, build, gather, restart, start_copier_late,
    in_child, in_children, load, rewrite_manifest, save, state, state_parts, train)

NARROW = ("bf16", "fp16", "fp8e4m3", "fp8e5m2")
STOCHASTIC = ("bf16", "fp8e4m3", "fp8e5m2")
FP32 = torch.float32
# test_checkpoint's params with a smaller param 4: the DP=2 shard boundary (element 3481) falls inside
# param 3, which has Adam state, away from the DP=1 buckets' block boundaries, so blocks really move
SHAPES = [(37, 29), (1000,), (3,), (4099,), (25, 31), (11,)]


def _manifest(base):
    return json.loads(open(os.path.join(base, "nvme_opt_state/rank00000/opt0_0/manifest.json")).read())


def _write_manifest(base, m):
    """A consistent manifest (its checksum recomputed) with other contents."""
    rewrite_manifest(pathlib.Path(base) / "nvme_opt_state/rank00000/opt0_0", m)


# ---- codec level ------------------------------------------------------------------------------------
@pytest.mark.parametrize("moment_dtype", NARROW)
def test_codec_rng_state_continues_the_noise(moment_dtype):
    x = torch.randn(3000, generator=torch.Generator().manual_seed(3)) * 1e-3
    a, b = make_moment_codecs(moment_dtype)["exp_avg"], make_moment_codecs(moment_dtype)["exp_avg"]
    a.encode([x])
    saved = a.rng_state()
    assert bool(saved) == (moment_dtype in STOCHASTIC)
    after = a.encode([x])[0]
    b.set_rng_state(saved)
    assert torch.equal(b.encode([x])[0], after), "restored generator draws the same noise"
    b.set_rng_state({})
    assert torch.equal(b.encode([x])[0], make_moment_codecs(moment_dtype)["exp_avg"].encode([x])[0]), \
        "no state: the noise restarts from the seed"
    if moment_dtype in STOCHASTIC:
        with pytest.raises(RuntimeError):
            b.set_rng_state({"cpu": torch.zeros(3, dtype=torch.uint8)})
    else:
        with pytest.raises(ValueError, match="draws no noise"):
            b.set_rng_state({"cpu": torch.zeros(3, dtype=torch.uint8)})


def test_codec_from_description_finds_the_saved_codec():
    for moment_dtype in ("fp32",) + NARROW:
        for codec in make_moment_codecs(moment_dtype).values():
            assert codec_from_description(codec.describe()).describe() == codec.describe()
    other = {**make_moment_codecs("fp8e4m3")["exp_avg"].describe(), "block_size": 128}
    with pytest.raises(StoreConfigError, match="no codec of this build stores a segment as .*'block_size': 128"):
        codec_from_description(other)


def test_saved_generator_state_follows_the_store_device():
    cuda1 = torch.device("cuda", 1)
    assert codec_rng._target_device("cuda:0", cuda1) == cuda1  # a restarted job may number GPUs otherwise
    assert codec_rng._target_device("cpu", torch.device("cpu")) == torch.device("cpu")
    assert codec_rng._target_device("cuda:0", torch.device("cpu")) is None  # another generator kind
    with pytest.raises(codec_rng.RngRecordError, match="'gpu0' is not a device"):
        codec_rng._target_device("gpu0", cuda1)


def test_block_window_is_a_segment_of_its_own():
    # 1000 elements in blocks of 256: 4 blocks, the last holding 232 elements
    assert block_window(256, 1, 1000, 0, 1000) == (0, 1000, 0, 16, 16)
    assert block_window(256, 2, 1000, 300, 301) == (256, 256, 4, 4, 16 + 2 * 256)
    assert block_window(256, 1, 1000, 511, 769) == (256, 744, 4, 12, 16 + 256)
    with pytest.raises(ValueError, match=r"elements \[990, 1001\) are not inside a segment of 1000"):
        block_window(256, 1, 1000, 990, 1001)
    codec = make_moment_codecs("fp8e4m3")["exp_avg_sq"]
    x = torch.rand(1000, generator=torch.Generator().manual_seed(1))
    buf, whole = codec.encode([x])[0], torch.empty(1000)
    codec.decode([buf], whole)
    first, count, s_at, s_n, p_at = block_window(256, 1, 1000, 511, 769)
    part = torch.empty(count)
    codec.decode([torch.cat([buf[s_at:s_at + s_n], buf[p_at:p_at + count]])], part)
    assert torch.equal(part, whole[first:first + count])


# ---- bit-identical resume at the same data-parallel size --------------------------------------------
def _run6(kind, root, moment_dtype):
    params, opt, store = build(kind, root, moment_dtype=moment_dtype)
    train(params, opt, range(6))
    return state(store, params)


def _run3_save(kind, root, base, background, moment_dtype):
    params, opt, store = build(kind, root, moment_dtype=moment_dtype)
    train(params, opt, range(3))
    at_save = state(store, params)
    if background:  # a copier that starts late: the next steps draw noise before it writes anything
        start_copier_late()
    save(params, store, base, wait=not background)
    train(params, opt, range(3, 6))
    stats = store.wait_for_save() if background else None
    return at_save, state(store, params), stats


def _load_run3(kind, root, base, moment_dtype):
    params, opt, store = build(kind, root, moment_dtype=moment_dtype)
    assert load(params, opt, store, base) is True
    loaded = state(store, params)
    train(params, opt, range(3, 6))
    return loaded, state(store, params)


@pytest.mark.parametrize("moment_dtype", NARROW)
@pytest.mark.parametrize("kind, background", [("plain", False), ("sharded", True)])
def test_narrow_moment_resume_is_bit_identical(tmp_path, kind, background, moment_dtype):
    """6 steps == 3 steps + save + load into a fresh store (a new process) + 3 steps, bit for bit:
    params, masters, both moments and the step counts."""
    ref = in_child(_run6, kind, tmp_path / "live", moment_dtype)
    at_save, after, stats = in_child(_run3_save, kind, tmp_path / "live", str(tmp_path / "iter3"), background,
                                     moment_dtype)
    assert_same(after, ref, "saving must not change training")
    if background:
        assert stats["copied_by_writer"] > 0, stats  # the copy ran after the next step's encodes
    loaded, resumed = in_child(_load_run3, kind, tmp_path / "live", str(tmp_path / "iter3"), moment_dtype)
    assert_same(loaded, at_save, "state after load")
    assert_same(resumed, ref, "resumed run")
    m = _manifest(str(tmp_path / "iter3"))
    assert m["next_bucket_order"] == "descending"  # 3 steps taken: the 4th walks the buckets backwards
    if moment_dtype in STOCHASTIC:
        assert m["codec_rng"]["devices"] == {"exp_avg": ["cpu"], "exp_avg_sq": ["cpu"]}
        assert os.path.getsize(tmp_path / "iter3/nvme_opt_state/rank00000/opt0_0/codec_rng.pt") == \
            m["codec_rng"]["file_bytes"]
    else:
        assert "codec_rng" not in m  # nearest rounding: no noise to record


@pytest.fixture
def saved_bf16(tmp_path):
    """A plain bf16 checkpoint after 3 steps: (tmp_path, base)."""
    restart()
    params, opt, store = build("plain", tmp_path / "live", moment_dtype="bf16")
    train(params, opt, range(3))
    save(params, store, str(tmp_path / "ck"))
    store.close()
    restart()
    return tmp_path, str(tmp_path / "ck")


def test_corrupt_rng_record_is_a_checkpoint_error(saved_bf16):
    tmp_path, base = saved_bf16
    path = os.path.join(base, "nvme_opt_state/rank00000/opt0_0", codec_rng.FILE)
    original = data = open(path, "rb").read()
    with open(path, "r+b") as f:
        f.seek(len(data) // 2)
        f.write(bytes([data[len(data) // 2] ^ 0x01]))
    _expect_error(tmp_path, base, r"codec_rng\.pt: checksum mismatch; the file is corrupt", kind="plain",
                  moment_dtype="bf16")
    m = _manifest(base)
    for record, match in (
            ({"version": 1, "segments": {"exp_avg": {"cpu": torch.zeros(16, dtype=torch.uint8)},
                                         "exp_avg_sq": {}}}, r"segment exp_avg, device cpu: invalid generator state"),
            ({"version": 1, "segments": {"exp_avg": {}}}, r"generators of segments \['exp_avg'\], the codecs of "
                                                          r"this store draw noise for \['exp_avg', 'exp_avg_sq'\]"),
            ({"version": 7}, "not a version-1 record")):
        torch.save(record, path)  # consistent (size and checksum in the manifest), wrong contents
        data = open(path, "rb").read()
        _write_manifest(base, {**m, "codec_rng": {**m["codec_rng"], "file_bytes": len(data),
                                                  "crc32": zlib.crc32(data)}})
        _expect_error(tmp_path, base, r"codec_rng\.pt: the record of the stochastic-rounding generators is corrupt "
                      r"or does not fit this store \(.*" + match, kind="plain", moment_dtype="bf16")
    with open(path, "wb") as f:
        f.write(original)
    _write_manifest(base, {**m, "next_bucket_order": "sideways"})
    _expect_error(tmp_path, base, r"next_bucket_order is 'sideways'", kind="plain", moment_dtype="bf16")


def test_checkpoint_without_rng_record_loads_and_restarts_the_noise(saved_bf16, caplog):
    """A checkpoint written before the record existed: it loads, and the noise restarts from the seeds."""
    tmp_path, base = saved_bf16
    restart()
    params, opt, store = build("plain", tmp_path / "live", moment_dtype="bf16")
    assert load(params, opt, store, base)
    expected = state(store, params)
    store.close()
    m = _manifest(base)
    os.unlink(os.path.join(base, "nvme_opt_state/rank00000/opt0_0", codec_rng.FILE))
    _write_manifest(base, {k: v for k, v in m.items() if k not in ("codec_rng", "next_bucket_order")})
    restart()
    params, opt, store = build("plain", tmp_path / "live", moment_dtype="bf16")
    train(params, opt, range(1))  # the generators have drawn noise: the load must put them back at the seed
    with caplog.at_level("WARNING"):
        assert load(params, opt, store, base)
    assert caplog.text.count("restarts from the seed") == 1, caplog.text
    assert all(store.codecs[n].rng_state() == {} for n in MOMENTS)
    assert_same(state(store, params), expected, "state after load")
    train(params, opt, range(3, 5))
    assert all(torch.isfinite(p).all() for p in params)
    store.close()


# ---- another data-parallel size -----------------------------------------------------------------------
def _segment_codes(store, bucket, name):
    """A block-scaled segment as the live file holds it: (scales, payload codes as fp32)."""
    seg, codec = bucket.layout.segments[name], store.codecs[name]
    with open(bucket.file.path, "rb") as f:
        f.seek(seg.offset)
        raw = torch.frombuffer(bytearray(f.read(seg.nbytes)), dtype=torch.uint8)
    nb = codec.num_blocks(bucket.numel)
    return raw[:4 * nb].view(torch.float32), raw[4 * nb:].view(codec.fmt.dtype).float()


def _code_step(codec, a):
    """Distance from the code `a` (fp32, representable) to its neighbour towards larger magnitude, on the
    codec's payload grid; the smallest subnormal at 0."""
    fmt = codec.fmt
    e = torch.floor(torch.log2(a.abs().clamp_min(fmt.min_normal))).clamp_min(fmt.min_exponent)
    return torch.where(a == 0, torch.full_like(a, fmt.min_positive), torch.exp2(e - fmt.mantissa_bits))


def check_resharded(store, expected, moment_dtype):
    """After a resharded load: masters and steps equal the saved ones; bf16 moments equal them bit for
    bit; block-scaled moments equal a direct encode of the saved decoded moments in this store's
    layout (same scales; payload codes equal (fp16) or neighbours (fp8): one quantization step)."""
    parts, changed = state_parts(store), 0
    for name, (main, m, v, step) in ((k, t) for k, t in gather([parts]).items() if k != "params"):
        start = min(p[0] for p in parts[name])
        ref = expected[name]
        assert torch.equal(main, ref[0][start:start + main.numel()]) and step == ref[3], name
        if m is not None:
            changed += int((m != ref[1][start:start + m.numel()]).sum() + (v != ref[2][start:start + v.numel()]).sum())
    if moment_dtype == "bf16":
        assert changed == 0, f"bf16 moments reshard by byte copies: {changed} values changed"
        return 0, 0
    neighbours = 0
    for b in store.buckets:
        if not b.moments_on_disk:
            continue
        for k, name in enumerate(MOMENTS):
            x = torch.zeros(b.numel)  # the saved decoded moments in this bucket's layout, 0 without state
            for j, piece in enumerate(b.pieces):
                e = store.entries[piece.entry]
                if b.optimizer.state.get(b.params[j]):
                    lo = e.start + piece.start
                    x[b.offsets[j]:b.offsets[j + 1]] = expected[e.name][1 + k][lo:lo + piece.numel]
            codec = store.codecs[name]
            assert isinstance(codec, BlockScaledCodec)
            direct = codec_from_description(codec.describe()).encode([x])[0]
            nb = codec.num_blocks(b.numel)
            d_scales, d_codes = direct[:4 * nb].view(torch.float32), direct[4 * nb:].view(codec.fmt.dtype).float()
            scales, codes = _segment_codes(store, b, name)
            assert torch.equal(scales, d_scales), f"bucket {b.index} {name}: scales differ"
            if moment_dtype == "fp16":  # nearest rounding: the very same bytes
                assert torch.equal(codes, d_codes), f"bucket {b.index} {name}: codes differ"
                continue
            gap = (codes - d_codes).abs()  # stochastic: both codes are one of the two neighbours of x / scale
            assert ((gap == 0) | (gap == _code_step(codec, torch.minimum(codes.abs(), d_codes.abs())))).all(), \
                f"bucket {b.index} {name}: codes more than one step apart ({gap.max().item()})"
            neighbours += int((gap != 0).sum())
    return neighbours, changed


def _finite(store, params):
    st = state(store, params)
    return all(torch.isfinite(p).all() for p in params) and all(
        t is None or torch.isfinite(t).all() for name, ps in st.items() if name != "params" for t in ps[:3])


def _dp1(root, base_out, base_in, expected, moment_dtype):
    params, opt, store = build("sharded", root, dtype=FP32, shapes=SHAPES, moment_dtype=moment_dtype)
    if base_in is None:
        train(params, opt, range(3), virtual_world=2)
        at3 = state(store, params)
        save(params, store, base_out)
        return at3, None
    assert load(params, opt, store, base_in)
    counts = check_resharded(store, expected, moment_dtype)
    train(params, opt, range(3, 6), virtual_world=2)
    assert _finite(store, params)
    return None, counts


def _dp2_rank(rank, port, root, base_out, base_in, expected, moment_dtype):
    """Save phase (base_in None): 3 steps, save, 3 more -> (parts at 3, parts at 6). Load phase: resume
    from this size's own checkpoint (base_out) -> parts at 6, then from the DP=1 one (base_in, resharded)
    -> counts of check_resharded."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    params_of = lambda ps: [p.detach().clone() for p in ps]  # noqa: E731
    try:
        params, opt, store = build("sharded", root, dtype=FP32, shapes=SHAPES, moment_dtype=moment_dtype)
        assert opt.dp_world_size == 2
        if base_in is None:
            train(params, opt, range(3), rank, world=2)
            at3 = state_parts(store), params_of(params)
            save(params, store, base_out)
            train(params, opt, range(3, 6), rank, world=2)
            return at3, (state_parts(store), params_of(params))
        assert load(params, opt, store, base_out)  # same size: each rank restores its own generators
        train(params, opt, range(3, 6), rank, world=2)
        same_size = state_parts(store), params_of(params)
        store.close()
        restart()
        params, opt, store = build("sharded", root, dtype=FP32, shapes=SHAPES, moment_dtype=moment_dtype)
        assert load(params, opt, store, base_in)
        counts = check_resharded(store, expected, moment_dtype)
        train(params, opt, range(3, 6), rank, world=2)
        assert _finite(store, params)
        return same_size, counts
    finally:
        dist.destroy_process_group()


def _dp2(*args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return in_children(_dp2_rank, [(r, port, *args) for r in range(2)])


@pytest.mark.parametrize("moment_dtype", NARROW)
def test_narrow_moments_reshard_across_data_parallel_sizes(tmp_path, moment_dtype):
    """DP=2 -> DP=1 and DP=1 -> DP=2 re-quantize (check_resharded); DP=2 -> DP=2 resumes bit-identically."""
    dp1_at3, _ = in_child(_dp1, tmp_path / "live1", str(tmp_path / "dp1_iter3"), None, None, moment_dtype)
    ranks = _dp2(tmp_path / "live2", str(tmp_path / "dp2_iter3"), None, None, moment_dtype)
    dp2_at3 = gather([ranks[0][0][0], ranks[1][0][0]], ranks[0][0][1])

    dp2_at6 = gather([ranks[0][1][0], ranks[1][1][0]], ranks[0][1][1])

    _, n21 = in_child(_dp1, tmp_path / "live1", None, str(tmp_path / "dp2_iter3"), dp2_at3, moment_dtype)
    ranks = _dp2(tmp_path / "live2", str(tmp_path / "dp2_iter3"), str(tmp_path / "dp1_iter3"), dp1_at3,
                 moment_dtype)
    assert_same(gather([ranks[0][0][0], ranks[1][0][0]], ranks[0][0][1]), dp2_at6, "DP=2 -> DP=2: resumed run")
    n12 = tuple(a + b for a, b in zip(ranks[0][1], ranks[1][1]))
    if moment_dtype != "bf16":  # blocks moved: values were re-quantized (not bit-identical) ...
        assert n21[1] > 0 and n12[1] > 0, (n21, n12)
    if moment_dtype in ("fp8e4m3", "fp8e5m2"):  # ... and stochastic rounding took the other neighbour at times
        assert n21[0] > 0 and n12[0] > 0, (n21, n12)


# ---- resume with another moment_dtype -----------------------------------------------------------------
@pytest.mark.parametrize("saved_dtype, load_dtype", [
    ("fp8e4m3", "fp32"), ("fp16", "fp32"), ("bf16", "fp32"),  # widening: exact
    ("fp32", "bf16"), ("fp8e5m2", "bf16"),                      # one stochastic rounding to bf16
    ("fp32", "fp16"), ("fp8e4m3", "fp16"),                      # block-scaled, nearest: a direct encode's bytes
    ("fp32", "fp8e4m3"), ("bf16", "fp8e5m2"),                   # block-scaled, stochastic: a neighbour code
])
@pytest.mark.parametrize("bucket_numel", [None, 3000], ids=["same-buckets", "other-buckets"])
def test_resume_with_another_moment_dtype_converts_the_moments(tmp_path, saved_dtype, load_dtype, bucket_numel):
    """The moment format may change between save and resume (say, to fp8 when the disk fills up): the
    saved moments are decoded to fp32 and encoded in the new format; masters and steps stay exact. The
    same holds when the layout changes too (another bucket size here; another DP size takes the same plan)."""
    params, opt, store = build("plain", tmp_path / "live", dtype=FP32, shapes=SHAPES, moment_dtype=saved_dtype)
    train(params, opt, range(3))
    saved = state(store, params)
    save(params, store, str(tmp_path / "ck"))
    store.close()
    restart()
    params, opt, store = build("plain", tmp_path / "live", dtype=FP32, shapes=SHAPES, moment_dtype=load_dtype,
                               **({"bucket_numel": bucket_numel} if bucket_numel else {}))
    assert load(params, opt, store, str(tmp_path / "ck")) is True
    got = state(store, params)
    assert got.keys() == saved.keys()
    for name in (k for k in saved if k != "params"):
        (main, m, v, step), (ref_main, ref_m, ref_v, ref_step) = got[name], saved[name]
        assert torch.equal(main, ref_main) and step == ref_step, name
        if load_dtype == "fp32":
            assert m is None or (torch.equal(m, ref_m) and torch.equal(v, ref_v)), f"{name}: widening is exact"
        elif load_dtype == "bf16" and m is not None:
            for x, y in ((ref_m, m), (ref_v, v)):  # stochastic rounding to bf16: within one ulp (2^-7 relative)
                assert ((y - x).abs() <= x.abs() * 2.0**-7).all(), name
    if load_dtype in ("fp16", "fp8e4m3", "fp8e5m2"):
        check_resharded(store, saved, load_dtype)
    train(params, opt, range(3, 5))
    assert _finite(store, params)
    store.close()


def test_unknown_saved_moment_format_is_a_clear_error(tmp_path):
    params, opt, store = build("plain", tmp_path / "live", moment_dtype="bf16")
    train(params, opt, range(2))
    save(params, store, str(tmp_path / "ck"))
    store.close()
    m = _manifest(str(tmp_path / "ck"))
    m["segments"]["exp_avg"] = {**m["segments"]["exp_avg"], "name": "bf17"}
    _write_manifest(str(tmp_path / "ck"), m)
    restart()
    params, opt, store = build("plain", tmp_path / "live", moment_dtype="fp32")
    with pytest.raises(CheckpointError, match="no codec of this build stores a segment as .*bf17"):
        load(params, opt, store, str(tmp_path / "ck"))
    store.close()
