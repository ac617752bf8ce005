"""A checkpoint's manifest is not trusted (issue 13): paths stay inside the checkpoint, declared sizes are
bounded by the live store's layout, and a checkpoint of another model is refused naming what differs."""

import json
import os
import zlib

import pytest
import torch

from miles_plugins.optimizers.nvme_stream import CheckpointError, stream_optimizer_state

from test_store import make_adamw, make_params, run_steps

BUCKET = 4096 + 100


def _saved(tmp_path, moment_dtype="fp32", sizes=None):
    params = make_params(sizes=sizes) if sizes else make_params()
    opt = make_adamw(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path / "live"), bucket_numel=BUCKET, moment_dtype=moment_dtype)
    run_steps([(opt, params)], steps=2)
    store.save_to(str(tmp_path / "ckpt"))
    return store, str(tmp_path / "ckpt" / "nvme_opt_state" / store.relative_dir)


def _edit_manifest(directory, edit):
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    m.pop("manifest_crc32")
    edit(m)
    m["manifest_crc32"] = zlib.crc32(json.dumps(m, sort_keys=True).encode())
    with open(path, "w") as f:
        json.dump(m, f)


def _outside_copy(tmp_path, directory, name="bucket00000.bin"):
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    with open(os.path.join(directory, name), "rb") as f:
        (outside / "evil.bin").write_bytes(f.read())
    return outside / "evil.bin"


def test_bucket_path_with_dotdot_is_refused(tmp_path):
    store, d = _saved(tmp_path)
    _outside_copy(tmp_path, d)
    _edit_manifest(d, lambda m: m["buckets"][0].update(file="../../../../outside/evil.bin"))
    with pytest.raises(CheckpointError, match=r"lists the file '\.\./\.\./\.\./\.\./outside/evil\.bin'.*plain names"):
        store.load_from(str(tmp_path / "ckpt"))
    store.close()


def test_absolute_path_is_refused_without_disclosing_the_outside_file(tmp_path):
    store, d = _saved(tmp_path)
    evil = _outside_copy(tmp_path, d)
    with open(evil, "ab") as f:
        f.write(b"x" * 12345)  # a size that an error must not reveal
    size = os.path.getsize(evil)
    _edit_manifest(d, lambda m: m["buckets"][0].update(file=str(evil)))
    with pytest.raises(CheckpointError) as info:
        store.load_from(str(tmp_path / "ckpt"))
    assert "plain names" in str(info.value) and str(size) not in str(info.value)
    store.close()


def test_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    store, d = _saved(tmp_path)
    evil = _outside_copy(tmp_path, d)
    os.unlink(os.path.join(d, "bucket00000.bin"))
    os.symlink(evil, os.path.join(d, "bucket00000.bin"))
    with pytest.raises(CheckpointError, match="leads outside the checkpoint"):
        store.load_from(str(tmp_path / "ckpt"))
    store.close()


def test_declared_rng_record_size_is_bounded_before_reading(tmp_path):
    store, d = _saved(tmp_path, moment_dtype="bf16")
    huge = 1 << 30
    os.truncate(os.path.join(d, "codec_rng.pt"), huge)  # sparse: costs no disk, would cost 1 GiB of RAM to read
    _edit_manifest(d, lambda m: m["codec_rng"].update(file_bytes=huge))
    with pytest.raises(CheckpointError, match=rf"declares {huge} bytes.*at most \d+"):
        store.load_from(str(tmp_path / "ckpt"))
    store.close()


def test_declared_bucket_size_beyond_the_layout_is_refused_and_the_live_file_keeps_its_size(tmp_path):
    store, d = _saved(tmp_path)
    big = 16 << 20
    live = store.buckets[0].file
    os.truncate(os.path.join(d, "bucket00000.bin"), big)
    _edit_manifest(d, lambda m: m["buckets"][0].update(file_bytes=big))
    with pytest.raises(CheckpointError, match=rf"declares {big} bytes, bucket 0 of this layout holds {live.nbytes}"):
        store.load_from(str(tmp_path / "ckpt"))
    assert os.fstat(live.fd).st_size == live.nbytes
    store.close()


def test_oversized_manifest_is_refused_before_parsing(tmp_path):
    store, d = _saved(tmp_path)
    with open(os.path.join(d, "manifest.json"), "ab") as f:
        f.write(b" " * (64 << 20))
    with pytest.raises(CheckpointError, match="more than the"):
        store.load_from(str(tmp_path / "ckpt"))
    store.close()


def test_checkpoint_of_a_model_with_more_params_is_refused_naming_the_first_difference(tmp_path):
    three_layers = (1000, 3, 5000, 12345, 7, 8191)
    store, _ = _saved(tmp_path, sizes=three_layers)
    store.close()
    params = make_params(sizes=three_layers[:4])
    small = stream_optimizer_state(make_adamw(params), dir=str(tmp_path / "live2"), bucket_numel=BUCKET)
    with pytest.raises(CheckpointError, match=r"holds 6 params \(26546 elements\), this model 4 \(18348 elements\); "
                                              r"first difference: param4: 7 elements in the checkpoint, absent now"):
        small.load_from(str(tmp_path / "ckpt"))
    small.close()
