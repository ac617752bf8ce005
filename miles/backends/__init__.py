"""Training backends: `torch` (transformers + ZeRO-1, runs on CPU) and `megatron` (GPU only).

A backend is a compute engine (:class:`miles.backends.engine.TrainEngine`) under the train rank that
owns init, the step, checkpoints, the weight handoff and sleep (:class:`miles.backends.rank.TrainRank`;
the step's pieces in :mod:`~miles.backends.step`, sleep in :mod:`~miles.backends.sleep`, decided by
:mod:`~miles.backends.sleep_mode`); the registry by ``--train-backend`` value is
:data:`miles.config.backends.BACKENDS`.
"""
