from fake_sglang import FakeSerializer as MultiprocessingSerializer  # noqa: F401
