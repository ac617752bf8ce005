"""Benchmarks: `miles bench <name>` (see miles/bench/cli.py). `stream`: the streamed optimizer step vs
the raw disk floor, the resident step and the sync engine (miles/bench/stream.py). `checkpoint`: saving
streamed state (`store.save_to`, waited and in the background) vs a plain copy of its files
(miles/bench/checkpoint.py)."""
