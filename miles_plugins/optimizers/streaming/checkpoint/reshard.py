"""Resharding: which ranges of saved bucket files fill this store's buckets when the layout differs
(another data-parallel size, another bucket size). Pure: manifests in, a plan out.

Every entry with a name is elements [start, stop) of a flattened param (bucket.StreamEntry). A saved
piece covers [entry start + piece start, entry start + piece stop) of its param; each live piece is
filled from the saved pieces that overlap it, segment by segment:
  byte copy    where a segment stores a fixed number of bytes per element (fp32, bf16) in the format
               this store uses too: bit-exact.
  re-quantize  where it stores per-block scales (fp16, fp8): blocks run across piece boundaries and a
               new layout moves them; and wherever the saved format is not this store's (moment_dtype
               changed since the save). The saved range is decoded to fp32 and the live segment encoded
               again (requantize.py): exact into fp32, one rounding into a narrower format.
The same plan serves a load onto the saved layout with another moment_dtype (save_load.py).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

from ..layout import MAIN, MOMENTS


class ReshardError(ValueError):
    """The saved state cannot be mapped onto this store's layout."""


def segment_names(store) -> tuple[str, ...]:
    return ((MAIN,) if store.streams_main else ()) + MOMENTS


def entry_meta(e) -> dict:
    numel = e.main.numel()
    return {"name": e.name, "start": e.start, "stop": e.start + numel,
            "full_numel": numel if e.full_numel is None else e.full_numel, "group": e.group}


@dataclass(frozen=True)
class Requantize:
    """Elements [src, src + count) of the saved segment `segment` of file `path` (a segment of `src_numel`
    elements at byte `src_offset`, stored as `description` says) fill elements [dst, dst + count) of the
    same segment of live bucket `bucket`, decoded and encoded in the store's format."""

    bucket: int
    segment: str
    dst: int
    path: str
    src_offset: int
    src_numel: int
    src: int
    count: int
    description: dict


def _element_sizes(store) -> dict[str, int | None]:
    """{segment: bytes per element}, None where the segment is block-scaled (re-quantized)."""
    sizes = {}
    for n in segment_names(store):
        codec = store.codecs[n]
        size = codec.encoded_nbytes(1)
        linear = not codec.describe().get("block_size") and codec.encoded_nbytes(4099) == 4099 * size
        sizes[n] = size if linear else None
    return sizes


def _saved_pieces(manifests) -> tuple[dict, dict]:
    """{param name: [(lo, hi, file, bucket meta, element offset in its segments, step, entry)]} sorted."""
    sources, files = {}, {}
    for directory, m in manifests:
        for sb in m["buckets"]:
            path, offset = os.path.join(directory, sb["file"]), 0
            files[path] = sb
            for entry, start, stop, step in sb["pieces"]:
                e = m["entries"][entry]
                if e["name"] is None:
                    raise ReshardError(f"{directory} has entries without param identities")
                sources.setdefault(e["name"], []).append((e["start"] + start, e["start"] + stop, path, sb,
                                                          offset, step, e))
                offset += stop - start
    for name, srcs in sources.items():
        srcs.sort(key=lambda s: s[0])
        for a, b in zip(srcs, srcs[1:]):
            if b[0] < a[1]:
                raise ReshardError(f"{name}[{b[0]}:{a[1]}] is saved twice ({a[2]}, {b[2]})")
    return sources, files


def plan_reshard(store, manifests: list[tuple[str, dict]]):
    """-> (copies, requants, steps, moments, used files). copies: (path, None, src offset, dst fd, dst
    offset, nbytes); requants: [Requantize] for block-scaled segments; steps: per live bucket, per
    piece, the Adam step or None; moments: per live bucket, whether its moment segments hold state;
    used: {path: bucket meta} of the files read."""
    if any(e.name is None for e in store.entries):
        raise ReshardError("this optimizer's binding gives its entries no param identities")
    sizes = _element_sizes(store)
    live = {n: store.codecs[n].describe() for n in sizes}
    requantized = {n for n, size in sizes.items()
                   if size is None or any(m["segments"][n] != live[n] for _, m in manifests)}
    sources, files = _saved_pieces(manifests)
    descriptions = {os.path.join(d, sb["file"]): m["segments"] for d, m in manifests for sb in m["buckets"]}
    copies, requants, steps, moments, used = [], [], [], [], {}
    for b in store.buckets:
        bucket_steps = []
        for j, piece in enumerate(b.pieces):
            e = entry_meta(store.entries[piece.entry])
            lo, hi, srcs = e["start"] + piece.start, e["start"] + piece.stop, sources.get(e["name"], [])
            if not srcs:
                raise ReshardError(f"{e['name']} is not in the checkpoint")
            saved = srcs[0][6]
            if (saved["full_numel"], saved["group"]) != (e["full_numel"], e["group"]):
                raise ReshardError(f"{e['name']}: {saved['full_numel']} elements in group {saved['group']} in "
                                   f"checkpoint, {e['full_numel']} in group {e['group']} now")
            k, covered, found = max(0, bisect.bisect_right([s[0] for s in srcs], lo) - 1), 0, set()
            for s_lo, s_hi, path, sb, offset, step, _ in srcs[k:]:
                if s_lo >= hi:
                    break
                a, z = max(lo, s_lo), min(hi, s_hi)
                if a >= z:
                    continue
                covered, used[path] = covered + z - a, files[path]
                found.add(step)
                for n, size in sizes.items():
                    if n in MOMENTS and step is None:
                        continue  # no Adam state: nothing on disk to keep
                    if n in requantized:
                        requants.append(Requantize(b.index, n, b.offsets[j] + a - lo, path, sb["segments"][n][0],
                                                   sb["numel"], offset + a - s_lo, z - a,
                                                   descriptions[path][n]))
                        continue
                    copies.append((path, None, sb["segments"][n][0] + (offset + a - s_lo) * size, b.file.fd,
                                   b.layout.segments[n].offset + (b.offsets[j] + a - lo) * size, (z - a) * size))
            if covered != hi - lo:
                raise ReshardError(f"{e['name']}[{lo}:{hi}] is only partly in the checkpoint "
                                   f"({covered} of {hi - lo} elements)")
            if len(found) != 1:
                raise ReshardError(f"{e['name']}[{lo}:{hi}] has inconsistent Adam steps {sorted(map(str, found))}")
            bucket_steps.append(found.pop())
        steps.append(bucket_steps)
        moments.append(any(s is not None for s in bucket_steps))
    return copies, requants, steps, moments, used
