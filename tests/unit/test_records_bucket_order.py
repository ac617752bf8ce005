"""An fp32 checkpoint's next bucket order: validated and restored like a narrow-moment checkpoint's.

The order alternates every step (pipeline.py); a checkpoint records the next one (rng.py). fp32 moments
round nothing, so their manifest has no generator record (codec_rng.pt), only the order: a load onto the
same layout still restores it, and a value other than "ascending" / "descending" is a CheckpointError.
"""

import os
import pathlib
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402

from miles_plugins.optimizers.streaming.checkpoint import rng as codec_rng  # noqa: E402
from test_checkpoint import (  # noqa: E402,F401  (_restarted_process: autouse fixture)
    _expect_error, _restarted_process, build, load, restart, rewrite_manifest, save, train)
from test_checkpoint_narrow import _manifest  # noqa: E402


def _walked(store, params, opt, step):
    """The bucket indices one optimizer step updates, in the order it updates them."""
    order = []
    for b in store.buckets:
        b.update = lambda b=b, update=b.update: (order.append(b.index), update())[1]
    try:
        train(params, opt, [step])
    finally:
        for b in store.buckets:
            del b.update  # the class's method again
    return order


@pytest.fixture
def saved_fp32(tmp_path):
    """A plain fp32-moment checkpoint after 3 steps (the 4th walks the buckets backwards): (tmp_path, base)."""
    restart()
    params, opt, store = build("plain", tmp_path / "live", moment_dtype="fp32")
    train(params, opt, range(3))
    assert store.pipeline.next_order_descending()
    save(params, store, str(tmp_path / "ck"))
    store.close()
    restart()
    return tmp_path, str(tmp_path / "ck")


def test_fp32_checkpoint_restores_the_next_bucket_order(saved_fp32):
    tmp_path, base = saved_fp32
    m = _manifest(base)
    assert m["next_bucket_order"] == "descending" and "codec_rng" not in m
    params, opt, store = build("plain", tmp_path / "live", moment_dtype="fp32")
    assert len(store.buckets) > 2
    assert load(params, opt, store, base) is True
    walked = _walked(store, params, opt, 3)
    assert walked == sorted(walked, reverse=True), walked  # the saved run's 4th step: descending
    assert _walked(store, params, opt, 4) == sorted(walked)  # and on from there, alternating
    store.close()


@pytest.mark.parametrize("bad", ["sideways", 1, ["descending"]])
def test_fp32_checkpoint_with_a_bad_next_bucket_order_is_refused(saved_fp32, bad):
    tmp_path, base = saved_fp32
    rewrite_manifest(pathlib.Path(base) / "nvme_opt_state/rank00000/opt0_0", {**_manifest(base),
                                                                              "next_bucket_order": bad})
    _expect_error(tmp_path, base, rf"manifest\.json: next_bucket_order is {re.escape(repr(bad))}, expected "
                  r"'ascending' or 'descending'; the manifest is corrupt", kind="plain", moment_dtype="fp32")


def test_an_order_without_the_generators_of_a_noisy_store_is_refused(tmp_path):
    """bf16 moments round stochastically: a same-layout manifest that kept the order and lost the record of
    the generators is inconsistent (both are written at the same snapshot)."""
    params, opt, store = build("plain", tmp_path / "live", moment_dtype="bf16")
    train(params, opt, range(3))
    base = str(tmp_path / "ck")
    save(params, store, base)
    store.close()
    restart()
    d = pathlib.Path(base) / "nvme_opt_state/rank00000/opt0_0"
    os.unlink(d / codec_rng.FILE)
    rewrite_manifest(d, {k: v for k, v in _manifest(base).items() if k != "codec_rng"})
    _expect_error(tmp_path, base, r"manifest\.json: the record of the stochastic-rounding generators is corrupt or "
                  r"does not fit this store \(next_bucket_order is recorded without the generator states",
                  kind="plain", moment_dtype="bf16")
