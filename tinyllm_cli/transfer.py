"""Host lists to device tensors, without a host sync.

``torch.tensor(values, device="cuda")`` copies with ``non_blocking=False``, and PyTorch then
waits for the whole CUDA stream: every such call in a step would stall the host behind the GPU.
Here the tensor is built on the host in pinned memory (PyTorch's caching host allocator keeps
the block until the copy has run) and copied with ``non_blocking=True``, which only queues the
copy, as vLLM does for its per-step inputs. On CPU it is a plain tensor. Every per-step index or
parameter tensor goes through here.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
