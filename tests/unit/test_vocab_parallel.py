"""vocab_parallel_logprobs over a gloo group of 2 processes equals the unsharded log-softmax of the target, and
its gradient the unsharded one, with the vocabulary padded as Megatron pads it (padding ids masked)."""

import multiprocessing as mp
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, start  # noqa: E402

TP, VOCAB, PADDED, TOKENS = 2, 300, 512, 37  # 300 ids padded to a multiple of 128 x TP
TIMEOUT = 120


def full_problem():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(TOKENS, PADDED, generator=g) * 4
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    targets[:3] = torch.tensor([0, VOCAB - 1, PADDED // TP])  # first id, last true id, first id of rank 1
    return logits, targets


def tp_rank(rank, port):
    import torch.distributed as dist

    from miles.backends.megatron_backend.vocab_parallel import vocab_parallel_logprobs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        logits, targets = full_problem()
        width = PADDED // TP
        mine = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
        logp = vocab_parallel_logprobs(mine, targets, vocab_start=rank * width, vocab_size=VOCAB)
        weights = torch.linspace(-1, 1, TOKENS)
        (logp * weights).sum().backward()
        # as lists: a tensor on the queue would be shared memory the exiting child takes with it
        return {"rank": rank, "logp": logp.detach().tolist(), "grad": mine.grad.tolist()}
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_logprobs_equal_the_unsharded_log_softmax():
    from miles.weights import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    got = sorted(collect(start(ctx, results, *[(tp_rank, (r, port)) for r in range(TP)]), results, TIMEOUT),
                 key=lambda r: r["rank"])
    logits, targets = full_problem()
    full = logits[:, :VOCAB].clone().requires_grad_(True)  # what the HF model has: no padding ids
    expected = torch.log_softmax(full, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (expected * torch.linspace(-1, 1, TOKENS)).sum().backward()
    for r in got:
        torch.testing.assert_close(torch.tensor(r["logp"]), expected.detach(), rtol=0, atol=2e-6)
    grad = torch.cat([torch.tensor(r["grad"]) for r in got], dim=-1)
    torch.testing.assert_close(grad[:, :VOCAB], full.grad, rtol=0, atol=1e-6)
    assert not grad[:, VOCAB:].any(), "padding ids get no gradient"
