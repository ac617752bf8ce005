"""The CPU megatron suite's harness (tests/megatron_cpu): the pinned wheel checked by hash, every edit of
patches.py applied exactly as declared (a mismatch fails naming the edit), and the patched copy marked '+cpu'."""

import importlib.metadata
import os

import pytest

from megatron_cpu import obtain, patches


def test_an_edit_that_does_not_match_as_declared_fails_naming_it(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text("x = torch.cuda.current_device()\ny = torch.cuda.current_device()\n")
    monkeypatch.setattr(patches, "EDITS", [patches.Edit("m.py", "torch.cuda.current_device()", '"cpu"', 1, "why")])
    with pytest.raises(ValueError, match=r"\(why\) on m.py: 'torch.cuda.current_device\(\)' found 2 time\(s\), "
                                         r"expected 1"):
        patches.apply(str(tmp_path))


def test_a_wheel_with_another_hash_is_refused(tmp_path, monkeypatch):
    wheel = tmp_path / obtain.WHEEL
    wheel.write_bytes(b"not the wheel")
    monkeypatch.setenv(obtain.WHEEL_ENV, str(wheel))
    monkeypatch.setenv(obtain.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(obtain.HarnessError, match=f"sha256 .* expected {obtain.WHEEL_SHA256}"):
        obtain.prepare()


def test_the_patched_copy_holds_every_edit_and_says_it_runs_on_cpu(megatron_cpu):
    for edit in patches.EDITS:
        with open(os.path.join(megatron_cpu, edit.path), encoding="utf-8") as f:
            text = f.read()
        assert text.count(edit.new) >= edit.count, (edit.path, edit.reason)
    [dist] = importlib.metadata.distributions(name="megatron-core", path=[megatron_cpu])
    assert dist.version == f"{obtain.VERSION}+cpu"
