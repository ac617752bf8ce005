"""Model FLOPs of training on a batch of sequences, and MFU: what fraction of the device's peak the train
call turned into the model's arithmetic.

For a model's tensors in Megatron's layout (:func:`tensor_flops`: a megatron family's count, or
:func:`model_flops` of a transformers config through :func:`~miles.sizing.model_params.model_tensors`),
forward + backward of one sequence of ``L`` tokens costs::

    F(L) = 6 * P_active * L  +  3 * W_attn * L * (L + 1)

- ``P_active``: the weight-matrix parameters one token multiplies through: every matrix of the decoder
  layers (attention projections, dense MLPs, the MoE router, shared experts) plus the routed experts'
  matrices times ``top_k / num_experts``, plus the output layer (``vocab x hidden``, also when tied to the
  embedding; the vocabulary padded to a multiple of 128 as Megatron pads it); not the embedding (a
  lookup) nor the norms and biases. A multiply-add is 2 FLOPs, and the
  backward pass costs twice the forward (grads of the activations and of the weights): ``2 + 4 = 6``.
- ``W_attn = sum over softmax-attention layers of heads * (d_qk + d_v)``: the score and value products
  of one (query, key) pair cost ``2 * heads * (d_qk + d_v)`` FLOPs forward, 3x that with the backward;
  under the causal mask position ``t`` sees ``t + 1`` keys, ``L (L + 1) / 2`` pairs in all. Linear
  attention (Gated DeltaNet) layers have no quadratic term and are counted by their matrices only.

These are the model's FLOPs for the real tokens: padding, recomputation (the chunked log-probs
recompute the output layer) and attention kernels that compute masked blocks are the implementation's
cost and count against MFU, as in the PaLM and Megatron conventions. MFU = F / (peak FLOP/s x seconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .model_params import experts_per_token, model_tensors
from .tensors import ModelTensors

__all__ = ["ModelFlops", "model_flops", "tensor_flops", "train_flops", "peak_bf16_flops", "mfu"]

# Dense bf16 tensor-core peak, FLOP/s, by the name torch.cuda.get_device_name reports (first match wins).
PEAK_BF16_FLOPS = (("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12))


@dataclass(frozen=True)
class ModelFlops:
    """The two coefficients of the module's formula: ``active_params`` (``P_active``) and
    ``attention_width`` (``W_attn``)."""

    active_params: int
    attention_width: int

    def per_sequence(self, length: int) -> int:
        """Forward + backward FLOPs of one sequence of ``length`` tokens."""
        return 6 * self.active_params * length + 3 * self.attention_width * length * (length + 1)


def _is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2 and name != "embedding"


def _tensor(layer, suffix: str):
    return next((t for t in layer if t.name.endswith(suffix)), None)


def _attention_width(layer) -> int:
    """``heads * (d_qk + d_v)`` of a softmax-attention layer's tensors (0 for other layers): ``heads * d_v``
    is the output projection's input width; ``heads * d_qk`` is the query projection's output width (MLA)
    or, with grouped-query attention, the same as ``heads * d_v``."""
    proj = _tensor(layer, ".self_attention.linear_proj")
    if proj is None:
        return 0
    query = _tensor(layer, ".self_attention.linear_q_up_proj") or _tensor(layer, ".self_attention.linear_q_proj")
    return proj.shape[1] + (query.shape[0] if query is not None else proj.shape[1])


def model_flops(config: dict, name: str = "model") -> ModelFlops:
    """The formula's coefficients for the model a transformers ``config`` dict describes, as transformers lays it
    out (multi-token prediction layers left out: the RL step does not train them). ModelConfigError (from
    :func:`~miles.sizing.model_params.model_tensors`) for a config it cannot count."""
    return tensor_flops(model_tensors(config, name=name, mtp=False), experts_per_token(config))


def tensor_flops(tensors: ModelTensors, top_k: int) -> ModelFlops:
    """The formula's coefficients for a model's tensors (a megatron family counts its own:
    ``families.count_tensors``) whose tokens each pass through ``top_k`` of the routed experts."""
    experts = 1 + max((t.expert for t in tensors.all() if t.expert is not None), default=-1)
    dense = sum(t.numel for t in tensors.all() if t.expert is None and _is_matrix(t.name, t.shape))
    routed = sum(t.numel for t in tensors.all() if t.expert is not None)
    active = dense + (routed * top_k // experts if experts else 0)
    if not any(t.name == "output_layer" for t in tensors.last):  # tied: the embedding's matrix is the output layer
        active += tensors.first[0].numel
    return ModelFlops(active_params=active, attention_width=sum(_attention_width(layer) for layer in tensors.layers))


def train_flops(flops: ModelFlops, lengths: Sequence[int]) -> int:
    """Forward + backward FLOPs of sequences of ``lengths`` tokens (each on its own, unpadded)."""
    return sum(flops.per_sequence(n) for n in lengths)


def peak_bf16_flops(device_name: Optional[str]) -> Optional[float]:
    """The dense bf16 peak FLOP/s of a GPU by its name (``torch.cuda.get_device_name``); None for a CPU
    (``device_name`` None) or a GPU this table does not know."""
    if device_name is None:
        return None
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in device_name), None)


def mfu(flops: float, peak: Optional[float], seconds: float) -> Optional[float]:
    """``flops / (peak * seconds)``, or None without a known peak or a positive time."""
    if peak is None or not seconds > 0:
        return None
    return flops / (peak * seconds)
