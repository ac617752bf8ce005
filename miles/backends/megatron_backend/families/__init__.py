"""Model families whose layers are not the common GPT layer: each module describes its HF config, names its
weights' layout and (in a ``*_layers`` module, which imports megatron-core) builds its layer spec. The shared
modules (``architecture.py``, ``convert.py``, ``model.py``) call them through one hook each."""
