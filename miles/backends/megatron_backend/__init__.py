"""The megatron training backend: megatron-core GPTModel + DDP + DistributedOptimizer (GPU only).

    architecture.py   what a transformers config means for Megatron (pure; rejects what cannot be built)
    model.py          TransformerConfig / GPTModel kwargs from an HF config (pure) and the builder
    convert.py        HF <-> Megatron state dicts (pure: fused QKV, SwiGLU fc1, norms, experts, EP)
    sdpa_attention.py the local spec's core attention as one scaled_dot_product_attention call
    logprobs.py       GPTModel's output processor: token log-probs, the output layer run chunk by chunk
    trainer.py        MegatronTrainer: the same methods as the torch backend's TorchTrainer

Importing this package does not import megatron-core (it needs Python >= 3.12 and CUDA).
"""
