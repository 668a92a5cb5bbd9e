"""A dynamic table's slot map on a CPU as numba loops: one pass over a batch instead of ``[keys, 2, WIDTH]`` tensor ops.

Imported only where :func:`~lightning_sparse.kernels.backend.uses_numba` says so (numba imports, the
tensors are on a CPU that is not on the GPU's path); the torch ops of
:class:`~lightning_sparse.tables.slot_map.SlotMap` and :class:`~lightning_sparse.tables.admission.SlotTable`
stay the reference and the fallback, with the same results:

* :func:`find` is ``SlotMap.find``;
* :func:`lookup_ids` is ``mix``, then ``find`` of each id with ``SlotTable.resolve``'s stamps of last use and
  requests, once per distinct id found: a one-process lookup needs no sort of its ids
  (``SlotTable.resolve_ids``);
* :func:`reserve` is ``SlotMap.reserve``: its two rounds of claims, taken one key at a time in key order
  (equal keys: the earlier first), so the ``k``-th key of a group gets its ``k``-th free entry, as the
  torch ops' ranks give it;
* :func:`place` is ``SlotTable._take`` (victims first, then the free stack from the top) with ``SlotMap.write``.

Kernels are compiled at their first call and cached on disk (numba's ``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from lightning_sparse.kernels.backend import compiled_call
from lightning_sparse.wire.hashing import MIX_MULTIPLIERS, MIX_SHIFTS

WIDTH = 8  # entries of a group (slot_map.WIDTH)
RESERVED = -1  # slot_map.RESERVED
_S0, _S1, _S2 = (np.uint64(shift) for shift in MIX_SHIFTS)
_M0, _M1 = (np.uint64(multiplier) for multiplier in MIX_MULTIPLIERS)


@numba.njit(cache=True, nogil=True)
def _groups(key: np.int64, mask: np.int64) -> tuple[np.int64, np.int64]:
    first = key & mask
    return first, (first + 1 + ((key >> 32) & (mask >> 1))) & mask


@numba.njit(cache=True, nogil=True)
def _slot_of(key, buckets, map_keys, mask):  # pragma: no cover
    """The slot that holds ``key`` (0: none): a key is in one entry of its two groups at most (stop there)."""
    first, second = _groups(key, mask)
    for entry in range(WIDTH * 2):
        held = buckets[(first if entry < WIDTH else second) * WIDTH + entry % WIDTH]
        if held > 0 and map_keys[held] == key:
            return held
    return 0


@numba.njit(cache=True, nogil=True)
def _find(keys, buckets, map_keys, mask, slots):  # pragma: no cover
    for i in range(len(keys)):
        slots[i] = _slot_of(keys[i], buckets, map_keys, mask)


@numba.njit(cache=True, nogil=True)
def _lookup_ids(ids, buckets, map_keys, mask, last_used, requests, now, count, seen, slots, keys, missing):  # pragma: no cover
    """Per id: its key (``mix``), its slot (0: none); each distinct id found is stamped once (``seen`` marks the slots
    stamped by this call and is cleared again); the positions of ids without a slot go to ``missing``."""
    misses = stamped = 0
    for i in range(len(ids)):
        x = ids[i]
        x = (x ^ (x >> _S0)) * _M0
        x = (x ^ (x >> _S1)) * _M1
        key = np.int64(x ^ (x >> _S2))
        keys[i] = key
        slot = _slot_of(key, buckets, map_keys, mask)
        slots[i] = slot
        if slot == 0:
            missing[misses] = i
            misses += 1
        elif count > 0 and not seen[slot]:
            seen[slot] = True
            last_used[slot] = now
            requests[slot] += count
            stamped += 1
    if stamped:
        for i in range(len(ids)):
            seen[slots[i]] = False
    return misses


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


def find(keys: Tensor, buckets: Tensor, map_keys: Tensor, mask: int) -> Tensor:
    """``SlotMap.find``: the slot of each key (0 where none)."""
    slots = np.empty(len(keys), np.int64)
    compiled_call(_find, _numpy(keys.to(torch.int64)), buckets.view(-1).numpy(), map_keys.numpy(), mask, slots)
    return torch.from_numpy(slots)


def reserve(keys: Tensor, valid: Tensor | None, buckets: Tensor, mask: int, ascending: bool) -> Tensor:
    """``SlotMap.reserve``'s entries (``-1``: no room), marked reserved in ``buckets``."""
    order = np.arange(len(keys)) if ascending else torch.sort(keys, stable=True).indices.numpy()
    valid = np.ones(len(keys), np.bool_) if valid is None else _numpy(valid)
    entries = np.full(len(keys), -1, np.int64)
    compiled_call(_reserve, _numpy(keys), order, valid, buckets.view(-1).numpy(), mask, entries)
    return torch.from_numpy(entries)


def place(entries: Tensor, keys: Tensor, counts: Tensor | int, victims: Tensor, stack: Tensor, free: int, buckets: Tensor,
          map_keys: Tensor, entry_of: Tensor, last_used: Tensor, requests: Tensor, now: int) -> tuple[Tensor, int]:  # fmt: skip
    """``SlotTable._take`` and ``SlotMap.write`` for reserved ``entries``: the keys with one take the ``victims``
    (ascending), then free slots from the top of ``stack`` (``free`` of them), in order, while there are any; each
    placed key's slot gets last use ``now`` and its count of requests. Returns (slots, 0 where none; how many got one)."""
    slots = np.empty(len(keys), np.int64)
    counts = np.full(1, counts, np.int64) if isinstance(counts, int) else _numpy(counts.to(torch.int64))
    taken = compiled_call(_place, _numpy(entries), _numpy(keys), counts, _numpy(victims), stack.numpy(), free, buckets.view(-1).numpy(),
                   map_keys.numpy(), entry_of.numpy(), last_used.numpy(), requests.numpy(), now, slots)  # fmt: skip
    return torch.from_numpy(slots), taken


def lookup_ids(ids: Tensor, buckets: Tensor, map_keys: Tensor, mask: int, last_used: Tensor, requests: Tensor, now: int,
               count: int, seen: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Per id (int64, may repeat): its slot (0: none), stamping each distinct found id once with ``count`` requests.

    Returns (slots, keys: ``mix(ids)``, the positions of the ids without a slot). ``seen``: a bool per slot, all false.
    """
    ids = ids.to(torch.int64)
    slots, keys, missing = (np.empty(len(ids), np.int64) for _ in range(3))
    misses = compiled_call(_lookup_ids, _numpy(ids).view(np.uint64), buckets.view(-1).numpy(), map_keys.numpy(), mask, last_used.numpy(),
                         requests.numpy(), now, count, seen.numpy(), slots, keys, missing)  # fmt: skip
    return torch.from_numpy(slots), torch.from_numpy(keys), torch.from_numpy(missing[:misses])
