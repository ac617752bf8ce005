"""Moment codecs on CPU: round-trip error bounds on adversarial data, no NaN/Inf, exact byte arithmetic,
the on-disk layout, unbiased stochastic rounding, determinism and the error for unsupported formats."""

import math

import pytest
import torch

from miles_plugins.optimizers.streaming.codec import (
    BLOCK_SIZE, CHUNK_NUMEL, FORMATS, MOMENT_DTYPES, BlockScaledCodec, CastCodec, Fp32Codec, _round,
    make_moment_codecs)
from miles_plugins.optimizers.streaming.layout import EXP_AVG, EXP_AVG_SQ
from miles_plugins.optimizers.streaming.io.stager import StoreConfigError, as_bytes

NARROW = ("bf16", "fp16", "fp8e4m3", "fp8e5m2")
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8e4m3": 1, "fp8e5m2": 1}


def adversarial(n=20_000, seed=0, nonnegative=False):
    """Magnitudes log-uniform over 1e-30..1e3, every sign pattern, zeros, and whole blocks that are
    all zero, a single spike, constant, or span the full range inside one block."""
    g = torch.Generator().manual_seed(seed)
    x = 10 ** (torch.rand(n, generator=g, dtype=torch.float64) * 33 - 30)
    x = x.float() * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x[::7] = 0
    x[1:200:2] *= -1  # alternating signs
    B = BLOCK_SIZE
    x[B:2 * B] = 0  # an all-zero block
    x[2 * B:3 * B] = 0
    x[2 * B + 17] = 1e3  # one spike among zeros
    x[3 * B:4 * B] = -3.25e-7  # constant block
    x[4 * B:5 * B] = torch.logspace(-30, 3, B)  # the whole range inside one block
    x[5 * B:6 * B] = 1e-30  # the smallest magnitude, a whole block of it
    return x.abs() if nonnegative else x


def roundtrip(codec, values):
    """encode -> the bytes a file would hold -> empty_encoded -> decode, as the bucket does."""
    numel = sum(v.numel() for v in values)
    raw = torch.cat([as_bytes(t) for t in codec.encode(values)]) if numel else torch.empty(0, dtype=torch.uint8)
    assert raw.numel() == codec.encoded_nbytes(numel)
    encoded, offset = codec.empty_encoded(numel, torch.device("cpu")), 0
    for part in encoded:
        as_bytes(part).copy_(raw[offset:offset + part.nbytes])
        offset += part.nbytes
    assert offset == raw.numel()
    out = torch.full((numel,), float("nan"))
    codec.decode(encoded, out)
    return out


