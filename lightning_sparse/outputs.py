"""Stage 5: the rows a lookup returns, and where their gradient stops.

A lookup's rows leave the graph at the distinct rows of each table (:func:`distinct_rows`): their
backward hands ``[distinct rows, dim]`` to the table's :class:`~lightning_sparse.pending.LookupRecord`
and communicates nothing. Features read them with ``index_select`` (:func:`expand_rows`, whose
backward is the segment sum of the lookup's sort) or pool them (:mod:`lightning_sparse.pooling`).
With one rank and one table there is nothing to deduplicate: :func:`gather` reads the shard
straight at the ids, as ``nn.Embedding`` does, and its backward sorts them for the segment sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from lightning_sparse.pending import LookupRecord
    from lightning_sparse.units import ShardedTable


class _DistinctRows(torch.autograd.Function):
    """The distinct rows of one table, as they came back, in its output dtype; backward hands their gradient to the record.

    The gradient arrives in the output dtype (e.g. float32 from a bf16 table) and is summed so.
    """

    @staticmethod
    def forward(ctx: Any, token: Tensor, rows: Tensor, record: LookupRecord, dtype: torch.dtype) -> Tensor:
        ctx.record = record
        return rows.to(dtype) if rows.dtype != dtype else rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, None]:
        ctx.record.add_grad(grad)
        return None, None, None, None


class _Expand(torch.autograd.Function):
    """``rows.index_select(0, inverse)`` for a feature that holds all of its table's ids in the round.

    Backward is the segment sum of the round's sort (``perm``, ``offsets``): one ``F.embedding_bag``
    gives ``[distinct rows, dim]``, with no scatter (autograd's ``index_select`` backward).
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, inverse: Tensor, perm: Tensor, offsets: Tensor) -> Tensor:
        ctx.save_for_backward(perm, offsets)
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        perm, offsets = ctx.saved_tensors
        return F.embedding_bag(perm, grad.contiguous(), offsets, mode="sum"), None, None, None


class _Gather(torch.autograd.Function):
    """``shard.index_select(0, ids)`` in the output dtype; backward hands ``[ids, dim]`` to the record (which sorts them)."""

    @staticmethod
    def forward(ctx: Any, token: Tensor, shard: Tensor, ids: Tensor, record: LookupRecord, dtype: torch.dtype) -> Tensor:
        ctx.record = record
        return shard.index_select(0, ids).to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, None, None]:
        ctx.record.add_grad(grad)
        return None, None, None, None, None


def distinct_rows(table: ShardedTable, rows: Tensor, record: LookupRecord | None) -> Tensor:
    """A table's distinct rows of a lookup in its output dtype; differentiable through ``record`` if given."""
    dtype = table.output_dtype or rows.dtype
    if record is None:
        return rows.to(dtype)
    return _DistinctRows.apply(torch.empty(0, device=rows.device, requires_grad=True), rows, record, dtype)


def expand(table: ShardedTable, rows: Tensor, record: LookupRecord | None, index: Tensor, shape: torch.Size) -> Tensor:
    """Stage 5 of one table's lookup: its distinct rows at ``index`` (one per id), shaped like the ids (``shape``)."""
    return distinct_rows(table, rows, record).index_select(0, index).view(*shape, table.embedding_dim)


def expand_rows(rows: Tensor, inverse: Tensor, perm: Tensor, offsets: Tensor) -> Tensor:
    """``rows.index_select(0, inverse)`` for a feature that holds all of its table's ids in the round (see :class:`_Expand`)."""
    return _Expand.apply(rows, inverse, perm, offsets)


def gather(table: ShardedTable, ids: Tensor, record: LookupRecord | None) -> Tensor:
    """One rank, one table: the shard's rows at ``ids`` in the output dtype; differentiable through ``record`` if given."""
    dtype = table.output_dtype or table.shard.dtype
    if record is None:
        return table.shard.index_select(0, ids).to(dtype)
    return _Gather.apply(torch.empty(0, device=ids.device, requires_grad=True), table.shard, ids, record, dtype)
