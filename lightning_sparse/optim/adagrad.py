"""SparseAdagrad (torch.optim.Adagrad's formula) and SparseRowWiseAdagrad (one accumulator per row)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_sparse.kernels import RuleState, UpdateRule
from lightning_sparse.kernels.rounding import compute_dtype
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.tables.placement import empty_rows


def _check(lr: float, weight_decay: float, initial_accumulator_value: float, eps: float) -> None:
    if lr < 0.0:
        raise ValueError(f"Invalid learning rate: {lr}. HINT: pass lr >= 0.")
    if weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}. HINT: pass weight_decay >= 0 (0 turns it off).")
    if initial_accumulator_value < 0.0:
        raise ValueError(
            f"Invalid initial_accumulator_value value: {initial_accumulator_value}. HINT: the sums of squares start at a value >= 0 "
            f"(default 0)."
        )
    if eps < 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}. HINT: pass eps >= 0 (the default is 1e-10).")


class SparseAdagrad(SparseOptimizer):
    """Adagrad for SparseEmbedding tables, with torch.optim.Adagrad's formula and defaults.

    For each touched row: ``g += weight_decay * row; sum += g^2;
    row -= clr * g / (sqrt(sum) + eps)`` with ``clr = lr / (1 + (step - 1) * lr_decay)``, where
    ``step`` counts the optimizer steps in which some rank looked the table up (as torch counts
    steps in which a parameter had a gradient). Weight decay applies to the touched rows only.
    State per table: ``sum`` (like the shard) and ``step`` (int64 scalar).
    """

    family = "adagrad"  # its update rule (:class:`~lightning_sparse.kernels.UpdateRule`)

    def __init__(
        self,
        params: Iterable[SparseEmbedding] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        duplicate_grads: str = "sum",
        check_finite: bool = False,
        capturable: bool = False,
    ) -> None:
        _check(lr, weight_decay, initial_accumulator_value, eps)
        if lr_decay < 0.0:
            raise ValueError(f"Invalid lr_decay value: {lr_decay}. HINT: pass lr_decay >= 0 (0 keeps the learning rate).")
        defaults = dict(
            lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
            initial_accumulator_value=initial_accumulator_value, duplicate_grads=duplicate_grads,
            check_finite=check_finite, capturable=capturable,
        )  # fmt: skip
        super().__init__(params, defaults)

    def init_state(self, table: SparseEmbedding, group: dict[str, Any]) -> dict[str, Tensor]:
        return {
            "step": torch.zeros((), dtype=torch.int64),
            "sum": empty_rows(table.shard.shape, compute_dtype(table.dtype), table.device).fill_(
                group["initial_accumulator_value"]
            ),
        }

    def rule(self, state: dict[str, Tensor], group: dict[str, Any], step: int | Tensor) -> UpdateRule:
        """torch's Adagrad with the decayed learning rate ``clr = lr / (1 + (step - 1) * lr_decay)``; ``sum`` per element."""
        clr = group["lr"] / (1 + (step - 1) * group["lr_decay"])
        return UpdateRule(self.family, clr, RuleState(first=state["sum"]), weight_decay=group["weight_decay"], eps=group["eps"])


class SparseRowWiseAdagrad(SparseOptimizer):
    """Row-wise Adagrad: one accumulator per row holding the mean over the row of the squared gradient.

    For each touched row: ``g += weight_decay * row; sum += mean(g^2);
    row -= lr * g / (sqrt(sum) + eps)``. This is FBGEMM's EXACT_ROWWISE_ADAGRAD and
    PyTorch-BigGraph's RowAdagrad: state is one scalar per row instead of one per element.
    Tables must be 2-D ``[rows, dim]`` (SparseEmbedding always is). Weight decay applies to the
    touched rows only. State per table: ``sum`` (``[local_rows]``) and ``step`` (int64 scalar).
    """

    family = "rowwise_adagrad"  # its update rule (:class:`~lightning_sparse.kernels.UpdateRule`)

    def __init__(
        self,
        params: Iterable[SparseEmbedding] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        duplicate_grads: str = "sum",
        check_finite: bool = False,
        capturable: bool = False,
    ) -> None:
        _check(lr, weight_decay, initial_accumulator_value, eps)
        defaults = dict(
            lr=lr, weight_decay=weight_decay, eps=eps,
            initial_accumulator_value=initial_accumulator_value, duplicate_grads=duplicate_grads,
            check_finite=check_finite, capturable=capturable,
        )  # fmt: skip
        super().__init__(params, defaults)

    def init_state(self, table: SparseEmbedding, group: dict[str, Any]) -> dict[str, Tensor]:
        if table.shard.dim() != 2:
            raise ValueError(f"Row-wise Adagrad needs a 2-D table, got shape {tuple(table.shard.shape)} for {table.name}.")
        return {
            "step": torch.zeros((), dtype=torch.int64),
            "sum": empty_rows((table.shard.shape[0],), compute_dtype(table.dtype), table.device).fill_(
                group["initial_accumulator_value"]
            ),
        }

    def rule(self, state: dict[str, Tensor], group: dict[str, Any], step: int | Tensor) -> UpdateRule:
        """Row-wise Adagrad: one ``sum`` per row."""
        return UpdateRule(self.family, group["lr"], RuleState(per_row=state["sum"]), weight_decay=group["weight_decay"],
                          eps=group["eps"])  # fmt: skip