def error_bound(codec, x):
    """Largest |decoded - x| the format allows, element by element (with a little fp32 slack)."""
    fmt = codec.fmt
    ulps = 1.0 if codec.stochastic else 0.5  # stochastic rounding moves up to one ulp, nearest half
    rel = ulps * 2.0 ** -fmt.mantissa_bits
    if isinstance(codec, CastCodec):  # bf16: fp32's exponent range, values here are all normal
        return x.abs() * rel * (1 + 1e-5)
    B = codec.block_size
    y = x.sign() * x.abs().sqrt() if codec.sqrt else x
    n = y.numel()
    padded = torch.zeros(-(-n // B) * B)
    padded[:n] = y.abs()
    scale = (padded.view(-1, B).amax(1) / fmt.max).clamp_min(torch.finfo(torch.float32).tiny)
    scale = scale.repeat_interleave(B)[:n]
    # one (half) ulp of the value, or of the smallest subnormal step where the value is that small;
    # the nonzero floor lifts a value to one smallest step at most
    delta = torch.maximum(y.abs() * rel, scale * fmt.min_positive * (1.0 if codec.floor_nonzero else ulps))
    delta = delta * (1 + 1e-5) + y.abs() * 1e-6
    if codec.sqrt:
        return delta * (2 * y.abs() + delta)
    return delta


def all_codecs():
    for dtype in NARROW:
        for segment, codec in make_moment_codecs(dtype).items():
            yield pytest.param(dtype, segment, id=f"{dtype}-{segment}")


@pytest.mark.parametrize("dtype,segment", list(all_codecs()))
def test_roundtrip_error_bounds_on_adversarial_data(dtype, segment):
    codec = make_moment_codecs(dtype)[segment]
    x = adversarial(nonnegative=segment == EXP_AVG_SQ)
    pieces = [x[:333], x[333:334], x[334:5000], x[5000:]]  # piece boundaries inside blocks
    out = roundtrip(codec, pieces)
    assert torch.isfinite(out).all()
    assert torch.equal(out[x == 0], torch.zeros_like(out[x == 0])), "zeros must stay zeros"
    assert ((out == 0) | (out.sign() == x.sign())).all(), "a sign never flips"
    err = (out.double() - x.double()).abs()
    bound = error_bound(codec, x).double()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"x={x[worst].item():.6g} decoded {out[worst].item():.6g} bound {bound[worst].item():.3g}")
    if segment == EXP_AVG_SQ:
        assert not ((out == 0) & (x != 0)).any(), "a nonzero exp_avg_sq must never decode to 0"
        assert (out >= 0).all()


@pytest.mark.parametrize("dtype", NARROW)
def test_typical_relative_error(dtype):
    """Values within a few decades of their block's max: the error is the mantissa's, per format."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50_000, generator=g) * 1e-4
    limit = {"bf16": 2 ** -8, "fp16": 2 ** -11, "fp8e4m3": 2 ** -3, "fp8e5m2": 2 ** -2}[dtype]
    for segment, codec in make_moment_codecs(dtype).items():
        xs = x.abs() if segment == EXP_AVG_SQ else x
        out = roundtrip(codec, [xs])
        big = xs.abs() > 1e-6
        rel = ((out - xs).abs() / xs.abs())[big]
        assert rel.median() < limit, (segment, rel.median().item())


@pytest.mark.parametrize("dtype", NARROW)
def test_extreme_magnitudes_never_produce_inf_or_nan(dtype):
    big = torch.tensor([3.4e38, -3.4e38, 1e38, 1e-45, -1e-45, 1e-38, 0.0, 2.0 ** -149] * 40)
    for segment, codec in make_moment_codecs(dtype).items():
        x = big.abs() if segment == EXP_AVG_SQ else big
        out = roundtrip(codec, [x])
        assert torch.isfinite(out).all(), (segment, out)
        assert ((out == 0) | (out.sign() == x.sign())).all()
        assert (out.abs() >= x.abs() * 0.5).all() or segment == EXP_AVG, "large values stay large"


@pytest.mark.parametrize("dtype", MOMENT_DTYPES)
@pytest.mark.parametrize("numel", [1, 2, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 4099, 100_003])
def test_encoded_nbytes_is_the_arithmetic(dtype, numel):
    blocks = math.ceil(numel / BLOCK_SIZE)
    expected = numel * ITEMSIZE[dtype] + (4 * blocks if dtype in ("fp16", "fp8e4m3", "fp8e5m2") else 0)
    for codec in make_moment_codecs(dtype).values():
        assert codec.encoded_nbytes(numel) == expected
        if not codec.reads_in_place():
            assert sum(t.nbytes for t in codec.empty_encoded(numel, torch.device("meta"))) == expected
            x = torch.rand(numel)
            assert sum(t.nbytes for t in codec.encode([x])) == expected


def test_bytes_per_param_per_step():
    """12 (fp32), 8 (16-bit; fp16 adds its block scales), ~6 (fp8 + scales): master + two moments."""
    n = 1024 * BLOCK_SIZE
    per_param = {d: (4 * n + sum(c.encoded_nbytes(n) for c in make_moment_codecs(d).values())) / n
                 for d in MOMENT_DTYPES}
    assert per_param == {"fp32": 12.0, "bf16": 8.0, "fp16": 8.0 + 8 / BLOCK_SIZE,
                         "fp8e4m3": 6.0 + 8 / BLOCK_SIZE, "fp8e5m2": 6.0 + 8 / BLOCK_SIZE}


@pytest.mark.parametrize("dtype", ("fp16", "fp8e4m3", "fp8e5m2"))
def test_block_scaled_layout_is_scales_then_payload(dtype):
    """One tensor per segment: [fp32 scale per block | payload]; scale = max|stored value| / format max."""
    codec = make_moment_codecs(dtype)[EXP_AVG]
    x = torch.randn(3 * BLOCK_SIZE + 5, generator=torch.Generator().manual_seed(1))
    (buf,) = codec.encode([x])
    assert buf.dtype == torch.uint8 and buf.numel() == codec.encoded_nbytes(x.numel())
    blocks = 4
    scales = buf[:4 * blocks].view(torch.float32)
    padded = torch.zeros(blocks * BLOCK_SIZE)
    padded[:x.numel()] = x.abs()
    torch.testing.assert_close(scales, padded.view(blocks, -1).amax(1) / FORMATS[dtype].max, rtol=0, atol=0)
    payload = buf[4 * blocks:].view(FORMATS[dtype].dtype)
    assert payload.float().abs().max() <= FORMATS[dtype].max
    d = codec.describe()
    assert d["name"] == dtype and d["block_size"] == BLOCK_SIZE and d["scale_dtype"] == "float32"
    assert "scales" in d["layout"] and d["storage_dtype"] == str(FORMATS[dtype].dtype).replace("torch.", "")


def test_describe_and_names():
    expected_sqrt = {"fp16": True, "fp8e4m3": True, "fp8e5m2": False}
    for dtype in MOMENT_DTYPES:
        codecs = make_moment_codecs(dtype)
        assert set(codecs) == {EXP_AVG, EXP_AVG_SQ}
        for segment, codec in codecs.items():
            d = codec.describe()
            assert codec.name == d["name"] == dtype
            assert {"name", "storage_dtype", "block_size", "layout"} <= set(d)
            if dtype in expected_sqrt:
                assert d["transform"].startswith("signed sqrt") == (segment == EXP_AVG_SQ and expected_sqrt[dtype])
    assert isinstance(make_moment_codecs("fp32")[EXP_AVG], Fp32Codec)
    assert make_moment_codecs("fp32")[EXP_AVG].reads_in_place()


@pytest.mark.parametrize("bad", ["fp8", "FP32", "bfloat16", "int8", "", None, torch.bfloat16])
def test_unsupported_moment_dtype_lists_the_valid_ones(bad):
    with pytest.raises(StoreConfigError) as err:
        make_moment_codecs(bad)
    msg = str(err.value)
    assert repr(bad) in msg and "fp32, bf16, fp16, fp8e4m3, fp8e5m2" in msg
    assert "unscaled" not in msg  # the private comparison codec is not offered


@pytest.mark.parametrize("dtype", NARROW)
def test_encode_never_modifies_its_input_and_keeps_the_device(dtype):
    for codec in make_moment_codecs(dtype).values():
        x = adversarial(3000, seed=5, nonnegative=True)
        before = x.clone()
        parts = codec.encode([x[:100], x[100:]])
        assert torch.equal(x, before)
        assert all(p.device == x.device and p.is_contiguous() for p in parts)
        assert all(p.dtype in (torch.uint8, torch.bfloat16) for p in parts)  # what the stager copies as is
        assert all(t.device.type == "meta" for t in codec.empty_encoded(10, torch.device("meta")))


@pytest.mark.parametrize("dtype", NARROW)
def test_stochastic_rounding_is_seeded_and_segments_differ(dtype):
    x = torch.rand(5000, generator=torch.Generator().manual_seed(2)) * 1e-3
    a, b = make_moment_codecs(dtype), make_moment_codecs(dtype)
    for segment in (EXP_AVG, EXP_AVG_SQ):
        assert torch.equal(a[segment].encode([x])[0], b[segment].encode([x])[0]), "same seed, same bytes"
    m, v = a[EXP_AVG], a[EXP_AVG_SQ]
    if m.stochastic and v.stochastic and v.describe()["transform"] == "none":  # same math, other noise
        assert not torch.equal(m.encode([x])[0], v.encode([x])[0])


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8e4m3", "fp8e5m2"])
def test_stochastic_rounding_is_unbiased_and_representable(fmt):
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(0)
    # a normal value and a subnormal one of the format (where it has any), each 200k times
    for value in (1.2345 * 2.0 ** 3, 2.7 * f.min_positive):
        x = torch.full((200_000,), value)
        for sign in (1.0, -1.0):
            y = _round(sign * x, f, stochastic=True, generator=g)
            assert torch.equal(y.to(f.dtype).float(), y), "every rounded value is a code of the format"
            assert len(torch.unique(y)) == 2
            ulp = (torch.unique(y).max() - torch.unique(y).min()).item()
            sigma = ulp / 2 / math.sqrt(x.numel())
            assert abs(y.double().mean().item() - sign * value) < 5 * sigma, (fmt, value, sign)
    # already-representable values are kept exactly
    codes = torch.tensor([0.0, f.min_positive, -f.min_positive, f.min_normal, 1.0, -1.5, f.max, -f.max])
    assert torch.equal(_round(codes, f, stochastic=True, generator=g), codes)


def test_chunked_encode_matches_across_chunk_and_piece_boundaries(monkeypatch):
    """Blocks that straddle pieces, and segments longer than one chunk, encode like one flat vector."""
    import miles_plugins.optimizers.streaming.codec as codec_module
    monkeypatch.setattr(codec_module, "CHUNK_NUMEL", 4 * BLOCK_SIZE)
    x = adversarial(10 * BLOCK_SIZE + 77, seed=9)
    for dtype in ("fp16", "fp8e4m3"):
        whole = make_moment_codecs(dtype)[EXP_AVG].encode([x])[0]
        pieces = make_moment_codecs(dtype)[EXP_AVG].encode([x[:5], x[5:1000], x[1000:1001], x[1001:]])[0]
        assert torch.equal(whole, pieces)
        out = roundtrip(make_moment_codecs(dtype)[EXP_AVG], [x])
        assert torch.isfinite(out).all()
    assert CHUNK_NUMEL % BLOCK_SIZE == 0


def test_block_scaled_codec_rejects_a_block_size_that_does_not_divide_the_chunk():
    with pytest.raises(ValueError):
        BlockScaledCodec("x", FORMATS["fp8e4m3"], block_size=300)
