"""A dynamic table's slot map on a CPU as numba loops: one pass over a batch instead of ``[keys, 2, WIDTH]`` tensor ops.

Imported only where :func:`~lightning_sparse.kernels.backend.uses_numba` says so (numba imports, the
tensors are on a CPU that is not on the GPU's path); the torch ops of
:class:`~lightning_sparse.tables.slot_map.SlotMap` and :class:`~lightning_sparse.tables.admission.SlotTable`
stay the reference and the fallback, with the same results:

* :func:`find` is ``SlotMap.find``;
* :class:`IdBatch` is ``SlotTable.resolve`` of raw ids that may repeat, in one loop: ``mix``, then ``find`` of
  each id with the stamps of last use and requests, once per distinct id found; the distinct ids without a slot in
  ascending order of their keys (a sort of those only); their :func:`reserve` and :func:`place`. A one-process
  lookup needs no sort of its ids and no tensor op around the loop (``SlotTable.resolve_ids``);
* :func:`reserve` is ``SlotMap.reserve``: its two rounds of claims, taken one key at a time in key order
  (equal keys: the earlier first), so the ``k``-th key of a group gets its ``k``-th free entry, as the
  torch ops' ranks give it;
* :func:`place` is ``SlotTable._take`` (victims first, then the free stack from the top) with ``SlotMap.write``.

Kernels are compiled at their first call and cached on disk (numba's ``cache=True``).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.extending import intrinsic
from torch import Tensor

from lightning_sparse.kernels.backend import compiled_call
from lightning_sparse.tables.free_slots import ADMISSIONS, REJECTIONS
from lightning_sparse.wire.hashing import MIX_MULTIPLIERS, MIX_SHIFTS

WIDTH = 8  # entries of a group (slot_map.WIDTH)
RESERVED = -1  # slot_map.RESERVED
AHEAD = 16  # ids between the one whose groups are asked for and the one probed (the probes wait on memory, not compute)
_S0, _S1, _S2 = (np.uint64(shift) for shift in MIX_SHIFTS)
_M0, _M1 = (np.uint64(multiplier) for multiplier in MIX_MULTIPLIERS)


@intrinsic
def _prefetch(typingctx, array, index):  # noqa: ANN001, ANN202 (numba's intrinsic protocol)
    """A hint to bring ``array[index]``'s cache line in (LLVM's ``prefetch``: a read, kept in every level); no result."""

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte = ir.IntType(8).as_pointer()
        hint = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [byte, *[ir.IntType(32)] * 3])
        )
        builder.call(
            hint, [builder.bitcast(builder.gep(data, [args[1]]), byte), *(ir.Constant(ir.IntType(32), v) for v in (0, 3, 1))]
        )
        return context.get_dummy_value()

    return numba.types.void(array, index), codegen


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
    for i in range(len(ids)):
        x = ids[i]
        x = (x ^ (x >> _S0)) * _M0
        x = (x ^ (x >> _S1)) * _M1
        keys[i] = np.int64(x ^ (x >> _S2))
    misses = stamped = 0
    for ahead in range(len(ids) + AHEAD):
        if ahead < len(ids):  # the groups of the id AHEAD places on start coming into the cache while this one is probed
            first, second = _groups(keys[ahead], mask)
            _prefetch(buckets, first * WIDTH)
            _prefetch(buckets, second * WIDTH)
        i = ahead - AHEAD
        if i < 0:
            continue
        slot = _slot_of(keys[i], buckets, map_keys, mask)
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


@numba.njit(cache=True, nogil=True)
def _distinct(keys, missing, new_keys, new_at, inverse):  # pragma: no cover
    """The distinct keys of the ids at ``missing``, ascending, each with its first id's position (``np.unique``'s)."""
    distinct = 0
    for j in np.argsort(keys[missing], kind="mergesort"):  # stable: of equal keys, the earliest id first
        key = keys[missing[j]]
        if distinct == 0 or new_keys[distinct - 1] != key:
            new_keys[distinct], new_at[distinct] = key, missing[j]
            distinct += 1
        inverse[j] = distinct - 1
    return distinct


# The rows of an IdBatch's work array: per id, then per distinct new key.
SLOTS, KEYS, MISSING, INVERSE, NEW_KEYS, NEW_AT, ENTRIES, GIVEN, NEW_SLOTS, NEW_IDS = range(10)


@numba.njit(cache=True, nogil=True)
def _finish(ids, work, misses, distinct):  # pragma: no cover
    """Each missing id gets its key's slot (``GIVEN``); returns how many keys got one, their slots and ids compacted."""
    for j in range(misses):
        work[SLOTS, work[MISSING, j]] = work[GIVEN, work[INVERSE, j]]
    placed = 0
    for d in range(distinct):
        if work[GIVEN, d] > 0:
            work[NEW_SLOTS, placed], work[NEW_IDS, placed] = work[GIVEN, d], ids[work[NEW_AT, d]]
            placed += 1
    return placed


