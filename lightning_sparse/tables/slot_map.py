"""SlotMap: an owner's map from hashed keys to the slots (rows) of its shard, built from tensor ops.

An open-addressing hash table with linear probing, in two tensors: ``buckets`` (``[M]``, the
slot stored in each bucket, or ``EMPTY``/``DELETED``) and ``keys`` (``[slots]``, the key each
slot holds). A batch of keys is looked up or inserted at once, in rounds: the first reads each
key's home bucket, which settles most of them; each later round reads the next ``WINDOW``
buckets of every unsettled key. So the rounds grow with the longest probe sequence of the batch
divided by ``WINDOW``, not with the batch size, and the same code runs on CPU and CUDA (one host
read per round, to stop).

Keys are already mixed (:func:`lightning_sparse.wire.hashing.mix`), so a key's home bucket is its
low bits. ``M`` is a power of two at least twice the slots, so the table is at most half full
with live keys; removed keys leave ``DELETED`` marks that probes walk over (and inserts reuse),
and the buckets are rebuilt when live keys and the marks made since the last rebuild would
fill three quarters of them.

>>> slots = SlotMap(4)
>>> slots.insert(torch.tensor([10, -7]), torch.tensor([0, 3]))
>>> slots.find(torch.tensor([-7, 5, 10])).tolist()
[3, -1, 0]
>>> slots.remove(torch.tensor([3])); slots.find(torch.tensor([-7, 10])).tolist()
[-1, 0]
"""

from __future__ import annotations

import torch
from torch import Tensor

EMPTY, DELETED = -1, -2
WINDOW = 16  # buckets a straggling probe reads per round
CHUNK = 8192  # keys a rebuild inserts at once


