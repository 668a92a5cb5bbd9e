"""Triton: a dynamic table's slot map, one kernel per batch operation (find, reserve, write), and its ids' keys (mix).

The layout and the plain torch versions are :class:`lightning_sparse.tables.slot_map.SlotMap`'s:
``buckets`` ``[G + 1, WIDTH]`` int32 (the slot in each entry, 0 where empty, -1 where reserved),
``keys`` ``[slots]`` int64, and a key's two groups from its low bits and from bits 32 and up.
A program handles ``BLOCK`` keys and reads each group as a ``[BLOCK, WIDTH]`` tile.

:func:`reserve` claims entries with atomic compare-and-swap in two rounds (a key's emptier group,
then its other one), three launches, and makes the torch version's decisions: in each round the
keys that share a group take its empty entries smallest key first, whatever the order of the
batch or of the atomics (a GPU's is unspecified). A claim is a mark in the entry (the claimant's
position in the batch); a better claim displaces a worse one, which moves on to the next entry
(see ``_insert``), so each group's empty entries end with its best claims whichever came first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_sparse.kernels.backend import launches

BLOCK = 128  # keys per program
# A claim on an entry is marked by the claimant's position in the batch (see _claim): int32 marks hold 2**30 positions.
MAX_BATCH = 2**30
NO_CLAIM = tl.constexpr(-(2**31))  # no entry holds it: a compare-and-swap expecting it writes nothing (an atomic takes no mask)


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
    """Entries of ``group`` that hold a slot (claims and reservations are not counted: a claim never changes the count)."""
    cols = tl.arange(0, WIDTH)
    return tl.sum((tl.load(buckets + group[:, None] * WIDTH + cols[None, :], mask=inside[:, None], other=0) > 0).to(tl.int32),
                  axis=1)  # fmt: skip


@triton.jit
def _choices(k, inside, buckets, mask, WIDTH: tl.constexpr):
    """A key's groups in the order it tries them: the emptier first (the first on a tie)."""
    first, second = _groups(k, mask)
    second_first = _held(second, inside, buckets, WIDTH) < _held(first, inside, buckets, WIDTH)
    return tl.where(second_first, second, first), tl.where(second_first, first, second)


@triton.jit
def _claim(position, ROUND: tl.constexpr):
    """The mark of a claim on an entry by the key at ``position`` in round ``ROUND``: -2, -4, ... (1) or -3, -5, ... (2)."""
    return (-2 * position - 1 - ROUND).to(tl.int32)


