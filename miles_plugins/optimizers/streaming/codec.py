"""Storage formats of a segment: how fp32 values on the device become the bytes in a bucket file.

The update math always runs in fp32; a codec only decides what is stored. Encoding and decoding run
on the device (torch ops on the tensors' own device), so the stager only ever moves same-dtype bytes
and the host never casts.

Interface, per segment of a bucket (`numel` elements, `values` logically concatenated):
    encoded_nbytes(numel)          bytes the segment occupies in the file (payload, before 4 KiB padding)
    reads_in_place()               True: the stager reads straight into the fp32 buffer (fp32 only)
    empty_encoded(numel, device)   device tensors the stager reads into, back to back
    decode(encoded, out)           fill the fp32 buffer `out` from them (on the device)
    encode(values)                 device tensors to write back to back (never modifies `values`)
    name, describe()               what a checkpoint manifest records

Formats (`moment_dtype`; bytes per param per step with streamed fp32 mains, B = BLOCK_SIZE = 256):
    fp32     4 B/moment, the buffer's own bytes, bit-exact           12 B/param
    bf16     2 B/moment, stochastic rounding, no scale               8 B/param
    fp16     2 B/moment + fp32 scale per block, stochastic rounding   8 + 8/B = 8.03 B/param
    fp8e4m3  1 B/moment + fp32 scale per block, stochastic rounding   6 + 8/B = 6.03 B/param
    fp8e5m2  1 B/moment + fp32 scale per block, stochastic rounding   6 + 8/B = 6.03 B/param
Without streamed mains (plain fp32 Adam) subtract 4 B/param.

Block-scaled segment layout: `[fp32 scales, ceil(n/B) x 4 B | payload, n x itemsize]`, one tensor, so
one segment is one contiguous read and one contiguous write starting on the segment's 4 KiB boundary.
Block k covers elements [kB, (k+1)B) of the segment (blocks run across param boundaries: the segment is
one logical vector). scale_k = max|x| over the block / the format's largest finite value (floored at
fp32's smallest normal), payload = round(x / scale_k), decoded = payload * scale_k.

exp_avg_sq in fp8e4m3 / fp16 is stored as its square root (sign-preserving: decode squares it back):
sqrt halves the dynamic range a block must hold (Adam's denominator spans the square of the gradient
range) and the update consumes sqrt(v) anyway, so the 3-bit mantissa's error lands on the update
once, not halved-then-doubled. fp8e5m2 stores exp_avg_sq as is (its 5-bit exponent has the range;
sqrt would spend mantissa it does not have). A nonzero exp_avg_sq never decodes to 0 (a zero
denominator turns Adam's update into exp_avg / eps): magnitudes below the smallest code round up to it.

Why these choices, measured by `scripts/compare_moment_dtypes.py` (numbers in docs/benchmarks.md):
see DECISIONS below.
"""

from __future__ import annotations

import math

import torch

from .layout import EXP_AVG, EXP_AVG_SQ
from .stager import StoreConfigError

BLOCK_SIZE = 256
# Encode/decode walk a segment in chunks of this many elements (a multiple of BLOCK_SIZE), so the
# device temporaries stay a few tens of MB whatever the bucket size.
CHUNK_NUMEL = 1 << 22

DECISIONS = """(filled in from measurements)"""


