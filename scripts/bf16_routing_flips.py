"""How far a model's bf16 forward is from its own fp32 forward, and how many tokens pick another expert set.

For an MoE model the engine and the trainer each run bf16: where router scores are close, rounding flips the
top-k choice, and a flip early changes the inputs of every later router. This prints, for transformers' own
model on random tokens, the mean/max per-token |log-prob diff| between bf16 and fp32, and per MoE layer the share
of tokens whose expert set differs: the floor under any engine-vs-trainer log-prob comparison.

    python scripts/bf16_routing_flips.py glm5-2b            # a random-init preset (scripts/make_random_model.py)
    python scripts/bf16_routing_flips.py /path/to/hf-folder # a checkpoint
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles.models import RANDOM_MODEL_PRESETS, random_model_config  # noqa: E402


def _model(name: str):
    import transformers

    if name in RANDOM_MODEL_PRESETS:
        torch.manual_seed(0)
        config = random_model_config(name, 256, max_position_embeddings=256)
        return transformers.AutoModelForCausalLM.from_config(config).float().eval()
    return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("model", help=f"an HF folder, or one of {sorted(RANDOM_MODEL_PRESETS)}")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    model = _model(args.model)
    vocab = min(model.config.vocab_size, 256)
    tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    picks: dict[str, list[torch.Tensor]] = {}

    def record(name):
        def hook(module, inputs, output):  # transformers' routers return (..., weights, indices)
            indices = output[-1]
            picks.setdefault(name, []).append(indices.reshape(indices.shape[0], -1).sort(-1).values)
        return hook

    for name, module in model.named_modules():
        if type(module).__name__.endswith("Router"):
            module.register_forward_hook(record(name))
    with torch.no_grad():
        logprobs = [torch.log_softmax(model.to(dtype)(tokens).logits.float(), -1)[:, :-1].gather(
            -1, tokens[:, 1:, None]) for dtype in (torch.float32, torch.bfloat16)]
    diff = (logprobs[0] - logprobs[1]).abs()
    print(f"{args.model}: bf16 vs fp32 per-token |log-prob diff| mean {diff.mean():.4f}, max {diff.max():.4f} "
          f"({args.batch} x {args.seq} random tokens)")
    for name, (fp32, bf16) in picks.items():
        print(f"  {name}: {(fp32 != bf16).any(-1).float().mean().item():.1%} of tokens pick another expert set")


if __name__ == "__main__":
    main()
