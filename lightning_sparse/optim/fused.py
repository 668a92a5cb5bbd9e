"""A table's step through the fused update (:func:`~lightning_sparse.kernels.update_rows`): Triton on a GPU, numba on a CPU.

The optimizer's :class:`~lightning_sparse.kernels.UpdateRule` says which family, which state and the step's scalars
(learning rate, step size). Two ways to hand the scalars over:

* as kernel arguments, computed on the host from the host's step count (the default);
* ``capturable=True``: computed on the device from a device step count and written into the
  table's entry of a one-table :class:`~lightning_sparse.kernels.runs.TableSet`, which the kernel
  reads. The entry (the table's and its state's addresses, then the scalars) is made once and
  kept while those tensors stay where they are, so a step captured in a CUDA graph replays the
  same entry with new scalars: the step reads no host value. A collection's tables on one GPU
  keep one entry for all of them (:mod:`lightning_sparse.optim.joint`), each table's scalars from
  its own count.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_sparse.kernels import (
    RuleState,
    Runs,
    StochasticRounding,
    TableSet,
    UpdateRule,
    sort_runs,
    table_entries,
    update_rows,
    uses_numba,
    uses_triton,
)
from lightning_sparse.kernels.host import KeptValues
from lightning_sparse.kernels.rounding import noise_salt

if TYPE_CHECKING:
    from lightning_sparse.optim.row_grads import TableGrads
    from lightning_sparse.tables.embedding import SparseEmbedding


# The families whose CPU step numba's fused update makes faster than the torch ops (benchmarks/single_process.py, 1M x 64,
# 65,536 skewed ids, 2 threads, quiet 2-core Xeon): Adagrad 2.19x -> 2.50x torch's, Adam 2.05x -> 3.49x; SGD's step
# (one index_add_) went from 17.6 to 19.9 ms and row-wise Adagrad's from 21.7 to 24.7 ms with it, so they keep the torch ops.
NUMBA_FAMILIES = ("adagrad", "adam")


def applies(table: SparseEmbedding, family: str) -> bool:
    """Whether the fused kernel steps ``table`` with ``family``'s rule: Triton for its device, and float32, bf16, or fp16
    rounded to nearest; or numba for a CPU table of float32 or float64 and a family in :data:`NUMBA_FAMILIES` (a half
    table's rounding stays with the torch ops)."""
    if uses_numba(table.shard):
        return family in NUMBA_FAMILIES and table.dtype in (torch.float32, torch.float64) and table.shard.is_contiguous()
    fusable = table.dtype in (torch.float32, torch.bfloat16) or (
        table.dtype == torch.float16 and table.stochastic_rounding is False
    )
    return fusable and uses_triton(table.shard)


def check_capturable(optimizer: str, table: SparseEmbedding, family: str) -> None:
    """``capturable=True`` on a GPU needs the fused update without stochastic rounding, which read no host value."""
    if table.device.type != "cuda" and not uses_triton(table.shard):
        return  # elsewhere the step counts on the table's device too, and its host reads are no GPU's
    if not (applies(table, family) and rounding(table, 0) is None):
        raise ValueError(
            f"{optimizer}(capturable=True) cannot step {table.name} ({table.dtype}) without reading the host: it needs "
            f"the fused update (float32, bf16 or fp16 tables with Triton), and no stochastic rounding, whose draws are "
            f"keyed by the host's step count. HINT: stochastic_rounding=False for a half table, or capturable=False."
        )


def rounding(table: SparseEmbedding, step: int) -> StochasticRounding | None:
    """A bf16 table's stochastic rounding at its ``step``-th update; local row ``r`` is global ``r * mul + add``."""
    if table.dtype != torch.bfloat16 or table.stochastic_rounding is False:
        return None
    sharding, rank = table.sharding, table.rank
    if sharding.scheme == "mod":
        return StochasticRounding(noise_salt(table.seed, step), sharding.world_size, rank)
    return StochasticRounding(noise_salt(table.seed, step), 1, rank * sharding.block_size)


class KeptTableSets:
    """Capturable steps' ``TableSet`` entries (a table's, or a collection's tables'), kept on the device while their
    tensors stay put (:class:`~lightning_sparse.kernels.host.KeptValues`: a captured step reads no host memory)."""

    def __init__(self) -> None:
        self._kept: weakref.WeakKeyDictionary[object, KeptValues] = weakref.WeakKeyDictionary()

    def table_set(self, owner: object, tables: list[SparseEmbedding], rule: UpdateRule, states: list[RuleState], shift: int,
                  *, like: int = 0, counted: bool = True) -> TableSet:  # fmt: skip
        """``tables`` as one set (keys ``table << shift | row``), each with its ``states``; ``rule``'s scalars written by
        device ops (a fill or a copy each): one value for every table, or (a tensor) one per table.

        ``owner``: the table or collection the entry belongs to. ``like``: the table whose tensors give the dtypes;
        ``counted``: whether the launch counts each table's distinct keys (its counter is in its entry).
        """
        from lightning_sparse.kernels.triton_runs import ENTRY

        counters = [t.stats.on_device("unique_ids", t.device) for t in tables]
        kept = self._kept.setdefault(owner, KeptValues())  # made anew when its state is loaded anew
        entries = table_entries([t.shard for t in tables], states, counters, [(0.0, 0.0, 1.0)] * len(tables), kept=kept)
        scalars = entries.view(torch.float64)
        for name, value in (("lr", rule.lr), ("step_size", rule.step_size), ("decay", 1.0 - rule.lr * rule.weight_decay)):
            column = scalars[:, ENTRY.index(name)]
            column.copy_(value) if isinstance(value, Tensor) else column.fill_(value)
        return TableSet(entries, shift, tables[like].shard, states[like], counters[like] if counted else None)


def update(table: SparseEmbedding, grads: TableGrads, rule: UpdateRule, mean: bool, *, step: int = 0,
           table_sets: KeptTableSets | None = None) -> None:  # fmt: skip
    """Sum each row's gradient and apply ``rule``: one sort, one fused launch.

    ``step``: the table's host step count (for a bf16 table's rounding draws); ``table_sets``: the
    optimizer's, when it is capturable (``rule``'s scalars are then tensors on the device, or constants).
    """
    runs = Runs(grads.rows) if grads.distinct else sort_runs(grads.rows, table.sharding.key_bound)
    unique = table.stats.on_device("unique_ids", table.device) if grads.per_id else None
    if table_sets is not None:
        shift = max(1, table.shard.shape[0].bit_length())
        target, draws = table_sets.table_set(table, [table], rule, [rule.state], shift, counted=grads.per_id), None
    else:
        target, draws = table.shard, rounding(table, step)
    update_rows(
        runs, grads.values, target, rule, counts=grads.counts, mean=mean, divisor=table.world_size * table.replicas,
        rounding=draws, verdict=table.range_check.device_verdict if grads.per_id else None, unique=unique,
    )  # fmt: skip