@numba.njit(cache=True, nogil=True)
def _resolve_ids(
    ids, work, buckets, map_keys, entry_of, mask, last_used, requests, now, count, seen, stack, free, admit, counters
):  # pragma: no cover
    """Returns (ids without a slot, their distinct keys, new slots placed: -1 where the caller admits the keys)."""
    slots, keys, missing, new_keys, entries = work[SLOTS], work[KEYS], work[MISSING], work[NEW_KEYS], work[ENTRIES]
    misses = _lookup_ids(
        ids.view(np.uint64), buckets, map_keys, mask, last_used, requests, now, count, seen, slots, keys, missing
    )
    if count == 0 or misses == 0:
        return misses, 0, 0
    distinct = _distinct(keys, missing[:misses], new_keys, work[NEW_AT], work[INVERSE])
    if not admit:  # a count sketch decides which keys to admit first
        return misses, distinct, -1
    entries[:distinct] = -1
    _reserve(new_keys[:distinct], np.arange(distinct), np.ones(distinct, np.bool_), buckets, mask, entries[:distinct])
    if (entries[:distinct] >= 0).sum() > free:  # some must evict: the caller takes its victims first
        return misses, distinct, -1
    taken = _place(entries[:distinct], new_keys[:distinct], np.full(1, count), new_keys[:0], stack, free, buckets, map_keys,
                   entry_of, last_used, requests, now, work[GIVEN, :distinct])  # fmt: skip
    counters[ADMISSIONS], counters[REJECTIONS] = counters[ADMISSIONS] + taken, counters[REJECTIONS] + distinct - taken
    return misses, distinct, _finish(ids, work, misses, distinct)


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


class IdBatch:
    """``SlotTable.resolve`` of raw ids (int64, they may repeat) in one loop: :meth:`resolve`, then :meth:`result`.

    Where the loop cannot admit the new keys itself (a count sketch decides first, or the free slots run short and
    the eviction policy picks victims), :meth:`resolve` stops with the distinct new keys (:meth:`keys_to_admit`,
    ascending) and their reserved entries, if any; the caller admits them and hands their slots to :meth:`finish`.
    """

    def __init__(self, ids: Tensor) -> None:
        self.ids = _numpy(ids.to(torch.int64))
        self.work = np.empty((10, len(ids)), np.int64)  # rows SLOTS ... NEW_IDS
        self.misses = self.distinct = self.placed = 0
        self.admit = False

    def resolve(self, table: Any, count: int, admit: bool) -> bool:
        """Find each id's slot in ``table`` (a ``SlotTable``), stamping found ids once with ``count`` requests; with ``admit``, reserve
        entries for the new keys and give them the table's free slots while they suffice. Returns whether that is done."""
        self.admit, slot_map, free = admit, table.map, table.free
        self.misses, self.distinct, self.placed = compiled_call(
            _resolve_ids, self.ids, self.work, slot_map.buckets.view(-1).numpy(), slot_map.keys.numpy(),
            slot_map.entry_of.numpy(), slot_map.mask, table.last_used.numpy(), table.requests.numpy(), int(table.now), count,
            slot_map.marks().numpy(), free.stack.numpy(), int(free.count), admit, table.counters.numpy(),
        )  # fmt: skip
        return self.placed >= 0

    def keys_to_admit(self) -> Tensor:
        """The distinct keys of the ids without a slot, ascending, that :meth:`resolve` left to the caller."""
        return torch.from_numpy(self.work[NEW_KEYS, : self.distinct])

    def reserved(self) -> Tensor | None:
        """The entries :meth:`resolve` reserved for :meth:`keys_to_admit` (``-1``: no room); ``None`` if it reserved none."""
        return torch.from_numpy(self.work[ENTRIES, : self.distinct]) if self.admit else None

    def finish(self, given: Tensor) -> None:
        """The slots the caller gave :meth:`keys_to_admit` (the null slot where none)."""
        self.work[GIVEN, : self.distinct] = given.numpy()
        self.placed = compiled_call(_finish, self.ids, self.work, self.misses, self.distinct)

    def result(self) -> tuple[Tensor, Tensor, Tensor]:
        """(the slot of each id, the slots given to new ids, their ids)."""
        slots, new_slots, new_ids = self.work[SLOTS], self.work[NEW_SLOTS, : self.placed], self.work[NEW_IDS, : self.placed]
        return torch.from_numpy(slots), torch.from_numpy(new_slots), torch.from_numpy(new_ids)
