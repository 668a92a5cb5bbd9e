"""Which id holds which row of an owner's shard: admission, eviction and expiry, all tensor ops.

An owner of a :class:`~lightning_sparse.tables.dynamic.DynamicEmbedding` keeps a :class:`SlotTable`:
a :class:`~lightning_sparse.tables.slot_map.SlotMap` from keys (mixed ids) to slots, and per slot the
step it was last used in and how often training lookups asked for it. Slot 0 is the *null
row*: it answers every id without a row and never holds an id.

The clock is the number of sparse optimizer steps taken. A slot used since the last step is
*pinned*: a gradient for it may be pending, so it is never evicted or expired before the
step (a row never serves two ids at once). When an id is admitted and no slot is free, the
unpinned slot with the oldest last use (``eviction="lru"``) or the fewest requests
(``eviction="lfu"``) is evicted, ties going to the lowest slot; with every slot pinned the id
waits (it keeps the null row) and counts as *rejected*. With ``ttl``, slots unused for more
than ``ttl`` steps are freed at each step.

Admission: with ``admit_after=k > 1``, training requests for ids without a row are counted in a
:class:`CountSketch`; an id gets a row on the request that brings its count to ``k``. A request
is one rank's lookup asking for the id (however often the id occurs in that rank's batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse.tables.slot_map import SlotMap
from lightning_sparse.wire.grouping import SortedKeys
from lightning_sparse.wire.hashing import mix

EVICTION = ("lru", "lfu")
NULL_SLOT = 0


@dataclass
class SlotStats:
    """Running totals of one owner's slot decisions; reset by the reader (``occupancy`` is a level, not a total)."""

    admissions: int = 0
    evictions: int = 0
    expirations: int = 0
    rejections: int = 0
    occupancy: int = 0

    def reset(self) -> None:
        self.admissions = self.evictions = self.expirations = self.rejections = 0


class CountSketch:
    """A count-min sketch of request counts: ``depth`` rows of ``width`` int32 counters, halved as they fill.

    An estimate is never below the true count since the last halving (it may be above, by
    collisions); once the counters have taken ``width`` requests, all are halved, so ids that
    stopped coming fade (TinyLFU's reset) and a row's counters stay small: a count of 1 or 2 means
    something. Memory: ``4 * depth * width`` bytes.
    """

    def __init__(self, width: int, depth: int = 4, device: torch.device | str | None = None) -> None:
        self.width = 1 << max(4, (width - 1).bit_length())
        self.counters = torch.zeros(depth, self.width, dtype=torch.int32, device=device)
        self.added, self.salts = 0, [((2 * d + 1) * 0x9E3779B97F4A7C15) & 0x7FFFFFFFFFFFFFFF for d in range(depth)]

    def add(self, keys: Tensor, counts: Tensor) -> Tensor:
        """Count ``counts[i]`` more requests of distinct ``keys[i]``; returns each key's estimate after."""
        estimate = None
        for row, salt in zip(self.counters, self.salts):
            bucket = mix(keys ^ salt) & (self.width - 1)
            row.index_add_(0, bucket, counts.to(torch.int32))
            seen = row.index_select(0, bucket)
            estimate = seen if estimate is None else torch.minimum(estimate, seen)
        self.added += int(counts.sum())
        if self.added >= self.width:
            self.counters.div_(2, rounding_mode="floor")
            self.added = 0
        return estimate.to(torch.int64)


