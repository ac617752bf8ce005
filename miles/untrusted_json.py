"""JSON from files and peers this process does not trust: read and parsed within bounds fixed before a byte
is parsed.

- :func:`read_regular_file`: the bytes of a regular file only (opened with O_NONBLOCK and judged by ``fstat``
  on the opened descriptor, so a FIFO, a device or a directory is refused without blocking or reading), its
  size taken from that descriptor and bounded before anything is read.
- :func:`parse_bounded`: ``json.loads`` after one linear scan of the text outside strings that bounds how
  deep its arrays and objects nest (Python's parser recurses once per level) and how many values it holds
  (each a Python object: ``[]`` is 3 bytes of text and 64 of memory), so neither a recursion error nor a
  parse many times larger than the text can happen.
- :func:`read_json`: both.

Each refusal is an :class:`UntrustedJSONError` whose message is one short line saying what is wrong (the
caller adds which file or answer, and what to do).
"""

from __future__ import annotations

import codecs
import json
import os
import re
import stat
from itertools import accumulate
from typing import Any, Optional

__all__ = ["UntrustedJSONError", "TooLargeError", "file_kind", "read_regular_file", "text_file_problem", "parse_bounded",
           "read_json", "DEFAULT_MAX_DEPTH"]

DEFAULT_MAX_DEPTH = 64  # config files nest a few levels; Python's parser gives up near 1000

_ESCAPE = re.compile(rb"\\.", re.DOTALL)  # an escape inside a string (outside one, a backslash is not JSON)
_STRING = re.compile(rb'"[^"]*"')  # a string once its escapes are gone
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b"[]{},")
_DEPTH_STEP = [1 if chr(b) in "[{" else -1 for b in range(256)]


class UntrustedJSONError(ValueError):
    """A file or an answer that is not JSON this process takes; the message is one line without the source."""


class TooLargeError(UntrustedJSONError):
    """More bytes, or more values, than the caller's bound: the caller may say what that bound stands for."""


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, as a message names it (``mode``: its ``st_mode``)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular_file(path: str, max_bytes: int) -> bytes:
    """The contents of the regular file at ``path`` (a symbolic link is followed to what it names), at most
    ``max_bytes`` of them. Raises :class:`UntrustedJSONError` for anything else (a FIFO, a device, a directory,
    a larger file: refused before a byte is read) and ``OSError`` when the file cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO does not wait for a writer
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedJSONError(f"{file_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise TooLargeError(f"{st.st_size:,} bytes, more than the {max_bytes:,} it may have")
        chunks, left = [], max_bytes + 1  # one byte more: a file that grew since fstat is seen growing
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    if left <= 0:
        raise TooLargeError(f"grew past the {max_bytes:,} bytes it may have while it was read")
    return b"".join(chunks)


def text_file_problem(path: str) -> Optional[str]:
    """Why ``path`` is not a text file to append lines to, or None (also when it does not exist yet): it is not
    a regular file (a directory, a FIFO, a device; a symbolic link is judged by what it names), or not UTF-8
    text. Read in chunks, never opened blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO does not wait for a writer
    except FileNotFoundError:
        return None  # the first record creates it (a dangling symbolic link: where it points)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        return f"is {file_kind(mode)}, not a regular file"
    with os.fdopen(fd, "rb") as f:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        try:
            while chunk := f.read(1 << 20):
                decoder.decode(chunk)
                offset += len(chunk)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            return f"is not a text file (byte {offset + e.start} is not UTF-8)"
        except OSError as e:
            return f"cannot be read ({e.strerror})"
    return None


def _structure(text: bytes) -> bytes:
    """The brackets and commas of ``text`` outside its strings: exact for JSON (a string's escapes, then the
    strings, are cut out left to right as JSON reads them); for text that is not JSON, parsing fails anyway."""
    return _STRING.sub(b"", _ESCAPE.sub(b"", text)).translate(None, _NOT_STRUCTURE)


def parse_bounded(text: bytes | str, max_depth: int = DEFAULT_MAX_DEPTH, max_values: Optional[int] = None) -> Any:
    """``json.loads(text)`` once its arrays and objects nest at most ``max_depth`` deep and it holds at most
    ``max_values`` values (None: any number; an object's key and value count as one), both checked first by a
    scan of the text; :class:`UntrustedJSONError` otherwise, and for text that is not JSON."""
    # the scan reads UTF-8 (where a byte below 0x80 is always that ASCII character); json.loads would also take
    # UTF-16 and UTF-32, whose bytes the scan could misread, so bytes must be UTF-8
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    structure = _structure(data)
    commas = structure.count(b",")
    containers = structure.count(b"[") + structure.count(b"{")
    values = 1 + commas + containers  # a container of k values has k - 1 commas
    if containers > max_depth:  # else it cannot nest deeper than it has containers
        depth = max(accumulate(map(_DEPTH_STEP.__getitem__, structure.translate(None, b","))), default=0)
        if depth > max_depth:
            raise UntrustedJSONError(f"nested {depth} levels deep, more than the {max_depth} it may have")
    if max_values is not None and values > max_values:
        raise TooLargeError(f"holds up to {values:,} values, more than the {max_values:,} it may have")
    try:
        return json.loads(text if isinstance(text, str) else data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UntrustedJSONError(f"not UTF-8 text (byte {e.start} is 0x{data[e.start]:02x})") from None
    except RecursionError:  # not reached after the scan; kept so no traceback can escape a caller
        raise UntrustedJSONError("nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, an integer of too many digits
        reason = " ".join(str(e).split())
        raise UntrustedJSONError(f"not JSON ({reason[:120]})") from None


def read_json(path: str, max_bytes: int, max_depth: int = DEFAULT_MAX_DEPTH, max_values: Optional[int] = None) -> Any:
    """:func:`parse_bounded` of :func:`read_regular_file`: the JSON document in a regular file, every bound
    checked before it is parsed."""
    return parse_bounded(read_regular_file(path, max_bytes), max_depth, max_values)
