"""Pure update kernels on the touched rows.

Each kernel takes the current values of the touched rows, their (coalesced, scaled) gradients
and their optimizer state, and returns the new values; it never sees the rest of the table.
Hyperparameters are keyword-only. The arithmetic follows torch.optim where an equivalent exists
(``torch.optim.SGD``, ``Adagrad`` and ``SparseAdam`` applied to sparse gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor


def sgd(rows: Tensor, grad: Tensor, *, lr: float, weight_decay: float) -> Tensor:
    """``rows - lr * (grad + weight_decay * rows)``."""
    if weight_decay:
        grad = grad.add(rows, alpha=weight_decay)
    return rows.add(grad, alpha=-lr)


def adagrad(
    rows: Tensor, grad: Tensor, state_sum: Tensor, *, clr: float, weight_decay: float, eps: float
) -> tuple[Tensor, Tensor]:
    """torch.optim.Adagrad: ``sum += g^2; rows -= clr * g / (sqrt(sum) + eps)``. Returns (rows, sum)."""
    if weight_decay:
        grad = grad.add(rows, alpha=weight_decay)
    state_sum = state_sum.addcmul(grad, grad)
    return rows.addcdiv(grad, state_sum.sqrt().add_(eps), value=-clr), state_sum


def rowwise_adagrad(
    rows: Tensor, grad: Tensor, state_sum: Tensor, *, lr: float, weight_decay: float, eps: float
) -> tuple[Tensor, Tensor]:
    """One accumulator per row: ``sum += mean_j(g_j^2); rows -= lr * g / (sqrt(sum) + eps)``.

    FBGEMM's EXACT_ROWWISE_ADAGRAD and PyTorch-BigGraph's RowAdagrad. ``state_sum`` is ``[n]``.
    """
    if weight_decay:
        grad = grad.add(rows, alpha=weight_decay)
    state_sum = state_sum + grad.pow(2).mean(dim=1)
    return rows.addcmul(grad, (state_sum.sqrt().add_(eps)).reciprocal().unsqueeze(1), value=-lr), state_sum


def adam(
    rows: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    bias_correction: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Lazy Adam on the touched rows. Returns (rows, exp_avg, exp_avg_sq).

    ``step`` is a 0-d tensor (``bias_correction="global"``: torch.optim.SparseAdam's formula
    ``rows -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``) or one count per row
    (``"row"``: DGL's ``rows -= lr * m_hat / (sqrt(v_hat) + eps)`` with per-row ``t``).
    ``weight_decay`` is L2 added to the gradient, or with ``decoupled_weight_decay`` AdamW's
    ``rows *= 1 - lr * weight_decay``.
    """
    if weight_decay and decoupled_weight_decay:
        rows = rows.mul(1 - lr * weight_decay)
    elif weight_decay:
        grad = grad.add(rows, alpha=weight_decay)
    exp_avg = exp_avg + (grad - exp_avg).mul_(1 - beta1)
    exp_avg_sq = exp_avg_sq + (grad * grad - exp_avg_sq).mul_(1 - beta2)
    if bias_correction == "global":
        t = float(step)
        step_size = lr * (1 - beta2**t) ** 0.5 / (1 - beta1**t)
        return rows - step_size * (exp_avg / exp_avg_sq.sqrt().add_(eps)), exp_avg, exp_avg_sq
    t = step.to(rows.dtype).unsqueeze(1)
    m_hat = exp_avg / (1 - torch.pow(beta1, t))
    v_hat = exp_avg_sq / (1 - torch.pow(beta2, t))
    return rows - lr * m_hat / (v_hat.sqrt().add_(eps)), exp_avg, exp_avg_sq
