"""What a manifest must be before a load uses any of it (save_load.py documents the format). Pure.

A checkpoint may come from anywhere, so every field a load reads is checked here for its type and range
first: counts and offsets are ints (a JSON `true` is not 1), offsets and sizes are non-negative, segments
lie 4 KiB-aligned inside their file, pieces lie inside their entry and add up to their bucket, and an Adam
step is an int from 1 up when the bucket's moments exist (no step at all when they do not). The JSON
text's nesting is bounded before it is parsed. Violations raise ManifestError naming the field and value;
save_load.py turns them into CheckpointError.
"""

from __future__ import annotations

import re

from ..layout import ALIGN_BYTES, MAIN, MOMENTS

# A manifest nests 5 deep (buckets -> bucket -> pieces -> piece); codec descriptions add one level.
MAX_NESTING = 16
# Adam keeps its step as a float: past 2**53 it no longer counts, so no real run gets there.
MAX_ADAM_STEP = 2 ** 53
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_A_BRACKET = re.compile(rb"[^\[\]{}]")


class ManifestError(ValueError):
    """The manifest holds a field of the wrong type or out of range."""


def check_nesting(text: bytes, limit: int = MAX_NESTING) -> None:
    """Refuse JSON nested deeper than `limit`, without parsing it (a deep one exhausts the parser's stack)."""
    depth = 0
    for bracket in _NOT_A_BRACKET.sub(b"", _STRING.sub(b'""', text)):
        depth += 1 if bracket in b"[{" else -1
        if depth > limit:
            raise ManifestError(f"the JSON nests deeper than {limit} levels, deeper than any manifest this "
                                "build writes")


_JSON_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "true or false"}


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _int(value, what: str, low: int = 0, high: int | None = None) -> int:
    if type(value) is not int or value < low or (high is not None and value > high):  # bool is not int here
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ManifestError(f"{what} is {_show(value)}; it must be an integer {bound}")
    return value


def _typed(value, kind, what: str):
    if not isinstance(value, kind):
        raise ManifestError(f"{what} is {_show(value)}; it must be {_JSON_NAMES[kind]}")
    return value


def _fields(value, what: str, required: tuple[str, ...]) -> dict:
    _typed(value, dict, what)
    missing = [k for k in required if k not in value]
    if missing:
        raise ManifestError(f"{what} lacks {missing}")
    return value


def _check_entry(e, i: int) -> None:
    what = f"entries[{i}]"
    _fields(e, what, ("name", "start", "stop", "full_numel", "group"))
    if e["name"] is not None:
        _typed(e["name"], str, f"{what}.name")
    start = _int(e["start"], f"{what}.start")
    stop = _int(e["stop"], f"{what}.stop", start)
    _int(e["full_numel"], f"{what}.full_numel", stop)
    _int(e["group"], f"{what}.group")


def _check_small_file(meta, what: str) -> None:
    _fields(meta, what, ("file", "file_bytes", "crc32"))
    _typed(meta["file"], str, f"{what}.file")
    _int(meta["file_bytes"], f"{what}.file_bytes")
    _int(meta["crc32"], f"{what}.crc32", 0, 2 ** 32 - 1)


def _check_bucket(sb, i: int, entries: list, segment_names: tuple[str, ...]) -> None:
    what = f"buckets[{i}]"
    _fields(sb, what, ("file", "numel", "file_bytes", "crc32", "moments", "segments", "pieces"))
    _typed(sb["file"], str, f"{what}.file")
    numel = _int(sb["numel"], f"{what}.numel")
    file_bytes = _int(sb["file_bytes"], f"{what}.file_bytes")
    _int(sb["crc32"], f"{what}.crc32", 0, 2 ** 32 - 1)
    moments = _typed(sb["moments"], bool, f"{what}.moments")
    segments = _typed(sb["segments"], dict, f"{what}.segments")
    if sorted(segments) != sorted(segment_names):
        raise ManifestError(f"{what}.segments holds {sorted(segments)}, expected {sorted(segment_names)}")
    for name, span in segments.items():
        if not isinstance(span, list) or len(span) != 2:
            raise ManifestError(f"{what}.segments.{name} is {_show(span)}; it must be [offset, nbytes]")
        offset = _int(span[0], f"{what}.segments.{name} offset")
        nbytes = _int(span[1], f"{what}.segments.{name} size")
        if offset % ALIGN_BYTES:
            raise ManifestError(f"{what}.segments.{name} starts at byte {offset}, not on a {ALIGN_BYTES}-byte "
                                "boundary")
        if offset + nbytes > file_bytes:
            raise ManifestError(f"{what}.segments.{name} spans bytes [{offset}, {offset + nbytes}), past the "
                                f"file's {file_bytes}")
    pieces = _typed(sb["pieces"], list, f"{what}.pieces")
    total, steps = 0, []
    for j, piece in enumerate(pieces):
        where = f"{what}.pieces[{j}]"
        if not isinstance(piece, list) or len(piece) != 4:
            raise ManifestError(f"{where} is {_show(piece)}; it must be [entry, start, stop, step]")
        entry = _int(piece[0], f"{where} entry", 0, len(entries) - 1)
        start = _int(piece[1], f"{where} start")
        span = entries[entry]["stop"] - entries[entry]["start"]
        stop = _int(piece[2], f"{where} stop", start + 1, span)
        total += stop - start
        if piece[3] is not None:
            steps.append(_int(piece[3], f"{where} Adam step", 1, MAX_ADAM_STEP))
    if total != numel:
        raise ManifestError(f"{what}: its pieces hold {total} elements, its numel says {numel}")
    if moments != bool(steps):
        raise ManifestError(f"{what}.moments is {moments}, but {len(steps)} of its {len(pieces)} pieces have an "
                            "Adam step: moments exist exactly when some piece has stepped")


def check_manifest(m) -> None:
    """Every field a load reads, its type and range (see the module doc). Raises ManifestError."""
    _fields(m, "the manifest", ("format", "version", "streams_main", "segments", "entries", "buckets"))
    _typed(m["format"], str, "format")
    _int(m["version"], "version")
    streams_main = _typed(m["streams_main"], bool, "streams_main")
    segment_names = ((MAIN,) if streams_main else ()) + MOMENTS
    segments = _typed(m["segments"], dict, "segments")
    if sorted(segments) != sorted(segment_names):
        raise ManifestError(f"segments describes {sorted(segments)}; a checkpoint with streams_main={streams_main} "
                            f"holds {sorted(segment_names)}")
    for name, description in segments.items():
        _typed(description, dict, f"segments.{name}")
    entries = _typed(m["entries"], list, "entries")
    for i, e in enumerate(entries):
        _check_entry(e, i)
    buckets = _typed(m["buckets"], list, "buckets")
    files = set()
    for i, sb in enumerate(buckets):
        _check_bucket(sb, i, entries, segment_names)
        if sb["file"] in files:
            raise ManifestError(f"buckets[{i}].file {sb['file']!r} is listed twice")
        files.add(sb["file"])
    for key in ("resident", "codec_rng"):
        if m.get(key) is not None:
            _check_small_file(m[key], key)
    steps = m.get("group_steps", {})
    _typed(steps, dict, "group_steps")
    for group, step in steps.items():
        _int(step, f"group_steps[{group!r}]", 0, MAX_ADAM_STEP)
