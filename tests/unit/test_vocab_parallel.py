"""vocab_parallel_logprobs over a gloo group of 2 processes equals the unsharded log-softmax of the target, and
its gradient the unsharded one, with the vocabulary padded as Megatron pads it (padding ids masked): a
vocabulary that reaches into rank 1's slice, and one smaller than a slice (rank 1 holds padding only: the tiny
model's 100 ids at TP 2)."""

import multiprocessing as mp
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, start  # noqa: E402

TP, TOKENS = 2, 37
TIMEOUT = 120


def full_problem(vocab, padded):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(TOKENS, padded, generator=g) * 4
    targets = torch.randint(0, vocab, (TOKENS,), generator=g)
    targets[:3] = torch.tensor([0, vocab - 1, min(padded // TP, vocab - 1)])  # first, last, rank 1's first id
    return logits, targets


def tp_rank(rank, port, vocab, padded):
    import torch.distributed as dist

    from miles.backends.megatron_backend.vocab_parallel import vocab_parallel_logprobs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        logits, targets = full_problem(vocab, padded)
        width = padded // TP
        mine = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
        logp = vocab_parallel_logprobs(mine, targets, vocab_start=rank * width, vocab_size=vocab)
        weights = torch.linspace(-1, 1, TOKENS)
        (logp * weights).sum().backward()
        # as lists: a tensor on the queue would be shared memory the exiting child takes with it
        return {"rank": rank, "logp": logp.detach().tolist(), "grad": mine.grad.tolist()}
    finally:
        dist.destroy_process_group()


# (true vocabulary, padded to a multiple of 128 x TP): 300 ids reach into rank 1's slice; 100 ids leave rank 1
# nothing but padding
@pytest.mark.parametrize("vocab,padded", [(300, 512), (100, 256)], ids=["both-slices", "one-slice"])
def test_vocab_parallel_logprobs_equal_the_unsharded_log_softmax(vocab, padded):
    from miles.weights import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    got = sorted(collect(start(ctx, results, *[(tp_rank, (r, port, vocab, padded)) for r in range(TP)]), results,
                         TIMEOUT), key=lambda r: r["rank"])
    logits, targets = full_problem(vocab, padded)
    full = logits[:, :vocab].clone().requires_grad_(True)  # what the HF model has: no padding ids
    expected = torch.log_softmax(full, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (expected * torch.linspace(-1, 1, TOKENS)).sum().backward()
    for r in got:
        torch.testing.assert_close(torch.tensor(r["logp"]), expected.detach(), rtol=0, atol=2e-6)
    grad = torch.cat([torch.tensor(r["grad"]) for r in got], dim=-1)
    torch.testing.assert_close(grad[:, :vocab], full.grad, rtol=0, atol=1e-6)
    assert not grad[:, vocab:].any(), "padding ids get no gradient"
