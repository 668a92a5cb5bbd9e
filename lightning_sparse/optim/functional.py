"""Update kernels: gather the touched rows, update them in place, scatter them back.

Each kernel takes the table's shard and its state tensors, the touched rows (distinct local
indices) and their coalesced, scaled gradient, and updates only those rows: ``index_select``
gathers them into a compact buffer, in-place arithmetic updates it, ``index_copy_`` writes it
back. The rest of the table is never read. ``grad`` is consumed (it may be modified in place).
Hyperparameters are keyword-only. The arithmetic follows torch.optim where an equivalent exists
(``SGD``, ``Adagrad`` and ``SparseAdam`` applied to sparse gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor


def sgd_(param: Tensor, rows: Tensor, grad: Tensor, *, lr: float, weight_decay: float) -> None:
    """``row -= lr * (grad + weight_decay * row)``."""
    values = param.index_select(0, rows)
    if weight_decay:
        grad.add_(values, alpha=weight_decay)
    values.add_(grad, alpha=-lr)
    param.index_copy_(0, rows, values)


def adagrad_(
    param: Tensor, state_sum: Tensor, rows: Tensor, grad: Tensor, *, clr: float, weight_decay: float, eps: float
) -> None:
    """torch.optim.Adagrad: ``sum += g^2; row -= clr * g / (sqrt(sum) + eps)``."""
    values = param.index_select(0, rows)
    sums = state_sum.index_select(0, rows)
    if weight_decay:
        grad.add_(values, alpha=weight_decay)
    sums.addcmul_(grad, grad)
    state_sum.index_copy_(0, rows, sums)
    values.addcdiv_(grad, sums.sqrt_().add_(eps), value=-clr)
    param.index_copy_(0, rows, values)


def rowwise_adagrad_(
    param: Tensor, state_sum: Tensor, rows: Tensor, grad: Tensor, *, lr: float, weight_decay: float, eps: float
) -> None:
    """One accumulator per row: ``sum += mean_j(g_j^2); row -= lr * g / (sqrt(sum) + eps)``.

    FBGEMM's EXACT_ROWWISE_ADAGRAD and PyTorch-BigGraph's RowAdagrad. ``state_sum`` is ``[rows]``.
    """
    values = param.index_select(0, rows)
    if weight_decay:
        grad.add_(values, alpha=weight_decay)
    sums = state_sum.index_select(0, rows)
    sums.add_(torch.linalg.vector_norm(grad, dim=1).square_().div_(grad.shape[1]))
    state_sum.index_copy_(0, rows, sums)
    values.addcmul_(grad, sums.sqrt_().add_(eps).reciprocal_().unsqueeze(1), value=-lr)
    param.index_copy_(0, rows, values)


def adam_(
    param: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    rows: Tensor,
    grad: Tensor,
    *,
    step: int | Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
) -> None:
    """Lazy Adam on the touched rows.

    ``step`` is an int (torch.optim.SparseAdam's global bias correction:
    ``row -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``) or a tensor of per-row
    counts (DGL's ``row -= lr * m_hat / (sqrt(v_hat) + eps)`` with each row's own ``t``).
    ``weight_decay`` is L2 added to the gradient, or with ``decoupled_weight_decay`` AdamW's
    ``row *= 1 - lr * weight_decay``.
    """
    values = param.index_select(0, rows)
    m = exp_avg.index_select(0, rows)
    v = exp_avg_sq.index_select(0, rows)
    if weight_decay and decoupled_weight_decay:
        values.mul_(1 - lr * weight_decay)
    elif weight_decay:
        grad.add_(values, alpha=weight_decay)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    exp_avg.index_copy_(0, rows, m)
    exp_avg_sq.index_copy_(0, rows, v)
    if isinstance(step, Tensor):  # per row: bias corrections are [rows, 1] columns
        t = step.to(values.dtype).unsqueeze(1)
        denom = v.div_(1 - torch.pow(beta2, t)).sqrt_().add_(eps).mul_(1 - torch.pow(beta1, t))
        values.addcdiv_(m, denom, value=-lr)
    else:
        step_size = lr * (1 - beta2**step) ** 0.5 / (1 - beta1**step)
        values.addcdiv_(m, v.sqrt_().add_(eps), value=-step_size)
    param.index_copy_(0, rows, values)
