"""Host services both the optimizer-state store and the framework use: who owns a directory (ownership.py)
and how much memory this process can still take (memory.py). Imports neither of them."""
