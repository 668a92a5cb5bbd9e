"""What a lookup reads: of a table (:class:`ShardedTable`) and of a lookup unit (:class:`LookupUnit`).

A lookup unit is a set of tables looked up in one round: a
:class:`~lightning_sparse.SparseEmbeddingCollection`, or a single table as a collection of one
(:class:`OneTable`). The engine (:mod:`lightning_sparse.lookup.engine`) needs nothing else of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lightning_sparse.lookup.features import FeatureIds, Problem, read_ids
from lightning_sparse.wire.sharding import JointSharding

if TYPE_CHECKING:
    import torch.distributed as dist

    from lightning_sparse.lookup.pending import PendingGrads
    from lightning_sparse.lookup.range_check import RangeCheck
    from lightning_sparse.wire.alltoall import ExchangeStats
    from lightning_sparse.wire.sharding import RowSharding


class ShardedTable(Protocol):
    """What a lookup reads of a table (:class:`~lightning_sparse.SparseEmbedding` is one): its shard,
    where its rows live, and where its gradients and stats go. This module needs nothing else of it.
    """

    name: str
    table_index: int
    num_embeddings: int
    embedding_dim: int
    output_dtype: torch.dtype | None
    resolves_ids: bool
    pending: PendingGrads
    range_check: RangeCheck
    stats: ExchangeStats

    @property
    def shard(self) -> Tensor: ...
    @property
    def sharding(self) -> RowSharding: ...
    @property
    def process_group(self) -> dist.ProcessGroup | None: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...


class LookupUnit(Protocol):
    """What the engine reads of a lookup unit: its tables, their joint sharding and its features.

    :class:`~lightning_sparse.SparseEmbeddingCollection` is one; :class:`OneTable` makes one of a table.
    """

    name: str
    unit_index: int  # its position among the module's lookup units (set by the strategy)
    stats: ExchangeStats
    feature_names: list[str]
    table_of_feature: list[int]
    feature_pooling: list[str]

    @property
    def table_list(self) -> list[ShardedTable]: ...
    @property
    def joint_sharding(self) -> JointSharding: ...
    @property
    def rank(self) -> int: ...
    def describe_feature(self, index: int) -> str: ...
    def read(self, inputs: Any) -> tuple[list[FeatureIds], Problem, Tensor | None]:
        """This rank's input as features (:mod:`lightning_sparse.lookup.features`), without raising."""


class OneTable:
    """A table as a lookup unit of one: one feature, named like the table, unpooled."""

    table_of_feature = [0]
    feature_pooling = ["none"]

    def __init__(self, table: ShardedTable) -> None:
        self.table = table
        self._joint: JointSharding | None = None

    name = property(lambda self: self.table.name)
    unit_index = property(lambda self: self.table.table_index)
    stats = property(lambda self: self.table.stats)
    feature_names = property(lambda self: [self.table.name])
    table_list = property(lambda self: [self.table])
    rank = property(lambda self: self.table.rank)

    @property
    def joint_sharding(self) -> JointSharding:
        """The table's sharding as a joint one of one table (its keys are the table's own owner-major keys)."""
        if self._joint is None or self._joint.shardings[0] != self.table.sharding:
            self._joint = JointSharding((self.table.sharding,))
        return self._joint

    def describe_feature(self, index: int) -> str:
        return self.table.name

    def read(self, ids: Any) -> tuple[list[FeatureIds], Problem, None]:
        """The table's ids as the unit's one feature."""
        read, problem = read_ids(ids, self.table.name, self.table.device)
        return read, problem, None
