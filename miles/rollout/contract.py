"""The rollout-engine contract: what the RL loop may call on any rollout engine.

It is shaped like sglang's RL API (``sglang.Engine``), so that a real sglang engine fits behind it with
thin adapters, and the embedded torch engine (:class:`miles.rollout.embedded.EmbeddedRolloutEngine`)
implements it directly. Every argument and return value is picklable (engines run as Ray actors).

States. An engine holds two kinds of memory, each resident or released on its own, named by a tag:

- ``"weights"``: the model weights.
- ``"kv_cache"``: the memory generation needs besides the weights (KV cache, static decode buffers,
  captured CUDA graphs).

Both are resident after construction. ``generate`` needs both; a weight update needs ``"weights"``.

Colocated order of one rollout (the trainer and the engine share the GPU)::

    engine.release_memory_occupation()                 # all tags: the GPU is the trainer's
    trainer wakes, trains, sleeps
    engine.resume_memory_occupation(["weights"])
    engine.begin_weight_update(version)                 # push the new weights
    engine.update_weights_from_tensor(...)  (or update_weights_from_distributed(...)), per bucket
    engine.end_weight_update(version)                   # samples now carry `version`
    engine.resume_memory_occupation(["kv_cache"])
    engine.generate(...)

The loop always pushes every weight after resuming ``"weights"``, so engines are free not to back them
up: sglang keeps none (its released weights come back undefined), and the loop builds the embedded engine
with ``backup="none"`` (it then refuses to generate until the weights are rewritten). An embedded engine
built with a backup restores them bit-exactly.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, Union, runtime_checkable

from miles.rollout.types import Sample, SamplingParams

__all__ = ["RolloutEngine", "MEMORY_TAGS", "WEIGHTS", "KV_CACHE", "FLATTENED_BUCKET", "LOAD_FORMATS",
           "MILES_FLAT_BUCKET", "SGLANG_FLATTENED_BUCKET", "WEIGHT_PAYLOADS", "check_memory_tags"]

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
MEMORY_TAGS = (WEIGHTS, KV_CACHE)
FLATTENED_BUCKET = "flattened_bucket"
LOAD_FORMATS = (FLATTENED_BUCKET, None)
# What an engine's weight updates consume (its ``weight_payload``); the trainer builds that (miles.weights.push).
# miles' bucket: by reference a miles.weights.SharedBucket, by broadcast miles' aligned flat of each spec.
MILES_FLAT_BUCKET = "miles_flat_bucket"
# sglang's own FlattenedTensorBucket: by reference its MultiprocessingSerializer payloads, one per tensor-parallel
# rank; by broadcast its flat, which sglang receives into a bucket of its class built from the spec's tensors.
SGLANG_FLATTENED_BUCKET = "sglang_flattened_bucket"
WEIGHT_PAYLOADS = (MILES_FLAT_BUCKET, SGLANG_FLATTENED_BUCKET)


def check_memory_tags(tags: Optional[Sequence[str]]) -> tuple[str, ...]:
    """The tags a release/resume call names, in :data:`MEMORY_TAGS` order (None: all of them).

    Raises ValueError for an unknown tag, and TypeError for a bare string (``"weights"`` instead of
    ``["weights"]``, which would otherwise read as the tags ``w``, ``e``, ...)."""
    if tags is None:
        return MEMORY_TAGS
    if isinstance(tags, str):
        raise TypeError(f"memory tags must be a list of tags, got the string {tags!r}: pass [{tags!r}]")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}: the tags are {list(MEMORY_TAGS)} (None: all)")
    return tuple(t for t in MEMORY_TAGS if t in tags)


@runtime_checkable
class RolloutEngine(Protocol):
    """A rollout engine. See the module docstring for the memory states and the colocated order.

    ``weight_payload``: the payload its weight updates consume (one of :data:`WEIGHT_PAYLOADS`), built by
    the trainer as it is; ``tp_size``: its tensor-parallel ranks (one payload each)."""

    weight_payload: str
    tp_size: int

    def generate(self, input_ids: list[list[int]], sampling_params: Union[SamplingParams, dict, None] = None,
                 return_logprob: bool = True) -> list[Sample]:
        """Sample ``sampling_params.n`` responses for each prompt of token ids.

        Returns prompt-major :class:`~miles.rollout.types.Sample` objects (the ``n`` samples of prompt ``i``
        at ``[i * n, (i + 1) * n)``), each with ``weight_version`` = :meth:`get_weight_version` and, when
        ``return_logprob``, ``response_logprobs[j]`` = ``log_softmax(logits / temperature)`` of
        ``response_ids[j]`` (else an empty list). Raises RuntimeError when ``"weights"`` or ``"kv_cache"``
        is released, or while a weight-update session is open."""
        ...

    def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> dict:
        """Free the memory of ``tags`` (None: all). Idempotent per tag: a released tag is skipped.

        Only while idle (no ``generate`` running) and, for ``"weights"``, outside a weight-update session;
        otherwise RuntimeError. Returns ``{tag: bytes freed by this call}`` for each tag named."""
        ...

    def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> dict:
        """Make the memory of ``tags`` (None: all) resident again. Idempotent per tag.

        ``"weights"`` come back as the engine's backup holds them (an embedded engine with a backup:
        bit-exact; without one, and sglang: undefined until the next update). Returns ``{tag: bytes restored by this call}``."""
        ...

    def begin_weight_update(self, version: int) -> None:
        """Open a weight-update session for ``version``. ``"weights"`` must be resident and no session
        open; otherwise RuntimeError."""
        ...

    def update_weights_from_tensor(self, serialized_named_tensors: list, load_format: Optional[str] = FLATTENED_BUCKET,
                                   flush_cache: bool = False) -> dict:
        """Copy named tensors into the weights, inside a session (RuntimeError outside one).

        ``serialized_named_tensors``: one payload per tensor-parallel rank of the engine. With
        ``load_format="flattened_bucket"`` each payload is of the engine's ``weight_payload`` kind: a
        :class:`miles.weights.SharedBucket` (:data:`MILES_FLAT_BUCKET`: opened with ``miles.weights.open_bucket``,
        unpacked with ``miles.weights.unpack_bucket``), or sglang's serialized bucket
        (:data:`SGLANG_FLATTENED_BUCKET`); the producer releases it after this call returns. With
        ``load_format=None`` the list itself holds
        ``(name, tensor)`` pairs. Names are the model's ``state_dict`` names (a ``module.`` prefix is
        stripped); each tensor is converted to its parameter's dtype and device. A shape mismatch raises
        ValueError and unknown names KeyError, before anything is copied. ``flush_cache``: call
        :meth:`flush_cache` afterwards. Returns ``{"tensors": n, "bytes": b}`` (b: source bytes)."""
        ...

    def end_weight_update(self, version: int) -> dict:
        """Close the session opened for ``version`` (RuntimeError for another version or no session): the
        engine's weight version becomes ``version``. Returns ``{"version", "tensors", "bytes"}`` of the
        whole session."""
        ...

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> None:
        """Join the weight-update process group ``group_name`` (a :class:`miles.weights.WeightUpdateGroup`)
        at rank ``rank_offset``. Blocks until all ``world_size`` ranks joined. A name already joined
        raises ValueError."""
        ...

    def update_weights_from_distributed(self, bucket_specs: list[dict], group_name: str, src: int = 0) -> dict:
        """Inside a session: for each ``BucketSpec.to_dict()`` in order, receive that bucket from rank
        ``src`` of the group, in the layout of the engine's ``weight_payload`` (miles' aligned flat, or
        sglang's bucket of the spec's tensors in their order), and copy its tensors in (as
        :meth:`update_weights_from_tensor`). Returns ``{"tensors": n, "bytes": b}``."""
        ...

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave and destroy the group (KeyError naming the joined groups for an unknown name)."""
        ...

    def flush_cache(self) -> None:
        """Drop cached prompt state that depends on the weights (sglang: its radix cache)."""
        ...

    def get_weight_version(self) -> int:
        """The version of the weights that generate with (0 before any session ended)."""
        ...

    def health(self) -> bool:
        """True while the engine can serve calls."""
        ...

    def close(self) -> None:
        """Leave every weight-update group and drop backups; the engine is unusable afterwards."""
        ...
