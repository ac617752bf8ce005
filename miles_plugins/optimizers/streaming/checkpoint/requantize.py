"""Re-encoding saved moments: decode the saved ranges to fp32, encode the live buckets' segments.

Two loads need it. (1) Resharding block-scaled moments (fp16, fp8): a block-scaled segment (codec.py)
stores one fp32 scale per block of 256 elements of its bucket's segment, blocks run across piece
boundaries, and another data-parallel size or bucket size moves them, so the saved bytes cannot be
copied. (2) A resume with another moment_dtype than the save's, on any layout: every saved format
decodes to fp32 and the store's format encodes it. reshard.py plans a `Requantize` per saved range. Per live bucket and moment segment, this module builds the segment in fp32 in the bucket's own
device buffer (zeros where a piece has no Adam state, as a first write-back stores them), decodes each
saved range into it with the codec its manifest describes, then encodes it with the store's codec and
writes it over the live file's segment. Blocks [k0, k1) of a segment are themselves a valid
block-scaled segment (their scales, then their payload), so a saved range is decoded from the whole
blocks that hold it, reading only those bytes, at most CHUNK_NUMEL elements at a time.

Into fp32 the values are exact (every format widens to fp32 exactly). Otherwise not bit-identical:
every value is quantized once more, in its new block, with the new block's scale
(max|x| of the block / the format's max). The result is exactly what encoding the saved run's decoded
moments in the new layout gives: for fp16 (nearest rounding) the same bytes; for fp8 (stochastic) the
same scales and payloads within one code of each other, so each value is within one quantization step
of the new block's grid (tests/unit/test_checkpoint_narrow.py). fp32 and bf16 segments reshard by byte
copies and stay bit-exact. The encodes draw noise from the store's generators; the load then restarts
them from their seeds (rng.py).
"""

from __future__ import annotations

import json

import torch

from ..io import stager as io
from ..codec import CHUNK_NUMEL, codec_from_description


def block_window(block_size: int, itemsize: int, numel: int, start: int, stop: int) -> tuple[int, int, int, int, int]:
    """Elements [start, stop) of a block-scaled segment of `numel` elements: the whole blocks holding
    them, as a segment of their own. -> (its first element, its element count, byte offset and byte
    count of its scales, byte offset of its payload), offsets from the start of the saved segment."""
    if not 0 <= start < stop <= numel:
        raise ValueError(f"elements [{start}, {stop}) are not inside a segment of {numel}")
    k0, k1 = start // block_size, -(-stop // block_size)
    first = k0 * block_size
    count = min(k1 * block_size, numel) - first
    blocks = -(-numel // block_size)
    return first, count, 4 * k0, 4 * (k1 - k0), 4 * blocks + itemsize * first


def _decode_range(codec, fd: int, r, out: torch.Tensor) -> None:
    """Saved elements [r.src, r.src + r.count) -> out[r.dst : r.dst + r.count] (fp32)."""
    if getattr(codec, "block_size", None) is None:  # fp32 or a cast format: element i at byte i * itemsize
        dtype = codec.fmt.dtype if hasattr(codec, "fmt") else codec.storage_dtype
        itemsize = codec.encoded_nbytes(1)
        for s in range(0, r.count, CHUNK_NUMEL):
            n = min(CHUNK_NUMEL, r.count - s)
            raw = io.read_at(fd, r.src_offset + (r.src + s) * itemsize, n * itemsize)
            values = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
            out[r.dst + s:r.dst + s + n].copy_(values.to(out.device))  # widening to fp32 is exact
        return
    itemsize = codec.fmt.itemsize
    for s in range(0, r.count, CHUNK_NUMEL):
        n = min(CHUNK_NUMEL, r.count - s)
        first, count, scales_at, scales_nbytes, payload_at = block_window(
            codec.block_size, itemsize, r.src_numel, r.src + s, r.src + s + n)
        raw = (io.read_at(fd, r.src_offset + scales_at, scales_nbytes)
               + io.read_at(fd, r.src_offset + payload_at, count * itemsize))
        window = torch.empty(count, dtype=torch.float32, device=out.device)
        codec.decode([torch.frombuffer(raw, dtype=torch.uint8).to(out.device)], window)
        skip = r.src + s - first
        out[r.dst + s:r.dst + s + n].copy_(window[skip:skip + n])


def apply(store, requants: list, fds: dict[str, int]) -> None:
    """Fill the block-scaled moment segments of the live buckets from `requants` (plan_reshard), encoded
    with the store's codecs. `fds`: {path: open read fd}, reused; files opened here are added to it (the
    caller closes them)."""
    targets, decoders = {}, {}
    for r in requants:
        targets.setdefault((r.bucket, r.segment), []).append(r)
    for (index, name), ranges in sorted(targets.items()):  # a fixed order of encodes: buckets, then segments
        bucket = store.buckets[index]
        values = bucket.flat[name]
        bucket.materialize((name,))
        try:
            values.zero_()
            for r in ranges:
                key = json.dumps(r.description, sort_keys=True)
                if key not in decoders:
                    decoders[key] = codec_from_description(r.description)
                if r.path not in fds:
                    fds[r.path] = io.open_read(r.path)
                _decode_range(decoders[key], fds[r.path], r, values)
            segment, offset = bucket.layout.segments[name], bucket.layout.segments[name].offset
            for tensor in store.codecs[name].encode([values]):
                host = io.as_bytes(tensor).cpu()  # same-dtype bytes to the host (a no-op on CPU)
                io.write_at(bucket.file.fd, offset, io.host_buffer(host))
                offset += host.numel()
            if offset - segment.offset != segment.nbytes:
                raise RuntimeError(f"bucket {index} {name}: encoded {offset - segment.offset} bytes, the segment "
                                   f"holds {segment.nbytes}")
        finally:
            bucket.release()
