"""The slot map's probes on a CPU as numba loops: one pass over a batch's keys instead of ``[keys, 2, WIDTH]`` tensor ops.

Imported only where :func:`~lightning_sparse.kernels.backend.uses_numba` says so (numba imports, the
tensors are on a CPU that is not on the GPU's path); the torch ops of
:class:`~lightning_sparse.tables.slot_map.SlotMap` stay the reference and the fallback, with the same
results: :func:`find_and_stamp` is ``SlotMap.find`` with ``SlotTable.resolve``'s stamps of last use
and requests, :func:`reserve` is ``SlotMap.reserve`` (its two rounds of claims, smallest key first in
a group, taken one key at a time in key order: the ``k``-th key of a group gets its ``k``-th free
entry, as the torch ops' ranks give it). Kernels are compiled at their first call and cached on disk.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

WIDTH = 8  # entries of a group (slot_map.WIDTH)
RESERVED = -1  # slot_map.RESERVED


@numba.njit(cache=True, nogil=True)
def _groups(key: np.int64, mask: np.int64) -> tuple[np.int64, np.int64]:
    first = key & mask
    return first, (first + 1 + ((key >> 32) & (mask >> 1))) & mask


@numba.njit(cache=True, nogil=True)
def _find_and_stamp(keys, buckets, map_keys, mask, last_used, requests, now, counts, slots, wanting):  # pragma: no cover
    per_key = len(counts) > 1
    missing = 0
    for i in range(len(keys)):
        key = keys[i]
        first, second = _groups(key, mask)
        slot = 0
        for entry in range(WIDTH * 2):  # a key is in one entry at most: stop there
            held = buckets[(first if entry < WIDTH else second) * WIDTH + entry % WIDTH]
            if held > 0 and map_keys[held] == key:
                slot = held
                break
        slots[i] = slot
        count = counts[i] if per_key else counts[0]
        if count > 0:
            if slot > 0:
                last_used[slot] = now
                requests[slot] += count
            else:
                wanting[missing] = i
                missing += 1
    return missing


@numba.njit(cache=True, nogil=True)
def _held(buckets, group) -> int:  # pragma: no cover
    held = 0
    for column in range(WIDTH):
        held += buckets[group * WIDTH + column] > 0
    return held


@numba.njit(cache=True, nogil=True)
def _claim(buckets, group) -> int:  # pragma: no cover
    for column in range(WIDTH):
        entry = group * WIDTH + column
        if buckets[entry] == 0:
            buckets[entry] = RESERVED
            return entry
    return -1


@numba.njit(cache=True, nogil=True)
def _reserve(keys, order, valid, buckets, mask, entries):  # pragma: no cover
    for second_round in (False, True):
        for i in order:
            if not valid[i] or entries[i] >= 0:
                continue
            first, second = _groups(keys[i], mask)
            emptier_second = _held(buckets, second) < _held(buckets, first)  # reservations are not slots: as before round 1
            group = second if emptier_second != second_round else first
            entries[i] = _claim(buckets, group)


@numba.njit(cache=True, nogil=True)
def _place(entries, keys, counts, victims, stack, free, buckets, map_keys, entry_of, last_used, requests, now, slots):
    per_key = len(counts) > 1  # pragma: no cover (compiled)
    rank = 0
    for i in range(len(keys)):
        slots[i] = 0
        if entries[i] < 0:
            continue
        slot = (
            victims[rank] if rank < len(victims) else stack[free - 1 - (rank - len(victims))] if rank - len(victims) < free else 0
        )
        rank += 1
        buckets[entries[i]] = slot  # the null slot: the entry is given back
        if slot > 0:
            slots[i], entry_of[slot], map_keys[slot] = slot, entries[i], keys[i]
            last_used[slot], requests[slot] = now, counts[i] if per_key else counts[0]
    return min(rank, len(victims) + free)


def _numpy(tensor: Tensor) -> np.ndarray:
    return (tensor if tensor.is_contiguous() else tensor.contiguous()).numpy()


def find_and_stamp(keys: Tensor, buckets: Tensor, map_keys: Tensor, mask: int, last_used: Tensor, requests: Tensor,
                   now: int, counts: Tensor | int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The slot of each key (0 where none); where ``counts > 0`` a found slot's last use becomes ``now`` and its
    requests grow by the count. Returns (slots, the positions of keys without a slot whose count is > 0)."""
    per_key = not isinstance(counts, int)
    slots, wanting = np.empty(len(keys), np.int64), np.empty(len(keys), np.int64)
    missing = _find_and_stamp(_numpy(keys.to(torch.int64)), buckets.view(-1).numpy(), map_keys.numpy(), mask,
                              last_used.numpy(), requests.numpy(), now, _numpy(counts.to(torch.int64)) if per_key else
                              np.full(1, counts, np.int64), slots, wanting)  # fmt: skip
    return torch.from_numpy(slots), torch.from_numpy(wanting[:missing])


def reserve(keys: Tensor, valid: Tensor | None, buckets: Tensor, mask: int, ascending: bool) -> Tensor:
    """``SlotMap.reserve``'s entries (``-1``: no room), marked reserved in ``buckets``."""
    order = np.arange(len(keys)) if ascending else torch.sort(keys, stable=True).indices.numpy()
    valid = np.ones(len(keys), np.bool_) if valid is None else _numpy(valid)
    entries = np.full(len(keys), -1, np.int64)
    _reserve(_numpy(keys), order, valid, buckets.view(-1).numpy(), mask, entries)
    return torch.from_numpy(entries)


def place(entries: Tensor, keys: Tensor, counts: Tensor | int, victims: Tensor, stack: Tensor, free: int, buckets: Tensor,
          map_keys: Tensor, entry_of: Tensor, last_used: Tensor, requests: Tensor, now: int) -> tuple[Tensor, int]:  # fmt: skip
    """``SlotTable._take`` and ``SlotMap.write`` for reserved ``entries``: the keys with one take the ``victims``
    (ascending), then free slots from the top of ``stack`` (``free`` of them), in order, while there are any; each
    placed key's slot gets last use ``now`` and its count of requests. Returns (slots, 0 where none; how many got one)."""
    slots = np.empty(len(keys), np.int64)
    counts = np.full(1, counts, np.int64) if isinstance(counts, int) else _numpy(counts.to(torch.int64))
    taken = _place(_numpy(entries), _numpy(keys), counts, _numpy(victims), stack.numpy(), free, buckets.view(-1).numpy(),
                   map_keys.numpy(), entry_of.numpy(), last_used.numpy(), requests.numpy(), now, slots)  # fmt: skip
    return torch.from_numpy(slots), taken