class SlotTable:
    """An owner's slots: which key each holds, and the admission, eviction and expiry decisions.

    ``num_slots`` includes the null slot 0; ``capacity`` (at most ``num_slots - 1``) is how many
    ids this owner may hold.
    """

    def __init__(self, num_slots: int, capacity: int, *, admit_after: int, eviction: str, ttl: int | None,
                 sketch_width: int, device: torch.device) -> None:  # fmt: skip
        self.map = SlotMap(num_slots, device)
        self.capacity, self.admit_after, self.eviction, self.ttl = capacity, admit_after, eviction, ttl
        self.last_used = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.requests = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.sketch = CountSketch(sketch_width, device=device) if admit_after > 1 else None
        self.clock = 0
        self.null_used = False  # since the last tick, a training lookup read the null slot (so it may get an update)
        self.stats = SlotStats()
        # Free slots as a stack: the next ones to take are at the end.
        self._free = torch.arange(capacity, 0, -1, dtype=torch.int64, device=device)
        self._num_free = capacity

    @property
    def occupancy(self) -> int:
        return self.capacity - self._num_free

    def to(self, device: torch.device) -> None:
        """Move every tensor of the table to ``device``."""
        self.map.to(device)
        self.last_used, self.requests, self._free = (t.to(device) for t in (self.last_used, self.requests, self._free))
        if self.sketch is not None:
            self.sketch.counters = self.sketch.counters.to(device)

    def resolve(self, keys: Tensor, requests: Tensor | int, *, distinct: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Slots of ``keys`` (``NULL_SLOT`` where none); ``requests``: training requests each entry makes (0: read only).

        ``requests`` is a tensor (one count per entry) or one count for every entry. Keys may
        repeat (the same key sent by several ranks): each entry adds its requests; ``distinct``
        says they do not, which saves a sort. Returns (slots, the slots newly given, where in
        ``keys`` their keys are): the caller initializes those rows and resets their optimizer
        state.
        """
        found, stops = self.map.find_with_stops(keys)
        rebuilds = self.map.rebuilds
        slots = found.clamp(min=NULL_SLOT)  # the map's -1 (no row) -> the null slot
        if isinstance(requests, int):  # the same for every entry: the null slot stands in for the misses
            if not requests:
                return slots, found.new_empty(0), found.new_empty(0)
            self._count_use(slots, torch.full_like(slots, requests))
            wanting = torch.nonzero(found < 0).view(-1)
        else:
            asked = requests > 0
            used = torch.nonzero((found >= 0) & asked).view(-1)
            self._count_use(slots.index_select(0, used), requests.index_select(0, used))
            wanting = torch.nonzero((found < 0) & asked).view(-1)
        if not len(wanting):
            return slots, found.new_empty(0), found.new_empty(0)
        counts = requests if isinstance(requests, int) else requests.index_select(0, wanting)
        runs = None
        if distinct:
            new_keys, new_index = keys.index_select(0, wanting), wanting
        else:  # the keys without a row, each once, with the requests of all their entries
            runs = SortedKeys(keys.index_select(0, wanting)).finish()
            new_keys, new_index = runs.unique, wanting.index_select(0, runs.perm.index_select(0, runs.offsets))
            if not isinstance(requests, int):
                counts = torch.zeros_like(new_keys).index_add_(0, runs.inverse(), counts)
        counts = torch.full_like(new_keys, counts) if isinstance(counts, int) else counts
        chosen = None
        if self.sketch is not None:
            chosen = torch.nonzero(self.sketch.add(new_keys, counts) >= self.admit_after).view(-1)
            new_keys, counts, new_index = (t.index_select(0, chosen) for t in (new_keys, counts, new_index))
        new_slots = self._take(len(new_keys))
        self.stats.rejections += len(new_keys) - len(new_slots)
        self.null_used |= len(new_slots) < len(wanting if runs is None else runs.unique)  # some training entry reads it
        if not len(new_slots):
            return slots, new_slots, new_index[:0]
        new_keys, counts, new_index = new_keys[: len(new_slots)], counts[: len(new_slots)], new_index[: len(new_slots)]
        self.map.insert(new_keys, new_slots, stops.index_select(0, new_index) if self.map.rebuilds == rebuilds else None)
        self.last_used.index_fill_(0, new_slots, self.clock)
        self.requests.index_copy_(0, new_slots, counts)
        self.stats.admissions += len(new_slots)
        self.stats.occupancy = self.occupancy
        if runs is None:
            slots.index_copy_(0, new_index, new_slots)
        else:  # every entry of a new key gets its slot
            given = new_slots  # the slot of each key of ``runs`` (NULL_SLOT: not admitted)
            if len(new_slots) < len(runs.unique):
                admitted = torch.arange(len(new_slots), device=slots.device) if chosen is None else chosen[: len(new_slots)]
                given = torch.full_like(runs.unique, NULL_SLOT).index_copy_(0, admitted, new_slots)
            slots.index_copy_(0, wanting, given.index_select(0, runs.inverse()))
        return slots, new_slots, new_index

    def _count_use(self, slots: Tensor, requests: Tensor) -> None:
        """Stamp ``slots`` with the clock and add their requests; the null slot's counters stay zero."""
        self.last_used.index_fill_(0, slots, self.clock)
        self.requests.index_add_(0, slots, requests)
        self.last_used[NULL_SLOT] = 0
        self.requests[NULL_SLOT] = 0

    def _take(self, count: int) -> Tensor:
        """Up to ``count`` slots for new ids: free ones first, then evicted unpinned ones."""
        short = count - self._num_free
        if short > 0:
            victims = self._victims(short)
            self._release(victims)
            self.stats.evictions += len(victims)
        count = min(count, self._num_free)
        taken = self._free[self._num_free - count : self._num_free].flip(0)
        self._num_free -= count
        return taken

    def _victims(self, count: int) -> Tensor:
        """The ``count`` (or fewer) unpinned slots to evict first under the eviction policy."""
        candidates = torch.nonzero(self.map.used() & (self.last_used < self.clock)).view(-1)
        if not len(candidates):
            return candidates
        score = self.last_used if self.eviction == "lru" else self.requests
        order = score.index_select(0, candidates) * len(self.last_used) + candidates  # ties: the lowest slot
        return candidates.index_select(0, torch.topk(order, min(count, len(candidates)), largest=False).indices)

    def _release(self, slots: Tensor) -> None:
        """Free slots in use: their keys leave the map; the slots go on the free stack."""
        if not len(slots):
            return
        self.map.remove(slots)
        self._free[self._num_free : self._num_free + len(slots)] = slots.sort(descending=True).values
        self._num_free += len(slots)

    def tick(self) -> None:
        """An optimizer step happened: unpin every slot, then free the slots unused for more than ``ttl`` steps."""
        self.clock += 1
        if self.ttl is not None:
            stale = torch.nonzero(self.map.used() & (self.last_used < self.clock - self.ttl)).view(-1)
            self._release(stale)
            self.stats.expirations += len(stale)
        self.stats.occupancy = self.occupancy

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Tensor]:
        """Per-slot tensors that restore the table: ``keys``, ``used`` (int8), ``last_used``, ``requests``."""
        return {"slot_keys": self.map.keys, "slot_used": self.map.used().to(torch.int8), "slot_last_used": self.last_used,
                "slot_requests": self.requests}  # fmt: skip

    def load(self, keys: Tensor, used: Tensor, last_used: Tensor, requests: Tensor, clock: int) -> None:
        """Hold what :meth:`state` returned, each key in the same slot."""
        self.map.load(keys, used.bool())
        self.last_used.copy_(last_used)
        self.requests.copy_(requests)
        self.clock = clock
        free = torch.nonzero(~self.map.used()[1 : self.capacity + 1]).view(-1) + 1
        self._num_free = len(free)
        self._free[: len(free)] = free.flip(0)
        self.stats.occupancy = self.occupancy

    def restore(self, keys: Tensor, last_used: Tensor, requests: Tensor, clock: int) -> Tensor:
        """Empty the table, then hold ``keys`` (distinct), the most deserving first while there is room; returns their slots.

        Keys without room get ``-1``. Used when loading a checkpoint, possibly saved on another
        number of ranks: every key arrives at its new owner with its last use and requests.
        """
        self._release(torch.nonzero(self.map.used()).view(-1))
        self.clock = clock
        score = last_used if self.eviction == "lru" else requests
        order = torch.argsort(score, descending=True, stable=True)[: self.capacity]
        slots = torch.full_like(keys, -1)
        taken = self._take(len(order))
        self.map.insert(keys.index_select(0, order), taken)
        self.last_used.index_copy_(0, taken, last_used.index_select(0, order))
        self.requests.index_copy_(0, taken, requests.index_select(0, order))
        self.stats.occupancy = self.occupancy
        return slots.index_copy_(0, order, taken)
