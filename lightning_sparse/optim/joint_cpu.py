"""A collection's rounds on a CPU (:mod:`lightning_sparse.lookup.joint`) at the optimizer step: one sort, one sum, one update.

The CPU's side of :mod:`lightning_sparse.optim.joint`: the rounds' keys over all the collection's tables
(``table << shift | row``) are sorted once; one ``F.embedding_bag`` sums each distinct key's gradient (its ids' bags'
gradients, times their weights), and the optimizer's rule runs once on all the tables' rows
(:func:`~lightning_sparse.optim.update.torch_update`, the arithmetic of :mod:`lightning_sparse.optim.functional`). Each
table keeps its own shard and state, so reading and writing rows is one op per table (:class:`Tables`); the scalars
that differ per table (Adagrad's decayed learning rate, Adam's step size) become one value per row. With numba
(:func:`~lightning_sparse.kernels.uses_numba`, as the per-table path) the rule runs as numba's fused update instead, one
call per table on its distinct rows and their sums (:func:`~lightning_sparse.kernels.update_rows`).

The sums add each key's gradients in the order of its ids, as the engine's backward does, and the arithmetic is the
per-table path's, op for op: a collection trains bitwise as when its tables step one by one.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sparse.kernels import RuleState, Runs, UpdateRule, update_rows, uses_numba
from lightning_sparse.kernels.rows import copy_rows
from lightning_sparse.optim import fused
from lightning_sparse.optim.update import torch_update
from lightning_sparse.wire.grouping import SortedKeys

if TYPE_CHECKING:
    from lightning_sparse.tables.embedding import SparseEmbedding


class Tables:
    """The tables' shards seen as one at the distinct rows of a step, table after table: one op per table.

    What the functional updates index (``index_select``, ``index_add_``, ``index_copy_`` along dim 0): each table's
    shard at its own rows; the ``rows`` argument (the rows of the joined state) is ignored.
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
            copy_rows(t, r, v)


class KeptStates:
    """A collection's tables' per-row optimizer state, one tensor per state key, each table's state a view of it.

    So the rule reads and writes the state of all the tables' rows in one op. Joined at the first joint step (one copy)
    and kept while the optimizer holds those views; a state loaded anew (``load_state_dict``) is joined again. The
    optimizer's ``state_dict`` holds the views, which share one storage: saved once, as many tensors.
    """

    def __init__(self) -> None:
        self._kept: weakref.WeakKeyDictionary[object, tuple[list[tuple[int, str, Tensor]], dict[int, Tensor]]] = (
            weakref.WeakKeyDictionary()
        )

    def joined(self, unit: object, states: list[dict[str, Tensor]]) -> dict[int, Tensor]:
        """The tables' per-row state (``states``, in the tables' order) joined: each view's ``id`` -> its joint tensor."""
        views, joint = self._kept.get(unit, ([], {}))
        if views and all(index < len(states) and states[index].get(key) is view for index, key, view in views):
            return joint
        views, joint = [], {}
        for key in [k for k, v in states[0].items() if isinstance(v, Tensor) and v.dim() > 0]:
            whole = torch.cat([state[key] for state in states])
            for index, (state, view) in enumerate(zip(states, whole.split([len(state[key]) for state in states]))):
                state[key] = view
                views.append((index, key, view))
                joint[id(view)] = whole
        self._kept[unit] = (views, joint)
        return joint


def update(tables: list[SparseEmbedding], keys: Tensor, values: Tensor, sources: Tensor, weights: Tensor | None,
           rules: dict[int, UpdateRule], mean: bool, shift: int, joint: dict[int, Tensor]) -> None:  # fmt: skip
    """Update the tables ``rules`` names (each with its rule and its step's scalars) from the rounds' gradient.

    Key ``i`` (``table << shift | row``) gets ``values[sources[i]] * weights[i]``; ``mean``: each row's sum is divided
    by its number of ids. ``joint``: the tables' state joined (:meth:`KeptStates.joined`), which the rules read. One
    host read: the number of distinct keys of each table.
    """
    runs = SortedKeys(keys, len(tables) << shift)
    bounds = torch.tensor([t << shift for t in range(len(tables) + 1)], dtype=runs.sorted.dtype)  # (it fits: the sort's)
    below = runs.counts_below(bounds).tolist()  # the host read
    offsets = torch.nonzero_static(runs.is_first, size=below[-1]).view(-1)  # where each distinct key's run starts
    unique = runs.sorted.index_select(0, offsets).to(torch.int64)
    sizes = [high - low for low, high in zip(below, below[1:])]
    stepped = [t for t in range(len(tables)) if sizes[t]]  # the tables of the keys (each in ``rules``)
    if not stepped:
        return
    by_bag = sources.index_select(0, runs.perm)
    sorted_weights = weights.index_select(0, runs.perm) if weights is not None else None
    grad = F.embedding_bag(by_bag, values, offsets, mode="sum", per_sample_weights=sorted_weights)
    if mean:  # each row's number of ids
        grad = grad / torch.diff(offsets, append=offsets.new_full((1,), len(keys))).to(grad.dtype).unsqueeze(1)
    for t in stepped:
        tables[t].stats.unique_ids += sizes[t]
    rows = (unique & ((1 << shift) - 1)).split(sizes)
    if uses_numba(values) and all(fused.applies(tables[t], rules[t].family) for t in stepped):  # numba's, one call a table
        for t, table_grad in zip(stepped, grad.split([sizes[t] for t in stepped])):
            update_rows(Runs(rows[t]), table_grad, tables[t].shard, rules[t])
        return
    # A key's row in the joined state: its row, after the rows of the tables before its table.
    before = list(itertools.accumulate((len(t.shard) for t in tables[:-1]), initial=0))
    before = [rows_before - (i << shift) for i, rows_before in enumerate(before)]
    joint_rows = unique + torch.repeat_interleave(torch.tensor(before), torch.tensor(sizes), output_size=below[-1])
    at, first = [rows[t] for t in stepped], rules[stepped[0]]
    rule = replace(first, state=RuleState(*(joint[id(v)] if v is not None else None for v in first.state)),
                   lr=_per_row([rules[t].lr for t in stepped], at, first.family),
                   step_size=_per_row([rules[t].step_size for t in stepped], at, first.family))  # fmt: skip
    torch_update(rule, Tables([tables[t].shard for t in stepped], at), joint_rows, grad, step=0)


def _per_row(scalars: list[float], rows: list[Tensor], family: str) -> float | Tensor:
    """One scalar for every table's rows, or (tables at different steps) each row its table's, in float32 as torch
    casts a number: ``[rows]`` for row-wise Adagrad's per-row scale, else ``[rows, 1]``."""
    if all(s == scalars[0] for s in scalars):
        return scalars[0]
    sizes = torch.tensor([len(r) for r in rows])
    per_row = torch.repeat_interleave(torch.tensor(scalars, dtype=torch.float32), sizes, output_size=int(sizes.sum()))
    return per_row if family == "rowwise_adagrad" else per_row.unsqueeze(1)
