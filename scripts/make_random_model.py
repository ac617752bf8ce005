"""Write a random-init HF model folder of a real architecture, for smoke runs and benchmarks without weights.

    python scripts/make_random_model.py llama-1b /scratch/llama-1b
    miles train --hf-checkpoint /scratch/llama-1b --train-backend megatron ...
"""

import argparse
import logging
import os
import sys

# The repo's `miles`, from any cwd and without installing it (python puts only this script's folder on sys.path).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles.models import RANDOM_MODEL_PRESETS, write_random_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("preset", choices=sorted(RANDOM_MODEL_PRESETS))
    parser.add_argument("folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_random_model(args.folder, args.preset, seed=args.seed, dtype=args.dtype)


if __name__ == "__main__":
    main()
