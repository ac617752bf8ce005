"""One bucket: its pieces, its file, its device buffers and the Adam instance that steps exactly them.

The device buffers are flat fp32 tensors, one per streamed segment, whose storage is materialized
for the duration of a step and resized to 0 afterwards; the pieces the Adam instance sees are views
into them, so they stay valid across release and re-materialization.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .codec import CHUNK_NUMEL
from .layout import EXP_AVG, EXP_AVG_SQ, MAIN, MOMENTS, BucketLayout, bucket_layout
from .plan import BucketPlan
from .io.stager import BucketFile, Stager

# Master-group keys that belong to the per-bucket instance, not to the hyperparameters it mirrors.
_NOT_HYPERPARAMETERS = {"params", "step"}


@dataclass
class StreamEntry:
    """One fp32 master tensor the store manages.

    main: the master optimizer's param (fp32); its storage is released when `model_view` is given.
    group: index into the master optimizer's param_groups.
    model_view: where updated mains are published (low-precision model storage, same numel), or None
        when `main` is itself the model param (plain fp32 training: only the moments stream).
    name, start, full_numel: identity for checkpoints: `main` is elements [start, start + numel) of the
        flattened param `name` of `full_numel` elements. Lets a checkpoint be resharded onto another
        data-parallel size; None (no identity) means it resumes only onto the same layout.
    """

    main: torch.Tensor
    group: int
    model_view: torch.Tensor | None = None
    name: str | None = None
    start: int = 0
    full_numel: int | None = None


# Narrow codecs encode and decode a segment in chunks of CHUNK_NUMEL elements. Counting the ops of the
# deepest path (stochastic rounding of a format with subnormals, then the nonzero floor), at most this many
# fp32 temporaries of one chunk are alive at once; one encode or decode runs at a time (the step's thread).
CODEC_SCRATCH_CHUNKS = 8


def inflight_bytes(codecs: dict, names, numel: int) -> int:
    """The most state bytes one bucket of `numel` elements holds on the device in flight: an fp32 buffer
    per streamed segment, plus the encoded bytes of the segments a narrow codec stores (read and not yet
    decoded, or encoded for the write-back; never both at once)."""
    return sum(4 * numel + (0 if codecs[n].reads_in_place() else codecs[n].encoded_nbytes(numel)) for n in names)


def codec_scratch_bytes(codecs: dict, names, numel: int) -> int:
    """Device bytes a narrow codec's encode or decode of a bucket of `numel` elements allocates on top."""
    if all(codecs[n].reads_in_place() for n in names):
        return 0
    return CODEC_SCRATCH_CHUNKS * 4 * min(numel, CHUNK_NUMEL)


def step_device_bytes(codecs: dict, names, largest_numel: int, in_flight: int) -> int:
    """The store's cost model (plan.DeviceBytes): `in_flight` buckets of at most `largest_numel` elements,
    plus one codec's scratch."""
    return in_flight * inflight_bytes(codecs, names, largest_numel) + codec_scratch_bytes(codecs, names, largest_numel)


def storage_identity(tensor: torch.Tensor) -> tuple:
    """Which storage `tensor` views and where: it changes when `tensor.data` is replaced, and not when the
    bytes of the same storage move (an in-place resize to 0 and back by a sleep/wake offload, share_memory_())."""
    return tensor.untyped_storage()._cdata, tensor.storage_offset()


# Set on an optimizer by torch.amp.GradScaler for the duration of its step when the optimizer unscales
# and skips overflowed steps itself (fused Adam: `_step_supports_amp_scaling`; torch/amp/grad_scaler.py).
AMP_SCALING_ATTRIBUTES = ("grad_scale", "found_inf")


def adam_constructor_kwargs(master: torch.optim.Optimizer) -> dict:
    accepted = inspect.signature(type(master).__init__).parameters
    return {k: v for k, v in master.defaults.items() if k in accepted and k != "params"}


