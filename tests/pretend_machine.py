"""What the tests' pretend machines share: which files they say exist (``Environment.is_file``)."""

import os


def pretend_file(path: str) -> bool:
    """Every file exists, but not the model folder's files whose contents validation reads (tokenizer, weights):
    a pretend folder has no contents to read, so it passes for a folder without them."""
    return os.path.basename(path) not in ("tokenizer.json", "tokenizer_config.json", "model.safetensors",
                                          "model.safetensors.index.json")
