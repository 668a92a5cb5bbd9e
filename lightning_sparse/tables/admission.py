"""Which id holds which row of an owner's shard: admission, eviction and expiry, in fixed-shape tensor ops.

An owner of a :class:`~lightning_sparse.tables.dynamic.DynamicEmbedding` keeps a :class:`SlotTable`: a
:class:`~lightning_sparse.tables.slot_map.SlotMap` from keys (mixed ids) to slots, and per slot the step it was last
used in and how often training lookups asked for it. Slot 0 is the *null row*: it answers every id without a row and
never holds an id.

The clock is the number of sparse optimizer steps taken. A slot used since the last step is *pinned*: a gradient for
it may be pending, so it is never evicted or expired before the step (a row never serves two ids at once). When an id
is admitted and no slot is free, the unpinned slot with the oldest last use (``eviction="lru"``) or the fewest
requests (``eviction="lfu"``) is evicted, ties going to the lowest slot; with every slot pinned the id waits (it keeps
the null row) and counts as *rejected*. With ``ttl``, slots unused for more than ``ttl`` steps are freed at each step.

Admission: with ``admit_after=k > 1``, training requests for ids without a row are counted in a
:class:`~lightning_sparse.tables.free_slots.CountSketch`; an id gets a row on the request that brings its count to
``k``. A request is one rank's lookup asking for the id (however often the id occurs in that rank's batch).

Nothing here reads the device from the host on a GPU's path: the clock, the free slots and the stats are device
tensors, a batch is handled at the size of its bound (padding entries write the null slot, whose counters are reset),
and eviction, which needs a ``topk`` over the slots, runs only when the batch may find too few free slots
(:class:`~lightning_sparse.tables.free_slots.FreeSlots` keeps the host's floor on them). So a one-process step can
also be captured in a CUDA graph. On a CPU, where a host read costs nothing, batches are compacted to their exact
sizes instead (``nonzero``), the map's loops run in numba where it imports (``slot_kernels``), and ``"lru"`` takes its
victims from an order kept between batches (:class:`~lightning_sparse.tables.free_slots.LruQueue`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.kernels import gpu_path, uses_triton
from lightning_sparse.kernels.backend import uses_numba
from lightning_sparse.tables.free_slots import (
    ADMISSIONS,
    EVICTIONS,
    EXPIRATIONS,
    REJECTIONS,
    CountSketch,
    FreeSlots,
    LruQueue,
    SlotStats,
)
from lightning_sparse.tables.placement import empty_rows
from lightning_sparse.tables.slot_map import NULL_SLOT, SlotMap, both, select
from lightning_sparse.wire.grouping import SortedKeys

EVICTION = ("lru", "lfu")
_LAST = 2**63 - 1  # sorts after every key and every score


class SlotTable:
    """An owner's slots: which key each holds, and the admission, eviction and expiry decisions.

    ``num_slots`` includes the null slot 0; ``capacity`` (at most ``num_slots - 1``) is how many
    ids this owner may hold. ``counters`` holds the totals that :attr:`stats` reads.
    """

    def __init__(self, num_slots: int, capacity: int, *, admit_after: int, eviction: str, ttl: int | None,
                 sketch_width: int, device: torch.device) -> None:  # fmt: skip
        self.map = SlotMap(num_slots, device)
        self.capacity, self.admit_after, self.eviction, self.ttl = capacity, admit_after, eviction, ttl
        self.last_used = empty_rows((num_slots,), torch.int64, device).zero_()
        self.requests = empty_rows((num_slots,), torch.int64, device).zero_()
        self.sketch = CountSketch(sketch_width, device=device) if admit_after > 1 else None
        self.now = torch.zeros((), dtype=torch.int64, device=device)  # the clock, on the device (see :attr:`clock`)
        self.counters = torch.zeros(4, dtype=torch.int64, device=device)
        self.stats = SlotStats(self)
        self.free = FreeSlots(capacity, device)
        self.lru = LruQueue()  # a CPU's "lru" eviction order (the GPU's path and "lfu" take a topk over the slots)
        self.null_asked = True  # whether a training request may have got the null slot since the last tick (see tick)

    @property
    def clock(self) -> int:
        """Sparse optimizer steps taken (a host read; the step path uses :attr:`now`, the device's copy)."""
        return int(self.now)

    @clock.setter
    def clock(self, value: int) -> None:
        self.now.fill_(value)
        self.lru.forget()

    @property
    def occupancy(self) -> int:
        """How many ids this owner holds (a host read)."""
        return self.capacity - int(self.free.count)

    def to(self, device: torch.device) -> None:
        """Move every tensor of the table to ``device``."""
        self.map.to(device)
        self.last_used, self.requests, self.counters, self.now = (
            t.to(device) for t in (self.last_used, self.requests, self.counters, self.now))  # fmt: skip
        self.free.to(device)
        self.lru.forget()
        if self.sketch is not None:
            self.sketch.to(device)

    def resolve(self, keys: Tensor, requests: Tensor | int, *, distinct: bool = False,
                valid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Slots of ``keys`` (``NULL_SLOT`` where none); ``requests``: training requests each entry makes (0: read only).

        ``requests`` is a tensor (one count per entry) or one count for every entry; ``valid``
        marks the real entries of a padded batch (default: all). Keys may repeat (the same key
        sent by several ranks): each entry adds its requests; ``distinct`` says they do not and
        come in ascending order (a sort's distinct keys), which saves sorts. Returns (slots, the slots given to new keys, where in ``keys`` their
        keys are): the caller initializes those rows and resets their optimizer state. On a
        GPU's path the last two are padded with the null slot (and position 0).
        """
        groups = (
            None if uses_triton(self.map.buckets) or uses_numba(self.map.buckets) else self.map.groups(keys)
        )  # the torch ops'
        slots = self.map.find(keys, groups)  # the null slot where no row
        if isinstance(requests, int) and not requests:
            return slots, slots[:0], slots[:0]
        asked = valid if isinstance(requests, int) else both(requests > 0, valid)
        stamp = slots if asked is None else torch.where(asked, slots, NULL_SLOT)
        self.last_used.index_copy_(0, stamp, self.now.expand(len(stamp)))  # (index_fill_ would read a tensor value)
        self.requests.index_add_(0, stamp, torch.full_like(stamp, requests) if isinstance(requests, int) else requests)
        index, real = select(both(slots == NULL_SLOT, asked))  # the entries without a row
        if len(index):
            new_keys, self.null_asked = keys.index_select(0, index), True  # (any of them may find no slot)
            if distinct:
                counts = requests if isinstance(requests, int) else requests.index_select(0, index)
                groups = None if groups is None else groups.index_select(0, index)
                given = self._admit(new_keys, counts, real, groups=groups)  # the null slot for padding
                new_slots, new_index = given, index
            else:  # the first entry of each key admits it, with the requests of all
                counts = torch.full_like(index, requests) if isinstance(requests, int) else requests.index_select(0, index)
                counts = counts if real is None else counts * real
                runs = SortedKeys(new_keys if real is None else torch.where(real, new_keys, _LAST))
                run = runs.run_index()
                counts = torch.zeros_like(counts).index_add_(0, run, counts.index_select(0, runs.perm)).index_select(0, run)
                first = runs.is_first if real is None else runs.is_first & real.index_select(0, runs.perm)
                new_slots = self._admit(runs.sorted, counts, first)
                new_index = index.index_select(0, runs.perm)
                by_run = torch.zeros_like(new_slots).index_add_(0, run, new_slots).index_select(0, run)
                given = torch.empty_like(by_run).index_copy_(0, runs.perm, by_run)  # every entry of a new key
                given = given if real is None else given * real
            slots.index_add_(0, index, given)  # to the null slot (0) of each entry without a row; padding adds 0
            if real is None:  # a CPU's exact sizes: only the keys that got a slot
                kept = torch.nonzero(new_slots != NULL_SLOT).view(-1)
                new_slots, new_index = new_slots.index_select(0, kept), new_index.index_select(0, kept)
        else:
            new_slots = new_index = slots[:0]
        # the null slot stood in for misses and padding (a fill, not ``x[i] = 0``: a host copy on CUDA)
        self.last_used[NULL_SLOT : NULL_SLOT + 1].fill_(0)
        self.requests[NULL_SLOT : NULL_SLOT + 1].fill_(0)
        return slots, new_slots, new_index

    def resolve_ids(self, ids: Tensor, requests: int) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`resolve` for raw ids that may repeat, on a CPU with numba: one loop, no sort of the batch, the same decisions.

        Returns (the slot of each id, the slots given to new ids, their ids). New ids are admitted in
        ascending order of their keys, each once, as :meth:`resolve` admits a sort's distinct keys.
        """
        from lightning_sparse.tables.slot_kernels import IdBatch

        if not (batch := IdBatch(ids)).resolve(self, requests, admit=self.sketch is None):  # (else a count sketch decides)
            batch.finish(self._admit(batch.keys_to_admit(), requests, None, entries=batch.reserved()))
        elif batch.placed:
            self.free.taken(batch.placed)
        self.null_asked |= batch.placed < batch.distinct  # a new id without a slot (requests > 0: else there are none)
        return batch.result()

    def _admit(self, keys: Tensor, counts: Tensor | int, candidates: Tensor | None, groups: Tensor | None = None,
               entries: Tensor | None = None) -> Tensor:  # fmt: skip
        """Slots for new distinct keys where ``candidates`` (default: all): admitted, placed in the map and given one, else null.

        ``counts``: each key's requests (or one count for all). The keys are in ascending order, padding aside (a sort's
        distinct keys, or its sorted runs); ``groups``: the map's groups of each, ``entries`` theirs, where known.
        """
        chosen = candidates
        if self.sketch is not None:
            counts = torch.full_like(keys, counts) if isinstance(counts, int) else counts
            estimate = self.sketch.add(keys, counts if candidates is None else counts * candidates)
            chosen = both(estimate >= self.admit_after, candidates)
        entries = self.map.reserve(keys, chosen, groups=groups, ascending=True) if entries is None else entries  # (padding: none)
        if uses_numba(self.map.buckets):
            return self._place(entries, keys, counts, len(keys) if chosen is None else int(chosen.sum()))
        got, slots = self._take(entries >= 0, len(keys))
        self.map.write(entries, keys, slots)  # (an entry whose key got no slot is given back)
        self.last_used.index_copy_(0, slots, self.now.expand(len(slots)))
        if isinstance(counts, int):
            self.requests.index_fill_(0, slots, counts)
        else:
            self.requests.index_copy_(0, slots, counts)
        asked = len(keys) if chosen is None else chosen.sum()
        self.counters[REJECTIONS].add_(asked - got.sum())  # no slot to be had (or a full group of the map)
        return slots

    def _place(self, entries: Tensor, keys: Tensor, counts: Tensor | int, asked: int) -> Tensor:
        """A CPU's :meth:`_take` and ``map.write`` in one numba loop (``slot_kernels.place``): the same slots and counts."""
        from lightning_sparse.tables import slot_kernels

        victims, evicted, free = keys[:0], 0, int(self.free.count)
        if self.free.may_run_short(len(keys)) and int((entries >= 0).sum()) > free:
            victims, evicted = self._evict(int((entries >= 0).sum()) - free, len(keys))
            victims, evicted = victims[: int(evicted)], int(evicted)
        slots, taken = slot_kernels.place(entries, keys, counts, victims, self.free.stack, free, self.map.buckets,
                                          self.map.keys, self.map.entry_of, self.last_used, self.requests, int(self.now))  # fmt: skip
        self.free.taken(taken - evicted)
        self.counters.add_(torch.tensor([taken, evicted, 0, asked - taken]))  # ADMISSIONS, EVICTIONS, EXPIRATIONS, REJECTIONS
        return slots

    def _take(self, wanted: Tensor, bound: int) -> tuple[Tensor, Tensor]:
        """A slot for each ``wanted`` entry, in order, while there are any: free ones first, then evicted unpinned ones.

        Returns (which got one, their slots; the null slot elsewhere). ``bound``: ``len(wanted)``.
        """
        rank = wanted.cumsum(0) - 1
        evicted = victims = None
        if self.free.may_run_short(bound):
            victims, evicted = self._evict(rank[-1] + 1 - self.free.count, bound)
        below = rank if evicted is None else rank - evicted  # the victims go first (ascending), then the stack from the top
        slots = self.free.top(below)
        if victims is not None:
            slots = torch.where(below < 0, victims.index_select(0, rank.clamp(0, len(victims) - 1)), slots)
        got = wanted & (below < self.free.count)
        slots = slots * got  # the null slot (0) elsewhere
        taken = got.sum()
        self.free.taken(taken if evicted is None else taken - evicted)
        self.counters[ADMISSIONS].add_(taken)
        if evicted is not None:
            self.counters[EVICTIONS].add_(evicted)
        return got, slots

    def _evict(self, short: Tensor, bound: int) -> tuple[Tensor, Tensor]:
        """Free the ``short`` (or fewer) unpinned slots to evict first under the eviction policy, at most ``bound``.

        Returns them in ascending order (padded with ``_LAST``) and how many there are.
        """
        if self.eviction == "lru" and not gpu_path(self.last_used):  # a CPU's: the next ones of the kept order
            victims = self.lru.victims(int(short), self.map.used, self.last_used, int(self.now))
            self.map.remove(victims)
            return torch.cat([torch.sort(victims).values, victims.new_full((1,), _LAST)]), len(victims)
        unpinned = self.map.used() & (self.last_used < self.now)
        score = self.last_used if self.eviction == "lru" else self.requests
        slot_numbers = torch.arange(len(score), device=score.device)
        order = torch.where(unpinned, score * len(score) + slot_numbers, _LAST)  # ties: the lowest slot
        first = torch.topk(order, min(bound, len(order)), largest=False)
        chosen = (slot_numbers[: len(first.values)] < short) & (first.values < _LAST)
        self.map.remove(torch.where(chosen, first.indices, NULL_SLOT))
        return torch.sort(torch.where(chosen, first.indices, _LAST)).values, chosen.sum()

    def _release(self, slots: Tensor, real: Tensor | None) -> None:
        """Free ascending ``slots`` in use (where ``real``): their keys leave the map; the slots go on the free stack."""
        slots = slots if real is None else torch.where(real, slots, NULL_SLOT)
        self.map.remove(slots)
        self.free.push(slots, real)

    def tick(self) -> bool:
        """An optimizer step happened: unpin every slot, then free the slots unused for more than ``ttl`` steps. Returns
        whether a training request may have got the null slot since the last tick (then its row had a gradient)."""
        asked, self.null_asked = self.null_asked, False
        self.now += 1
        if self.ttl is not None:
            stale, real = select(self.map.used() & (self.last_used < self.now - self.ttl))
            if len(stale):
                self._release(stale, real)
                self.counters[EXPIRATIONS].add_(len(stale) if real is None else real.sum())
        return asked

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Tensor]:
        """Per-slot tensors that restore the table: ``keys``, ``used`` (int8), ``last_used``, ``requests``."""
        used = self.map.used()
        return {"slot_keys": torch.where(used, self.map.keys, 0), "slot_used": used.to(torch.int8),
                "slot_last_used": self.last_used, "slot_requests": self.requests}  # fmt: skip

    def load(self, keys: Tensor, used: Tensor, last_used: Tensor, requests: Tensor, clock: int) -> None:
        """Hold what :meth:`state` returned, each key in the same slot."""
        self.map.clear()
        self.map.keys.copy_(keys)
        held = torch.nonzero(used).view(-1)
        self.map.place(keys.index_select(0, held), held)
        self.last_used.copy_(last_used)
        self.requests.copy_(requests)
        self.clock = clock
        free = torch.nonzero(~self.map.used()[1 : self.capacity + 1]).view(-1) + 1
        self.free.reset(free.flip(0))

    def restore(self, keys: Tensor, last_used: Tensor, requests: Tensor, clock: int) -> Tensor:
        """Empty the table, then hold ``keys`` (distinct), the most deserving first while there is room; returns their slots.

        Keys without room get ``-1``. Used when loading a checkpoint, possibly saved on another
        number of ranks: every key arrives at its new owner with its last use and requests.
        """
        held = torch.nonzero(self.map.used()).view(-1)
        if len(held):
            self._release(held, None)
        self.clock = clock
        score = last_used if self.eviction == "lru" else requests
        order = torch.argsort(score, descending=True, stable=True)[: self.capacity]
        num_free = int(self.free.count)
        taken = self.free.stack[num_free - len(order) : num_free].flip(0)
        placed = self.map.place(keys.index_select(0, order), taken)
        self.last_used.index_copy_(0, taken, last_used.index_select(0, order))
        self.requests.index_copy_(0, taken, requests.index_select(0, order))
        self.free.reset(torch.cat([self.free.stack[: num_free - len(order)], taken[~placed].flip(0)]))
        return torch.full_like(keys, -1).index_copy_(0, order, torch.where(placed, taken, -1))
