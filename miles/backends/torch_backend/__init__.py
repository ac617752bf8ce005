"""The torch training backend. Kept import-light: torch loads only when a name is used."""

__all__ = ["MasterShard", "ShardedMixedPrecisionAdam"]


def __getattr__(name):
    if name in __all__:
        from . import sharded_optimizer

        return getattr(sharded_optimizer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
