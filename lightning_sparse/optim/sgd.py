"""SparseSGD: plain SGD on the touched rows."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_sparse.kernels import UpdateRule
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.tables.embedding import SparseEmbedding


class SparseSGD(SparseOptimizer):
    """SGD for SparseEmbedding tables: ``row -= lr * (grad + weight_decay * row)`` for touched rows.

    Equals ``torch.optim.SGD`` on ``nn.Embedding(sparse=True)`` (which supports neither momentum
    nor weight decay with sparse gradients). Weight decay applies to the touched rows only.
    """

    family = "sgd"  # its update rule (:class:`~lightning_sparse.kernels.UpdateRule`)

    def __init__(
        self,
        params: Iterable[SparseEmbedding] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        *,
        weight_decay: float = 0.0,
        duplicate_grads: str = "sum",
        check_finite: bool = False,
        capturable: bool = False,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}. HINT: pass lr >= 0.")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}. HINT: pass weight_decay >= 0 (0 turns it off).")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, duplicate_grads=duplicate_grads,
                                      check_finite=check_finite, capturable=capturable))  # fmt: skip

    def init_state(self, table: SparseEmbedding, group: dict[str, Any]) -> dict[str, Tensor]:
        return {"step": torch.zeros((), dtype=torch.int64)}

    def rule(self, state: dict[str, Tensor], group: dict[str, Any], step: int | Tensor) -> UpdateRule:
        """``row -= lr * (grad + weight_decay * row)``; no state read."""
        return UpdateRule(self.family, group["lr"], weight_decay=group["weight_decay"])
