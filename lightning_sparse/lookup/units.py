"""What a lookup reads: of a table (:class:`ShardedTable`) and of a lookup unit (:class:`LookupUnit`).

A lookup unit is a set of tables looked up in one round: a
:class:`~lightning_sparse.SparseEmbeddingCollection`, or a single table as a collection of one
(:class:`OneTable`). The engine (:mod:`lightning_sparse.lookup.engine`) needs nothing else of them.
On one GPU a collection of tables of several dims or dtypes is looked up in parts of one kind each
(:class:`Part`, :func:`parts_of`; :class:`~lightning_sparse.lookup.joint.Joint`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import Tensor

from lightning_sparse.kernels.bags import Feature
from lightning_sparse.lookup.features import FeatureIds, Problem, read_ids
from lightning_sparse.lookup.pending import PendingGrads
from lightning_sparse.lookup.range_check import RangeCheck
from lightning_sparse.wire.sharding import JointSharding

if TYPE_CHECKING:
    import torch.distributed as dist

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


class ReadFeature(NamedTuple):
    """A given feature as the gather reads it (:func:`~lightning_sparse.lookup.joint.read`)."""

    name: str
    feature: Feature  # what the kernel reads
    shape: tuple[int, ...]  # its output's shape
    dtype_code: int  # its ids' dtype, as the range check reports it


class Part:
    """A share of a collection on the joint path: its tables of one (dim, dtype, output dtype) and the features that read
    them, a lookup unit of its own to the joint gather and step (its record, its range check), named as the collection.
    """

    def __init__(self, collection: LookupUnit, tables: list[int]) -> None:
        self.collection, self.tables = collection, tables  # ``tables``: the collection's indices of the part's tables
        self.features = [i for i, t in enumerate(collection.table_of_feature) if t in tables]  # the collection's indices
        self.feature_names = [collection.feature_names[i] for i in self.features]
        self.table_of_feature = [tables.index(collection.table_of_feature[i]) for i in self.features]
        self.feature_pooling = [collection.feature_pooling[i] for i in self.features]
        self.pending, self.range_check = PendingGrads(), RangeCheck()

    name = property(lambda self: self.collection.name)
    rank = property(lambda self: self.collection.rank)
    table_list = property(lambda self: [self.collection.table_list[t] for t in self.tables])

    def describe_feature(self, index: int) -> str:
        """The collection's words for the part's feature ``index``."""
        return self.collection.describe_feature(self.features[index] if 0 <= index < len(self.features) else -1)


def parts_of(collection: LookupUnit) -> list[LookupUnit | Part]:
    """The collection itself if its tables are of one kind, else one :class:`Part` per (dim, dtype, output dtype), in the
    order of their first tables."""
    kinds: dict[tuple, list[int]] = {}
    for index, t in enumerate(collection.table_list):
        kinds.setdefault((t.embedding_dim, t.dtype, t.output_dtype or t.dtype), []).append(index)
    return [collection] if len(kinds) == 1 else [Part(collection, tables) for tables in kinds.values()]


def resolve_dynamic_ids(unit: LookupUnit | Part, read_in: list[ReadFeature]) -> list[ReadFeature]:
    """``read_in`` with each dynamic table's ids turned into its rows, as the engine's round does it: one ``rows_of`` per
    dynamic table of ``unit`` (slots found or admitted on the device), over its features' ids in the collection's order."""
    for t, table in enumerate(unit.table_list):
        if not table.resolves_ids:
            continue
        mine = sorted((i for i, r in enumerate(read_in) if r.feature.table == t), key=lambda i: read_in[i].feature.report_as)
        ids = [read_in[i].feature.ids for i in mine]
        rows = table.rows_of(torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64, device=table.device))
        for i, feature_rows in zip(mine, rows.split([len(i) for i in ids])):
            read_in[i] = read_in[i]._replace(feature=replace(read_in[i].feature, ids=feature_rows))
    return read_in
