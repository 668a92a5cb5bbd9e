"""A collection's rounds on a CPU (:mod:`lightning_sparse.lookup.joint`) at the optimizer step: one sort, one sum, one update.

The CPU's side of :mod:`lightning_sparse.optim.joint`: the rounds' keys over all the collection's tables
(``table << shift | row``) are sorted once; one ``F.embedding_bag`` sums each distinct key's gradient (its ids' bags'
gradients, times their weights), and the optimizer's rule runs once on all the tables' rows
(:func:`~lightning_sparse.optim.update.torch_update`, the arithmetic of :mod:`lightning_sparse.optim.functional`). Each
table keeps its own shard and state, so reading and writing rows is one op per table (:class:`Tables`); the scalars
that differ per table (Adagrad's decayed learning rate, Adam's step size) become one value per row.

The sums add each key's gradients in the order of its ids, as the engine's backward does, and the arithmetic is the
per-table path's, op for op: a collection trains bitwise as when its tables step one by one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sparse.kernels import RuleState, UpdateRule
from lightning_sparse.optim.update import torch_update
from lightning_sparse.wire.grouping import SortedKeys

if TYPE_CHECKING:
    from lightning_sparse.tables.embedding import SparseEmbedding


class Tables:
    """One tensor per table (its rows, or a state tensor), seen as one at the distinct rows of a step, table after table.

    What the functional updates index (``index_select``, ``index_add_``, ``index_copy_`` along dim 0): each table's
    tensor at its own rows; the ``rows`` argument is ignored (they are this object's).
    """

    def __init__(self, tensors: list[Tensor], rows: list[Tensor]) -> None:
        self.tensors, self.rows, self.sizes = tensors, rows, [len(r) for r in rows]
        self.dtype = tensors[0].dtype

    def index_select(self, dim: int, rows: object) -> Tensor:
        pieces = [t.index_select(0, r) for t, r in zip(self.tensors, self.rows)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def index_add_(self, dim: int, rows: object, values: Tensor) -> None:
        for t, r, v in zip(self.tensors, self.rows, values.split(self.sizes)):
            t.index_add_(0, r, v)

    def index_copy_(self, dim: int, rows: object, values: Tensor) -> None:
        for t, r, v in zip(self.tensors, self.rows, values.split(self.sizes)):
            t.index_copy_(0, r, v)


def update(tables: list[SparseEmbedding], keys: Tensor, values: Tensor, sources: Tensor, weights: Tensor | None,
           rules: dict[int, UpdateRule], mean: bool, shift: int) -> None:  # fmt: skip
    """Update the tables ``rules`` names (each with its rule: its state, its step's scalars) from the rounds' gradient.

    Key ``i`` (``table << shift | row``) gets ``values[sources[i]] * weights[i]``; ``mean``: each row's sum is divided
    by its number of ids. One host read: the number of distinct keys of each table.
    """
    runs = SortedKeys(keys, len(tables) << shift)
    bounds = torch.arange(len(tables) + 1, dtype=torch.int64) << shift
    below = runs.counts_below(bounds).tolist()  # the host read
    runs.finish(below[-1])
    sizes = [high - low for low, high in zip(below, below[1:])]
    by_bag = sources.index_select(0, runs.perm)
    sorted_weights = weights.index_select(0, runs.perm) if weights is not None else None
    grad = F.embedding_bag(by_bag, values, runs.offsets, mode="sum", per_sample_weights=sorted_weights)
    if mean:
        grad = grad / runs.counts().to(grad.dtype).unsqueeze(1)
    rows = (runs.unique & ((1 << shift) - 1)).split(sizes)
    stepped = [t for t in sorted(rules) if sizes[t]]
    for t in stepped:
        tables[t].stats.unique_ids += sizes[t]
    if len(stepped) < len(tables):  # tables without rows in the step: no gradient rows to skip
        grad = torch.cat([piece for t, piece in enumerate(grad.split(sizes)) if t in stepped]) if stepped else grad[:0]
    if not stepped:
        return
    at = [rows[t] for t in stepped]
    first = rules[stepped[0]]
    state = RuleState(*(Tables([getattr(rules[t].state, name) for t in stepped], at) if getattr(first.state, name) is not None
                        else None for name in RuleState._fields))  # fmt: skip
    rule = replace(first, state=state, lr=_per_row([rules[t].lr for t in stepped], at, first.family),
                   step_size=_per_row([rules[t].step_size for t in stepped], at, first.family))  # fmt: skip
    torch_update(rule, Tables([tables[t].shard for t in stepped], at), None, grad, step=0)


def _per_row(scalars: list[float], rows: list[Tensor], family: str) -> float | Tensor:
    """One scalar for every table's rows, or (tables at different steps) each row its table's, in float32 as torch
    casts a number: ``[rows]`` for row-wise Adagrad's per-row scale, else ``[rows, 1]``."""
    if all(s == scalars[0] for s in scalars):
        return scalars[0]
    sizes = torch.tensor([len(r) for r in rows])
    per_row = torch.repeat_interleave(torch.tensor(scalars, dtype=torch.float32), sizes, output_size=int(sizes.sum()))
    return per_row if family == "rowwise_adagrad" else per_row.unsqueeze(1)
