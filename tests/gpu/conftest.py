import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # megatron_models.py, shared with the torchrun script
