"""SparseAdam: lazy Adam on the touched rows, with per-row or global bias correction."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_sparse.kernels import RuleState, UpdateRule
from lightning_sparse.kernels.rounding import compute_dtype
from lightning_sparse.optim import functional as F
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.tables.placement import empty_rows

BIAS_CORRECTIONS = ("row", "global")


class SparseAdam(SparseOptimizer):
    """Lazy Adam for SparseEmbedding tables: only touched rows update their moments.

    ``bias_correction="row"`` (default, DGL's lazy Adam): each row counts its own steps ``t``
    (``row_step``) and ``row -= lr * m_hat / (sqrt(v_hat) + eps)``.
    ``bias_correction="global"`` (torch.optim.SparseAdam): one ``step`` per table, counting the
    optimizer steps in which some rank looked the table up, and
    ``row -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``.
    ``weight_decay`` adds L2 to the gradient or, with ``decoupled_weight_decay=True``, scales the
    row by ``1 - lr * weight_decay`` (AdamW); either way only touched rows decay.
    State per table: ``exp_avg``, ``exp_avg_sq`` (like the shard) and ``step`` (int64 scalar);
    with ``bias_correction="row"`` also ``row_step`` (int64 per row).
    """

    family = "adam"  # its update rule (:class:`~lightning_sparse.kernels.UpdateRule`)

    def __init__(
        self,
        params: Iterable[SparseEmbedding] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool = False,
        bias_correction: str = "row",
        duplicate_grads: str = "sum",
        check_finite: bool = False,
        capturable: bool = False,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}. HINT: pass lr >= 0.")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}. HINT: pass eps >= 0 (the default is 1e-8).")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}. HINT: each beta is in [0, 1), e.g. (0.9, 0.999).")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}. HINT: each beta is in [0, 1), e.g. (0.9, 0.999).")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}. HINT: pass weight_decay >= 0 (0 turns it off).")
        if bias_correction not in BIAS_CORRECTIONS:
            raise ValueError(f"Invalid bias_correction: {bias_correction!r}. HINT: use one of {BIAS_CORRECTIONS}.")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
            bias_correction=bias_correction, duplicate_grads=duplicate_grads,
            check_finite=check_finite, capturable=capturable,
        )  # fmt: skip
        super().__init__(params, defaults)

    def init_state(self, table: SparseEmbedding, group: dict[str, Any]) -> dict[str, Tensor]:
        shard = table.shard
        state = {
            "step": torch.zeros((), dtype=torch.int64),
            "exp_avg": empty_rows(shard.shape, compute_dtype(shard.dtype), shard.device).zero_(),
            "exp_avg_sq": empty_rows(shard.shape, compute_dtype(shard.dtype), shard.device).zero_(),
        }
        if group["bias_correction"] == "row":
            state["row_step"] = empty_rows((shard.shape[0],), torch.int64, shard.device).zero_()
        return state

    def rule(self, state: dict[str, Tensor], group: dict[str, Any], step: int | Tensor) -> UpdateRule:
        """Lazy Adam on ``exp_avg`` and ``exp_avg_sq``; per-row bias correction counts each row's steps in ``row_step`` (in the
        update), global bias correction has the step size ``lr * sqrt(1 - b2^t) / (1 - b1^t)`` of the table's ``step``."""
        lr, per_row = group["lr"], group["bias_correction"] == "row"
        return UpdateRule(
            self.family, lr, RuleState(state["exp_avg"], state["exp_avg_sq"], state.get("row_step")),
            weight_decay=group["weight_decay"], decoupled_weight_decay=group["decoupled_weight_decay"], eps=group["eps"],
            betas=tuple(group["betas"]), row_bias=per_row, step_size=0.0 if per_row else F.adam_step_size(lr, *group["betas"], step),
        )  # fmt: skip
