"""Placing a module's tables: what a strategy (Trainer's or Fabric's) does when it sets a module up."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from lightning_sparse.collection import SparseEmbeddingCollection
from lightning_sparse.embedding import SparseEmbedding


def place_tables(
    module: nn.Module, shard_group: dist.ProcessGroup | None = None, replica_group: dist.ProcessGroup | None = None
) -> tuple[list[SparseEmbedding], list[SparseEmbeddingCollection]]:
    """Name, number and shard every table of ``module``; return its tables and its collections.

    Each SparseEmbedding takes its module path as name and its position in ``named_modules`` as
    ``table_index``, and materializes over ``shard_group`` (default: the default group); the
    collections are numbered after the tables. Every rank must place the same module alike: the
    numbers ride with each lookup (:func:`~lightning_sparse.lookup.serve_lookups`). Local only.
    """
    tables = [(name, m) for name, m in module.named_modules() if isinstance(m, SparseEmbedding)]
    for index, (name, table) in enumerate(tables):
        table.adopt(name, index)
        table.materialize(shard_group, replica_group)
    collections = [(name, m) for name, m in module.named_modules() if isinstance(m, SparseEmbeddingCollection)]
    for index, (name, collection) in enumerate(collections, start=len(tables)):
        collection.adopt(name, index)
        collection.materialize()
    return [t for _, t in tables], [c for _, c in collections]
