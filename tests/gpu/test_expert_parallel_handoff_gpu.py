"""The expert-parallel weight handoff on one GPU (skipped without CUDA): two EP ranks in two processes
share the GPU (gloo between them: NCCL refuses two ranks on one device), gather each MoE layer's experts
on the device and hand the buckets to their own engine process through CUDA IPC.

    python -m pytest -q tests/gpu/test_expert_parallel_handoff_gpu.py
"""

import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))
from test_expert_parallel_handoff import check_reports, run_expert_parallel_handoff  # noqa: E402


def test_expert_parallel_ranks_sharing_a_gpu_hand_their_engines_every_weight_bit_exact():
    check_reports(run_expert_parallel_handoff("cuda"))
