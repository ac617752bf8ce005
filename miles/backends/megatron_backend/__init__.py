"""The megatron training backend: megatron-core GPTModel + DDP + DistributedOptimizer (CUDA; machine.py).

    architecture.py   Architecture: what a transformers config means for Megatron, as plain values
    families/         one folder per model family (gpt: Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral, qwen3_5_moe,
                      glm_moe_dsa, ...) behind the registry in families/__init__.py (keyed by model_type):
                      how it reads its config, its megatron config and layer spec, its weight rules
    pieces/           layer pieces families compose: MLA, DSA's indexer, Gated DeltaNet, the sigmoid router
    weight_rules.py   HF <-> Megatron name rules and the GPT layer's (fused QKV, SwiGLU fc1, norms, experts)
    model.py          TransformerConfig / GPTModel kwargs from an HF config (pure) and the builder
    convert.py        HF <-> Megatron state dicts by the family's rules (pure: HF expert layouts, EP)
    sdpa_attention.py the local spec's core attention as one scaled_dot_product_attention call
    logprobs.py       GPTModel's output processor: token log-probs, the output layer run chunk by chunk
    tp_shards.py      Megatron's TP/ETP/PP cuts of a state dict and their gathers (pure)
    parallel_export.py  the weight handoff's order under TP/PP: part by part, gathers injected (pure)
    vocab_parallel.py log-probs from vocab-parallel logits (all-reduces over the TP group)
    model_parallel.py one rank's place in the TP/PP layout: process groups, shards, log-probs, handoff
    pipeline.py       the policy-gradient step through Megatron's pipeline schedule (PP > 1)
    router_bias.py    routers with an expert bias: fp32 in a bf16 model, the aux-loss-free balancing step (GPU)
    trainer.py        MegatronTrainer: the same methods as the torch backend's TorchTrainer
    machine.py        what it needs of the machine: CUDA, unless megatron-core is a build for CPU ('+cpu')

Importing this package does not import megatron-core (it needs Python >= 3.12 and, released, CUDA).
"""