@triton.jit
def _insert(group, going, position, new, buckets, ROUND: tl.constexpr, WIDTH: tl.constexpr):
    """Round ``ROUND``'s claims on the empty entries of ``group`` by the lanes ``going``, whatever their order.

    A lane carries a claim through the group's entries: an empty entry takes it; an entry claimed
    in this round by a key of lower priority (a larger key; of equal keys, the later position) takes
    it and the lane carries that claim on instead; any other entry is passed. So each entry ends with
    the best claim that reached it, the rest go on, and the empty entries of a group end holding its
    best claims in order, however the claims met (``tests/test_dynamic_gpu_path.py`` permutes batches).
    """
    carry = position
    for j in tl.static_range(WIDTH):
        # A block with no claim going stops: an atomic takes no mask, and the padding of a batch (one key, one group, whole
        # blocks of it) would queue on the same entries. On an H100 that cost 672 us of a 1.6 ms dynamic step.
        if tl.max(going.to(tl.int32), axis=0) > 0:
            at = group * WIDTH + j
            here, expected = going, tl.zeros_like(carry)
            while tl.max(here.to(tl.int32), axis=0) > 0:
                old = tl.atomic_cas(buckets + at, tl.where(here, expected, NO_CLAIM), _claim(carry, ROUND))
                swapped = here & (old == expected)
                rival = here & (old <= -2) & ((-old - 1 - ROUND) % 2 == 0)  # a claim of this round
                other = (-old - 1 - ROUND) // 2  # its position
                key, rival_key = tl.load(new + carry, mask=here, other=0), tl.load(new + other, mask=rival, other=0)
                better = (key < rival_key) | ((key == rival_key) & (carry < other))
                going = going & ~(swapped & (expected == 0))  # parked in an empty entry
                carry = tl.where(swapped & (expected != 0), (-expected - 1 - ROUND) // 2, carry)  # displaced: carry it on
                retry = ~swapped & ((old == 0) | (rival & better))
                expected = tl.where(retry, old, expected)
                here = here & retry


@triton.jit
def _claimed(group, position, inside, buckets, ROUND: tl.constexpr, WIDTH: tl.constexpr):
    """The entry of ``group`` that holds round ``ROUND``'s claim of the key at ``position``, -1 if none does."""
    cols = tl.arange(0, WIDTH)
    at = group[:, None] * WIDTH + cols[None, :]
    held = tl.load(buckets + at, mask=inside[:, None], other=0)
    return tl.max(tl.where(inside[:, None] & (held == _claim(position, ROUND)[:, None]), at, -1), axis=1).to(tl.int64)


@triton.jit
def _waiting(new, valid, n, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = p < n
    waiting = inside
    if HAS_VALID:
        waiting = waiting & (tl.load(valid + p, mask=inside, other=0) != 0)
    return p, inside, waiting, tl.load(new + p, mask=inside, other=0)


@triton.jit
def claim_first(new, valid, n, buckets, mask, out, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """Round 1 of :func:`reserve`: each waiting key claims in the emptier of its groups; ``out`` is -1 throughout."""
    p, inside, waiting, k = _waiting(new, valid, n, HAS_VALID, BLOCK)
    tl.store(out + p, tl.full([BLOCK], -1, tl.int64), mask=inside)
    first, _ = _choices(k, inside, buckets, mask, WIDTH)
    _insert(first, waiting, p, new, buckets, 1, WIDTH)


@triton.jit
def claim_second(new, valid, n, buckets, mask, out, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """Round 2: a key whose round-1 claim held takes its entry (reserved); the others claim in their other group."""
    p, inside, waiting, k = _waiting(new, valid, n, HAS_VALID, BLOCK)
    first, second = _choices(k, inside, buckets, mask, WIDTH)  # the same as round 1's: claims are not counted
    entry = _claimed(first, p, waiting, buckets, 1, WIDTH)
    won = waiting & (entry >= 0)
    tl.store(out + p, entry, mask=won)
    tl.store(buckets + entry, tl.full([BLOCK], -1, tl.int32), mask=won)
    _insert(second, waiting & ~won, p, new, buckets, 2, WIDTH)


@triton.jit
def claim_settle(new, valid, n, buckets, mask, out, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """After round 2: a key whose round-2 claim held takes its entry (reserved)."""
    p, inside, waiting, k = _waiting(new, valid, n, HAS_VALID, BLOCK)
    _, second = _choices(k, inside, buckets, mask, WIDTH)
    pending = waiting & (tl.load(out + p, mask=inside, other=0) < 0)
    entry = _claimed(second, p, pending, buckets, 2, WIDTH)
    won = pending & (entry >= 0)
    tl.store(out + p, entry, mask=won)
    tl.store(buckets + entry, tl.full([BLOCK], -1, tl.int32), mask=won)


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
    """A reserved entry for each ``valid`` key of ``new`` (distinct, none in the map), -1 where none. Three launches.

    The same entries as the torch version (:meth:`lightning_sparse.tables.slot_map.SlotMap.reserve`),
    whatever the order of the batch or of the claims.
    """
    out = torch.empty_like(new)
    if len(new):
        if len(new) > MAX_BATCH:
            raise ValueError(f"A batch of {len(new)} new keys for the slot map. HINT: reserve at most {MAX_BATCH} at once.")
        for kernel in (claim_first, claim_second, claim_settle):
            with launches.launch(new.device):
                kernel[_grid(len(new))](new, valid if valid is not None else new, len(new), buckets, mask, out,
                                        HAS_VALID=valid is not None, BLOCK=BLOCK, WIDTH=buckets.shape[1])  # fmt: skip
    return out


def write(entries: Tensor, new: Tensor, slots: Tensor, buckets: Tensor, keys: Tensor, entry_of: Tensor) -> None:
    """Fill the ``entries`` that :func:`reserve` gave (see :func:`write_entries`). One launch."""
    if len(entries):
        with launches.launch(entries.device):
            write_entries[_grid(len(entries))](entries, new, slots, len(entries), buckets, keys, entry_of, BLOCK=BLOCK)
