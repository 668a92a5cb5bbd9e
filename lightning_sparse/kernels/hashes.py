"""The counter-based hash every random row comes from: initial rows and the draws of stochastic rounding.

Element ``(row, column)`` of a draw is a pure function of ``(seed, global row, column)``, so a row
gets the same values whichever rank computes it, on a CPU or a GPU. :func:`hashes` is the plain
torch implementation; the Triton kernels hash alike (``triton_update.hash_bits``: the update's
rounding noise, and the new rows of ``triton_rows.normal_rows``), with :data:`ROW_MULTIPLIER`
and :func:`seed_salt` from here.

>>> hashes(torch.tensor([3]), 2, seed=7).shape
torch.Size([1, 1, 2])
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _hash32(x: int) -> int:
    """Chris Wellons' ``lowbias32`` integer hash of a 32-bit value."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _hash32_(x: Tensor) -> Tensor:
    """:func:`_hash32` in place on int32 tensors holding the values' 32 bits.

    int32 shifts and multiplies wrap and vectorize (int64 right shifts do not, on AVX2): a right
    shift is arithmetic, so its copies of the sign bit are masked off.
    """
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x ^= (x >> shift).bitwise_and_((1 << (32 - shift)) - 1)
        x.mul_(_int32(multiplier))
    x ^= (x >> 16).bitwise_and_(0xFFFF)
    return x


def _int32(value: int) -> int:
    """A 32-bit pattern as the int32 that holds it."""
    return value - (1 << 32) if value >= 1 << 31 else value


def hashes(global_ids: Tensor, columns: int, seed: int, blocks: int = 1) -> Tensor:
    """int32 ``[blocks, rows, columns]`` of 32 random bits each: a pure function of (seed, row, block * columns + column).

    A row's key folds the 64-bit product of its id with an odd constant (plus the seed's salt)
    to 32 bits; element ``(r, c)`` is the ``lowbias32`` hash of the row's key plus ``c`` times the
    golden ratio. Few tensor ops, in int32 in place (a row of a DynamicEmbedding is initialized as
    its id arrives, so this is on the training path).
    """
    x = global_ids.to(torch.int64).view(-1, 1) * ROW_MULTIPLIER + seed_salt(seed)
    row_keys = (x ^ (x >> 32)).to(torch.int32)  # low ^ high 32 bits (the shift's sign copies fall outside them)
    cols = torch.arange(blocks * columns, dtype=torch.int32, device=x.device).mul_(COLUMN_MULTIPLIER)
    return _hash32_(row_keys + cols.view(blocks, 1, columns))


def seed_salt(seed: int) -> int:
    """The int64 that :func:`hashes` adds to ``id * ROW_MULTIPLIER`` for ``seed`` (the Triton kernels hash alike)."""
    return _signed64(_hash32(seed & _MASK32) << 32 | _hash32((seed >> 32) & _MASK32 ^ 0x5BD1E995))


def _signed64(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


# The odd constants of :func:`hashes` (the golden ratio's bits), as the signed ints that hold them.
ROW_MULTIPLIER = _signed64(0x9E3779B97F4A7C15)
COLUMN_MULTIPLIER = _int32(0x9E3779B9)
