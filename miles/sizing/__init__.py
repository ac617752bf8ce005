"""`miles plan`: size a run before launching it, from the same bucket planner, file layout and codecs the store uses.

    model_params.py  trained tensors of a model from a transformers config.json (shapes, TP/EP sharding)
    presets.py       named models and where their numbers come from
    sharding.py      what one rank holds and owns under TP/PP/DP/EP (Megatron's rules)
    store_plan.py    what a store builds over a rank's entries (buckets, bytes, GPU residency): the store's footprint
    estimate.py      per-rank bytes, which mechanism fits, disk per node, streamed bytes, step floors
    report.py        the human table and the JSON
    cli.py           `miles plan` / `python -m miles.sizing.cli`
"""
