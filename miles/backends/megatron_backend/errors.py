"""The Megatron backend's error for a transformers config it cannot build exactly (a leaf: every module of
the backend, the families' own modules included, raises it; ``architecture`` re-exports it)."""


class UnsupportedModelError(ValueError):
    """A transformers config the Megatron backend cannot build exactly (the message says which field)."""
