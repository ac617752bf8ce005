"""Time a forward of a random-init MoE preset with each transformers experts implementation, against eager.

    python scripts/bench_experts_implementation.py qwen3-moe-8e --device cpu --dtype fp32
    python scripts/bench_experts_implementation.py qwen3-30b-a3b-12l --device cuda --dtype bf16 --batch 8 --seq 1024

One forward over ``--batch`` x ``--seq`` random tokens (a prefill) and one over ``--batch`` x 1 (a decode step
without cache: the token count a decode step routes), median of ``--repeats`` after a warm-up, per
implementation; the ratio is eager's time over each one's, and the logits' largest difference from eager's is
printed beside it. ``--layers`` keeps the first N layers (the per-layer ratio is the same, the run smaller).
On a shared CPU the times move by 3x between runs: compare runs made back to back, several times.
miles.models.experts_implementation says which one load_policy runs.
"""

import argparse
import os
import statistics
import sys
import time

# The repo's `miles`, from any cwd and without installing it (python puts only this script's folder on sys.path).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from miles.models import RANDOM_MODEL_PRESETS, experts_implementation, random_model_config, torch_dtype  # noqa: E402

# batched_mm (each token gathers its experts' weights) is left out: a prefill's gather takes GBs of memory
IMPLEMENTATIONS = ("eager", "grouped_mm")


def _seconds(forward, device: torch.device, repeats: int) -> float:
    forward()  # warm-up: kernels chosen, allocator filled
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("preset", choices=sorted(RANDOM_MODEL_PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, help="keep the preset's first N layers (default: all)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: the preset's, else the char "
                        "tokenizer's 100); a small one leaves the forward's time to the layers")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    device, dtype = torch.device(args.device), torch_dtype(args.dtype)
    fields = {} if args.layers is None else {"num_hidden_layers": args.layers}
    config = random_model_config(args.preset, 100, **fields)
    if args.vocab is not None:
        config.get_text_config().vocab_size = args.vocab
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
    if not model._can_set_experts_implementation():
        parser.error(f"{args.preset} has no switchable MoE experts ({type(model).__name__})")
    vocab = config.get_text_config().vocab_size
    prefill = torch.randint(0, vocab, (args.batch, args.seq), device=device)
    step = prefill[:, :1].contiguous()
    print(f"{args.preset}: {type(model).__name__}, {config.get_text_config().num_hidden_layers} layers, "
          f"{args.dtype} on {device}; load_policy runs {experts_implementation(device.type, dtype)!r} here")
    for name, ids in (("prefill", prefill), ("step", step)):
        results = {}
        for implementation in IMPLEMENTATIONS:
            model.set_experts_implementation(implementation)
            with torch.no_grad():
                logits = model(ids).logits.float()
                seconds = _seconds(lambda: model(ids), device, args.repeats)
            results[implementation] = (seconds, logits)
        eager_seconds, eager_logits = results["eager"]
        for implementation, (seconds, logits) in results.items():
            print(f"  {name:7s} {tuple(ids.shape)}  {implementation:10s} {seconds * 1e3:9.2f} ms  "
                  f"eager / this {eager_seconds / seconds:5.2f}x  "
                  f"max |logits - eager's| {(logits - eager_logits).abs().max().item():.2e}", flush=True)


if __name__ == "__main__":
    main()
