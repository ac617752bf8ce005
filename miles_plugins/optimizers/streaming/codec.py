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
    rng_state(), set_rng_state(s)  where the stochastic-rounding noise stands, per device ({} for
                                   deterministic codecs); checkpoints record it (checkpoint/rng.py)

Formats (`moment_dtype`). Bytes per param per step, each direction, with streamed fp32 masters
(B = BLOCK_SIZE = 256; subtract 4 when the params are themselves the fp32 masters):
    fp32     the buffer's own bytes, bit-exact                                      12
    bf16     2 B, stochastic rounding, no scale (bf16 has fp32's exponent range)    8
    fp16     2 B + fp32 scale per block, nearest rounding, exp_avg_sq as sqrt       8 + 8/B = 8.03
    fp8e4m3  1 B + fp32 scale per block, stochastic rounding, exp_avg_sq as sqrt    6 + 8/B = 6.03
    fp8e5m2  1 B + fp32 scale per block, stochastic rounding, exp_avg_sq as is      6 + 8/B = 6.03
fp16 needs the scale (8/B extra) because its range is not fp32's: unscaled, an exp_avg below 6e-5
loses mantissa bits (subnormal) and an exp_avg_sq below 3e-8 rounds to 0.

Block-scaled segment layout: one tensor `[fp32 scales, ceil(n/B) x 4 B | payload, n x itemsize]`, so a
segment is one contiguous read and one contiguous write from its 4 KiB boundary. Block k covers
elements [kB, (k+1)B) of the segment, which runs across param boundaries (the bucket's segment is one
logical vector). scale_k = max|x| over the block / the format's largest finite value (at least fp32's
smallest normal), payload = round(clamp(x / scale_k)), decoded = payload * scale_k. exp_avg and
exp_avg_sq use the same blocks.

Decisions, measured by `scripts/compare_moment_dtypes.py study` (the same gradient stream drives an
fp32 Adam and one whose moments round-trip through the encoding every step, 1000 steps; err = relative
L2 error of the update m_hat / (sqrt(v_hat) + eps) at the end, 'rows' = per-row gradient scales like a
weight matrix, 'elem' = 8 decades of scale inside every block; full table in docs/benchmarks.md):
  * exp_avg_sq as its square root in e4m3. Stored as is, v spans the square of the gradient range
    and small entries flush to 0 in their block: the update becomes exp_avg / eps (err 3e5, largest
    update 7.6e6 x lr). sqrt halves the range a block must hold and is what the update consumes, so the
    mantissa error lands on the update once: err 0.217 vs 0.331 ('rows') with the floor below on both.
    e5m2 keeps v as is (its 5-bit exponent holds the range; err 0.279 'rows' vs 0.345 with sqrt,
    which wins only on the adversarial 'elem' data, 0.348 vs 0.625). fp16 stores sqrt too: as is,
    v's 16 decades overflow fp16's range inside a block ('elem' err 59, largest update 684 x lr).
  * A nonzero exp_avg_sq never decodes to 0: what rounds to 0 becomes the smallest code. Without it
    e4m3 + sqrt still blows up (err 11 'rows', 472 'elem'; largest update 6.4e3 x lr); with it the
    largest update stays within 2x fp32's. Why it suffices: exp_avg shares the block partition, so a
    tiny exp_avg that rounds up to the smallest code (scale_m * min_code) meets a denominator of at
    least scale_v * min_code, and scale_m / scale_v = max|m| / max sqrt(v) over the block, which Adam
    itself keeps O(1).
  * Stochastic rounding for fp8 and bf16: an EMA step of (1 - beta2) = 0.1% is below half an ulp of
    8 bits (and of bf16's 8-bit mantissa), so round-to-nearest freezes the moments: e4m3 nearest err
    0.515 vs 0.217 stochastic; bf16 nearest drifts 0.031 -> 0.081 -> 0.148 at steps 1000/2000/4000
    while stochastic stays 0.017 -> 0.020 -> 0.021. fp16's 10-bit mantissa does not freeze (nearest
    0.0033 -> 0.0042, stochastic 0.0046 -> 0.0061), so fp16 rounds to nearest. The noise comes from
    one seeded generator per segment codec and device: runs are reproducible given the same order of
    encodes. A checkpoint records the generators' states and the next step's bucket order
    (checkpoint/rng.py), so a resumed run draws the same noise as an uninterrupted one.
  * Block size 256: err 0.207 / 0.213 / 0.217 / 0.217 for 32 / 128 / 256 / 512 ('rows'; 0.602 at
    2048, where a block spans rows of different scale), for 0.25 / 0.06 / 0.03 / 0.016 B/param of scales.
