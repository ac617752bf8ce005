"""Layer pieces model families compose: multi-latent attention (``mla``), DeepSeek sparse attention's indexer on
top of it (``dsa``), the Gated DeltaNet (``gated_deltanet``) and the group-limited sigmoid router
(``sigmoid_router``). A ``*.py`` piece is pure (what the config means, weight names, TP rules, megatron-core config
fields); its ``*_layers.py`` imports megatron-core inside its functions and builds the modules."""
