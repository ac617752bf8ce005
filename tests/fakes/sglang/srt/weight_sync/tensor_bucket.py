from fake_sglang import FakeFlattenedTensorBucket as FlattenedTensorBucket  # noqa: F401
