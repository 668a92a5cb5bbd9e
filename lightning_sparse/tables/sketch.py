"""CountSketch: how often ids without a row were asked for, so that a dynamic table admits an id on its ``k``-th request.

A count-min sketch of ``depth`` rows of ``width`` int32 counters, kept on the table's device. An
estimate is never below the true count since the last halving (it may be above, by collisions);
once the counters have taken ``width`` requests, all are halved, so ids that stopped coming fade
(TinyLFU's reset) and a row's counters stay small: a count of 1 or 2 means something. Memory:
``4 * depth * width`` bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.kernels import gpu_path
from lightning_sparse.wire.hashing import mix


class CountSketch:
    """Request counts of keys, estimated from ``depth`` hashed counters each (see the module)."""

    def __init__(self, width: int, depth: int = 4, device: torch.device | str | None = None) -> None:
        self.width = 1 << max(4, (width - 1).bit_length())
        self.counters = torch.zeros(depth, self.width, dtype=torch.int32, device=device)
        self.added = torch.zeros((), dtype=torch.int64, device=device)  # requests since the last halving
        self.salts = [((2 * d + 1) * 0x9E3779B97F4A7C15) & 0x7FFFFFFFFFFFFFFF for d in range(depth)]

    def to(self, device: torch.device) -> None:
        self.counters, self.added = self.counters.to(device), self.added.to(device)

    def add(self, keys: Tensor, counts: Tensor) -> Tensor:
        """Count ``counts[i]`` more requests of distinct ``keys[i]`` (0: none); returns each key's estimate after."""
        estimate = None
        for row, salt in zip(self.counters, self.salts):
            bucket = mix(keys ^ salt) & (self.width - 1)
            row.index_add_(0, bucket, counts.to(torch.int32))
            seen = row.index_select(0, bucket)
            estimate = seen if estimate is None else torch.minimum(estimate, seen)
        self.added += counts.sum()
        if gpu_path(self.counters):  # no host read: every call shifts the counters by 0 or 1
            full = self.added >= self.width
            self.counters.bitwise_right_shift_(full.to(torch.int32))
            self.added.masked_fill_(full, 0)
        elif int(self.added) >= self.width:
            self.counters.bitwise_right_shift_(1)
            self.added.zero_()
        return estimate.to(torch.int64)