class Bucket:
    def __init__(self, index: int, plan: BucketPlan, entries: list[StreamEntry], master: torch.optim.Optimizer,
                 codecs: dict, file: BucketFile, device: torch.device, streams_main: bool):
        self.index = index
        self.pieces = plan.pieces
        self.numel = plan.numel
        self.entries = entries
        self.master = master
        self.codecs = codecs  # segment name -> codec
        self.file = file
        self.streams_main = streams_main
        self.moments_on_disk = False
        self._decode_pending: list[tuple[str, list[torch.Tensor]]] = []  # read, not yet decoded (start_fetch)
        self.layout: BucketLayout = bucket_layout(
            [(name, codecs[name].encoded_nbytes(self.numel)) for name in self.segment_names])
        self.offsets = [0]
        for piece in self.pieces:
            self.offsets.append(self.offsets[-1] + piece.numel)
        # Views must be cut while the storage exists; release() right after frees it.
        self.flat = {name: torch.empty(self.numel, dtype=torch.float32, device=device) for name in self.segment_names}
        self.params = [self._param_view(i) for i in range(len(self.pieces))]
        self.moment_views = [{k: self._flat_view(k, i) for k in MOMENTS} for i in range(len(self.pieces))]
        groups, self.master_group_of = {}, []
        for piece, param in zip(self.pieces, self.params):
            g = entries[piece.entry].group
            if g not in groups:
                groups[g] = {**self._hyperparameters(g), "params": []}
                self.master_group_of.append(g)
            groups[g]["params"].append(param)
        self.optimizer = type(master)(list(groups.values()), **adam_constructor_kwargs(master))
        self.release()

    @property
    def segment_names(self) -> tuple[str, ...]:
        return (MAIN, EXP_AVG, EXP_AVG_SQ) if self.streams_main else (EXP_AVG, EXP_AVG_SQ)

    def _flat_view(self, name: str, i: int) -> torch.Tensor:
        return self.flat[name][self.offsets[i]:self.offsets[i + 1]]

    def _param_view(self, i: int) -> torch.Tensor:
        if self.streams_main:
            return self._flat_view(MAIN, i)
        piece = self.pieces[i]
        return self.entries[piece.entry].main.detach().view(-1)[piece.start:piece.stop]

    def _hyperparameters(self, g: int) -> dict:
        return {k: v for k, v in self.master.param_groups[g].items() if k not in _NOT_HYPERPARAMETERS}

    # ---- residency ----------------------------------------------------------------------------
    def materialize(self, names) -> None:
        for name in names:
            storage = self.flat[name].untyped_storage()
            if storage.nbytes() != self.numel * 4:  # resize_ reallocates even to the same size: a
                storage.resize_(self.numel * 4)    # write-back may still be copying out of this memory

    def release(self) -> None:
        for flat in self.flat.values():
            flat.untyped_storage().resize_(0)

    def resident_bytes(self) -> int:
        total = sum(f.untyped_storage().nbytes() for f in self.flat.values())
        for param, views in zip(self.params, self.moment_views):
            state = self.optimizer.state.get(param, {})
            total += sum(state[k].nbytes for k in MOMENTS if k in state and state[k] is not views[k])
        return total

    # ---- the data path ------------------------------------------------------------------------
    def segments_to_fetch(self) -> tuple[str, ...]:
        """Moments do not exist before the first step: the first fetch reads mains only."""
        moments = MOMENTS if self.moments_on_disk else ()
        return ((MAIN,) if self.streams_main else ()) + moments

    def fetch(self, stager: Stager, names: tuple[str, ...]) -> None:
        """Materialize `names` and fill them from the file; returns once they hold the bytes."""
        self.start_fetch(stager, names)
        self.finish_fetch(stager)

    def start_fetch(self, stager: Stager, names: tuple[str, ...]) -> None:
        """Materialize `names` and submit their reads (one request per segment; the engine may run
        them in the background, after any write of this file still in flight)."""
        self.materialize(names)
        self._decode_pending = []
        for name in names:
            codec, segment = self.codecs[name], self.layout.segments[name]
            if codec.reads_in_place():
                stager.read_async(self.file, segment.offset, [self.flat[name]])
            else:
                encoded = codec.empty_encoded(self.numel, self.flat[name].device)
                stager.read_async(self.file, segment.offset, encoded)
                self._decode_pending.append((name, encoded))

    def finish_fetch(self, stager: Stager) -> None:
        """Wait for the reads start_fetch submitted, then decode narrow segments into the fp32 buffers."""
        stager.wait_reads(self.file)
        pending, self._decode_pending = self._decode_pending, []
        for name, encoded in pending:
            self.codecs[name].decode(encoded, self.flat[name])

    def pending_decode_bytes(self) -> int:
        """Device bytes of encoded segments read but not yet decoded (they count towards residency)."""
        return sum(t.nbytes for _, encoded in self._decode_pending for t in encoded)

    def discard_pending_decode(self) -> None:
        """Forget reads whose bytes will not be used (the pipeline releases a prefetched bucket)."""
        self._decode_pending = []

    def update(self) -> None:
        """One Adam step over exactly this bucket's pieces, hyperparameters re-read from the master."""
        for group, g in zip(self.optimizer.param_groups, self.master_group_of):
            group.update(self._hyperparameters(g))
        for piece, param in zip(self.pieces, self.params):
            grad = self.entries[piece.entry].main.grad
            # reshape, not view: a non-contiguous grad is copied (transiently) into the param's element order
            param.grad = None if grad is None else grad.detach().reshape(-1)[piece.start:piece.stop]
        amp_scaling = {k: v for k, v in vars(self.master).items() if k in AMP_SCALING_ATTRIBUTES}
        vars(self.optimizer).update(amp_scaling)
        try:
            step_without_hooks(self.optimizer)
        finally:
            for k in amp_scaling:
                delattr(self.optimizer, k)
            for param in self.params:
                param.grad = None

    def publish(self) -> None:
        """Copy updated mains into the model's low-precision storage (cast on the device)."""
        if not self.streams_main:
            return
        for piece, param in zip(self.pieces, self.params):
            self.entries[piece.entry].model_view[piece.start:piece.stop].copy_(param)

    def write_back(self, stager: Stager) -> None:
        if self.streams_main:
            self.write_segment(stager, MAIN, [self.flat[MAIN]])
        if self.moments_on_disk:
            self._adopt_new_moments(copy=True)
            for k in MOMENTS:
                self.write_segment(stager, k, [self.flat[k]])
            return
        states = [self.optimizer.state.get(p, {}) for p in self.params]
        if not any(states):
            return  # no piece has stepped yet: there are no moments to keep
        for k in MOMENTS:
            values = [s[k] if k in s else torch.zeros(p.numel(), device=p.device) for s, p in zip(states, self.params)]
            self.write_segment(stager, k, values)
        self._adopt_new_moments(copy=False)
        self.moments_on_disk = True

    def write_segment(self, stager: Stager, name: str, values: list[torch.Tensor]) -> None:
        """Submit one write of the whole segment: small parts (per-piece moments, a codec's scales and
        payload) are packed into chunk-sized transfers by the engine. The segment's tail up to the next
        4 KiB boundary is reserved (layout.py), so the engine may pad it for O_DIRECT. The sources must
        stay allocated until stager.wait_sources(file)."""
        stager.write_async(self.file, self.layout.segments[name].offset, self.codecs[name].encode(values),
                           pad_tail=True)

    def _adopt_new_moments(self, copy: bool) -> None:
        """Point moments the optimizer created lazily at this bucket's flat buffers.

        copy=True: the buffers are resident and hold this step's values only for adopted pieces, so
        copy the new ones in. copy=False: the values are already on disk; the released view suffices.
        """
        for param, views in zip(self.params, self.moment_views):
            state = self.optimizer.state.get(param)
            if not state:
                continue
            for k in MOMENTS:
                if state[k] is not views[k]:
                    if copy:
                        views[k].copy_(state[k].view(-1))
                    state[k] = views[k]

    def refresh_main(self, stager: Stager) -> None:
        """mains <- model params, through resident storage: writing into released storage is illegal."""
        self.materialize((MAIN,))
        for piece, param in zip(self.pieces, self.params):
            param.copy_(self.entries[piece.entry].model_view[piece.start:piece.stop])
        self.write_segment(stager, MAIN, [self.flat[MAIN]])
        stager.wait_sources(self.file)
        self.release()

    # ---- checkpoints (checkpoint/ reads and installs Adam state only through these) -------------
    def adam_steps(self) -> list[int | float | None]:
        """Per piece, the Adam step its state has reached (None: never stepped, no moments)."""
        steps = []
        for param in self.params:
            state = self.optimizer.state.get(param)
            if not state or "step" not in state:
                steps.append(None)
                continue
            value = float(state["step"])
            steps.append(int(value) if value.is_integer() else value)
        return steps

    def install_moments(self, steps: list, moments_on_disk: bool) -> None:
        """Adam state as torch creates it, per piece at `steps` (None: no state), its moments pointing at
        the (released) bucket buffers: the next fetch reads them from the file, which holds them."""
        scalar = _adam_step_dtype()
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        self.optimizer.state.clear()
        for param, views, step in zip(self.params, self.moment_views, steps):
            if step is None:
                continue
            g = groups[id(param)]
            on_device = bool(g.get("capturable") or g.get("fused"))
            self.optimizer.state[param] = {
                "step": torch.tensor(float(step), dtype=torch.float32 if on_device else scalar,
                                     device=param.device if on_device else "cpu"),
                **{k: views[k] for k in MOMENTS}}
        self.moments_on_disk = moments_on_disk

    def reset_state(self) -> None:
        """Back to a fresh bucket: no Adam state, no moments on disk (a failed checkpoint load)."""
        self.optimizer.state.clear()
        self.moments_on_disk = False


def step_without_hooks(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's own step, without torch's step hooks (global and per instance): a per-bucket
    instance is internal, and the bound optimizer runs the hooks once around the whole streamed step."""
    step = type(optimizer).step
    if vars(step).get("hooked"):  # torch.optim.Optimizer wraps each class's step once (profile_hook_step)
        step = step.__wrapped__
    step(optimizer)


def _adam_step_dtype() -> torch.dtype:
    """The dtype torch's Adam keeps a CPU `step` in (torch's own choice; fp32 on builds without it)."""
    try:
        from torch.optim.optimizer import _get_scalar_dtype
    except ImportError:
        return torch.float32
    return _get_scalar_dtype()
