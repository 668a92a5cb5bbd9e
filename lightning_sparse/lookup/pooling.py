"""Reading a feature's ids from the distinct rows a lookup brought back: selected one per id, or pooled per bag.

``pooling="sum"``/``"mean"`` (and per-id weights) as ``nn.EmbeddingBag`` computes them, forward
and backward, over the distinct rows of the lookup round (see :mod:`lightning_sparse.lookup.engine`),
without an ``[ids, dim]`` tensor; ``pooling="none"`` for a feature that shares its table with
others selects one row per id (:func:`select`). Both backwards sum the gradients that reach each
distinct row with one sort of the ids' rows and :func:`lightning_sparse.kernels.segment_sum`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sparse.kernels import Runs, gpu_path, segment_sum


def _sum_by_row(position: Tensor, grad: Tensor, num_rows: int, source: Tensor | None, weights: Tensor | None) -> Tensor:
    """``[num_rows, dim]``: for each row, the sum over the ids at it (``position``) of their gradient rows.

    Id ``i`` contributes ``grad[source[i]]`` (``source``: the bag of each id; ``None``: ``i``),
    times ``weights[i]`` if given. One row per id on a CPU: ``index_add_``, which adds in order
    there with no sort (on a GPU it adds with atomics, in no fixed order: the sorted sum instead).
    """
    if source is None and weights is None and not gpu_path(grad):
        return grad.new_zeros(num_rows, grad.shape[1]).index_add_(0, position, grad)
    order = torch.argsort(position, stable=True)
    rows = source.index_select(0, order) if source is not None else order
    sorted_weights = weights.index_select(0, order) if weights is not None else None
    return segment_sum(Runs(position.index_select(0, order), rows), grad, num_rows, weights=sorted_weights)


class _Select(torch.autograd.Function):
    """``rows.index_select(0, position)``, with a deterministic backward (a sorted segment sum, not atomic adds)."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, position: Tensor) -> Tensor:
        ctx.save_for_backward(position)
        ctx.num_rows = len(rows)
        return rows.index_select(0, position)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (position,) = ctx.saved_tensors
        return _sum_by_row(position, grad, ctx.num_rows, None, None), None


class _Pool(torch.autograd.Function):
    """Bags pooled from distinct rows, both ways without an ``[ids, dim]`` tensor.

    Forward is ``F.embedding_bag`` over the distinct rows. Backward is the same operation
    turned around: each distinct row's gradient is a weighted sum of the gradients of the bags
    that hold it (weights: the per-id weights, or ``1 / bag length`` for ``"mean"``), summed
    with the ids sorted by row. Per-id weights that need a gradient go through
    ``F.embedding_bag``'s own backward instead (see :func:`pool`).
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, position: Tensor, offsets: Tensor, mode: str, weights: Tensor | None) -> Tensor:
        ctx.save_for_backward(position, offsets, weights)
        ctx.mode, ctx.num_rows = mode, len(rows)
        return F.embedding_bag(position, rows, offsets, mode=mode, per_sample_weights=weights, include_last_offset=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        position, offsets, weights = ctx.saved_tensors
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(len(lengths), device=grad.device), lengths, output_size=len(position))
        scale = weights
        if ctx.mode == "mean":
            scale = (1 / lengths.clamp(min=1).to(grad.dtype)).index_select(0, bag)
        return _sum_by_row(position, grad.contiguous(), ctx.num_rows, bag, scale), None, None, None, None


def select(rows: Tensor, position: Tensor) -> Tensor:
    """One row per id: ``rows[position]``, differentiable with respect to ``rows``."""
    return _Select.apply(rows, position) if rows.requires_grad else rows.index_select(0, position)


def pool(rows: Tensor, position: Tensor, offsets: Tensor, mode: str, weights: Tensor | None) -> Tensor:
    if weights is not None and weights.requires_grad:
        return F.embedding_bag(position, rows, offsets, mode=mode, per_sample_weights=weights, include_last_offset=True)
    return _Pool.apply(rows, position, offsets, mode, weights)
