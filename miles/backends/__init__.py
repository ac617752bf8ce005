"""Training backends: `torch` (transformers + ZeRO-1, runs on CPU) and `megatron` (GPU only).

The interface and the registry are in :mod:`miles.backends.base` (``TrainBackend``, ``BACKENDS``).
"""
