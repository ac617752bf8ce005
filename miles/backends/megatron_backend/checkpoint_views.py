"""What the Megatron trainer hands to ``miles.checkpoint`` so that its checkpoints take the one path.

``miles.checkpoint.save_train_state`` / ``load_train_state`` expect a model with ``save_pretrained``
and ``load_state_dict`` in HF names, an optimizer with ``state_dict`` / ``load_state_dict`` /
``reload_model_params``, and a store with ``save_to(base, wait)`` / ``wait_for_save`` / ``load_from``
(a chained optimizer's stores come as the binding's ``StoreGroup``, which has them).
These views give the Megatron objects that shape, so a Megatron checkpoint is an HF folder (loadable
by transformers and by ``--hf-checkpoint``) plus the optimizer state.
"""

from __future__ import annotations

import os
from collections import namedtuple
from typing import Any, Callable, Optional

import torch

_LoadResult = namedtuple("_LoadResult", ["missing_keys", "unexpected_keys"])


class HFModelView:
    """The Megatron model as an HF model for checkpoints.

    ``hf_state``: a callable returning the full HF-layout state dict (it may be a collective under
    expert parallelism: the trainer calls it on every rank before saving and hands the result over
    through :meth:`prepare_save`). ``load_hf_state``: copies an HF state dict into the Megatron params
    in place (the DDP buffers and the optimizer keep their storage).
    """

    def __init__(self, hf_config: Any, load_hf_state: Callable[[dict[str, torch.Tensor]], None]):
        self.config = hf_config
        self._load_hf_state = load_hf_state
        self._to_save: Optional[dict[str, torch.Tensor]] = None

    def prepare_save(self, hf_state: dict[str, torch.Tensor]) -> None:
        self._to_save = hf_state

    def save_pretrained(self, model_dir: str, safe_serialization: bool = True) -> None:
        from safetensors.torch import save_file

        if self._to_save is None:
            raise RuntimeError("HFModelView.save_pretrained without prepare_save: the trainer gathers the weights "
                               "on every rank first")
        state, self._to_save = self._to_save, None
        if getattr(self.config, "tie_word_embeddings", False):
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # transformers re-ties on load
        self.config.save_pretrained(model_dir)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(model_dir, "model.safetensors"),
                  metadata={"format": "pt"})

    def load_state_dict(self, hf_state: dict[str, torch.Tensor], strict: bool = False) -> _LoadResult:
        self._load_hf_state(hf_state)  # raises, naming the keys, when the layout does not match
        return _LoadResult([], [])


class ResidentOptimizerState:
    """``state_dict`` / ``load_state_dict`` of a Megatron optimizer whose state lives on the GPU.

    Megatron's own ``DistributedOptimizer.state_dict()`` leaves the per-parameter state out (it goes
    through distributed checkpointing). Per rank, the state is exactly the inner torch optimizer's
    state over this rank's fp32 main shards plus the mains themselves; saving both makes a resume
    bit-identical on the same data-parallel layout (which ``miles.checkpoint`` enforces for
    non-streamed state).
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.members = [m for m in getattr(optimizer, "chained_optimizers", [optimizer])
                        if not getattr(m, "is_stub_optimizer", False)]

    @staticmethod
    def _mains(member) -> list[torch.Tensor]:
        return [p for group in member.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        return {"members": [{"inner": m.optimizer.state_dict(),
                             "mains": [p.detach().to("cpu", copy=True) for p in self._mains(m)]}
                            for m in self.members]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["members"]
        if len(saved) != len(self.members):
            raise ValueError(f"the checkpoint holds {len(saved)} optimizer members, this model has "
                             f"{len(self.members)}: was it saved with another MoE/expert-parallel layout?")
        with torch.no_grad():
            for member, part in zip(self.members, saved):
                mains = self._mains(member)
                if [tuple(p.shape) for p in mains] != [tuple(p.shape) for p in part["mains"]]:
                    raise ValueError("the checkpoint's optimizer shards do not match this rank's shards: it was "
                                     "saved with another data-parallel size or model")
                for p, saved_main in zip(mains, part["mains"]):
                    p.copy_(saved_main)
                member.optimizer.load_state_dict(part["inner"])

    def reload_model_params(self) -> None:
        self.optimizer.reload_model_params()

