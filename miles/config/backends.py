"""The training backends by ``--train-backend`` value, as ``"module:Class"`` strings.

Pure data: the driver reads it to tell each train actor which class to build, and choosing a backend
imports nothing (no torch, no store, no megatron-core) until the actor resolves the spec
(:func:`miles.backends.rank.resolve_backend`).
"""

BACKENDS: dict[str, str] = {
    "torch": "miles.backends.torch_backend.trainer:TorchTrainer",
    "megatron": "miles.backends.megatron_backend.trainer:MegatronTrainer",
}
