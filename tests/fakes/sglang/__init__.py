"""A stand-in ``sglang`` package for CPU tests (tests/fakes on the path): ``Engine`` is the fake engine of
tests/fakes/fake_sglang.py; ``MILES_FAKE_SGLANG_VERSION`` picks the version it emulates (default 0.5.17)."""

import os

import fake_sglang

__version__ = os.environ.get("MILES_FAKE_SGLANG_VERSION", "0.5.17")
ENGINES = []  # every engine built in this process, for tests to inspect


def Engine(**server_args):
    engine = fake_sglang.FakeSglangEngine(version=__version__, **server_args)
    ENGINES.append(engine)
    return engine
