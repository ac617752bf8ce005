"""torch_memory_saver's hook mode in a train rank (CPU: a stand-in module with the real package's
semantics). megatron-core's import sets the singleton's mode to "torch"; a rank runs under the preload
hook, so miles sets it back to "preload" before the singleton initializes, and every use in miles goes
through miles.offload.tms.preloaded_memory_saver (the GPU side: tests/gpu/test_weight_handoff_tms.py)."""

import pathlib
import re
import sys
import types

import pytest

from miles.offload.tms import preloaded_memory_saver

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _StandIn:
    """The package's singleton as it behaves: hook_mode may be set until the first use initializes it."""

    def __init__(self):
        self._ctor_kwargs = {}
        self.initialized_with = None

    @property
    def hook_mode(self):
        raise AttributeError

    @hook_mode.setter
    def hook_mode(self, mode):
        assert self._ctor_kwargs is not None, "Cannot configure after initialization"
        self._ctor_kwargs["hook_mode"] = mode

    def initialize(self):
        if self.initialized_with is None:
            self.initialized_with = self._ctor_kwargs.get("hook_mode", "preload")
            self._ctor_kwargs = None


@pytest.fixture
def saver(monkeypatch):
    singleton = _StandIn()
    monkeypatch.setitem(sys.modules, "torch_memory_saver", types.SimpleNamespace(torch_memory_saver=singleton))
    return singleton


def test_the_mode_megatron_sets_at_import_is_set_back_before_the_first_use(saver):
    saver.hook_mode = "torch"  # what importing megatron.core's GPT model does
    assert preloaded_memory_saver() is saver
    saver.initialize()
    assert saver.initialized_with == "preload"


def test_a_second_call_after_initialization_returns_the_same_singleton(saver):
    preloaded_memory_saver()
    saver.initialize()
    assert preloaded_memory_saver() is saver and saver.initialized_with == "preload"


def test_miles_reaches_the_singleton_only_through_preloaded_memory_saver():
    direct = re.compile(r"from\s+torch_memory_saver\s+import\s+torch_memory_saver|torch_memory_saver\.torch_memory_saver")
    users = [str(p.relative_to(ROOT)) for d in ("miles", "miles_plugins") for p in (ROOT / d).rglob("*.py")
             if direct.search(p.read_text())]
    assert users == ["miles/offload/tms.py"], users
