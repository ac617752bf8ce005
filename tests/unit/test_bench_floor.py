"""The raw disk floor (`miles bench stream`, `miles bench rl`): it moves exactly the bytes it is given, in
both orders, and a worker's I/O error reaches the caller."""

import pytest

from miles.bench.floor import raw_floor

CHUNK = 64 * 1024


def test_write_then_read_moves_the_bytes_asked_for(tmp_path):
    path = str(tmp_path / "f")
    nbytes = 5 * CHUNK + 4096  # a short last chunk
    with open(path, "wb") as f:
        f.truncate(nbytes)
    written = raw_floor([], path, nbytes, CHUNK, direct=False, concurrent=False)
    assert written["bytes_read"] == 0 and written["bytes_written"] == nbytes
    assert written["read_seconds"] >= 0 and written["write_seconds"] >= 0 and written["direct"] is False
    with open(path, "rb") as f:
        assert f.read() == b"\x07" * nbytes  # the floor writes its touched buffers, every chunk of them

    read = raw_floor([(path, 0, nbytes)], path, 0, CHUNK, concurrent=False)
    assert read["bytes_read"] == nbytes and read["bytes_written"] == 0 and read["seconds"] > 0


def test_concurrent_reads_and_writes_report_one_time(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    for path in (src, dst):
        with open(path, "wb") as f:
            f.truncate(4 * CHUNK)
    r = raw_floor([(src, CHUNK, 2 * CHUNK), (src, 0, CHUNK)], dst, 4 * CHUNK, CHUNK, threads=3, direct=False)
    assert r["bytes_read"] == 3 * CHUNK and r["bytes_written"] == 4 * CHUNK
    assert r["read_seconds"] is None and r["write_seconds"] is None and r["seconds"] > 0


def test_a_read_past_the_end_of_the_file_raises(tmp_path):
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.truncate(CHUNK)
    with pytest.raises(OSError, match="unexpected end of file"):
        raw_floor([(path, 0, 2 * CHUNK)], path, 0, CHUNK, direct=False)
