"""One table's update at a step: the optimizer's rule applied to the table's gradient rows, fused or with torch ops.

An optimizer says once what its step is: an :class:`~lightning_sparse.kernels.UpdateRule` (the family, the
state it reads by name, the step's scalars by name). :func:`update_table` applies it, picking the backend in one
place, as ``torch.optim.adagrad(..., fused=)`` does:

* ``fused``: one sort and one fused launch that sums each row's gradient and updates the row in registers
  (:func:`lightning_sparse.optim.fused.update`, :func:`lightning_sparse.kernels.update_rows`: Triton on a GPU, numba
  on a CPU);
* else one sort and a segment sum (:func:`lightning_sparse.optim.row_grads.summed`), then :func:`torch_update`: the
  arithmetic of :mod:`lightning_sparse.optim.functional`, which the fused kernel is tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from lightning_sparse.kernels import UpdateRule
from lightning_sparse.kernels.rounding import RowWriter, writer_for
from lightning_sparse.optim import functional as F
from lightning_sparse.optim import fused, row_grads

if TYPE_CHECKING:
    from lightning_sparse.optim.row_grads import TableGrads
    from lightning_sparse.tables.embedding import SparseEmbedding

FAMILIES = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def update_table(table: SparseEmbedding, grads: TableGrads, rule: UpdateRule, *, mean: bool, step: int | Tensor, use_fused: bool,
                 table_sets: fused.KeptTableSets | None = None) -> None:  # fmt: skip
    """Sum the table's gradient rows per row (``mean``: divided by their occurrences) and apply ``rule`` to those rows.

    ``step``: the table's step count, an int (a bf16 table's rounding draws are keyed by it), or (capturable, fused)
    the device's, with ``table_sets`` the optimizer's kept entries, where ``rule``'s scalars are written on the device.
    """
    if use_fused:
        fused.update(table, grads, rule, mean, step=0 if table_sets is not None else step, table_sets=table_sets)
        return
    rows, grad = row_grads.summed(table, grads, mean)
    torch_update(rule, table.shard, rows, grad, step=step, write=writer_for(table, step))  # a half table's rows: rounded


def torch_update(
    rule: UpdateRule, param: Tensor, rows: Tensor, grad: Tensor, *, step: int, write: RowWriter | None = None
) -> None:
    """``rule`` on ``param[rows]`` (distinct local rows) with their summed ``grad``, by torch ops (:mod:`.functional`).

    ``step``: the table's step count (global-bias Adam's ``t``); per-row Adam counts each row's steps here, in
    ``rule.state.per_row``. ``write``: a half table's writer of the new rows (float32 in, rounded).
    """
    state, decay = rule.state, rule.weight_decay
    if rule.family == "sgd":
        F.sgd_(param, rows, grad, lr=rule.lr, weight_decay=decay, write=write)
    elif rule.family == "adagrad":
        F.adagrad_(param, state.first, rows, grad, clr=rule.lr, weight_decay=decay, eps=rule.eps, write=write)
    elif rule.family == "rowwise_adagrad":
        F.rowwise_adagrad_(param, state.per_row, rows, grad, lr=rule.lr, weight_decay=decay, eps=rule.eps, write=write)
    elif rule.family == "adam":
        if rule.row_bias:  # each row's own count
            t = state.per_row.index_select(0, rows).add_(1)
            state.per_row.index_copy_(0, rows, t)
        beta1, beta2 = rule.betas
        F.adam_(param, state.first, state.second, rows, grad, step=t if rule.row_bias else step, lr=rule.lr, beta1=beta1,
                beta2=beta2, eps=rule.eps, weight_decay=decay, decoupled_weight_decay=rule.decoupled_weight_decay,
                write=write, step_size=None if rule.row_bias else rule.step_size)  # fmt: skip
    else:
        raise ValueError(f"Invalid update family: {rule.family!r}. HINT: use one of {FAMILIES}.")
