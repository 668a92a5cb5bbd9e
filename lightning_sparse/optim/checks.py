"""What an optimizer step raises before it updates any row: gradients that are not finite, ids that were out of range.

Both raise on every rank alike and drop the step's gradients, so catching the error and going on is safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_sparse.lookup.joint import raise_failed
from lightning_sparse.lookup.verdict import raise_if_out_of_range

if TYPE_CHECKING:
    from lightning_sparse.optim.row_grads import TableGrads
    from lightning_sparse.tables.collection import SparseEmbeddingCollection
    from lightning_sparse.tables.embedding import SparseEmbedding


def raise_if_not_finite(optimizer_name: str, tables: list[SparseEmbedding], grads: list[TableGrads]) -> None:
    """Every rank learned the same ranks from the exchange, so every rank raises alike (before any update)."""
    bad = [(table.name, table_grads.nonfinite_ranks) for table, table_grads in zip(tables, grads) if table_grads.nonfinite_ranks]
    if bad:
        where = "; ".join(f"{name} on rank(s) {ranks}" for name, ranks in bad)
        raise FloatingPointError(
            f"{optimizer_name}: the sparse gradient is not finite (inf or NaN) for {where}; no row was updated "
            f"and the gradients were dropped. HINT: look for the source (the loss, the learning rate, an fp16 "
            f"overflow: 16-mixed skips such steps by itself); catching this error and going on is safe."
        )


def raise_if_ids_were_out_of_range(tables: list[SparseEmbedding], units: list[SparseEmbeddingCollection]) -> None:
    """A one-process GPU lookup's bad input, once the host has it (:mod:`lightning_sparse.lookup.range_check`): before any update.

    The gradients were taken, so they are dropped, as a CPU lookup would have raised before making them.
    """
    for table in tables:
        failed = table.range_check.failed(table.num_embeddings)
        if failed is not None:
            raise_if_out_of_range(table.lookup_unit, *failed[:2], table.range_check.dtype_code)
    for unit in units:
        raise_failed(unit, unit.range_check.failed(1))
