"""`miles bench` refuses bad values at the boundary: exit 2, one error line, no traceback, nothing made."""

import os
import subprocess
import sys

import pytest
import torch

CASES = [
    (["stream", "--params", "lots"], "argument --params: 'lots' is not a number"),
    (["stream", "--params", "1e400"], "argument --params: '1e400' is not a number"),
    (["stream", "--dir", "/proc/self"], "argument --dir: /proc/self cannot hold a bench's files"),
    (["checkpoint", "--dir", "/sys/kernel"], "argument --dir: /sys/kernel cannot hold a bench's files"),
    (["stream", "--fwd-bwd-seconds", "1e9"], "argument --fwd-bwd-seconds: must be <= 600, got 1e9"),
    (["checkpoint", "--fwd-bwd-seconds", "1e9"], "argument --fwd-bwd-seconds: must be <= 600, got 1e9"),
    (["stream", "--host-cache-fractions", "2"], "argument --host-cache-fractions: must be <= 1, got 2"),
    (["stream", "--host-cache-fractions", "0.5,-1"], "argument --host-cache-fractions: must be >= 0, got -1"),
    (["rl", "--preset", "llama-9000", "--dir", "{tmp}/new"], "argument --preset: invalid choice: 'llama-9000'"),
    (["rl", "--preset", "llama-tiny", "--dir", "{tmp}/new", "--rollouts", "1"], "argument --rollouts: must be >= 2"),
    (["rl", "--preset", "llama-tiny", "--dir", "{tmp}/new", "--arms", "bogus"], "--arms 'bogus': unknown arm(s)"),
    (["checkpoint", "--gb", "1e-12", "--dir", "{tmp}/new"], "--gb 1e-12 is 0 params"),
]
if not torch.cuda.is_available():
    CASES += [(["stream", "--device", "cuda"], "--device cuda, but torch sees no CUDA device"),
              (["checkpoint", "--device", "cuda:0"], "--device cuda:0, but torch sees no CUDA device")]


def _bench(argv, cwd):
    return subprocess.run([sys.executable, "-m", "miles.cli", "bench", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=os.environ | {"PYTHONPATH": os.getcwd()})


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_value_is_one_line_and_exit_2_and_makes_nothing(argv, message, tmp_path):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    before = sorted(os.listdir(tmp_path))
    r = _bench(argv, tmp_path)
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(errors) == 1 and message in errors[0], r.stderr
    assert sorted(os.listdir(tmp_path)) == before  # neither --dir nor a default folder was created


def test_the_rl_presets_are_listed_in_its_help(tmp_path):
    from miles.models import RANDOM_MODEL_PRESETS

    out = _bench(["rl", "--help"], tmp_path).stdout
    assert all(name in out for name in RANDOM_MODEL_PRESETS)


def test_a_dir_under_a_file_or_unwritable_is_refused(tmp_path, monkeypatch):
    from miles.bench.common import dir_arg

    (tmp_path / "f").write_text("")
    with pytest.raises(Exception, match="is not a directory"):
        dir_arg(str(tmp_path / "f" / "sub"))
    monkeypatch.setattr("tempfile.TemporaryFile", lambda **kw: (_ for _ in ()).throw(PermissionError(13, "denied")))
    with pytest.raises(Exception, match=f"cannot create files in {tmp_path}"):
        dir_arg(str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
