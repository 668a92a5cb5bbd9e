"""Many tables' rows in one all-to-all buffer, packed and unpacked with one gather each way.

An exchange round that serves several tables sends each rank one contiguous message: table 0's
rows for it, then table 1's, and so on. The tables hold their rows the other way round, by
table, then rank. :func:`pack` and :func:`unpack` turn one layout into the other with a single
``index_select`` (:func:`~lightning_sparse.grouping.transpose_blocks`), so the host work of a
round does not grow with ranks x tables.

Rows of different widths move in *units* of ``unit`` values (a common divisor of the widths):
a row of width ``w`` is ``w / unit`` consecutive units, so one gather moves whole rows. Equal
widths give one unit per row; widths without a common divisor above 1 fall back to single
values (correct, with a gather index as long as the buffer).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_sparse.grouping import transpose_blocks


def common_unit(widths: list[int]) -> int:
    """The largest unit that divides every width (1 when there are none)."""
    return math.gcd(*widths) if widths else 1


def to_device(counts: Tensor, device: torch.device) -> Tensor:
    """A small host tensor of counts on ``device``, without blocking (pinned memory on a GPU)."""
    if device.type == "cpu":
        return counts
    return counts.pin_memory().to(device, non_blocking=True)


def pack(rows: list[Tensor], counts: Tensor, device_counts: Tensor, unit: int) -> tuple[Tensor, list[int]]:
    """One flat buffer by destination, then table; and the number of values for each destination.

    ``rows[t]`` holds table ``t``'s rows ``[n_t, w_t]``, by destination: ``counts[t, d]`` rows for
    rank ``d`` (``counts`` ``[T, W]`` int64 on the host, ``device_counts`` the same on the rows'
    device). Every ``w_t`` must be a multiple of ``unit``.
    """
    widths = torch.tensor([r.shape[1] for r in rows], dtype=torch.int64)
    units = torch.cat([r.reshape(-1, unit) for r in rows])
    unit_counts = device_counts * to_device(widths // unit, device_counts.device).unsqueeze(1)
    flat = units.index_select(0, transpose_blocks(unit_counts, len(units))).view(-1)
    return flat, (counts * widths.unsqueeze(1)).sum(0).tolist()


def unpack(flat: Tensor, counts: Tensor, device_counts: Tensor, widths: list[int], unit: int) -> list[Tensor]:
    """The inverse of :func:`pack` on the receiving side: per table ``[rows, w_t]``, by source.

    ``flat`` holds, by source, then table, ``counts[t, s]`` rows of width ``widths[t]`` for each
    table ``t`` from source ``s`` (``counts`` ``[T, W]`` on the host, ``device_counts`` on ``flat``'s device).
    """
    units = torch.tensor(widths, dtype=torch.int64) // unit
    by_source = flat.view(-1, unit)
    unit_counts = (device_counts * to_device(units, device_counts.device).unsqueeze(1)).t()
    by_table = by_source.index_select(0, transpose_blocks(unit_counts, len(by_source)))
    pieces = by_table.split((counts.sum(1) * units).tolist())
    return [piece.view(-1, width) for piece, width in zip(pieces, widths)]
