"""Triton: a dynamic table's slot map, one kernel per batch operation (find, reserve, write), and its ids' keys (mix).

The layout and the plain torch versions are :class:`lightning_sparse.tables.slot_map.SlotMap`'s:
``buckets`` ``[G + 1, WIDTH]`` int32 (the slot in each entry, 0 where empty, -1 where reserved),
``keys`` ``[slots]`` int64, and a key's two groups from its low bits and from bits 32 and up.
A program handles ``BLOCK`` keys and reads each group as a ``[BLOCK, WIDTH]`` tile.

:func:`reserve` claims entries with atomic compare-and-swap, so keys of one batch that share a
group get distinct entries in no fixed order (the torch version takes them in batch order).
Which entry a key sits in is not observable: the slots, and every decision of the table, are
the same either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_sparse.kernels.backend import launches

BLOCK = 128  # keys per program


@triton.jit
def _groups(k, mask):
    first = k & mask
    return first, (first + 1 + ((k >> 32) & (mask >> 1))) & mask


@triton.jit
def _find_in(group, k, inside, buckets, keys, WIDTH: tl.constexpr):
    cols = tl.arange(0, WIDTH)
    held = tl.load(buckets + group[:, None] * WIDTH + cols[None, :], mask=inside[:, None], other=0).to(tl.int64)
    held_keys = tl.load(keys + held, mask=inside[:, None] & (held > 0), other=0)
    return tl.sum(tl.where((held > 0) & (held_keys == k[:, None]), held, 0), axis=1)


@triton.jit
def find_slots(query, n, buckets, keys, mask, out, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """``out[i]``: the slot that holds ``query[i]``, 0 where none."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = p < n
    k = tl.load(query + p, mask=inside, other=0)
    first, second = _groups(k, mask)
    found = _find_in(first, k, inside, buckets, keys, WIDTH) + _find_in(second, k, inside, buckets, keys, WIDTH)
    tl.store(out + p, found, mask=inside)


@triton.jit
def _held(group, inside, buckets, WIDTH: tl.constexpr):
    cols = tl.arange(0, WIDTH)
    return tl.sum(
        (tl.load(buckets + group[:, None] * WIDTH + cols[None, :], mask=inside[:, None], other=0) != 0).to(tl.int32), axis=1
    )


@triton.jit
def _claim_in(group, waiting, entry, buckets, WIDTH: tl.constexpr):
    for j in tl.static_range(WIDTH):  # the group's entries in turn: an empty one becomes reserved (-1) for one key
        # A block with no key waiting stops: an atomic takes no mask, and the padding of a batch (one key, one group,
        # whole blocks of it) would queue on the same entries. On an H100 that cost 672 us of a 1.6 ms dynamic step.
        if tl.max(waiting.to(tl.int32), axis=0) > 0:
            at = group * WIDTH + j
            expected = tl.where(waiting, 0, -7).to(tl.int32)  # -7: no entry holds it, so a key not waiting writes nothing
            old = tl.atomic_cas(buckets + at, expected, tl.full(expected.shape, -1, tl.int32))
            won = waiting & (old == 0)
            entry = tl.where(won, at, entry)
            waiting = waiting & (old != 0)
    return entry, waiting


@triton.jit
def reserve_entries(new, valid, n, buckets, mask, out, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """``out[i]``: an empty entry now reserved for ``new[i]``, in the emptier of its groups first; -1 if both are full."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = p < n
    k = tl.load(new + p, mask=inside, other=0)
    waiting = inside
    if HAS_VALID:
        waiting = waiting & (tl.load(valid + p, mask=inside, other=0) != 0)
    first, second = _groups(k, mask)
    second_first = _held(second, inside, buckets, WIDTH) < _held(first, inside, buckets, WIDTH)
    entry = tl.full([BLOCK], -1, tl.int64)
    entry, waiting = _claim_in(tl.where(second_first, second, first), waiting, entry, buckets, WIDTH)
    entry, waiting = _claim_in(tl.where(second_first, first, second), waiting, entry, buckets, WIDTH)
    tl.store(out + p, entry, mask=inside)


@triton.jit
def write_entries(entries, new, slots, n, buckets, keys, entry_of, BLOCK: tl.constexpr):
    """Entry ``entries[i]`` (skipped if -1) holds ``slots[i]`` (0: empty again); a slot other than 0 learns its key and entry."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = p < n
    entry = tl.load(entries + p, mask=inside, other=-1)
    slot = tl.load(slots + p, mask=inside, other=0)
    has = inside & (entry >= 0)
    tl.store(buckets + entry, slot.to(tl.int32), mask=has)
    placed = has & (slot != 0)
    tl.store(entry_of + slot, entry, mask=placed)
    tl.store(keys + slot, tl.load(new + p, mask=placed, other=0), mask=placed)


@triton.jit
def mix_keys(ids, n, out, m1, m2, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i]``: the key of ``ids[i]`` (lightning_sparse.wire.hashing.mix, op for op: logical shifts, wrapping products)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = p < n
    x = tl.load(ids + p, mask=inside, other=0).to(tl.int64)
    x = (x ^ ((x >> S1) & ((1 << (64 - S1)) - 1))) * m1
    x = (x ^ ((x >> S2) & ((1 << (64 - S2)) - 1))) * m2
    tl.store(out + p, x ^ ((x >> S3) & ((1 << (64 - S3)) - 1)), mask=inside)


def mix(ids: Tensor, shifts: tuple[int, int, int], multipliers: tuple[int, int]) -> Tensor:
    """:func:`lightning_sparse.wire.hashing.mix` of ``ids`` (int64 keys) in one launch."""
    out = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
    if ids.numel():
        with launches.launch(ids.device):
            mix_keys[_grid(ids.numel())](ids, ids.numel(), out, *multipliers, S1=shifts[0], S2=shifts[1], S3=shifts[2],
                                         BLOCK=BLOCK)  # fmt: skip
    return out


def _grid(n: int) -> tuple[int]:
    return (-(-n // BLOCK),)


def find(query: Tensor, buckets: Tensor, keys: Tensor, mask: int) -> Tensor:
    """The slot of each of ``query`` (int64), 0 where the map does not hold it. One launch, no host read."""
    out = torch.empty_like(query)
    if len(query):
        with launches.launch(query.device):
            find_slots[_grid(len(query))](query, len(query), buckets, keys, mask, out, BLOCK=BLOCK, WIDTH=buckets.shape[1])
    return out


def reserve(new: Tensor, valid: Tensor | None, buckets: Tensor, mask: int) -> Tensor:
    """A reserved entry for each ``valid`` key of ``new`` (distinct, none in the map), -1 where none. One launch."""
    out = torch.empty_like(new)
    if len(new):
        with launches.launch(new.device):
            reserve_entries[_grid(len(new))](new, valid if valid is not None else new, len(new), buckets, mask, out,
                                             HAS_VALID=valid is not None, BLOCK=BLOCK, WIDTH=buckets.shape[1])  # fmt: skip
    return out


def write(entries: Tensor, new: Tensor, slots: Tensor, buckets: Tensor, keys: Tensor, entry_of: Tensor) -> None:
    """Fill the ``entries`` that :func:`reserve` gave (see :func:`write_entries`). One launch."""
    if len(entries):
        with launches.launch(entries.device):
            write_entries[_grid(len(entries))](entries, new, slots, len(entries), buckets, keys, entry_of, BLOCK=BLOCK)
