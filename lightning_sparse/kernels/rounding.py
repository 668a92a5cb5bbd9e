"""Half-precision tables: updates computed in float32, written back with stochastic rounding.

A table may keep its rows in ``torch.bfloat16`` or ``torch.float16`` (half the memory of
float32); its optimizer state stays float32 and each update is computed in float32. Writing
``row + delta`` back by rounding to the nearest half value loses every step smaller than half
the spacing of half values around the row (2**-9 of the row's magnitude in bf16): with a small
learning rate the rows stop moving. Stochastic rounding writes the neighbour above ``x`` with
probability ``(x - below) / (above - below)`` and the one below otherwise, so a row moves by
``delta`` on average, however small.

The random draw for element ``(row, column)`` at the table's ``n``-th optimizer step is a hash of
(the table's seed, ``n``, the row's global id, the column), as for :mod:`lightning_sparse.tables.init`:
a run is reproducible, and the same on any number of ranks.

>>> x = torch.full((100_000,), 1.0 + 2**-10)       # an eighth of the way from 1 to the next bf16 value
>>> noise = torch.randint(0, 2**16, (100_000,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
>>> rounded = stochastic_round(x, torch.bfloat16, noise)
>>> round(rounded.float().mean().item() - 1.0, 4), sorted(set(rounded.float().tolist()))
(0.001, [1.0, 1.0078125])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from lightning_sparse.kernels.rows import copy_rows, hashes, seed_salt


class GlobalRows(Protocol):
    """Where a table's rows live (:class:`~lightning_sparse.wire.sharding.RowSharding` is one): what the draws need of it."""

    @property
    def block_size(self) -> int: ...
    def global_of_key(self, keys: Tensor) -> Tensor: ...


HALF = (torch.float16, torch.bfloat16)
_SALT = 0x5851F42D4C957F2D  # keeps rounding draws apart from the init's (same hash, other seeds)

# Writes float32 rows into a table: ``write(rows, values)`` (local row indices, ``[rows, dim]`` float32).
RowWriter = Callable[[Tensor, Tensor], None]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a table's updates and optimizer state use: float32 for half tables, else the table's."""
    return torch.float32 if dtype in HALF else dtype


def stochastic_round(x: Tensor, dtype: torch.dtype, noise: Tensor) -> Tensor:
    """``x`` (float32) as ``dtype``: the neighbour on the far side of the nearest value with probability of the remainder.

    ``noise`` (int32 like ``x``, uniform in ``[0, 2**16)``) decides. Values that are
    representable stay exact; infinities and NaN round as ``x.to(dtype)`` does. bf16 is float32's
    upper half: adding the noise to the bits and cutting the lower 16 rounds the magnitude up
    with just that probability (a value past bf16's largest may round to infinity).
    """
    if dtype == torch.bfloat16 and x.dtype == torch.float32:
        return (x.view(torch.int32) + noise).bitwise_and_(-65536).view(torch.float32).to(dtype)  # -65536: 0xFFFF0000
    nearest = x.to(dtype)
    back = nearest.to(x.dtype)
    other = torch.nextafter(nearest, torch.where(x > back, math.inf, -math.inf).to(dtype))  # the neighbour on x's side
    share = (x - back).div_(other.to(x.dtype) - back)  # how far x is from ``nearest`` toward ``other``, in [0, 0.5]
    return torch.where(noise.to(x.dtype).mul_(2.0**-16) < share, other, nearest)


def rounding_noise(global_rows: Tensor, columns: int, seed: int, step: int) -> Tensor:
    """``[rows, columns]`` int32 uniform in ``[0, 2**16)``: a pure function of (seed, step, global row, column).

    Each 32-bit hash (:func:`lightning_sparse.tables.init.hashes`) gives two columns, its low and high
    16 bits, so half as many are computed.
    """
    bits = hashes(global_rows, -(-columns // 2), noise_stream(seed, step))[0]
    noise = torch.cat([bits & 0xFFFF, (bits >> 16) & 0xFFFF], dim=1)
    return noise[:, :columns] if noise.shape[1] != columns else noise


def noise_stream(seed: int, step: int) -> int:
    """The hash seed of a table's draws at its ``step``-th update."""
    return ((seed & 0xFFFFFFFF) << 32 | (step & 0xFFFFFFFF)) ^ _SALT


def noise_salt(seed: int, step: int) -> int:
    """The salt the Triton update kernel hashes with to draw what :func:`rounding_noise` draws (see ``init.hashes``)."""
    return seed_salt(noise_stream(seed, step))


class RoundedTable(Protocol):
    """What :func:`writer_for` reads of a table (:class:`~lightning_sparse.SparseEmbedding` is one)."""

    seed: int
    stochastic_rounding: bool | None

    @property
    def shard(self) -> Tensor: ...
    @property
    def sharding(self) -> GlobalRows: ...
    @property
    def rank(self) -> int: ...


def writer_for(table: RoundedTable, step: int) -> RowWriter | None:
    """How an optimizer step writes ``table``'s new rows: ``None`` (in place, in the table's dtype) unless it is half.

    A half table's rows are rounded stochastically with the draws of its ``step``-th update, or to
    nearest with ``stochastic_rounding=False``.
    """
    shard = table.shard
    if shard.dtype not in HALF:
        return None
    if table.stochastic_rounding is False:
        return lambda rows, values: copy_rows(shard, rows, values.to(shard.dtype))
    sharding, first = table.sharding, table.rank * table.sharding.block_size

    def write(rows: Tensor, values: Tensor) -> None:
        noise = rounding_noise(sharding.global_of_key(rows + first), values.shape[1], table.seed, step)
        copy_rows(shard, rows, stochastic_round(values, shard.dtype, noise))

    return write