class Fp32Codec:
    """Stores fp32 as is: the device buffer's own bytes are the file's bytes (bit-exact)."""

    name = "fp32"
    storage_dtype = torch.float32

    def encoded_nbytes(self, numel: int) -> int:
        return numel * 4

    def reads_in_place(self) -> bool:
        """True: the stager may read straight into the fp32 buffer, no temporary needed."""
        return True

    def empty_encoded(self, numel: int, device: torch.device) -> list[torch.Tensor]:
        raise AssertionError("fp32 reads in place")

    def decode(self, encoded: list[torch.Tensor], out: torch.Tensor) -> None:
        raise AssertionError("fp32 reads in place")

    def encode(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """`values` are logically concatenated; returns the tensors to write back to back."""
        return values

    def describe(self) -> dict:
        return {"name": self.name, "storage_dtype": "float32", "block_size": None, "layout": "[fp32 values]"}


# ---- number formats ---------------------------------------------------------------------------------
class _Format:
    """A narrow float format: torch dtype, largest finite value, mantissa bits, smallest normal exponent."""

    def __init__(self, dtype: torch.dtype, mantissa_bits: int):
        info = torch.finfo(dtype)
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.max = float(info.max)
        self.mantissa_bits = mantissa_bits
        self.min_normal = float(info.tiny)
        self.min_exponent = round(math.log2(self.min_normal))
        self.min_positive = math.ldexp(1.0, self.min_exponent - mantissa_bits)  # smallest subnormal


FORMATS = {
    "bf16": _Format(torch.bfloat16, 7),
    "fp16": _Format(torch.float16, 10),
    "fp8e4m3": _Format(torch.float8_e4m3fn, 3),
    "fp8e5m2": _Format(torch.float8_e5m2, 2),
}
_FP32_TINY = float(torch.finfo(torch.float32).tiny)


def _round(x: torch.Tensor, fmt: _Format, stochastic: bool, generator: torch.Generator | None) -> torch.Tensor:
    """fp32 values (|x| <= fmt.max) -> fp32 values exactly representable in `fmt` (same shape).

    Stochastic: round up with probability equal to the distance from the lower neighbour in ulps, so the
    stored value is unbiased. That matters for Adam's moments: an EMA step of (1-beta2) = 0.1% is far
    below half an ulp of an 8-bit (or even bf16) value, and round-to-nearest would freeze it.
    """
    if not stochastic:
        return x.to(fmt.dtype).float()
    drop = 23 - fmt.mantissa_bits
    noise = torch.randint(0, 1 << drop, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = x.view(torch.int32)
    # Normal range: add the noise to the magnitude bits below the kept mantissa, then truncate. The bit
    # pattern is sign-magnitude, so this rounds |x| stochastically and keeps the sign.
    y = ((bits + noise) & ~((1 << drop) - 1)).view(torch.float32)
    if fmt.min_exponent > -126:
        # Subnormals of the narrow format have a fixed ulp, coarser than what truncation keeps.
        ulp = fmt.min_positive
        u = noise.float() * (1.0 / (1 << drop))
        sub = torch.floor(x * (1.0 / ulp) + u) * ulp
        y = torch.where(x.abs() < fmt.min_normal, sub, y)
    return y.clamp_(-fmt.max, fmt.max)


def _cat_chunk(values: list[torch.Tensor], bounds: list[int], start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the logical concatenation of `values` (a view when inside one)."""
    parts = []
    for i, v in enumerate(values):
        lo, hi = bounds[i], bounds[i + 1]
        if hi <= start or lo >= stop:
            continue
        parts.append(v.reshape(-1)[max(start, lo) - lo:min(stop, hi) - lo])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _CodecBase:
    name: str
    fmt: _Format

    def __init__(self, stochastic: bool, seed: int):
        self.stochastic = stochastic
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def reads_in_place(self) -> bool:
        return False

    def _generator(self, device: torch.device) -> torch.Generator | None:
        """One seeded generator per device: runs are reproducible given the same encode order."""
        if not self.stochastic:
            return None
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self.seed)
        return gen


class CastCodec(_CodecBase):
    """A 16-bit format with the fp32 exponent range (bf16): a plain device cast, no scale needed."""

    def __init__(self, name: str, fmt: _Format, stochastic: bool = True, seed: int = 0):
        super().__init__(stochastic, seed)
        self.name, self.fmt = name, fmt

    def encoded_nbytes(self, numel: int) -> int:
        return numel * self.fmt.itemsize

    def empty_encoded(self, numel: int, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty(numel, dtype=self.fmt.dtype, device=device)]

    def decode(self, encoded: list[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(encoded[0])

    def encode(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for v in values:
            v = v.detach().reshape(-1)
            enc = torch.empty(v.numel(), dtype=self.fmt.dtype, device=v.device)
            gen = self._generator(v.device)
            for s in range(0, v.numel(), CHUNK_NUMEL):
                x = v[s:s + CHUNK_NUMEL].clamp(-self.fmt.max, self.fmt.max)
                enc[s:s + CHUNK_NUMEL].copy_(_round(x, self.fmt, self.stochastic, gen))
            out.append(enc)
        return out

    def describe(self) -> dict:
        return {"name": self.name, "storage_dtype": str(self.fmt.dtype).replace("torch.", ""), "block_size": None,
                "layout": f"[{self.fmt.itemsize}-byte values]", "transform": "none",
                "rounding": "stochastic" if self.stochastic else "nearest"}


class BlockScaledCodec(_CodecBase):
    """A narrow format with one fp32 scale per block of `block_size` elements (see the module doc)."""

    def __init__(self, name: str, fmt: _Format, block_size: int = BLOCK_SIZE, sqrt: bool = False,
                 stochastic: bool = True, floor_nonzero: bool = False, seed: int = 0):
        super().__init__(stochastic, seed)
        if CHUNK_NUMEL % block_size:
            raise ValueError(f"block size {block_size} must divide {CHUNK_NUMEL}")
        self.name, self.fmt, self.block_size = name, fmt, block_size
        self.sqrt, self.floor_nonzero = sqrt, floor_nonzero

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * self.num_blocks(numel) + numel * self.fmt.itemsize

    def empty_encoded(self, numel: int, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty(self.encoded_nbytes(numel), dtype=torch.uint8, device=device)]

    def _views(self, buf: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        nb = self.num_blocks(numel)
        return buf[:4 * nb].view(torch.float32), buf[4 * nb:].view(self.fmt.dtype)

    def encode(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        values = [v.detach() for v in values]
        bounds = [0]
        for v in values:
            bounds.append(bounds[-1] + v.numel())
        numel = bounds[-1]
        device = values[0].device if values else torch.device("cpu")
        buf = torch.empty(self.encoded_nbytes(numel), dtype=torch.uint8, device=device)
        scales, payload = self._views(buf, numel)
        gen = self._generator(device)
        B, fmt = self.block_size, self.fmt
        for s in range(0, numel, CHUNK_NUMEL):
            e = min(s + CHUNK_NUMEL, numel)
            n, nb = e - s, -(-(e - s) // B)
            x = torch.zeros(nb * B, dtype=torch.float32, device=device)
            x[:n].copy_(_cat_chunk(values, bounds, s, e))
            if self.sqrt:
                x = x.sign() * x.abs().sqrt()
            x = x.view(nb, B)
            scale = (x.abs().amax(dim=1) / fmt.max).clamp_min_(_FP32_TINY)
            q = (x / scale[:, None]).clamp_(-fmt.max, fmt.max)
            q = _round(q, fmt, self.stochastic, gen)
            if self.floor_nonzero:
                q = torch.where((q == 0) & (x != 0), torch.copysign(torch.full_like(q, fmt.min_positive), x), q)
            payload[s:e].copy_(q.view(-1)[:n])
            scales[s // B:s // B + nb].copy_(scale)
        return [buf]

    def decode(self, encoded: list[torch.Tensor], out: torch.Tensor) -> None:
        numel = out.numel()
        scales, payload = self._views(encoded[0], numel)
        B = self.block_size
        limit = math.sqrt(torch.finfo(torch.float32).max) if self.sqrt else torch.finfo(torch.float32).max
        for s in range(0, numel, CHUNK_NUMEL):
            e = min(s + CHUNK_NUMEL, numel)
            n, nb = e - s, -(-(e - s) // B)
            y = out[s:e]
            y.copy_(payload[s:e])
            full = n // B * B
            y[:full].view(-1, B).mul_(scales[s // B:s // B + full // B, None])
            if full < n:
                y[full:].mul_(scales[s // B + nb - 1])
            y.clamp_(-limit, limit)  # the scale's rounding must not push a max-magnitude value to Inf
            if self.sqrt:
                y.mul_(y.abs())

    def describe(self) -> dict:
        return {"name": self.name, "storage_dtype": str(self.fmt.dtype).replace("torch.", ""),
                "block_size": self.block_size, "scale_dtype": "float32",
                "layout": f"[fp32 scales, ceil(n/{self.block_size}) x 4 B | payload, n x {self.fmt.itemsize} B]",
                "scale": "max|x| per block / format max",
                "transform": "signed sqrt (decode squares)" if self.sqrt else "none",
                "rounding": "stochastic" if self.stochastic else "nearest",
                "nonzero_never_decodes_to_zero": self.floor_nonzero}


class UnscaledCastCodec(CastCodec):
    """A saturating round-to-nearest cast with no scale: the seed's fp8. Kept only to show, next to the
    real formats, what scaling buys; not a user-facing `moment_dtype`."""

    def __init__(self, name: str, fmt: _Format):
        super().__init__(name, fmt, stochastic=False)


# ---- the moment_dtype table -------------------------------------------------------------------------
# moment_dtype -> (exp_avg codec, exp_avg_sq codec); the segment-specific seeds keep their noise apart.
def _moment_codecs(moment_dtype: str):
    f = FORMATS
    table = {
        "fp32": lambda: (Fp32Codec(), Fp32Codec()),
        "bf16": lambda: (CastCodec("bf16", f["bf16"], seed=1), CastCodec("bf16", f["bf16"], seed=2)),
        "fp16": lambda: (BlockScaledCodec("fp16", f["fp16"], seed=1),
                         BlockScaledCodec("fp16", f["fp16"], sqrt=True, floor_nonzero=True, seed=2)),
        "fp8e4m3": lambda: (BlockScaledCodec("fp8e4m3", f["fp8e4m3"], seed=1),
                            BlockScaledCodec("fp8e4m3", f["fp8e4m3"], sqrt=True, floor_nonzero=True, seed=2)),
        "fp8e5m2": lambda: (BlockScaledCodec("fp8e5m2", f["fp8e5m2"], seed=1),
                            BlockScaledCodec("fp8e5m2", f["fp8e5m2"], floor_nonzero=True, seed=2)),
        # Private, for scripts/compare_moment_dtypes.py: the seed's unscaled fp8.
        "_fp8e4m3_unscaled": lambda: (UnscaledCastCodec("_fp8e4m3_unscaled", f["fp8e4m3"]),
                                      UnscaledCastCodec("_fp8e4m3_unscaled", f["fp8e4m3"])),
    }
    return table.get(moment_dtype)


MOMENT_DTYPES = ("fp32", "bf16", "fp16", "fp8e4m3", "fp8e5m2")


def make_moment_codecs(moment_dtype: str) -> dict:
    """{"exp_avg": codec, "exp_avg_sq": codec} for a `moment_dtype`; a clear error for anything else."""
    make = _moment_codecs(moment_dtype) if isinstance(moment_dtype, str) else None
    if make is None:
        raise StoreConfigError(
            f"moment_dtype {moment_dtype!r} is not supported; choose one of {', '.join(MOMENT_DTYPES)}")
    exp_avg, exp_avg_sq = make()
    return {EXP_AVG: exp_avg, EXP_AVG_SQ: exp_avg_sq}


def make_codec(moment_dtype: str):
    """The exp_avg codec of a `moment_dtype` (kept for callers that want one codec)."""
    return make_moment_codecs(moment_dtype)["exp_avg"]
