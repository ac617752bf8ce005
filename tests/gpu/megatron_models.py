"""Megatron model builders shared by the single- and multi-GPU tests (import needs megatron-core + CUDA)."""

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, BATCH = 256, 32, 4


def build(moe: bool, seed: int = 1234, expert_parallel: int = 1):
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    kwargs = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
                  hidden_dropout=0.0, attention_dropout=0.0)
    if moe:
        kwargs.update(num_moe_experts=4, moe_router_topk=2, moe_router_enable_expert_bias=True,
                      moe_router_score_function="sigmoid", moe_router_dtype="fp32",
                      moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, add_bias_linear=False,
                      expert_model_parallel_size=expert_parallel)
    config = TransformerConfig(**kwargs)
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, moe_grouped_gemm=False)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ).cuda()
    model = Float16Module(config, model)
    if moe:  # a native-fp32 param: the router weight, as MoE recipes keep it
        for name, p in model.named_parameters():
            if "router.weight" in name:
                p.data = p.data.float()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True, bucket_size=20_000)
    ddp = DistributedDataParallel(config, ddp_config, model)
    opt_config = OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.01, bf16=True,
                                 use_distributed_optimizer=True, clip_grad=1.0, adam_beta2=0.95)
    return ddp, get_megatron_optimizer(opt_config, [ddp])


def train_step(ddp, opt, step: int, data_rank: int = 0):
    g = torch.Generator(device="cuda").manual_seed(1000 * data_rank + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    position_ids = torch.arange(SEQ, device="cuda").expand(BATCH, SEQ)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(tokens, position_ids, None, labels=tokens.roll(-1, dims=1)).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok
    return loss.item()


def params_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def members(opt):
    return getattr(opt, "chained_optimizers", [opt])


def main_bytes(opt) -> int:
    return sum(4 * m.numel() for o in members(opt) for g in o.shard_fp32_from_float16_groups for m in g)
