"""`miles plan`: size a run before launching it, from the same bucket planner, file layout and codecs the store uses.

    inputs.py        what a plan takes (hardware, training settings); light, so `miles plan` parses without torch
    model_params.py  trained tensors of a model from a transformers config.json (shapes, TP/EP sharding)
    presets.py       named models and where their numbers come from, the one list `miles plan --preset`,
                     `miles bench rl --preset` and scripts/make_random_model.py take
    sharding.py      what one rank holds and owns under TP/PP/DP/EP (Megatron's rules)
    store_plan.py    what a store builds over a rank's entries (buckets, bytes, GPU residency): the store's footprint
    estimate.py      per-rank bytes, which mechanism fits, disk per node, streamed bytes, step floors
    report.py        the human table and the JSON
    cli.py           `miles plan` / `python -m miles.sizing.cli`
"""
