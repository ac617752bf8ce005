"""The store's documented log lines (docs/advanced/disk-offload.md) reach the run's log at INFO once
configure_logging has run, as it does in the CLI, the driver and every Ray actor."""

from __future__ import annotations

import logging

import pytest
import torch

from miles.logging_setup import configure_logging
from miles_plugins.optimizers.nvme_stream import stream_optimizer_state

STORE_LOGGER = "miles_plugins.optimizers.streaming.store"


class _Stderr:
    """What the run's stderr received (the handler writes to ``sys.stderr`` as it is at each record)."""

    def __init__(self, capsys):
        self._capsys = capsys

    def getvalue(self) -> str:
        return self._capsys.readouterr().err


@pytest.fixture
def log_stream(capsys):
    """stderr as a string, with the loggers' levels and the root's handlers restored afterwards."""
    names = ("", "miles", "miles_plugins")
    saved_levels = {name: logging.getLogger(name).level for name in names}
    root = logging.getLogger()
    saved_handlers = list(root.handlers)
    yield _Stderr(capsys)
    root.handlers = saved_handlers
    for name, level in saved_levels.items():
        logging.getLogger(name).setLevel(level)


def test_a_store_record_at_info_is_emitted(log_stream):
    configure_logging("INFO")
    logging.getLogger(STORE_LOGGER).info("optimizer step 7 streamed")
    logging.getLogger(STORE_LOGGER).debug("not at INFO")
    out = log_stream.getvalue()
    assert "optimizer step 7 streamed" in out
    assert "not at INFO" not in out


def test_debug_reaches_the_store_loggers_too(log_stream):
    configure_logging("DEBUG")
    logging.getLogger("miles_plugins.optimizers.streaming.io.stager").debug("fallocate unsupported")
    assert "fallocate unsupported" in log_stream.getvalue()


def test_a_store_step_save_and_load_log_their_documented_lines(log_stream, tmp_path):
    configure_logging("INFO")
    params = [torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n))) for n in (1000, 5000)]
    opt = torch.optim.AdamW(params, lr=1e-2)
    stream_optimizer_state(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(8))]), dir=str(tmp_path / "auto"),
                           host_cache_mb="auto").close()  # its sizing line
    store = stream_optimizer_state(opt, dir=str(tmp_path / "state"), bucket_numel=4096)
    try:
        # write-back images over the bucket files: a tier set after construction keeps every bucket's file
        # (one given at construction holds what fits in RAM only), so a load reads the images back
        store.set_io(host_cache_mb=1)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        store.save_to(str(tmp_path / "ckpt"))
        assert store.load_from(str(tmp_path / "ckpt"))
    finally:
        store.close()
    out = log_stream.getvalue()
    assert "optimizer step 1 streamed" in out
    assert "host tier (host_cache_mb='auto')" in out
    assert "host tier: reading" in out  # the read-ahead after a load
    assert "O_DIRECT" in out  # either "uses O_DIRECT" or the buffered fallback, whichever this filesystem gives
