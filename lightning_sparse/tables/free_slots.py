"""Where an owner's admissions find slots and how often ids without one were asked for: its bookkeeping beside the map.

:class:`SlotStats`: the totals of an owner's slot decisions, read from its device counters when asked.

:class:`FreeSlots`: the free slots as a stack on the device, and the floor on their number that
the host knows. The stack holds the free slots with the next to take on top (``count - 1``) and one
scratch entry at the end, where padding writes. Nothing reads ``count`` on a step: the host keeps a
floor on it instead, from a copy it reads without waiting (:class:`~lightning_sparse.kernels.host.LateRead`),
less the most that batches took since; a batch that may find too few free slots must then also
run the eviction's ops (:meth:`FreeSlots.may_run_short`). Once a step was captured in a CUDA graph,
every batch may: the graph's replays take slots the host never hears of.

:class:`LruQueue`: on a CPU, the slots that ``eviction="lru"`` takes next, kept in order between
batches, so that a batch that evicts reads a few entries instead of every slot (a ``topk`` over the
table, which the GPU's path and ``"lfu"`` still take).

:class:`CountSketch`: how often ids without a row were asked for, so that a dynamic table admits an
id on its ``k``-th request. A count-min sketch of ``depth`` rows of ``width`` int32 counters, kept on
the table's device. An estimate is never below the true count since the last halving (it may be
above, by collisions); once the counters have taken ``width`` requests, all are halved, so ids that
stopped coming fade (TinyLFU's reset) and a row's counters stay small: a count of 1 or 2 means
something. Memory: ``4 * depth * width`` bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_sparse.kernels import gpu_path
from lightning_sparse.kernels.host import LateRead
from lightning_sparse.wire.hashing import mix

ADMISSIONS, EVICTIONS, EXPIRATIONS, REJECTIONS = range(4)  # SlotTable.counters, which SlotStats reads


def _total(which: int) -> property:
    return property(lambda self: int(self._table.counters[which]), doc="Since the last reset (a host read).")


class SlotStats:
    """One owner's running totals of slot decisions, read from its device counters when asked, and its occupancy.

    :meth:`reset` zeroes the totals (``occupancy`` is a level, not a total).
    """

    admissions, evictions, expirations, rejections = (_total(which) for which in range(4))

    def __init__(self, table: Any) -> None:  # a SlotTable
        self._table = table

    @property
    def clock(self) -> int:
        """The table's :attr:`SlotTable.clock`: sparse optimizer steps taken (a host read)."""
        return self._table.clock

    @property
    def occupancy(self) -> int:
        """The table's :attr:`SlotTable.occupancy`: how many ids this owner holds (a host read)."""
        return self._table.occupancy

    def reset(self) -> None:
        self._table.counters.zero_()


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


class LruQueue:
    """A CPU's eviction order for ``"lru"``: the unpinned slots by (last use, slot), from a snapshot kept between batches.

    The snapshot, taken at clock ``S`` when needed, lists the slots in use and unpinned (last use
    below ``S``) in eviction order, with the last use each had. An entry stays *valid* while its
    slot holds the same id, unused since: still in use with the same last use (a use or an
    admission sets it to the clock, at least ``S``). Every other slot in use has a last use of at
    least ``S``, so the valid entries, in order, come first in eviction order: the victims are the
    next valid ones. When none is left, a new snapshot. A table that loads its slots forgets it.
    """

    def __init__(self) -> None:
        self.order: Tensor | None = None
        self.stamps, self.cursor = None, 0

    def forget(self) -> None:
        self.order = None

    def victims(self, wanted: int, used: Callable[[Tensor | None], Tensor], last_used: Tensor, now: int) -> Tensor:
        """The next ``wanted`` (or fewer: all there are) slots to evict, in eviction order.

        ``used(slots)``: which of ``slots`` hold a key (``used(None)``: of all).
        """
        found, fresh = [], False
        while wanted > 0:
            if self.order is None or self.cursor >= len(self.order):
                if fresh:  # a snapshot of this call is used up: no unpinned slot is left
                    break
                self._snapshot(used, last_used, now, found)
                fresh = True
            window = slice(self.cursor, self.cursor + max(4 * wanted, 64))
            slots = self.order[window]
            valid = used(slots) & (last_used.index_select(0, slots) == self.stamps[window])
            at = torch.nonzero(valid).view(-1)[:wanted]
            self.cursor += int(at[-1]) + 1 if len(at) == wanted else len(slots)
            found.append(slots.index_select(0, at))
            wanted -= len(at)
        return torch.cat(found) if found else last_used.new_empty(0)

    def _snapshot(self, used: Callable[[Tensor | None], Tensor], last_used: Tensor, now: int, taken: list[Tensor]) -> None:
        unpinned = used(None) & (last_used < now)
        for slots in taken:  # victims of this call stay in use until the caller frees them
            unpinned.index_fill_(0, slots, False)
        candidates = torch.nonzero(unpinned).view(-1)  # ascending slots: a stable sort breaks ties by the lower one
        self.stamps, order = torch.sort(last_used.index_select(0, candidates), stable=True)
        self.order, self.cursor = candidates.index_select(0, order), 0


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
