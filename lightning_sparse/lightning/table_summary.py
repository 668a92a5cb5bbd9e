"""The tables beside Lightning's model summary, which counts parameters only (a table's shard is not one).

The strategy logs it on rank 0 when the Trainer has a model summary (``enable_model_summary``),
right before Lightning's own table. Each table: its rows and dim, dtype, how it is sharded, and
what one rank holds: rows, the shard's bytes and its optimizer state's bytes.

>>> import lightning_sparse as ls
>>> print(summarize([ls.SparseEmbedding(1000, 8, name="users")], []))  # doctest: +NORMALIZE_WHITESPACE
  | Table | Rows  | Dim | Dtype   | Sharding        | Rows per rank | Bytes per rank | Optimizer state per rank
---------------------------------------------------------------------------------------------------------------
0 | users | 1.0 K | 8   | float32 | mod over 1 rank | 1.0 K         | 32.0 KB        | 0 B
---------------------------------------------------------------------------------------------------------------
Sparse tables: 1.0 K rows, 32.0 KB per rank, 0 B of optimizer state per rank
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from lightning_sparse.optim.base import SparseOptimizer
    from lightning_sparse.tables.embedding import SparseEmbedding

HEADER = ("", "Table", "Rows", "Dim", "Dtype", "Sharding", "Rows per rank", "Bytes per rank", "Optimizer state per rank")


def summarize(tables: list[SparseEmbedding], optimizers: list[SparseOptimizer]) -> str:
    """The tables as a table, with this rank's share (materializes them), then the totals."""
    rows, total_rows, total_bytes, total_state = [], 0, 0, 0
    for index, table in enumerate(tables):
        shard = table.shard
        state = sum(_bytes(value) for optimizer in optimizers if shard in optimizer.tracked_shards
                    for value in optimizer.state.get(shard, {}).values() if isinstance(value, Tensor) and value.dim())  # fmt: skip
        ranks = f"{table.world_size} rank{'s' if table.world_size > 1 else ''}"
        rows.append((str(index), table.name, _count(table.num_embeddings), str(table.embedding_dim), str(table.dtype).removeprefix("torch."),
                     f"{table.sharding_scheme} over {ranks}", _count(shard.shape[0]), _size(_bytes(shard)), _size(state)))  # fmt: skip
        total_rows, total_bytes, total_state = total_rows + table.num_embeddings, total_bytes + _bytes(shard), total_state + state
    widths = [max(len(row[i]) for row in [HEADER, *rows]) for i in range(len(HEADER))]
    line = "-" * (sum(widths) + 3 * (len(widths) - 1))
    lines = [_row(HEADER, widths), line, *(_row(row, widths) for row in rows), line]
    lines.append(f"Sparse tables: {_count(total_rows)} rows, {_size(total_bytes)} per rank, {_size(total_state)} of optimizer "
                 f"state per rank")  # fmt: skip
    return "\n".join(lines)


def _row(cells: tuple[str, ...], widths: list[int]) -> str:
    return " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()


def _bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _count(n: int) -> str:
    """Like Lightning's parameter counts: 1.0 K, 2.5 M, 3.0 B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def _size(n: int) -> str:
    """Decimal units, as Lightning's model size in MB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
