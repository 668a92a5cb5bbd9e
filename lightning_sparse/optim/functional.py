"""Update kernels: only the touched rows of a table and of its state are read and written.

Each kernel takes the table's shard and its state tensors, the touched rows (distinct local
indices) and their coalesced, scaled gradient (which it may overwrite). It computes each row's
change and applies it in one pass over the table: ``shard.index_add_(0, rows, delta)``, a
read-modify-write of just those rows. Only weight decay needs the rows' current values: then
they are gathered (``index_select``), updated in place and written back (``index_copy_``, as 16-byte words: :func:`~lightning_sparse.kernels.rows.copy_rows`).
State rows are gathered, updated in place and written back. Hyperparameters are keyword-only.
A half-precision table (:mod:`lightning_sparse.kernels.rounding`) comes with float32 state, its rows are
computed on in float32, and ``write`` puts them back (with stochastic rounding).
The arithmetic follows torch.optim where an equivalent exists (``SGD``, ``Adagrad`` and
``SparseAdam`` applied to sparse gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.kernels.rounding import RowWriter, compute_dtype
from lightning_sparse.kernels.rows import copy_rows


def _apply(param: Tensor, rows: Tensor, delta: Tensor, values: Tensor | None = None, write: RowWriter | None = None) -> None:
    """``param[rows] += delta``: one read-modify-write pass, or a write if ``values`` (the rows' current values) were gathered.

    With ``write`` (a half table), the new rows are computed in float32 and handed to it.
    """
    if write is not None:
        write(rows, (values if values is not None else _gather(param, rows)).add_(delta))
    elif values is None:
        param.index_add_(0, rows, delta)
    else:
        copy_rows(param, rows, values.add_(delta))


def _gather(param: Tensor, rows: Tensor, wanted: bool = True) -> Tensor | None:
    """The rows' current values in the update's dtype (float32 for a half table), if ``wanted``."""
    return param.index_select(0, rows).to(compute_dtype(param.dtype)) if wanted else None


def sgd_(param: Tensor, rows: Tensor, grad: Tensor, *, lr: float, weight_decay: float, write: RowWriter | None = None) -> None:
    """``row -= lr * (grad + weight_decay * row)``."""
    values = _gather(param, rows, bool(weight_decay))
    if values is not None:
        grad.add_(values, alpha=weight_decay)
    _apply(param, rows, grad.mul_(-lr), values, write)


def adagrad_(
    param: Tensor, state_sum: Tensor, rows: Tensor, grad: Tensor, *, clr: float, weight_decay: float, eps: float,
    write: RowWriter | None = None,
) -> None:  # fmt: skip
    """torch.optim.Adagrad: ``sum += g^2; row -= clr * g / (sqrt(sum) + eps)``."""
    values = _gather(param, rows, bool(weight_decay))
    if values is not None:
        grad.add_(values, alpha=weight_decay)
    sums = state_sum.index_select(0, rows).addcmul_(grad, grad)
    copy_rows(state_sum, rows, sums)
    _apply(param, rows, grad.div_(sums.sqrt_().add_(eps)).mul_(-clr), values, write)


def rowwise_adagrad_(
    param: Tensor, state_sum: Tensor, rows: Tensor, grad: Tensor, *, lr: float, weight_decay: float, eps: float,
    write: RowWriter | None = None,
) -> None:  # fmt: skip
    """One accumulator per row: ``sum += mean_j(g_j^2); row -= lr * g / (sqrt(sum) + eps)``.

    FBGEMM's EXACT_ROWWISE_ADAGRAD and PyTorch-BigGraph's RowAdagrad. ``state_sum`` is ``[rows]``.
    """
    values = _gather(param, rows, bool(weight_decay))
    if values is not None:
        grad.add_(values, alpha=weight_decay)
    sums = state_sum.index_select(0, rows)
    sums.add_(torch.linalg.vector_norm(grad, dim=1).square_().div_(grad.shape[1]))
    state_sum.index_copy_(0, rows, sums)
    scale = sums.sqrt_().add_(eps).reciprocal_().mul_(-lr)
    _apply(param, rows, grad.mul_(scale.unsqueeze(1)), values, write)


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
    write: RowWriter | None = None,
    step_size: float | Tensor | None = None,
) -> None:
    """Lazy Adam on the touched rows.

    ``step`` is an int (torch.optim.SparseAdam's global bias correction:
    ``row -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``) or a tensor of per-row
    counts (DGL's ``row -= lr * m_hat / (sqrt(v_hat) + eps)`` with each row's own ``t``).
    ``weight_decay`` is L2 added to the gradient, or with ``decoupled_weight_decay`` AdamW's
    ``row *= 1 - lr * weight_decay``. ``step_size``: the global correction's step size if known (one per row: ``[rows, 1]``,
    for rows of tables at different steps), else computed from ``step``.
    """
    values = _gather(param, rows, bool(weight_decay))
    if values is not None and decoupled_weight_decay:
        values.mul_(1 - lr * weight_decay)
    elif values is not None:
        grad.add_(values, alpha=weight_decay)
    m = exp_avg.index_select(0, rows).lerp_(grad, 1 - beta1)
    v = exp_avg_sq.index_select(0, rows).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    copy_rows(exp_avg, rows, m)
    copy_rows(exp_avg_sq, rows, v)
    if isinstance(step, Tensor):  # per row: bias corrections are [rows, 1] columns
        t = step.to(v.dtype).unsqueeze(1)
        denom = v.div_(1 - torch.pow(beta2, t)).sqrt_().add_(eps).mul_(1 - torch.pow(beta1, t))
        delta = m.div_(denom).mul_(-lr)
    else:
        delta = m.div_(v.sqrt_().add_(eps)).mul_(
            -(step_size if step_size is not None else adam_step_size(lr, beta1, beta2, step))
        )
    _apply(param, rows, delta, values, write)


def adam_step_size(lr: float, beta1: float, beta2: float, step: int | Tensor) -> float | Tensor:
    """torch.optim.SparseAdam's step size at step ``step``: ``lr * sqrt(1 - beta2^t) / (1 - beta1^t)`` (a tensor: on its device)."""
    return lr * (1 - beta2**step) ** 0.5 / (1 - beta1**step)
