"""The megatron training backend: megatron-core GPTModel + DDP + DistributedOptimizer (GPU only).

    architecture.py   what a transformers config means for Megatron (pure; rejects what cannot be built)
    model.py          TransformerConfig / GPTModel kwargs from an HF config (pure) and the builder
    convert.py        HF <-> Megatron state dicts (pure: fused QKV, SwiGLU fc1, norms, experts, EP)
    glm_moe_dsa.py    GLM-5: its config, attention weight names, MLA + DSA config fields (pure)
    local_dsa_spec.py GLM-5's DSA decoder block without Transformer Engine (GPU)
    router_bias.py    routers with an expert bias: fp32 in a bf16 model, the aux-loss-free balancing step (GPU)
    trainer.py        MegatronTrainer: the same methods as the torch backend's TorchTrainer

Importing this package does not import megatron-core (it needs Python >= 3.12 and CUDA).
"""
