"""Megatron's model parallelism as arithmetic: the layout of ranks and pipeline stages (layout.py).

Pure (no torch, no megatron): validation, ``miles plan`` and the megatron trainer read the same layout.
"""
