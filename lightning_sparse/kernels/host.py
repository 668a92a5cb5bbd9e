"""Small tensors of host values on the device, without a wait."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def host_tensor(values: Sequence[int | float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small tensor of Python values on ``device``; to a GPU through pinned memory, without blocking.

    (The pinned buffer comes from torch's caching host allocator: it is reused, not allocated anew, once
    its copy is done.)
    """
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
