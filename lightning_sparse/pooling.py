"""Pooling a feature's bags from the distinct rows a lookup brought back, without an ``[ids, dim]`` tensor.

``pooling="sum"``/``"mean"`` (and per-id weights) as ``nn.EmbeddingBag`` computes them, forward
and backward, over the distinct rows of the lookup round (see :mod:`lightning_sparse.lookup`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


class _Pool(torch.autograd.Function):
    """Bags pooled from distinct rows, both ways without an ``[ids, dim]`` tensor.

    Forward is ``F.embedding_bag`` over the distinct rows. Backward is the same operation
    turned around: each distinct row's gradient is a weighted sum of the gradients of the bags
    that hold it, so one ``F.embedding_bag`` over the bags' gradients, with the ids sorted by
    row, gives ``[distinct rows, dim]`` directly (weights: the per-id weights, or ``1 / bag
    length`` for ``"mean"``). Per-id weights that need a gradient go through ``F.embedding_bag``'s
    own backward instead (see :func:`pool`).
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
        order = torch.argsort(position, stable=True)
        starts = torch.searchsorted(position.index_select(0, order), torch.arange(ctx.num_rows, device=grad.device))
        return F.embedding_bag(bag.index_select(0, order), grad.contiguous(), starts, mode="sum",
                               per_sample_weights=None if scale is None else scale.index_select(0, order)), None, None, None, None  # fmt: skip


def pool(rows: Tensor, position: Tensor, offsets: Tensor, mode: str, weights: Tensor | None) -> Tensor:
    if weights is not None and weights.requires_grad:
        return F.embedding_bag(position, rows, offsets, mode=mode, per_sample_weights=weights, include_last_offset=True)
    return _Pool.apply(rows, position, offsets, mode, weights)
