"""The store's exceptions, one home each: every module raises these, the public API re-exports them."""

from __future__ import annotations


class StoreConfigError(ValueError):
    """Bad input to the store (configuration, optimizer, directory), found before anything on disk changed.
    For a bad StreamConfig field: ``field`` (its name) and ``expected`` (what it must be); else both None."""

    def __init__(self, message: str, field: str | None = None, expected: str | None = None):
        super().__init__(message)
        self.field = field
        self.expected = expected


class CheckpointError(RuntimeError):
    """A checkpoint of streamed state is incomplete, corrupt, or does not fit this store."""


class StorePoisonedError(RuntimeError):
    """A step failed part way: the bucket files hold a mix of two steps. Only `load_from` recovers."""


class StateCorruptionError(RuntimeError):
    """verify=True: a live bucket file's bytes differ from what the store wrote (changed outside the store)."""
