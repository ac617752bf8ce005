"""Training backends: `torch` (transformers + ZeRO-1, runs on CPU) and `megatron` (GPU only).

The interface is :class:`miles.backends.base.TrainBackend`; the registry by ``--train-backend`` value is
:data:`miles.config.backends.BACKENDS`.
"""
