"""Policy-gradient loss against the rollout engine's log-probs (GRPO token-level or GSPO sequence-level,
truncated importance sampling optional; docs/advanced/train-rollout-mismatch.md), and the helpers
that put samples and model outputs on the same token grid.

Token grid: a batch row is ``prompt_ids + response_ids`` right-padded to ``L``. Targets are
``input_ids[:, 1:]`` (``[B, L-1]``); ``loss_mask[b, t] = 1`` iff target ``t`` is a response token of
row ``b``; ``rollout_logprobs`` / ``advantages`` are placed on the same ``[B, L-1]`` grid.

Public API::

    batch = collate_samples(samples, pad_token_id, advantages)      # dict of tensors (see docstring)
    logprobs = forward_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature)
    loss, metrics = policy_gradient_loss(logprobs, batch["rollout_logprobs"], batch["advantages"],
                                         batch["loss_mask"], eps_clip=args.eps_clip,
                                         num_tokens=total_response_tokens, advantage_estimator="gspo",
                                         tis=TruncatedImportanceSampling(low=0.0, high=2.0))  # both optional
    stats = mismatch_stats(logprobs, batch["rollout_logprobs"], batch["loss_mask"])   # train vs rollout
    token_logprobs(logits, targets, temperature) -> [B, T]
    chunked_token_logprobs(hidden, targets, output_layer, temperature)  # the same, a chunk of logits at a time
    problem = training_input_problem(samples, advantages, vocab_size)   # None, or why not to train on them
    for indices, batch in micro_batch_inputs(samples, advantages, plan, pad_id=0, device=d): ...

A plan (``micro_batches``) is a list of index lists, :mod:`miles.rl.batching`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.utils.checkpoint

__all__ = ["token_logprobs", "forward_logprobs", "collate_samples", "policy_gradient_loss", "mismatch_stats",
           "ADVANTAGE_ESTIMATORS", "TruncatedImportanceSampling", "training_input_problem", "micro_batch_inputs", "chunked_token_logprobs",
           "LOGPROB_CHUNK_TOKENS"]


def training_input_problem(samples: Sequence[Any], advantages: Sequence[float], vocab_size: int) -> Optional[str]:
    """Why these samples must not be trained on, or None when they may: a token id outside
    ``[0, vocab_size)``, a rollout log-prob that is not a finite number <= 0 (a log-probability; an engine
    or server can return NaN, -inf or garbage), a response whose log-probs do not match its tokens one to
    one, or an advantage that is not finite. Any of these makes the loss and every grad NaN (or, for an id,
    indexes outside the embedding); the first one found is named."""
    for i, s in enumerate(samples):
        for part in ("prompt_ids", "response_ids"):
            ids = getattr(s, part)
            if ids and not (all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < vocab_size):
                t, token = next((t, x) for t, x in enumerate(ids) if not (type(x) is int and 0 <= x < vocab_size))
                return f"sample {i}: {part}[{t}] = {token!r} is not a token id of the vocabulary (0..{vocab_size - 1})"
        logprobs = s.response_logprobs
        if len(logprobs) != len(s.response_ids):
            return (f"sample {i}: {len(logprobs)} rollout log-probs for {len(s.response_ids)} response tokens "
                    "(one per token expected)")
        if not all(isinstance(lp, (int, float)) and math.isfinite(lp) and lp <= 0.0 for lp in logprobs):
            t, lp = next((t, x) for t, x in enumerate(logprobs)
                         if not (isinstance(x, (int, float)) and math.isfinite(x) and x <= 0.0))
            return f"sample {i}: rollout log-prob of response token {t} is {lp!r} (a finite number <= 0 expected)"
        if not math.isfinite(advantages[i]):
            return f"sample {i}: advantage is {advantages[i]!r} (finite expected; are the rewards finite?)"
    return None


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or as it is when it is fp64 (the loss's math keeps fp64 inputs exact, for tests)."""
    return x if x.dtype == torch.float64 else x.float()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)[..., target]`` in fp32 (fp64 for fp64 logits); ``logits``
    ``[B, T, V]`` already aligned with ``targets`` ``[B, T]`` (i.e. logits at position t predict
    targets[t]). This is exactly the quantity the embedded rollout engine reports (temperature applied,
    top-p not applied)."""
    x = at_least_fp32(logits)
    if temperature and temperature != 1.0:
        x = x / temperature
    return torch.log_softmax(x, dim=-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


# Tokens whose fp32 logits exist at once in chunked_token_logprobs: 2048 x a 152k vocabulary is 1.2 GiB,
# small beside the [tokens, vocab] tensors of the whole micro-batch (16k tokens: 10 GiB, twice over with the
# log-softmax autograd keeps) and large enough that each chunk's matmul keeps the GPU busy.
LOGPROB_CHUNK_TOKENS = 2048

# transformers families whose causal LM's logits are exactly ``lm_head(decoder(...).last_hidden_state)`` (no
# soft-capping or scaling): forward_logprobs computes theirs chunk by chunk.
PLAIN_HEAD_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, logits_of, temperature: float) -> torch.Tensor:
    return token_logprobs(logits_of(hidden), targets, temperature)


def chunked_token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, logits_of, temperature: float = 1.0,
                           chunk_tokens: int = LOGPROB_CHUNK_TOKENS) -> torch.Tensor:
    """:func:`token_logprobs` of ``logits_of(hidden)`` without the logits of every token at once:
    ``hidden`` ``[N, ..., H]`` (the last hidden states, token-major), ``targets`` ``[N, ...]``,
    ``logits_of`` the output layer (``[n, ..., H] -> [n, ..., V]``). Each chunk of ``chunk_tokens``
    tokens is checkpointed, so the backward pass recomputes its logits rather than keeping them: the fp32
    logits of one chunk exist at a time, in either pass, at the price of one more output-layer matmul.
    Returns log-probs of ``targets``' shape, equal to the unchunked computation (same math per token)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (got {chunk_tokens})")
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            parts.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, h, t, logits_of, temperature,
                                                           use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(h, t, logits_of, temperature))
    return torch.cat(parts) if parts else hidden.new_zeros(targets.shape, dtype=torch.float32)


