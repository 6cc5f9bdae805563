"""Host lists to device tensors, without a host sync.

``torch.tensor(values, device="cuda")`` copies with ``non_blocking=False``, and PyTorch then
waits for the whole CUDA stream: every such call in a step would stall the host behind the GPU.
Building the tensor on the host and copying it with ``non_blocking=True`` queues the copy
instead (pageable memory is staged at once, so the host list may go away). On CPU it is a plain
tensor. Every per-step index or parameter tensor goes through here.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
