"""FreeSlots: an owner's free slots as a stack on the device, and the floor on their number that the host knows.

The stack holds the free slots with the next to take on top (``count - 1``) and one scratch
entry at the end, where padding writes. Nothing reads ``count`` on a step: the host keeps a floor
on it instead, from a copy it reads without waiting (:class:`~lightning_sparse.kernels.host.LateRead`),
less the most that batches took since; a batch that may find too few free slots must then also
run the eviction's ops (:meth:`may_run_short`). Once a step was captured in a CUDA graph, every
batch may: the graph's replays take slots the host never hears of.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.kernels.host import LateRead


class FreeSlots:
    """The free slots of ``capacity`` (slots ``1 .. capacity``, all free at first)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.stack = torch.cat([torch.arange(capacity, 0, -1), torch.zeros(1, dtype=torch.int64)]).to(device)
        self.count = torch.tensor(capacity, device=device)
        self._copy, self._floor, self._spent, self._spent_at_copy = LateRead(), capacity, 0, 0
        self._captured = False

    def to(self, device: torch.device) -> None:
        self.stack, self.count, self._copy = self.stack.to(device), self.count.to(device), LateRead()

    def may_run_short(self, bound: int) -> bool:
        """Whether a batch of up to ``bound`` new keys may find fewer free slots than it asks for (no wait)."""
        self._captured = self._captured or (self.count.is_cuda and torch.cuda.is_current_stream_capturing())
        if self._captured:
            return True
        seen = self._copy.read()
        if seen is not None:
            self._floor = seen - (self._spent - self._spent_at_copy)
        short = self._floor < bound
        self._floor -= bound
        self._spent += bound
        return short

    def top(self, below: Tensor) -> Tensor:
        """The free slot ``below`` places under the top of the stack, for each entry (clamped into the stack)."""
        return self.stack.index_select(0, (self.count - 1 - below).clamp(0, self.capacity))

    def taken(self, count: Tensor) -> None:
        """``count`` slots were taken from the top; the host's copy of what is left starts."""
        self.count -= count
        if not self._captured and self._copy.start(self.count):
            self._spent_at_copy = self._spent

    def push(self, slots: Tensor, real: Tensor | None) -> None:
        """Put ascending ``slots`` (where ``real``) on the stack, the highest lowest."""
        count = len(slots) if real is None else real.sum()
        places = self.count + count - 1 - torch.arange(len(slots), device=slots.device)
        if real is not None:
            places = torch.where(real, places, self.capacity)  # padding: the scratch entry
        self.stack.index_copy_(0, places, slots)
        self.count += count

    def reset(self, stack: Tensor) -> None:
        """The free slots are ``stack`` (the next to take last); the host's floor on them is exact again."""
        self.stack[: len(stack)] = stack
        self.count.fill_(len(stack))
        self._floor, self._copy = len(stack), LateRead()
