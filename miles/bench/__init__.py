"""Benchmarks: `miles bench <name>` (see miles/bench/cli.py). `stream`: the streamed optimizer step vs
the raw disk floor, the resident step and the sync engine (miles/bench/stream.py)."""
