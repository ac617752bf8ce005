"""The engine's weights read back by reference (miles/weights/readback.py; on CPU through /dev/shm)."""

import torch

from miles.weights.readback import open_named_tensors, share_named_tensors


def test_named_tensors_round_trip_bit_for_bit_and_tied_ones_once():
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(7, 3, generator=g).to(torch.bfloat16)
    named = [("embed.weight", embed), ("norm.weight", torch.randn(3, generator=g)),
             ("lm_head.weight", embed), ("scale", torch.tensor(2.5))]  # lm_head tied to embed
    shared = share_named_tensors(named)
    try:
        back = {name: t.clone() for name, t in open_named_tensors(shared)}
    finally:
        for bucket in shared:
            bucket.release()
    assert list(back) == ["embed.weight", "norm.weight", "scale"]
    assert all(torch.equal(back[n], t) and back[n].dtype == t.dtype for n, t in named if n in back)
