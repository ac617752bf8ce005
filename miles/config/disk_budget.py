"""What one run writes to disk, computed from the model size before anything starts.

Pure functions over the parsed flags and a parameter count; :func:`miles.config.validation.validate_args`
compares the result with the free space of the filesystems holding ``--offload-train-disk-dir`` and
``--save``. Every term is an upper estimate for the ranks on one machine: all of them when the
run starts its own single-node Ray, or as many as can land on the driver's node when it joins a cluster
(:func:`ranks_on_driver_node`; :mod:`miles.ray.node_disk` then checks every node once Ray has placed them):

- ``state``: the streamed optimizer state (``--stream-optimizer-state-to-disk``): fp32 masters plus the
  two moments as the store's own codecs encode them (12 B/param with fp32 moments, about 6 with fp8).
  ZeRO-1 shards it over the ranks, so the total does not grow with ``--num-train-ranks``.
- ``trainer_offload``: trainer offload to disk: every rank's weights (model dtype), plus the in-memory
  optimizer state (12 B/param, sharded) when it does not stream.
- ``checkpoint``: one checkpoint (weights + optimizer state), counted where ``--save`` lives.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GIB = 2**30
FP32_BYTES = 4
# fp32 master + two fp32 moments: the in-memory Adam state per parameter
RESIDENT_ADAM_BYTES = 12
DTYPE_BYTES = {"fp32": 4, "bf16": 2}

# SmolLM2-135M-Instruct (the embedded default): its config.json counted by miles.sizing.model_params
# (tied embeddings). A constant because the HF folder exists only after the first run converts it.
SMOLLM2_PARAMS = 134_515_008


@dataclass(frozen=True)
class DiskBudget:
    """Bytes a run writes, by mechanism (0 when the mechanism is off)."""

    state: int = 0
    trainer_offload: int = 0
    checkpoint: int = 0

    @property
    def scratch(self) -> int:
        """Everything under ``--offload-train-disk-dir``."""
        return self.state + self.trainer_offload

    def describe(self, with_checkpoint: bool) -> str:
        """``1.61 GiB streamed state + 0.54 GiB trainer offload + ...`` (the non-zero terms)."""
        terms = [(self.state, "streamed optimizer state"), (self.trainer_offload, "trainer offload")]
        if with_checkpoint:
            terms.append((self.checkpoint, "checkpoint copy"))
        return " + ".join(f"{n / GIB:.2f} GiB {what}" for n, what in terms if n) or "nothing"


def model_params(model_source: str, hf_config: dict | None) -> int | None:
    """Parameters of the policy: from ``--hf-checkpoint``'s config.json, the embedded default's count, or
    the tiny model's config. None when the config describes an architecture the counter does not know
    (the free-space check is then skipped rather than guessed)."""
    tensors = model_tensors_of_run(model_source, hf_config)
    return tensors.total() if tensors is not None else None


def model_tensors_of_run(model_source: str, hf_config: dict | None):
    """The policy's tensors as :mod:`miles.sizing` counts them (a ``ModelTensors``: dense and expert apart,
    for ``miles train``'s per-node disk check), or None as in :func:`model_params`."""
    from miles.sizing.model_params import ModelConfigError, flat_model, model_tensors

    if model_source == "smollm2":
        return flat_model(SMOLLM2_PARAMS, name="SmolLM2-135M-Instruct")
    if model_source == "tiny":
        from miles.models import TINY_MODEL_CONFIG

        # the tiny char vocabulary is under 128 tokens; the counter pads any vocabulary to 128
        return model_tensors({**TINY_MODEL_CONFIG, "vocab_size": 128}, "tiny")
    try:
        return model_tensors(hf_config or {}, "--hf-checkpoint")
    except (ModelConfigError, KeyError, TypeError, ValueError):
        return None


def streamed_state_bytes(params: int, moment_dtype: str) -> int:
    """fp32 masters + both moments in ``moment_dtype``, as the store's codecs encode them."""
    from miles_plugins.optimizers.streaming.codec import make_moment_codecs

    moments = sum(codec.encoded_nbytes(params) for codec in make_moment_codecs(moment_dtype).values())
    return FP32_BYTES * params + moments


def ranks_on_driver_node(num_train_ranks: int, node_slots: int) -> int:
    """Train ranks that can land on the driver's node of a cluster: one bundle each, and the node holds at
    most ``node_slots`` bundles (its GPUs, or its CPUs / --num-cpus-per-rank)."""
    return max(0, min(num_train_ranks, node_slots))


def disk_budget(a: argparse.Namespace, params: int, cuda: bool, ranks_here: int | None = None) -> DiskBudget:
    """The run's :class:`DiskBudget` for the resolved flags ``a`` (offload_train and model_dtype set).

    ``ranks_here``: the train ranks whose scratch lands on the checked filesystem (None: all of them, the
    single-node case); their share of the sharded state is counted."""
    n = a.num_train_ranks
    ranks = n if ranks_here is None else ranks_here
    streaming = a.stream_optimizer_state_to_disk
    optimizer_state = (streamed_state_bytes(params, a.stream_optimizer_state_moment_dtype) if streaming
                       else RESIDENT_ADAM_BYTES * params)
    shard = -(-optimizer_state * ranks // n)  # ZeRO-1: these ranks' part of the state, rounded up
    weights = params * DTYPE_BYTES[a.model_dtype]
    disk_offload = a.offload_train and a.offload_train_target == "disk"
    return DiskBudget(
        state=shard if streaming else 0,
        trainer_offload=(weights * ranks + (0 if streaming else shard)) if disk_offload else 0,
        checkpoint=weights + optimizer_state if a.save else 0,
    )