def forward_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     temperature: float = 1.0, chunk_tokens: int = LOGPROB_CHUNK_TOKENS) -> torch.Tensor:
    """Run the causal LM and return log-probs of ``input_ids[:, 1:]`` (``[B, L-1]``).

    Position ids come from the attention mask (``cumsum - 1``), as in the rollout engine, so left- and
    right-padded rows see the same positions. For the families of :data:`PLAIN_HEAD_MODEL_TYPES` the
    output layer runs chunk by chunk (:func:`chunked_token_logprobs`); other models' logits come whole.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    head = model.get_output_embeddings()
    if model.config.model_type not in PLAIN_HEAD_MODEL_TYPES or type(head) is not torch.nn.Linear:
        return token_logprobs(model(**inputs).logits[:, :-1], input_ids[:, 1:], temperature)
    hidden = model.get_decoder()(**inputs).last_hidden_state[:, :-1]
    rows, length = hidden.shape[:2]
    logp = chunked_token_logprobs(hidden.reshape(rows * length, -1), input_ids[:, 1:].reshape(-1), head,
                                  temperature, chunk_tokens)
    return logp.view(rows, length)


def collate_samples(
    samples: Sequence[Any],
    pad_token_id: int,
    advantages: Optional[Sequence[float] | torch.Tensor] = None,
) -> dict[str, torch.Tensor]:
    """Right-padded training tensors from rollout samples.

    ``samples`` have ``prompt_ids``, ``response_ids``, ``response_logprobs`` (e.g.
    :class:`miles.rollout.Sample`); ``advantages[i]`` belongs to ``samples[i]`` (default: each
    sample's ``advantage`` attribute). Returns ``input_ids`` ``[B, L]`` (long), ``attention_mask``
    ``[B, L]`` (long), and on the ``[B, L-1]`` target grid: ``loss_mask`` (fp32),
    ``rollout_logprobs`` (fp32), ``advantages`` (fp32, per-token broadcast, zero off-mask).
    """
    if advantages is None:
        advantages = [s.advantage for s in samples]
    adv = torch.as_tensor(list(advantages) if not torch.is_tensor(advantages) else advantages, dtype=torch.float32)
    B = len(samples)
    L = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    input_ids = torch.full((B, L), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    loss_mask = torch.zeros((B, L - 1), dtype=torch.float32)
    rollout_lp = torch.zeros((B, L - 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if len(s.response_logprobs) != r:
            raise ValueError(f"sample {i}: {r} response tokens but {len(s.response_logprobs)} log-probs")
        if p < 1:
            raise ValueError(f"sample {i}: empty prompt")
        input_ids[i, : p + r] = torch.as_tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        attention_mask[i, : p + r] = 1
        # response token j sits at position p + j and is target index p + j - 1
        loss_mask[i, p - 1 : p - 1 + r] = 1.0
        rollout_lp[i, p - 1 : p - 1 + r] = torch.as_tensor(list(s.response_logprobs), dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "rollout_logprobs": rollout_lp,
        "advantages": adv.view(-1, 1) * loss_mask,
    }


ADVANTAGE_ESTIMATORS = ("grpo", "gspo")


@dataclasses.dataclass(frozen=True)
class TruncatedImportanceSampling:
    """``--use-tis``: the bounds ``[low, high]`` (``--tis-clip-low``, ``--tis-clip``) each token's weight
    ``exp(trainer - rollout log-prob)`` is truncated to (:func:`policy_gradient_loss`)."""

    low: float
    high: float


def _log_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, advantage_estimator: str) -> torch.Tensor:
    """Per token ``logp - old`` (GRPO), or each sample's mean of it on every one of its tokens (GSPO: Qwen's GSPO,
    arXiv 2507.18071; upstream slime's ``compute_gspo_kl``): the gradient flows through the mean, and a sample's
    ratio ``exp(mean)`` is clipped as a whole. The mean needs all of a sample's tokens in one row, as every
    micro-batch plan keeps them (a sample is never split)."""
    log_ratio = (logp - old) * mask
    if advantage_estimator == "gspo":
        sample_mean = log_ratio.sum(-1, keepdim=True) / torch.clamp(mask.sum(-1, keepdim=True), min=1.0)
        log_ratio = sample_mean * mask
    return log_ratio


def _tis_weights(old: torch.Tensor, rollout: torch.Tensor,
                 tis: TruncatedImportanceSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, raw)``: ``raw = exp(old - rollout)``, the importance weight between the policy the trainer computes
    and the one the engine sampled from, and ``w`` its truncation to ``[tis.low, tis.high]`` (upstream's
    ``vanilla_tis_function``; Yao et al., "Your efficient RL framework secretly brings you off-policy RL
    training"). Both detached."""
    raw = torch.exp(old - rollout)
    return torch.clamp(raw, tis.low, tis.high), raw


def _loss_metrics(loss: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor, log_ratio: torch.Tensor,
                  clipped: torch.Tensor, tis_weights: Optional[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    n = torch.clamp(mask.sum(), min=1.0)
    metrics = {
        "pg_loss": loss.detach(),
        "clipfrac": (clipped.float() * mask).sum() / n,
        "ratio_mean": (ratio * mask).sum() / n,
        "approx_kl": (-log_ratio * mask).sum() / n,
        "num_tokens": mask.sum(),
    }
    if tis_weights is not None:
        weight, raw = tis_weights
        metrics["tis_weight_mean"] = (weight * mask).sum() / n
        metrics["tis_clipfrac"] = ((weight != raw).float() * mask).sum() / n
    return metrics


def policy_gradient_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: Optional[float] = None,
    num_tokens: Optional[float] = None,
    advantage_estimator: str = "grpo",
    tis: Optional[TruncatedImportanceSampling] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss (PPO surrogate), token-level (GRPO) or sequence-level (GSPO,
    :func:`_log_ratio`), with truncated importance sampling optional (TIS, :func:`_tis_weights`).

    The "old" policy of the ratio: without ``tis`` the rollout engine's log-probs, ``ratio = exp(logprobs -
    rollout_logprobs)`` (upstream's ``--use-rollout-logprobs``, "bypass" mode); with ``tis`` the trainer's own
    log-probs before the update, which with one optimizer step per rollout are ``logprobs`` detached: the ratio is
    1 in value, its gradient that of ``logprobs``, and each token's loss is multiplied by the truncated weight
    instead. Per token ``-min(ratio * A, clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A)``, summed over
    ``loss_mask`` and divided by ``num_tokens`` (default ``loss_mask.sum()``; with gradient accumulation the whole
    batch's count, so micro-batch losses add up to its token mean; under GSPO a sample's loss counts once per
    token). Inputs ``[B, T]`` (``advantages`` may be ``[B]``); ``eps_clip=inf``: the unclipped surrogate.

    Returns ``(loss, metrics)``, metrics detached means over the masked tokens: ``pg_loss``, ``clipfrac`` (under
    GSPO the tokens of clipped samples), ``ratio_mean``, ``approx_kl`` (mean of ``old - logprobs``),
    ``num_tokens``, and with ``tis`` ``tis_weight_mean`` and ``tis_clipfrac`` (tokens whose weight was truncated).
    """
    if advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS} (got {advantage_estimator!r})")
    mask = loss_mask.to(torch.float32)
    if advantages.dim() == 1:
        advantages = advantages.view(-1, 1).expand_as(mask)
    adv = advantages.to(torch.float32)
    rollout = rollout_logprobs.to(torch.float32).detach()
    logp = at_least_fp32(logprobs)
    old = logp.detach() if tis is not None else rollout
    high = eps_clip if eps_clip_high is None else eps_clip_high
    log_ratio = _log_ratio(logp, old, mask, advantage_estimator)
    ratio = torch.exp(log_ratio)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high) * adv
    per_token = -torch.min(surr1, surr2)
    tis_weights = _tis_weights(old, rollout, tis) if tis is not None else None
    if tis_weights is not None:
        per_token = per_token * tis_weights[0]
    denom = mask.sum() if num_tokens is None else torch.as_tensor(float(num_tokens))
    loss = (per_token * mask).sum() / torch.clamp(denom, min=1.0)
    with torch.no_grad():
        metrics = _loss_metrics(loss, mask, ratio, log_ratio, surr2 < surr1, tis_weights)
    return loss, metrics


def mismatch_stats(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                   loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs are from the rollout engine's on the masked tokens, in float64
    (detached): ``abs_diff_sum`` (sum of ``|trainer - rollout|``), ``abs_diff_max`` (0 with no token) and
    ``kl_sum``, the sum of Schulman's k3 ``exp(d) - 1 - d`` with ``d = trainer - rollout``: the tokens
    were sampled from the rollout policy, so its mean estimates KL(rollout || trainer), without bias and
    never negative (upstream miles' ``train_rollout_kl``, which clamps ``d`` to [-10, 10]; here it is not
    clamped, so one far-off token shows)."""
    with torch.no_grad():
        mask = loss_mask.bool()
        d = torch.where(mask, logprobs.detach().double() - rollout_logprobs.detach().double(), 0.0)
        return {"abs_diff_sum": d.abs().sum(), "abs_diff_max": d.abs().max() if d.numel() else d.new_zeros(()),
                "kl_sum": torch.expm1(d).sub(d).sum()}


def micro_batch_inputs(samples: Sequence[Any], advantages: Sequence[float], micro_batches: Sequence[Sequence[int]], *,
                       pad_id: int, device: Any) -> Iterator[tuple[Sequence[int], dict[str, torch.Tensor]]]:
    """``(indices, batch)`` per micro-batch of the plan (:mod:`miles.rl.batching`): the collated tensors of
    ``samples[indices]`` on ``device``; row ``k`` of the batch is sample ``indices[k]``."""
    for indices in micro_batches:
        rows = [samples[i] for i in indices]
        batch = collate_samples(rows, pad_id, [advantages[i] for i in indices])
        yield indices, {k: v.to(device) for k, v in batch.items()}
