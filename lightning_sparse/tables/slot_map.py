"""SlotMap: an owner's map from hashed keys to the slots (rows) of its shard, in fixed-shape tensor ops.

A bucketed hash table with two choices, in two tensors: ``buckets`` (``[G, B]`` int32: ``G``
groups of ``B`` entries, each the slot stored there, or the null slot 0 where empty: slot 0 never
holds a key) and ``keys`` (``[slots]``, the key each slot holds). A key may sit in either of two
groups, picked by two bit ranges of the key (keys are already mixed,
:func:`lightning_sparse.wire.hashing.mix`); a new key goes to the emptier one, or to the other if
smaller keys of its batch filled the first: which keys get in depends on the batch's keys, never
on their order (nor, on a GPU, on the order of the atomics). So a batch of keys is found with one gather of
2 groups per key and one of their slots' keys, with no probe sequence to follow and nothing to
read on the host: the ops and their shapes depend on the batch size only, on CPU and GPU alike.
Removing a key empties its entry (no tombstones, no rebuilds).

The map has ``4 * slots`` entries or more (a quarter full at most; ``16 * slots`` bytes or more,
as the open-addressing map before it): with ``B = 8`` a group holds 2 keys on average, and in
simulations of a million keys under churn never more than 6. A new key
whose two groups are both full anyway is not placed; its owner treats it as having no free slot
(:class:`~lightning_sparse.tables.admission.SlotTable`: a rejection; it is asked again on the next
lookup).

On a GPU (or with ``LIGHTNING_SPARSE_KERNELS=triton``) :meth:`find` and :meth:`write` are one
Triton kernel each and :meth:`reserve` three (:mod:`lightning_sparse.kernels.triton_slots`), with
the same results; the torch versions here are the CPU's and the reference.

Row ``G`` of ``buckets`` is a scratch group and the null slot a scratch slot: writes for the padding entries of a batch land there, so that batches sized by
their bound (a GPU's) need no compaction.

>>> slots = SlotMap(4)
>>> slots.place(torch.tensor([10, -7]), torch.tensor([1, 3])).tolist()
[True, True]
>>> slots.find(torch.tensor([-7, 5, 10])).tolist()
[3, 0, 1]
>>> slots.remove(torch.tensor([3])); slots.find(torch.tensor([-7, 10])).tolist()
[0, 1]
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from lightning_sparse.kernels import gpu_path, uses_triton
from lightning_sparse.kernels.backend import uses_numba
from lightning_sparse.tables.placement import empty_rows

NULL_SLOT = 0  # never a key's: an entry holding it is empty, and padding may write it
RESERVED = -1  # an entry that reserve() handed out and write() has not filled yet
NO_ENTRY = -1  # reserve()'s answer for a key without room
WIDTH = 8  # entries of a group
CHUNK = 8192  # keys a whole-table load places at once


def both(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """``a & b`` of two optional masks (``None``: all true)."""
    return b if a is None else a if b is None else a & b


def select(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """The positions of ``mask``'s true entries, and which of them are real (``None``: all).

    On a CPU: exactly those (``nonzero``). On a GPU's path, without a host read: ``len(mask)``
    positions, those first, then position 0 as padding, and the mask of the real ones.
    """
    if not gpu_path(mask):
        return torch.nonzero(mask).view(-1), None
    index = torch.nonzero_static(mask, size=len(mask), fill_value=0).view(-1)
    return index, torch.arange(len(mask), device=mask.device) < mask.sum()


class SlotMap:
    """Key -> slot for ``num_slots`` slots (slot 0 excluded); each slot holds at most one key, each key at most one slot."""

    def __init__(self, num_slots: int, device: torch.device | str | None = None) -> None:
        self.num_slots = num_slots
        groups = 1 << max(1, (-(-4 * num_slots // WIDTH) - 1).bit_length())
        self.mask = groups - 1
        self.scratch = groups * WIDTH  # the first entry of the scratch group
        self.buckets = empty_rows((groups + 1, WIDTH), torch.int32, device).zero_()  # NULL_SLOT: empty
        self.keys = empty_rows((num_slots,), torch.int64, device).zero_()  # valid where the slot is in use
        self.entry_of = empty_rows((num_slots,), torch.int64, device).fill_(self.scratch)  # scratch: not in use
        self._seen: Tensor | None = None  # marks(), made at its first call

    @property
    def device(self) -> torch.device:
        return self.buckets.device

    def to(self, device: torch.device) -> None:
        """Move the map's tensors to ``device``."""
        self.buckets, self.keys, self.entry_of = (t.to(device) for t in (self.buckets, self.keys, self.entry_of))

    def used(self, slots: Tensor | None = None) -> Tensor:
        """``[num_slots]`` bool: which slots hold a key (or which of ``slots``)."""
        return (self.entry_of if slots is None else self.entry_of.index_select(0, slots)) < self.scratch

    def find(self, keys: Tensor, groups: Tensor | None = None) -> Tensor:
        """The slot of each key (keys may repeat), the null slot where the map does not hold it.

        ``groups``: the keys' :meth:`groups`, where the caller has them (the torch path's; the kernel reads none).
        """
        if uses_triton(self.buckets):
            from lightning_sparse.kernels import triton_slots

            return triton_slots.find(keys, self.buckets, self.keys, self.mask)
        if uses_numba(self.buckets):  # one loop (tables/slot_kernels.py)
            from lightning_sparse.tables import slot_kernels

            return slot_kernels.find(keys, self.buckets, self.keys, self.mask)
        groups = self.groups(keys) if groups is None else groups
        held = self.buckets.index_select(0, groups.view(-1)).view(len(keys), 2 * WIDTH)
        hit = self.keys.index_select(0, held.view(-1)).view_as(held) == keys.unsqueeze(1)
        return (hit * held).sum(dim=1, dtype=torch.int64)  # one hit at most (an empty entry holds the null slot: adds 0)

    def marks(self) -> Tensor:
        """A bool per slot, all false: where a CPU loop marks the slots it stamped (and clears them after)."""
        if self._seen is None or len(self._seen) != self.num_slots:
            self._seen = torch.zeros(self.num_slots, dtype=torch.bool)
        return self._seen

    def groups(self, keys: Tensor) -> Tensor:
        """``[len(keys), 2]``: a key's two groups (never the same one), from its low bits and from bits 32 and up."""
        first = keys & self.mask
        return torch.stack([first, (first + 1 + ((keys >> 32) & (self.mask >> 1))) & self.mask], dim=1)

    def reserve(self, keys: Tensor, valid: Tensor | None = None, *, groups: Tensor | None = None,
                ascending: bool = False) -> Tensor:  # fmt: skip
        """Entries for distinct new ``keys`` (none in the map), marked reserved; ``-1`` where both groups are full.

        Only ``valid`` keys (default: all) get one. A key tries the emptier of its groups first (the
        one holding fewer slots; the first on a tie), then the other; keys that share a group take its
        free entries smallest key first (of equal keys, the earlier), so the entries given depend on
        the batch's keys, not on their order. :meth:`write` fills the entries (or gives them back).
        ``groups`` as for :meth:`find`; ``ascending``: the keys are in ascending order (a sort's), which
        saves the torch path a sort.
        """
        if uses_triton(self.buckets):  # three kernels, the same entries (kernels/triton_slots.py)
            from lightning_sparse.kernels import triton_slots

            return triton_slots.reserve(keys, valid, self.buckets, self.mask)
        if uses_numba(self.buckets):  # one loop, the same entries (tables/slot_kernels.py)
            from lightning_sparse.tables import slot_kernels

            return slot_kernels.reserve(keys, valid, self.buckets, self.mask, ascending)
        n = len(keys)
        groups = self.groups(keys) if groups is None else groups
        held = (self.buckets.index_select(0, groups.view(-1)).view(n, 2, WIDTH) > NULL_SLOT).sum(dim=2)  # slots, not claims
        emptier_second = (held[:, 1] < held[:, 0]).unsqueeze(1)
        choices = torch.where(emptier_second, groups.flip(1), groups).t()  # [2, n]: the emptier group, then the other
        entries, waiting = torch.full_like(keys, NO_ENTRY), valid
        for group in choices:
            claimed = self._claim(group if waiting is None else torch.where(waiting, group, self.mask + 1), keys, ascending)
            entries = torch.maximum(entries, claimed)  # (a key claims in one round at most)
            waiting = both(entries < 0, valid)
            if not gpu_path(waiting) and not bool(waiting.any()):  # a CPU reads for free whether a second round is needed
                break
        return entries

    def _claim(self, group: Tensor, keys: Tensor, ascending: bool) -> Tensor:
        """For ``keys`` bound to ``group`` (the scratch group: none), the next free entries of their groups, smallest key first.

        Marks them reserved; ``-1`` where the group has no free entry left. ``ascending``: the keys are sorted already.
        """
        if ascending:
            group, order = torch.sort(group, stable=True)
        else:
            by_key = torch.sort(keys, stable=True).indices  # equal keys: the earlier first
            group, within = torch.sort(group.index_select(0, by_key), stable=True)
            order = by_key.index_select(0, within)
        rank = torch.arange(len(group), device=group.device) - torch.searchsorted(group, group)  # among its group's keys
        free = self.buckets.index_select(0, group) == NULL_SLOT
        column = (free.cumsum(dim=1) <= rank.unsqueeze(1)).sum(dim=1)  # of the group's (rank + 1)-th free entry
        entry = torch.where((column < WIDTH) & (group <= self.mask), group * WIDTH + column, NO_ENTRY)
        self.buckets.view(-1).index_fill_(0, torch.where(entry >= 0, entry, self.scratch), RESERVED)
        return torch.empty_like(entry).index_copy_(0, order, entry)

    def write(self, entries: Tensor, keys: Tensor, slots: Tensor) -> None:
        """Put ``keys`` in the ``entries`` that :meth:`reserve` gave them, holding ``slots``.

        An entry whose slot is the null slot (a key that got no slot) is given back; ``-1`` entries are skipped.
        """
        if uses_triton(self.buckets):
            from lightning_sparse.kernels import triton_slots

            return triton_slots.write(entries, keys, slots, self.buckets, self.keys, self.entry_of)
        reserved = entries >= 0
        placed = reserved & (slots != NULL_SLOT)
        at = torch.where(reserved, entries, self.scratch)
        self.buckets.view(-1).index_copy_(0, at, slots.to(torch.int32))  # the null slot: the entry is empty again
        slots = slots * placed  # the null slot (0) where not placed
        self.entry_of.index_copy_(0, slots, torch.where(placed, entries, self.scratch))
        self.keys.index_copy_(0, slots, keys)

    def remove(self, slots: Tensor) -> None:
        """Free ``slots`` (distinct, in use, or the null slot as padding): their keys leave the map."""
        self.buckets.view(-1).index_fill_(0, self.entry_of.index_select(0, slots), NULL_SLOT)
        self.entry_of.index_fill_(0, slots, self.scratch)

    def clear(self) -> None:
        """Hold no key."""
        self.buckets.zero_()
        self.entry_of.fill_(self.scratch)

    def place(self, keys: Tensor, slots: Tensor) -> Tensor:
        """:meth:`reserve` and :meth:`write` for a whole table's keys (a checkpoint's), ``CHUNK`` at a time; returns which got in.

        The ``[keys, 2, WIDTH]`` temporaries stay small.
        """
        placed = []
        for start in range(0, len(keys), CHUNK):
            chunk_keys, chunk_slots = keys[start : start + CHUNK], slots[start : start + CHUNK]
            entries = self.reserve(chunk_keys)
            self.write(entries, chunk_keys, chunk_slots)
            placed.append(entries >= 0)
        placed = torch.cat(placed) if placed else torch.ones_like(keys, dtype=torch.bool)
        if not bool(placed.all()):
            warnings.warn(f"{int((~placed).sum())} ids of a checkpoint found no room in the slot map and were dropped.",
                          stacklevel=3)  # fmt: skip
        return placed
