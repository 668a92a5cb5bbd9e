"""SlotMap: an owner's map from hashed keys to the slots (rows) of its shard, built from tensor ops.

An open-addressing hash table with linear probing, in two tensors: ``buckets`` (``[M]``, the
slot stored in each bucket, or ``EMPTY``/``DELETED``) and ``keys`` (``[slots]``, the key each
slot holds). A batch of keys is looked up or inserted at once: every round moves all unsettled
keys one bucket on, so the number of rounds is the longest probe sequence of the batch, not the
batch size, and the same code runs on CPU and CUDA (one host read per round, to stop).

Keys are already mixed (:func:`lightning_sparse.hashing.mix`), so a key's home bucket is its
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
        found = torch.full_like(keys, -1)
        pending, waiting, bucket = None, keys, keys & self.mask  # pending: positions in ``keys`` (None: all)
        while len(waiting):
            slot = self.buckets.index_select(0, bucket)
            hit = (slot >= 0) & (self.keys.index_select(0, slot.clamp(min=0)) == waiting)
            if pending is None:
                found = torch.where(hit, slot, found)
            else:
                found.index_copy_(0, pending, torch.where(hit, slot, -1))
            go_on = torch.nonzero(~hit & (slot != EMPTY)).view(-1)  # another key or a mark: probe the next bucket
            pending = go_on if pending is None else pending.index_select(0, go_on)
            waiting, bucket = waiting.index_select(0, go_on), (bucket.index_select(0, go_on) + 1) & self.mask
        return found

    def insert(self, keys: Tensor, slots: Tensor) -> None:
        """Put distinct ``keys``, none of them in the map, into free ``slots`` (one each)."""
        placed = torch.empty_like(keys)  # the bucket each key ends in
        pending, bucket = torch.arange(len(keys), device=keys.device), keys & self.mask
        while len(pending):
            candidates = torch.nonzero(self.buckets.index_select(0, bucket) < 0).view(-1)  # free buckets
            tried, their_slots = bucket.index_select(0, candidates), slots.index_select(0, pending.index_select(0, candidates))
            # Several keys may try one free bucket in a round: one write lands, and the key it came from takes the bucket.
            self.buckets.index_copy_(0, tried, their_slots)
            won = torch.zeros_like(bucket, dtype=torch.bool)
            won.index_copy_(0, candidates, self.buckets.index_select(0, tried) == their_slots)
            taken = torch.nonzero(won).view(-1)
            placed.index_copy_(0, pending.index_select(0, taken), bucket.index_select(0, taken))
            go_on = torch.nonzero(~won).view(-1)
            pending, bucket = pending.index_select(0, go_on), (bucket.index_select(0, go_on) + 1) & self.mask
        self.bucket_of.index_copy_(0, slots, placed)
        self.keys.index_copy_(0, slots, keys)

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
        self.insert(self.keys.index_select(0, slots), slots)

    def load(self, keys: Tensor, used: Tensor) -> None:
        """Hold exactly the keys of ``used`` slots (``keys`` and ``used``: one entry per slot)."""
        self.keys.copy_(keys)
        self.buckets.fill_(EMPTY)
        self.bucket_of.fill_(EMPTY)
        self.deleted = 0
        slots = torch.nonzero(used).view(-1)
        self.insert(keys.index_select(0, slots), slots)
