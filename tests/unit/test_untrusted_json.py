"""miles.untrusted_json: regular files only, never blocking on a FIFO nor reading a device, sizes from the opened
file, nesting and the number of values bounded before json parses, each refusal one line."""

import json
import os
import threading

import pytest

from miles.untrusted_json import UntrustedJSONError, parse_bounded, read_json, read_regular_file


def _within_seconds(seconds, fn, *args):
    """fn(*args) in a thread: what it returned or raised, or a failure when it has not returned in time."""
    out = {}

    def call():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} blocked for {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_fifo_is_refused_at_once_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(UntrustedJSONError, match="a FIFO, not a regular file"):
        _within_seconds(10, read_json, str(fifo), 1 << 20)


def test_a_link_to_a_device_or_a_directory_is_refused_before_a_byte_is_read(tmp_path):
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    with pytest.raises(UntrustedJSONError, match="a character device, not a regular file"):
        _within_seconds(10, read_regular_file, str(tmp_path / "zero.json"), 4 << 30)
    with pytest.raises(UntrustedJSONError, match="a directory, not a regular file"):
        read_regular_file(str(tmp_path), 1 << 20)


def test_a_link_to_a_regular_file_is_followed_and_the_size_bound_holds(tmp_path):
    (tmp_path / "real.json").write_text('{"a": [1, 2]}')
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert read_json(str(tmp_path / "link.json"), 13) == {"a": [1, 2]}
    with pytest.raises(UntrustedJSONError, match="13 bytes, more than the 12 it may have"):
        read_json(str(tmp_path / "link.json"), 12)


def test_deep_nesting_is_one_line_before_json_recurses(tmp_path):
    with pytest.raises(UntrustedJSONError, match="^nested 100000 levels deep, more than the 64 it may have$"):
        parse_bounded(b"[" * 100_000 + b"]" * 100_000)
    assert parse_bounded(b"[" * 64 + b"]" * 64) is not None
    # brackets inside strings (escaped quotes too) are text, not nesting
    assert parse_bounded(json.dumps(["[[[[\"{{{{", "\\"]).encode(), max_depth=1) == ["[[[[\"{{{{", "\\"]


def test_more_values_than_allowed_are_refused_before_they_are_allocated():
    text = b"[" + b"[], " * 999 + b"[]]"
    with pytest.raises(UntrustedJSONError, match="holds up to 2,001 values, more than the 2,000 it may have"):
        parse_bounded(text, max_values=2000)
    assert len(parse_bounded(text, max_values=2001)) == 1000


@pytest.mark.parametrize("text, words", [
    (b"\xff\xfe[\x001\x00]\x00", "not UTF-8 text (byte 0 is 0xff)"),
    (b"[1, 2", "not JSON (Expecting"),
    (b"1" * 5000, "not JSON (Exceeds the limit"),
])
def test_text_that_is_not_json_is_one_line(text, words):
    with pytest.raises(UntrustedJSONError) as e:
        parse_bounded(text)
    assert words in str(e.value) and "\n" not in str(e.value)
