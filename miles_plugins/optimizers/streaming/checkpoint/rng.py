"""The stochastic-rounding record of a checkpoint: where each codec's noise stands at the snapshot.

bf16 and fp8 moments round stochastically (codec.py). The noise comes from one seeded generator per
segment codec and device, and a step encodes its buckets in an order that alternates every step. A
resumed run draws the same noise as an uninterrupted one only if the checkpoint restores both: the
generators' states at the snapshot, and the direction in which the next step walks the buckets.

Record (save_load.py writes and verifies the file like every other one):
  manifest  "next_bucket_order": "ascending" | "descending" (every checkpoint)
            "codec_rng": {file, file_bytes, crc32 (zlib), devices {segment: [device, ...]}}, only when a
            codec of the store rounds stochastically
  codec_rng.pt   torch.save of {"version": 1, "segments": {segment: {device: uint8 state tensor}}}
                 (loaded with weights_only); `device` is str(torch.device), e.g. "cpu", "cuda:0"
Both are taken when the save snapshots the store (before `save_to(wait=False)` returns), not when the
background copy runs: the next step draws new noise while the files are still being copied.

Restore: a load onto the same layout (same data-parallel size and bucket size) restores the states and
the order. A state saved on one device restores onto the store's device when both are of one type
(cuda:0 -> cuda:1: a restarted job may number its GPUs differently); across types (cuda <-> cpu) the
generators differ and that segment's noise restarts from its seed. Every other load restarts the noise
from the seeds, logged once per load: a checkpoint written before this record existed, and a resharded
load (the buckets differ, so no order of encodes reproduces the saved run's). Such a resume is correct
(the noise stays unbiased) but not bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import logging
import zlib
from io import BytesIO

import torch

from .reshard import segment_names

logger = logging.getLogger(__name__)
FILE, VERSION = "codec_rng.pt", 1


class RngRecordError(ValueError):
    """The record of generator states is unreadable or does not fit this store's codecs."""


def _noisy_segments(store) -> list[str]:
    """The segments whose codec rounds stochastically (draws noise)."""
    return [n for n in segment_names(store) if getattr(store.codecs[n], "stochastic", False)]


def snapshot(store) -> tuple[dict, bytes | None]:
    """At the save's snapshot: (manifest fields, bytes of codec_rng.pt or None when no codec draws noise)."""
    fields = {"next_bucket_order": "descending" if store.pipeline.next_order_descending() else "ascending"}
    states = {n: store.codecs[n].rng_state() for n in _noisy_segments(store)}
    if not states:
        return fields, None
    buf = BytesIO()
    torch.save({"version": VERSION, "segments": states}, buf)
    data = buf.getvalue()
    fields["codec_rng"] = {"file": FILE, "file_bytes": len(data), "crc32": zlib.crc32(data),
                           "devices": {n: sorted(s) for n, s in states.items()}}
    return fields, data


def _target_device(key, device: torch.device) -> torch.device | None:
    """Where a state saved for device `key` goes in a store on `device`; None: another type of device."""
    try:
        saved = torch.device(key)
    except (RuntimeError, TypeError) as e:
        raise RngRecordError(f"{key!r} is not a device ({e})") from None
    return device if saved.type == device.type else None


def parse_order(next_order) -> bool | None:
    """The manifest's "next_bucket_order" -> the next step walks the buckets descending, or None when the
    checkpoint predates the record. Raises RngRecordError for any other value."""
    if next_order not in (None, "ascending", "descending"):
        raise RngRecordError(f"next_bucket_order is {next_order!r}, expected 'ascending' or 'descending'")
    return None if next_order is None else next_order == "descending"


def parse(data: bytes | None, descending: bool | None,
          store) -> tuple[dict[str, dict[torch.device, torch.Tensor]], bool | None] | None:
    """codec_rng.pt's bytes (None: the manifest lists no such file) and the next step's order (from
    `parse_order`) -> ({segment: {device: state}}, descending), or None when the checkpoint records
    neither (it predates them). Without the file a store whose codecs draw noise has nothing to continue
    from, so its order alone is refused as inconsistent. Each state is tried on a scratch generator, so
    restoring cannot fail half way. Raises RngRecordError saying what is wrong."""
    noisy = _noisy_segments(store)
    if data is None:
        if descending is None:
            return None
        if noisy:
            raise RngRecordError(f"next_bucket_order is recorded without the generator states, and the codecs of "
                                 f"this store draw noise for {noisy}")
        return {}, descending
    try:
        record = torch.load(BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise RngRecordError(f"unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(record, dict) or record.get("version") != VERSION or not isinstance(record.get("segments"), dict):
        what = sorted(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise RngRecordError(f"not a version-{VERSION} record of generator states (holds {what})")
    if sorted(record["segments"]) != sorted(noisy):
        raise RngRecordError(f"it holds generators of segments {sorted(record['segments'])}, the codecs of this "
                             f"store draw noise for {noisy}")
    out = {}
    for name, states in record["segments"].items():
        if not isinstance(states, dict):
            raise RngRecordError(f"segment {name}: expected {{device: state}}, got {type(states).__name__}")
        out[name] = {}
        for key, state in states.items():
            device = _target_device(key, store.device)
            if device is None:
                logger.warning("the %s generator state was saved on %s, this store runs on %s: its "
                               "stochastic-rounding noise restarts from the seed", name, key, store.device)
                continue
            if device in out[name]:
                raise RngRecordError(f"segment {name}: two generator states ({sorted(states)}) for device {device}")
            if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
                raise RngRecordError(f"segment {name}, device {key}: a state is a 1-D uint8 tensor, got "
                                     f"{getattr(state, 'dtype', type(state).__name__)}")
            try:
                torch.Generator(device=device).set_state(state)
            except (RuntimeError, ValueError, TypeError) as e:
                raise RngRecordError(f"segment {name}, device {key}: invalid generator state "
                                     f"({len(state)} bytes): {e}") from None
            out[name][device] = state
    return out, descending


def restore(store, record: tuple | None, why_not: str = "") -> None:
    """Continue the saved noise (`record` from parse), or, when it is None, restart every codec's noise
    from its seed; `why_not` (logged once when a codec draws noise) says why there is no record."""
    if record is None:
        reset(store)
        noisy = _noisy_segments(store)
        if noisy:
            logger.warning("stochastic-rounding noise of %s restarts from the seed (%s): this resume is not "
                           "bit-identical to an uninterrupted run", ", ".join(noisy), why_not)
        return
    states, descending = record
    for name, per_device in states.items():
        store.codecs[name].set_rng_state(per_device)
    if descending is not None:
        store.pipeline.restore_next_order(descending)


def reset(store) -> None:
    """Every codec's noise restarts from its seed (a fresh store's state)."""
    for name in segment_names(store):
        store.codecs[name].set_rng_state({})