Training a small LM 200 steps through the store (docs/benchmarks.md): final loss within 0.05% of fp32
for every format; a plain cast to fp8 without scales diverges to loss ~1e5.
"""

from __future__ import annotations

import math

import torch

from .layout import EXP_AVG, EXP_AVG_SQ
from .config import MOMENT_DTYPES, check_moment_dtype
from .errors import StoreConfigError

BLOCK_SIZE = 256
# Encode/decode walk a segment in chunks of this many elements (a multiple of BLOCK_SIZE), so the
# device temporaries stay a few tens of MB whatever the bucket size.
CHUNK_NUMEL = 1 << 22


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

    def rng_state(self) -> dict[str, torch.Tensor]:
        return {}  # deterministic: no noise

    def set_rng_state(self, states: dict) -> None:
        if states:
            raise ValueError(f"fp32 draws no noise; got generator states for {sorted(map(str, states))}")


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


def _floor(q: torch.Tensor, x: torch.Tensor, fmt: _Format) -> torch.Tensor:
    """Nonzero inputs that rounded to 0 become the smallest code of their sign."""
    return torch.where((q == 0) & (x != 0), torch.copysign(torch.full_like(q, fmt.min_positive), x), q)


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

    @property
    def storage_dtype(self) -> torch.dtype:
        """The payload's element type (a block-scaled segment's buffer is bytes: scales, then payload)."""
        return self.fmt.dtype

    def _generator(self, device: torch.device) -> torch.Generator | None:
        """One seeded generator per device: runs are reproducible given the same encode order."""
        if not self.stochastic:
            return None
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self.seed)
        return gen

    def rng_state(self) -> dict[str, torch.Tensor]:
        """{str(device): state} of the generators that drew noise so far (a snapshot: later draws do not
        change it). Empty for nearest rounding, or before the first stochastic encode."""
        return {str(device): gen.get_state() for device, gen in self._generators.items()}

    def set_rng_state(self, states: dict) -> None:
        """Continue the noise from `states` ({device or its str: state}, as rng_state() gives it);
        devices left out restart from the seed. Raises (RuntimeError, ValueError) on an invalid state
        and then changes nothing."""
        if states and not self.stochastic:
            raise ValueError(f"{self.name} rounds to nearest and draws no noise; got generator states for "
                             f"{sorted(map(str, states))}")
        generators = {}
        for key, state in states.items():
            device = torch.device(key)
            generators[device] = torch.Generator(device=device)
            generators[device].set_state(state)
        self._generators = generators


class CastCodec(_CodecBase):
    """A 16-bit format with the fp32 exponent range (bf16): a plain device cast, no scale needed."""

    def __init__(self, name: str, fmt: _Format, stochastic: bool = True, floor_nonzero: bool = False, seed: int = 0):
        super().__init__(stochastic, seed)
        self.name, self.fmt, self.floor_nonzero = name, fmt, floor_nonzero

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
                q = _round(x, self.fmt, self.stochastic, gen)
                enc[s:s + CHUNK_NUMEL].copy_(_floor(q, x, self.fmt) if self.floor_nonzero else q)
            out.append(enc)
        return out

    def describe(self) -> dict:
        return {"name": self.name, "storage_dtype": str(self.fmt.dtype).replace("torch.", ""), "block_size": None,
                "layout": f"[{self.fmt.itemsize}-byte values]", "transform": "none",
                "rounding": "stochastic" if self.stochastic else "nearest",
                "nonzero_never_decodes_to_zero": self.floor_nonzero}


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
                q = _floor(q, x, fmt)
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


# ---- the moment_dtype table -------------------------------------------------------------------------
# moment_dtype -> (exp_avg codec, exp_avg_sq codec); the segment-specific seeds keep their noise apart.
def _moment_codecs(moment_dtype: str):
    f = FORMATS
    table = {
        "fp32": lambda: (Fp32Codec(), Fp32Codec()),
        "bf16": lambda: (CastCodec("bf16", f["bf16"], seed=1),
                         CastCodec("bf16", f["bf16"], floor_nonzero=True, seed=2)),
        "fp16": lambda: (BlockScaledCodec("fp16", f["fp16"], stochastic=False),
                         BlockScaledCodec("fp16", f["fp16"], sqrt=True, stochastic=False, floor_nonzero=True)),
        "fp8e4m3": lambda: (BlockScaledCodec("fp8e4m3", f["fp8e4m3"], seed=1),
                            BlockScaledCodec("fp8e4m3", f["fp8e4m3"], sqrt=True, floor_nonzero=True, seed=2)),
        "fp8e5m2": lambda: (BlockScaledCodec("fp8e5m2", f["fp8e5m2"], seed=1),
                            BlockScaledCodec("fp8e5m2", f["fp8e5m2"], floor_nonzero=True, seed=2)),
    }
    return table.get(moment_dtype)


def codec_from_description(description: dict):
    """The codec whose describe() is `description` (what a checkpoint manifest recorded): it decodes the
    bytes of that checkpoint's segments. A clear error when this build has no such codec."""
    for moment_dtype in MOMENT_DTYPES:
        for codec in _moment_codecs(moment_dtype)():
            if codec.describe() == description:
                return codec
    raise StoreConfigError(f"no codec of this build stores a segment as {description}; it was saved by "
                           "another version: resume with that version, or without the optimizer state")


def make_moment_codecs(moment_dtype: str) -> dict:
    """{"exp_avg": codec, "exp_avg_sq": codec} for a `moment_dtype`; a clear error for anything else."""
    check_moment_dtype(moment_dtype)
    exp_avg, exp_avg_sq = _moment_codecs(moment_dtype)()
    return {EXP_AVG: exp_avg, EXP_AVG_SQ: exp_avg_sq}
