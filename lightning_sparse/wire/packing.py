"""Many tables' rows in one all-to-all buffer, packed and unpacked with one gather each way.

An exchange round that serves several tables sends each rank one contiguous message: table 0's
rows for it, then table 1's, and so on. The tables hold their rows the other way round, by
table, then rank. :func:`pack` and :func:`unpack` turn one layout into the other with a single
scatter or gather per table (:func:`~lightning_sparse.wire.grouping.transposed_places`,
:func:`~lightning_sparse.wire.grouping.transpose_blocks`), so the host work of a round does not grow
with ranks x tables, and each row is copied once on each side.

Rows of different widths move in *words* of ``word`` values (a common divisor of the widths):
a row of width ``w`` is ``w / word`` consecutive words, so one gather moves whole rows. Equal
widths give one word per row; widths without a common divisor above 1 fall back to single
values (correct, with a gather index as long as the buffer).
"""

from __future__ import annotations

import math
from itertools import accumulate

import torch
from torch import Tensor

from lightning_sparse.kernels.host import to_device
from lightning_sparse.wire.grouping import transpose_blocks, transposed_places


def common_word(widths: list[int]) -> int:
    """The largest word that divides every width (1 when there are none)."""
    return math.gcd(*widths) if widths else 1


# Up to this many (table, rank) blocks, slices are cheaper than the index arithmetic of one gather.
FEW_BLOCKS = 128


def pack(
    rows: list[Tensor], counts: Tensor, device_counts: Tensor, word: int, places: Tensor | None = None
) -> tuple[Tensor, list[int]]:
    """One flat buffer by destination, then table; and the number of values for each destination.

    ``rows[t]`` holds table ``t``'s rows ``[n_t, w_t]``, by destination: ``counts[t, d]`` rows for
    rank ``d`` (``counts`` ``[T, W]`` int64 on the host, ``device_counts`` the same on the rows'
    device). Every ``w_t`` must be a multiple of ``word``. ``places``: where each word lands, if
    the caller has it already (when every row is one word, the gather of
    ``transpose_blocks(device_counts.t(), ...)``: the turn that split the items by table).
    """
    if counts.numel() <= FEW_BLOCKS:  # few blocks: slices and one concatenation, sizes from the host lists
        lengths, widths = counts.tolist(), [r.shape[1] for r in rows]
        pieces, sizes = [], []
        starts = [list(accumulate(row, initial=0)) for row in lengths]
        for d in range(counts.shape[1]):
            pieces += [r.narrow(0, starts[t][d], lengths[t][d]).reshape(-1) for t, r in enumerate(rows)]
            sizes.append(sum(lengths[t][d] * widths[t] for t in range(len(rows))))
        return torch.cat(pieces), sizes
    widths = torch.tensor([r.shape[1] for r in rows], dtype=torch.int64)
    sizes_per_destination = (counts * widths.unsqueeze(1)).sum(0).tolist()
    word_counts = device_counts * to_device(widths // word, device_counts.device).unsqueeze(1)
    sizes = [r.numel() // word for r in rows]
    places = (places if places is not None else transposed_places(word_counts, sum(sizes))).split(sizes)
    out = rows[0].new_empty(sum(sizes), word)
    for table_rows, table_places in zip(rows, places):  # each table's rows written once, straight into place
        out.index_copy_(0, table_places, table_rows.reshape(-1, word))
    return out.view(-1), sizes_per_destination


def unpack(
    flat: Tensor, counts: Tensor, device_counts: Tensor, widths: list[int], word: int, gather: Tensor | None = None
) -> list[Tensor]:
    """The inverse of :func:`pack` on the receiving side: per table ``[rows, w_t]``, by source.

    ``flat`` holds, by source, then table, ``counts[t, s]`` rows of width ``widths[t]`` for each
    table ``t`` from source ``s`` (``counts`` ``[T, W]`` on the host, ``device_counts`` on ``flat``'s device).
    ``gather``: the words' gather, if the caller has it already (when every row is one word,
    ``transpose_blocks(device_counts.t(), ...)``).
    """
    if counts.numel() <= FEW_BLOCKS:  # few blocks: slices and one concatenation per table
        lengths = counts.tolist()
        pieces = flat.split([lengths[t][s] * w for s in range(counts.shape[1]) for t, w in enumerate(widths)])
        tables = len(widths)
        return [torch.cat(pieces[t::tables]).view(-1, width) for t, width in enumerate(widths)]
    words = torch.tensor(widths, dtype=torch.int64) // word
    by_source = flat.view(-1, word)
    word_counts = (device_counts * to_device(words, device_counts.device).unsqueeze(1)).t()
    gather = gather if gather is not None else transpose_blocks(word_counts, len(by_source))
    gathers = gather.split((counts.sum(1) * words).tolist())
    return [by_source.index_select(0, gather).view(-1, width) for gather, width in zip(gathers, widths)]


def read_as(columns: Tensor, dtype: torch.dtype) -> Tensor:
    """Columns of unpacked rows (``[n, k]``, e.g. a row's id in its first bytes) copied out and read as ``dtype``.

    A copy with its own strides: the columns of a received buffer may start at an offset, or lie at a row stride, that
    is no multiple of ``dtype``'s size, which a view rejects (a one-row slice counts as contiguous at any stride, so
    ``contiguous()`` would not copy it).
    """
    return columns.clone(memory_format=torch.contiguous_format).view(dtype)
