"""Log-probs through the output layer chunk by chunk (miles.rl.loss.chunked_token_logprobs): the same
values and grads as the whole-vocabulary logits (fp64), and no chunk's logits kept for the backward."""

from __future__ import annotations

import pytest
import torch

from miles.rl.loss import chunked_token_logprobs, forward_logprobs, token_logprobs
from test_batching import _tiny_fp64_llama


def _head(vocab=97, hidden=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g, dtype=torch.float64))
    return head


@pytest.mark.parametrize("chunk", [1, 5, 23, 1000])
def test_chunks_equal_the_whole_logits_in_value_and_grad(chunk):
    head = _head()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(23, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 97, (23,), generator=g)
    upstream = torch.randn(23, generator=g, dtype=torch.float64)

    whole = token_logprobs(head(hidden), targets, temperature=0.7)
    grad_hidden, grad_weight = torch.autograd.grad((whole * upstream).sum(), (hidden, head.weight))
    chunked = chunked_token_logprobs(hidden, targets, head, temperature=0.7, chunk_tokens=chunk)
    assert chunked.dtype == torch.float64 and chunked.shape == (23,)
    torch.testing.assert_close(chunked, whole, rtol=1e-13, atol=1e-13)
    chunk_grad_hidden, chunk_grad_weight = torch.autograd.grad((chunked * upstream).sum(), (hidden, head.weight))
    torch.testing.assert_close(chunk_grad_hidden, grad_hidden, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(chunk_grad_weight, grad_weight, rtol=1e-12, atol=1e-13)
    with torch.no_grad():
        torch.testing.assert_close(chunked_token_logprobs(hidden, targets, head, 0.7, chunk), whole.detach())


def test_backward_keeps_no_chunks_logits():
    """What autograd saves for the backward: with chunks, no [tokens, vocab]-sized tensor (the checkpoint
    keeps each chunk's inputs, the output layer's weight is the model's own); without, the whole logits."""
    head = _head(vocab=4096, hidden=8)
    hidden = torch.randn(64, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 4096, (64,))
    largest = []

    def pack(t):
        largest.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(head(hidden), targets)
    assert max(largest) >= 64 * 4096
    largest.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = chunked_token_logprobs(hidden, targets, head, chunk_tokens=16)
    assert max(largest) == 16 * 8  # a chunk's hidden states: the largest thing kept
    out.sum().backward()
    assert hidden.grad is not None and head.weight.grad is not None


def test_forward_logprobs_chunked_equals_the_models_logits():
    model = _tiny_fp64_llama(seed=2)
    g = torch.Generator().manual_seed(4)
    input_ids = torch.randint(1, 61, (3, 11), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    attention_mask[2, 4:] = 0

    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    whole = token_logprobs(logits[:, :-1], input_ids[:, 1:], 0.9)
    whole.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    chunked = forward_logprobs(model, input_ids, attention_mask, 0.9, chunk_tokens=7)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
    chunked.sum().backward()
    for name, grad in grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-10, atol=1e-12)


class _OutputLayer(torch.nn.Module):
    """Megatron's output layer as the output processor sees it: ``(logits, bias)`` of a ``[S, B, H]`` input."""

    def __init__(self, head, sequence_parallel=False):
        super().__init__()
        self.head, self.sequence_parallel = head, sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        assert runtime_gather_output is True  # the full vocabulary, gathered over tensor-parallel shards
        return torch.nn.functional.linear(hidden, self.head.weight if weight is None else weight), None


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_megatron_output_processor_gives_the_logits_log_probs(sequence_parallel):
    from miles.backends.megatron_backend.logprobs import LogprobRequest, output_logprobs

    head = _head(vocab=50, hidden=12)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(9, 3, 12, generator=g, dtype=torch.float64, requires_grad=True)  # [L, B, H]
    input_ids = torch.randint(0, 50, (3, 9), generator=g)
    upstream = torch.randn(3, 8, generator=g, dtype=torch.float64)

    whole = token_logprobs(head(hidden).transpose(0, 1)[:, :-1], input_ids[:, 1:], 1.3)  # what the trainer did
    expected = torch.autograd.grad((whole * upstream).sum(), (hidden, head.weight))
    ours = output_logprobs(hidden_states=hidden, output_layer=_OutputLayer(head, sequence_parallel),
                           output_weight=None, scale_logits=lambda x: x, labels=None, input_ids=input_ids,
                           context=LogprobRequest(input_ids[:, 1:], 1.3, chunk_tokens=4))
    assert ours.shape == (3, 8)
    torch.testing.assert_close(ours, whole, rtol=1e-13, atol=1e-13)
    for got, want in zip(torch.autograd.grad((ours * upstream).sum(), (hidden, head.weight)), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
