"""Training backends: `torch` (transformers + ZeRO-1, runs on CPU) and `megatron` (GPU only)."""