class SlotMap:
    """Key -> slot for ``num_slots`` slots; each slot holds at most one key, each key at most one slot."""

    def __init__(self, num_slots: int, device: torch.device | str | None = None) -> None:
        self.num_slots = num_slots
        size = 1 << max(4, (2 * num_slots - 1).bit_length())
        self.mask = size - 1
        self.buckets = torch.full((size,), EMPTY, dtype=torch.int64, device=device)
        self.keys = torch.zeros(num_slots, dtype=torch.int64, device=device)  # valid where the slot is in use
        self.bucket_of = torch.full((num_slots,), EMPTY, dtype=torch.int64, device=device)  # EMPTY: slot not in use
        self.deleted = 0  # DELETED marks made since the last rebuild (some may have been reused since)
        self.rebuilds = 0

    @property
    def device(self) -> torch.device:
        return self.buckets.device

    def to(self, device: torch.device) -> None:
        """Move the map's tensors to ``device``."""
        self.buckets, self.keys, self.bucket_of = (t.to(device) for t in (self.buckets, self.keys, self.bucket_of))

    def used(self) -> Tensor:
        """``[num_slots]`` bool: which slots hold a key."""
        return self.bucket_of >= 0

    def find(self, keys: Tensor) -> Tensor:
        """The slot of each key (keys may repeat), ``-1`` where the map does not hold it."""
        return self.find_with_stops(keys)[0]

    def find_with_stops(self, keys: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`find`, and for each key not held the ``EMPTY`` bucket where its probe stopped (where it may go in).

        The first round probes each key's home bucket, which settles most keys; the rest probe
        ``WINDOW`` buckets per round (one gather of ``[keys, WINDOW]``), so a long probe sequence
        costs a few rounds, not one round per bucket. The stops hold for :meth:`insert` until
        the next :meth:`rebuild` (``rebuilds`` counts them).
        """
        stops = keys & self.mask
        slot = self.buckets.index_select(0, stops)
        hit = (slot >= 0) & (self.keys.index_select(0, slot.clamp(min=0)) == keys)
        found = torch.where(hit, slot, -1)
        pending = torch.nonzero(~hit & (slot != EMPTY)).view(-1)  # another key or a mark: probe on
        start = (stops.index_select(0, pending) + 1) & self.mask
        while len(pending):
            waiting = keys.index_select(0, pending).unsqueeze(1)
            slot = self._window(start)
            hit = (slot >= 0) & (self.keys.index_select(0, slot.clamp(min=0).view(-1)).view_as(slot) == waiting)
            first = (hit | (slot == EMPTY)).to(torch.uint8).argmax(dim=1, keepdim=True)  # where each probe stops
            stopped = (slot.gather(1, first) == EMPTY) | hit.gather(1, first)
            found.index_copy_(0, pending, torch.where(hit.gather(1, first), slot.gather(1, first), -1).view(-1))
            stops.index_copy_(0, pending, (start + first.view(-1)) & self.mask)
            go_on = torch.nonzero(~stopped.view(-1)).view(-1)  # no stop in the window: the next window
            pending, start = pending.index_select(0, go_on), (start.index_select(0, go_on) + WINDOW) & self.mask
        return found, stops

    def insert(self, keys: Tensor, slots: Tensor, stops: Tensor | None = None) -> None:
        """Put distinct ``keys``, none of them in the map, into free ``slots`` (one each).

        Each round, every unplaced key picks the first free bucket (``EMPTY`` or ``DELETED``) in
        the ``WINDOW`` buckets from where it stands (in the first round, its ``stops`` from
        :meth:`find_with_stops` if given); several keys may pick one bucket: one write lands, the
        key it came from keeps the bucket, and the others go on from there.
        """
        placed = torch.empty_like(keys)  # the bucket each key ends in
        pending = torch.arange(len(keys), device=keys.device)
        start, bucket, has_free = keys & self.mask, stops, None
        while len(pending):
            if bucket is None:
                free = self._window(start) < 0
                has_free = free.any(dim=1)
                bucket = (start + free.to(torch.uint8).argmax(dim=1)) & self.mask
                candidates = torch.nonzero(has_free).view(-1)
            else:  # the stops: free buckets all
                candidates = pending
            tried, their_slots = bucket.index_select(0, candidates), slots.index_select(0, pending.index_select(0, candidates))
            self.buckets.index_copy_(0, tried, their_slots)
            won = torch.zeros_like(pending, dtype=torch.bool)
            won.index_copy_(0, candidates, self.buckets.index_select(0, tried) == their_slots)
            taken = torch.nonzero(won).view(-1)
            placed.index_copy_(0, pending.index_select(0, taken), bucket.index_select(0, taken))
            go_on = torch.nonzero(~won).view(-1)  # lost the bucket (go on from it) or none free (the next window)
            step = 0 if has_free is None else torch.where(has_free, 0, WINDOW).index_select(0, go_on)
            pending, start = pending.index_select(0, go_on), (bucket.index_select(0, go_on) + step) & self.mask
            bucket = None
        self.bucket_of.index_copy_(0, slots, placed)
        self.keys.index_copy_(0, slots, keys)

    def _window(self, start: Tensor) -> Tensor:
        """``[len(start), WINDOW]``: the buckets from each start on (wrapping around)."""
        positions = (start.unsqueeze(1) + torch.arange(WINDOW, device=start.device)) & self.mask
        return self.buckets.index_select(0, positions.view(-1)).view(positions.shape)

    def remove(self, slots: Tensor) -> None:
        """Free ``slots`` (distinct, in use): their keys leave the map."""
        if not len(slots):
            return
        self.buckets.index_fill_(0, self.bucket_of.index_select(0, slots), DELETED)
        self.bucket_of.index_fill_(0, slots, EMPTY)
        self.deleted += len(slots)
        if (int(self.used().sum()) + self.deleted) * 4 > 3 * len(self.buckets):
            self.rebuild()

    def rebuild(self) -> None:
        """Put every live key back into fresh buckets (drops the DELETED marks)."""
        slots = torch.nonzero(self.used()).view(-1)
        self.buckets.fill_(EMPTY)
        self.bucket_of.fill_(EMPTY)
        self.deleted = 0
        self.rebuilds += 1
        self._insert_in_chunks(self.keys.index_select(0, slots), slots)

    def load(self, keys: Tensor, used: Tensor) -> None:
        """Hold exactly the keys of ``used`` slots (``keys`` and ``used``: one entry per slot)."""
        self.keys.copy_(keys)
        self.buckets.fill_(EMPTY)
        self.bucket_of.fill_(EMPTY)
        self.deleted = 0
        self.rebuilds += 1
        slots = torch.nonzero(used).view(-1)
        self._insert_in_chunks(keys.index_select(0, slots), slots)

    def _insert_in_chunks(self, keys: Tensor, slots: Tensor) -> None:
        """:meth:`insert` of a whole table's keys, ``CHUNK`` at a time: its ``[keys, WINDOW]`` temporaries stay small."""
        for start in range(0, len(keys), CHUNK):
            self.insert(keys[start : start + CHUNK], slots[start : start + CHUNK])
