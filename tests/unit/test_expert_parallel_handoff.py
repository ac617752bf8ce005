"""The expert-parallel weight handoff with real processes: two EP ranks, each holding half the experts of a
Qwen3-MoE model, iterate the HF-layout weights (gathering each MoE layer's experts over a gloo group) and
hand the buckets to their own engine process by reference; each engine ends with every weight, bit-equal.

On CPU the buckets travel as /dev/shm files; tests/gpu/test_expert_parallel_handoff_gpu.py runs the same
four processes on one GPU (gloo between the ranks, CUDA IPC to the engines)."""

import multiprocessing as mp
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, start  # noqa: E402

transformers = pytest.importorskip("transformers")

EP = 2
MAX_BYTES = 64 << 10
TIMEOUT = 240


def tiny_moe():
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                                      tie_word_embeddings=False)
    torch.manual_seed(7)
    return cfg, {k: torch.randn_like(v) for k, v in transformers.Qwen3MoeForCausalLM(cfg).state_dict().items()}


def ep_rank(rank, port, device, payloads, acks):
    import torch.distributed as dist

    from miles.backends.megatron_backend.convert import hf_moe_layout, hf_to_megatron, iter_megatron_to_hf
    from miles.backends.megatron_backend.expert_gather import gather_layer_experts
    from miles.weights import iter_buckets, share_bucket

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=EP)
    try:
        cfg, hf = tiny_moe()
        mine = {k: v.to(device) for k, v in hf_to_megatron(hf, cfg, ep_rank=rank, ep_size=EP).items()}
        gathered = []

        def layer_experts(layer, local):
            gathered.append(layer)
            return gather_layer_experts(local, hf_config=cfg, ep_size=EP)

        weights = iter_megatron_to_hf(mine, cfg, hf_moe_layout=hf_moe_layout(hf), layer_experts=layer_experts)
        sizes = []
        for spec, flat in iter_buckets(weights, MAX_BYTES):
            sizes.append((spec.nbytes, len(spec.tensors)))
            shared = share_bucket(spec, flat)
            payloads.put(shared)
            assert acks.get(timeout=TIMEOUT) == spec.index
            shared.release()
        return {"role": f"rank{rank}", "gathered_layers": gathered, "sizes": sizes}
    finally:
        payloads.put(None)  # the engine stops waiting, also when this rank failed
        dist.destroy_process_group()


def engine(index, device, payloads, acks):
    from miles.weights import open_bucket, unpack_bucket

    _, hf = tiny_moe()
    received, mismatches = {}, []
    while (shared := payloads.get(timeout=TIMEOUT)) is not None:
        spec, flat = open_bucket(shared)
        for name, view in unpack_bucket(spec, flat):
            received[name] = view.to("cpu", copy=True)
            if not torch.equal(received[name], hf[name]):
                mismatches.append(name)
        del flat, view
        acks.put(spec.index)
    return {"role": f"engine{index}", "missing": sorted(hf.keys() - received.keys()),
            "extra": sorted(received.keys() - hf.keys()), "mismatches": mismatches}


def run_expert_parallel_handoff(device: str) -> dict:
    """Two EP ranks and their two engines as four spawned processes on ``device``; each one's report."""
    from miles.weights import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    queues = [(ctx.Queue(), ctx.Queue()) for _ in range(EP)]
    procs = start(ctx, results, *[(ep_rank, (r, port, device, *queues[r])) for r in range(EP)],
                  *[(engine, (r, device, *queues[r])) for r in range(EP)])
    got = collect(procs, results, TIMEOUT)
    return {r["role"]: r for r in got}


def check_reports(reports: dict) -> None:
    for r in range(EP):
        eng, rank = reports[f"engine{r}"], reports[f"rank{r}"]
        assert not eng["missing"] and not eng["extra"] and not eng["mismatches"], eng
        assert rank["gathered_layers"] == [0, 2], "every MoE layer (not the dense layer 1) is gathered, once"
        oversized = [s for s in rank["sizes"] if s[0] > MAX_BYTES and s[1] > 1]
        assert not oversized, f"rank {r}: buckets over {MAX_BYTES} bytes holding several tensors: {oversized}"
    assert reports["rank0"]["sizes"] == reports["rank1"]["sizes"], "both ranks should build the same buckets"


def test_each_expert_parallel_rank_hands_its_engine_every_weight_bit_exact():
    check_reports(run_expert_parallel_handoff("cpu"))
