"""Every change the CPU suite makes to megatron-core 0.19.2 (tests only: the product runs it unchanged).

Each :class:`Edit` replaces exact text in one file of the unpacked wheel, and must match exactly ``count``
times, else :func:`apply` fails naming it: a new megatron-core fails loudly, not half patched.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class Edit(NamedTuple):
    path: str  # relative to the unpacked wheel
    old: str
    new: str
    count: int
    reason: str


_CPU = "the miles CPU suite runs megatron on the CPU: this copy's tensors live there"


def _on_cpu(path: str, old: str, count: int, new: str = '"cpu"') -> Edit:
    """Every ``old`` device expression of ``path`` (``count`` of them) as the CPU."""
    return Edit(path, old, new, count, f"CUDA device literal: {_CPU}")


def _cpu_streams(path: str, count: int) -> Edit:
    """``torch.cuda``'s calls of ``path`` as ``torch.cpu``'s: the same API (streams, events and synchronize as
    no-ops, current_device() "cpu"); only where ``path`` calls nothing torch.cpu lacks or answers otherwise."""
    return Edit(path, "torch.cuda.", "torch.cpu.", count,
                f"CUDA device, streams, events and synchronize: {_CPU}; torch.cpu has the same calls (no-ops)")


EDITS: list[Edit] = [
    _cpu_streams("megatron/core/distributed/param_and_grad_buffer.py", 7),
    Edit("megatron/core/pipeline_parallel/p2p_communication.py", "torch.cuda.synchronize()", "torch.cpu.synchronize()",
         2, f"the pipeline's point-to-point sends synchronize the CUDA device: {_CPU}"),
    Edit("megatron/core/tensor_parallel/random.py",
         "        # Check if we have added the state\n        if name not in self.states_:",
         "        if not torch.cuda.is_available():  # miles CPU suite: no CUDA RNG state to fork\n"
         "            yield\n            return\n"
         "        # Check if we have added the state\n        if name not in self.states_:", 1,
         "megatron forks its CUDA RNG tracker around expert and tensor-parallel layers; without CUDA the product "
         "seeds no tracker (its RNG state is CUDA's), and the models under test have no dropout to draw"),
    *(Edit("megatron/core/transformer/moe/token_dispatcher.py", old, new, count,
           f"the all-to-all dispatcher's device-to-host side stream and its event: {_CPU}; torch.cpu's streams "
           "and events are no-ops (its stream records no event: a torch.cpu.Event stands in)")
      for old, new, count in [
          ("torch.cuda.Stream()", "torch.cpu.Stream()", 1),
          ("on_side_stream = torch.cuda.current_stream() != self.cuda_dtoh_stream", "on_side_stream = False", 1),
          ("torch.cuda.stream(self.cuda_dtoh_stream)", "torch.cpu.stream(self.cuda_dtoh_stream)", 1),
          ("self.d2h_event = self.cuda_dtoh_stream.record_event()", "self.d2h_event = torch.cpu.Event()", 1)]),
    Edit("megatron/core/transformer/moe/moe_utils.py", "    if torch.is_tensor(tensor) and tensor.is_cuda:\n",
         "    if torch.is_tensor(tensor):\n", 1,
         "the dispatcher's split sizes become host lists (numpy) only when they were on the GPU; on the CPU they "
         "stayed tensors, which all_to_all_single refuses as split sizes"),
    # Qwen3.5's Gated DeltaNet: flash-linear-attention (fla) is Triton, for GPUs. With deterministic_mode (what
    # the product sets without CUDA) megatron runs its own torch chunked delta rule and torch conv1d; only the
    # q/k l2norm stays fla's. transformers' Qwen3.5-MoE ships the torch reference of it ("aligned with fla's").
    Edit("megatron/core/ssm/gated_delta_net/common.py", "    l2norm = None\n",
         "    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import l2norm  # miles CPU suite\n", 1,
         "fla's l2norm is a Triton kernel: transformers' torch reference of it (its Qwen3.5-MoE modeling) instead"),
    Edit("megatron/core/ssm/gated_delta_net/common.py", "        if not HAVE_FLA:\n",
         "        if not HAVE_FLA and not config.deterministic_mode:\n", 1,
         "GatedDeltaNet refuses to build without fla although deterministic_mode runs megatron's torch kernels "
         "(and the l2norm above)"),
    *(_on_cpu(f"megatron/core/{path}", "torch.cuda.current_device()", count) for path, count in [
        ("models/common/embeddings/rotary_pos_embedding.py", 3),
        ("models/common/embeddings/yarn_rotary_pos_embedding.py", 3), ("tensor_parallel/layers.py", 8),
        ("tensor_parallel/mappings.py", 5), ("tensor_parallel/utils.py", 2), ("transformer/attention.py", 2),
        ("transformer/dot_product_attention.py", 2), ("transformer/moe/router.py", 9),
        ("models/gpt/gpt_model.py", 1), ("pipeline_parallel/p2p_communication.py", 6),
        ("ssm/gated_delta_net/common.py", 5)]),
    _on_cpu("megatron/core/optimizer/optimizer.py", "device='cuda'", 5, "device='cpu'"),
    _on_cpu("megatron/core/optimizer/optimizer.py", "torch.cuda.current_device()", 1),
    _on_cpu("megatron/core/optimizer/distrib_optimizer.py", "torch.cuda.current_device()", 2),
    _on_cpu("megatron/core/optimizer/clip_grads.py", "device='cuda'", 5, "device='cpu'"),
    _on_cpu("megatron/core/utils.py", 'device="cuda"', 1, 'device="cpu"'),
    Edit("megatron/core/utils.py", """                    dtype=dtype,
                    device=torch.cuda.current_device(),
                    requires_grad=False,""", """                    dtype=dtype,
                    device="cpu",
                    requires_grad=False,""", 1, f"GlobalMemoryBuffer (sequence parallel's all-gather): {_CPU}"),
    _on_cpu("megatron/core/pipeline_parallel/schedules.py", 'device="cuda"', 3, 'device="cpu"'),
    _on_cpu("megatron/core/transformer/utils.py", 'device="cuda"', 2, 'device="cpu"'),
    *(Edit(path, "'torch.cuda.", "'torch.", count,
           f"param.type() checks name CUDA tensor types ('torch.cuda.BFloat16Tensor'): {_CPU}, whose types "
           "have no '.cuda'")
      for path, count in [("megatron/core/optimizer/optimizer.py", 6),
                          ("megatron/core/optimizer/distrib_optimizer.py", 8),
                          ("megatron/core/optimizer/clip_grads.py", 1)]),
    Edit("megatron_core-0.19.2.dist-info/METADATA", "\nVersion: 0.19.2\n", "\nVersion: 0.19.2+cpu\n", 1,
         "the local label '+cpu' marks this copy as a build that runs without CUDA, which miles checks before a "
         "real start on a machine without CUDA (miles/backends/megatron_backend/machine.py)"),
    Edit("megatron/core/transformer/moe/paged_stash.py",
         """from megatron.core.transformer.moe.ops.paged_stash import (
    GLOBAL_BLOCK_SIZE,
    paged_stash_copy_kernel,
    paged_stash_pop_kernel,
)
""",
         """try:
    from megatron.core.transformer.moe.ops.paged_stash import (
        GLOBAL_BLOCK_SIZE,
        paged_stash_copy_kernel,
        paged_stash_pop_kernel,
    )
except ImportError:  # miles CPU suite: no Triton; the paged stash is never enabled
    GLOBAL_BLOCK_SIZE = 1024
    paged_stash_copy_kernel = paged_stash_pop_kernel = None
""", 1,
         "Triton-only kernels imported at module level (pipeline schedules import the module); CPU torch has no "
         "Triton, and the MoE paged stash they serve is never enabled"),
]


def apply(root: str) -> None:
    """Apply :data:`EDITS` to the unpacked wheel at ``root``; ValueError naming the first edit that does not match."""
    for edit in EDITS:
        path = os.path.join(root, edit.path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        found = text.count(edit.old)
        if found != edit.count:
            raise ValueError(f"megatron CPU patch ({edit.reason}) on {edit.path}: {edit.old!r} found {found} "
                             f"time(s), expected {edit.count}")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace(edit.old, edit.new))
