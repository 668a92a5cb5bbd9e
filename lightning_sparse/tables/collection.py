"""SparseEmbeddingCollection: many tables, many features, one exchange round per lookup.

The module holds the tables and says which feature reads which table and how it is pooled. Its
lookup path is chosen when its tables are placed: in one process, every feature at once
(:class:`~lightning_sparse.lookup.joint.Joint`: on one GPU one kernel per (dim, dtype) of its tables, a
dynamic table's ids turned into rows first; on a CPU, with float32 tables of one dim, one gather per feature);
elsewhere the engine's rounds
(:class:`~lightning_sparse.lookup.engine.Round`), as for a single table, after its dynamic tables
turned their ids into rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sparse.kernels import backend
from lightning_sparse.lookup import compiled
from lightning_sparse.lookup import joint as joint_lookup
from lightning_sparse.lookup.engine import Round
from lightning_sparse.lookup.features import POOLING, FeatureIds, JaggedIds, Problem, as_feature_dict, read_features
from lightning_sparse.lookup.pending import PendingGrads
from lightning_sparse.lookup.range_check import RangeCheck
from lightning_sparse.tables.dynamic import rows_of_features
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.wire.alltoall import ExchangeStats
from lightning_sparse.wire.exchange import Route
from lightning_sparse.wire.sharding import JointSharding


class TableDict(nn.Module):
    """A collection's tables by name, in order: like ``nn.ModuleDict``, but any name works.

    ``nn.ModuleDict`` refuses names of its own attributes, and "items", "keys" or "values" are
    natural table names in a recommender. Tables are reached with ``tables["items"]``.
    """

    def __init__(self, tables: Mapping[str, SparseEmbedding]) -> None:
        super().__init__()
        for name, table in tables.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"Invalid table name {name!r}. HINT: use a non-empty name without '.'.")
            self._modules[name] = table  # not add_module: it refuses names like "items"

    def __getitem__(self, name: str) -> SparseEmbedding:
        return self._modules[name]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Any:
        return iter(self._modules)

    def __contains__(self, name: object) -> bool:
        return name in self._modules

    def keys(self) -> list[str]:
        return list(self._modules)

    def values(self) -> list[SparseEmbedding]:
        return list(self._modules.values())

    def items(self) -> list[tuple[str, SparseEmbedding]]:
        return list(self._modules.items())


class SparseEmbeddingCollection(nn.Module):
    """Several SparseEmbedding tables looked up together: all features of a batch in one exchange round.

    Args:
        tables: name -> :class:`SparseEmbedding` (each with its own size, dim, dtype, init, seed
            and sharding scheme; all over the same process group).
        features: feature name -> table name; default: one feature per table, named like it.
            Several features may read one table (a user's clicked items and the candidate item):
            their ids are deduplicated together.
        pooling: ``"none"`` (one row per id, shaped like the ids), ``"sum"`` or ``"mean"`` (one row
            per bag, as ``nn.EmbeddingBag``: an empty bag gives zeros, for ``"mean"`` too); one
            mode for all features, or a dict feature -> mode (missing features: ``"none"``).
            Per-id weights (``JaggedIds(weights=...)``) need ``"sum"``: a weighted sum.

    ``collection({"user": user_ids, "item": JaggedIds(...)})`` returns a dict with the given
    features' outputs. A lookup is a collective: every rank of the group must call it, with the
    same features or a subset of them (a rank may leave a feature out or give it no ids).
    All tables' ids go to their owners in one all-to-all and their rows come back in one; the
    optimizer later sends all tables' gradients in one round, as for separate tables. The
    gradient of a row is the one of :class:`SparseEmbedding` (summed over its occurrences on a
    rank, over all features that read the table), so sparse optimizers apply the same
    semantics, ``duplicate_grads`` included.

    A sparse optimizer takes the collection itself (``SparseAdagrad([collection], lr=0.1)``) or
    its tables. Checkpoints, export and the strategy treat its tables as any other
    SparseEmbedding (state-dict keys ``<collection>.tables.<name>.*``).
    """

    def __init__(
        self,
        tables: Mapping[str, SparseEmbedding],
        features: Mapping[str, str] | None = None,
        pooling: str | Mapping[str, str] = "none",
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("A SparseEmbeddingCollection needs at least one table. HINT: {'user': SparseEmbedding(...)}.")
        for name, table in tables.items():
            if not isinstance(table, SparseEmbedding):
                raise TypeError(f"Table {name!r} is a {type(table).__name__}, not a SparseEmbedding. HINT: build it as "
                                f"lightning_sparse.SparseEmbedding(num_embeddings, embedding_dim).")  # fmt: skip
        shared = [name for name, table in tables.items() if getattr(table, "shared_memory", False)]
        if shared:
            raise ValueError(f"Tables {shared} have shared_memory=True, which a collection's rounds do not use. HINT: look them "
                             f"up as tables of their own, or build them without shared_memory.")  # fmt: skip
        if len({id(t) for t in tables.values()}) != len(tables):
            raise ValueError("The same SparseEmbedding appears under two names. HINT: map two features to one table "
                             "with features={'clicked': 'item', 'candidate': 'item'}.")  # fmt: skip
        self.tables = TableDict(tables)
        features = dict(features) if features is not None else {name: name for name in tables}
        for feature, table in features.items():
            if table not in tables:
                raise ValueError(f"Feature {feature!r} reads table {table!r}, which is not in the collection "
                                 f"({list(tables)}). HINT: features maps feature name -> table name.")  # fmt: skip
        modes = {name: pooling for name in features} if isinstance(pooling, str) else {n: "none" for n in features}
        if not isinstance(pooling, str):
            unknown = set(pooling) - set(features)
            if unknown:
                raise ValueError(f"pooling names unknown features {sorted(unknown)}; the features are {list(features)}. "
                                 f"HINT: key pooling by feature name, as features is.")  # fmt: skip
            modes.update(pooling)
        for name, mode in modes.items():
            if mode not in POOLING:
                raise ValueError(f"Invalid pooling {mode!r} for feature {name!r}. HINT: use one of {POOLING}.")
        names = list(tables)
        self.feature_names = list(features)
        self.feature_tables = [features[f] for f in self.feature_names]
        self.table_of_feature = [names.index(t) for t in self.feature_tables]
        self.feature_pooling = [modes[f] for f in self.feature_names]
        self.name = "SparseEmbeddingCollection"
        self.has_given_name = False
        self.stats = ExchangeStats()
        # Set by a strategy: this collection's position among the lookup units (tables, then collections).
        self.unit_index = -1
        self._joint: JointSharding | None = None
        self.pending = PendingGrads()  # a round's gradient over all tables, on one GPU (lookup/joint.py)
        self.range_check = RangeCheck()
        self.lookups: joint_lookup.Joint | Round | None = None  # its lookup path: chosen when its tables are placed
        self._placed_as: tuple | None = None  # what the path was chosen for
        joint_lookup.hold(self)  # the optimizer finds the collection's rounds on one GPU through its tables
        self.compile_token = compiled.register(self)

    def __setstate__(self, state: dict[str, Any]) -> None:  # a copy holds its own tables (weak references do not pickle)
        super().__setstate__(state)
        for unit in [self, *getattr(self.lookups, "parts", [])]:  # and its parts on one GPU (lookup.units.Part)
            joint_lookup.hold(unit)
        compiled.register_copy(self)

    # ------------------------------------------------------------------ placement
    @property
    def table_list(self) -> list[SparseEmbedding]:
        return list(self.tables.values())

    @property
    def lookup_unit(self) -> SparseEmbeddingCollection:
        """The collection is its own lookup unit (a table's is :class:`~lightning_sparse.lookup.units.OneTable`)."""
        return self

    @property
    def rank(self) -> int:
        return self.table_list[0].rank

    @property
    def joint_sharding(self) -> JointSharding:
        """All tables' rows in one key space (kept while the placement stays the same)."""
        shardings = tuple(t.sharding for t in self.table_list)
        if self._joint is None or self._joint.shardings != shardings:
            self._joint = JointSharding(shardings)
        return self._joint

    def materialize(self) -> SparseEmbeddingCollection:
        """Materialize every table (they must share their process group and device), and choose the lookup path."""
        tables = self.table_list
        for table in tables:
            table.materialize()
        first = tables[0]
        for table in tables[1:]:
            if (table.world_size, table.process_group, table.device) != (first.world_size, first.process_group, first.device):
                raise ValueError(f"{table.name} and {first.name} are placed differently (process group or device). "
                                 f"HINT: the tables of a collection share one process group and device.")  # fmt: skip
        placed_as = (first.world_size, first.device, first.dtype, backend.choice())
        if placed_as != self._placed_as:
            self.lookups = joint_lookup.Joint(self) if joint_lookup.fits(self) else Round(self)
            self._placed_as = placed_as
        return self

    def adopt(self, name: str, unit_index: int) -> None:
        """Called by the strategy: this collection's module path and its position among the lookup units."""
        if not self.has_given_name:
            self.name = name or self.name
        self.unit_index = unit_index

    def describe_feature(self, index: int) -> str:
        """``"feature 'f' (table 't') of <name>"`` for error messages."""
        if 0 <= index < len(self.feature_names):
            return f"Feature {self.feature_names[index]!r} (table {self.feature_tables[index]!r}) of {self.name}"
        return self.name

    # ------------------------------------------------------------------ lookups
    def forward(self, features: Mapping[str, Any] | Any) -> dict[str, Tensor]:
        """Rows (``pooling="none"``: ``[*ids.shape, dim]``) or pooled bags (``[bags, dim]``) per given feature.

        ``features``: feature name -> ids tensor or :class:`~lightning_sparse.lookup.features.JaggedIds`,
        or a TorchRec ``KeyedJaggedTensor``. Collective: every rank of the group must call it
        (see the class docstring), in the same order as the other tables and collections of the
        group. Differentiable with respect to the rows (and per-id weights) when grad mode is on.
        Under ``torch.compile`` the lookup is one opaque op (:mod:`lightning_sparse.lookup.compiled`).
        """
        if torch.compiler.is_compiling():
            given = as_feature_dict(features)
            if given is not None and compiled.traceable(given):
                return dict(zip(given, compiled.run_op(self, given)))
        return self.lookup_features(features)

    def eager_lookup(self, features: Mapping[str, Any]) -> list[Tensor]:
        """The compiled op's run-time work (:mod:`lightning_sparse.lookup.compiled`): the outputs, in the features' order."""
        out = self.lookup_features(features)
        return [out[name] for name in features]

    def output_specs(self, features: Mapping[str, Any]) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
        """The shape, dtype and device of each output of :meth:`forward` for ``features`` (the compiled op's fake kernel)."""
        specs = []
        for name, given in features.items():
            index = self.feature_names.index(name) if name in self.feature_names else 0  # an unknown name raises at run time
            table, mode = self.table_list[self.table_of_feature[index]], self.feature_pooling[index]
            if isinstance(given, JaggedIds):
                rows = len(given.values) if mode == "none" else given.num_bags
                shape = (rows,)
            else:
                shape = tuple(given.shape) if mode == "none" else (given.shape[0],)
            specs.append(((*shape, table.embedding_dim), table.output_dtype or table.dtype, table.device))
        return specs

    @torch.compiler.disable
    def lookup_features(self, features: Mapping[str, Any] | Any) -> dict[str, Tensor]:
        """The eager lookup of :meth:`forward` (never traced by dynamo: see :mod:`lightning_sparse.lookup.compiled`)."""
        for table in self.table_list:
            table.check_first_lookup()
        return self.materialize().lookups.lookup(features)

    def read(self, features: Mapping[str, Any] | Any) -> tuple[list[FeatureIds], Problem, Tensor | None]:
        """This rank's features as a round reads them; a dynamic table's ids turned into rows first (a round per table)."""
        read, problem, bad_offsets = read_features(features, self.feature_names, self.table_of_feature, self.feature_pooling,
                                                   self.table_list[0].device)  # fmt: skip
        return rows_of_features(self.table_list, read), problem, bad_offsets

    def serve(self, route: Route) -> None:
        """Answer a round of this collection's lookups made by other ranks (see ``serve_lookups``)."""
        self.materialize().lookups.serve(route)

    def extra_repr(self) -> str:
        pooled = {f: m for f, m in zip(self.feature_names, self.feature_pooling) if m != "none"}
        mapped = {f: t for f, t in zip(self.feature_names, self.feature_tables) if f != t}
        return ", ".join(part for part in (f"features={mapped}" if mapped else "", f"pooling={pooled}" if pooled else "") if part)
