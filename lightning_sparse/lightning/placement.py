"""Placing tables: what the Trainer's and Fabric's ``"sparse_ddp"`` strategies share, and the Trainer's 2-D groups.

Placing a module's tables when a strategy sets it up, the strategies' registration, the check
that refuses any other strategy, the one that finds a table's shard in a dense optimizer, and the
process groups of 2-D sharding (:class:`ShardingGroups`, held by the Trainer's strategy), and the
placed tables beside Lightning's model summary (:func:`summarize`: rows, dim, dtype, sharding, what a rank holds);
what a captured step needs of the optimizers and collections (:func:`optimizer_problems`, :func:`collection_problems`,
:func:`fingerprint`), for the Trainer's and Fabric's captured steps.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_sparse.kernels.rounding import HALF
from lightning_sparse.lightning import compat
from lightning_sparse.tables.collection import SparseEmbeddingCollection
from lightning_sparse.tables.dynamic import DynamicEmbedding
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.wire.replicas import sharding_groups

if TYPE_CHECKING:
    from lightning_sparse.optim.base import SparseOptimizer

log = logging.getLogger("lightning_sparse.lightning.strategy")

STRATEGY_NAME = "sparse_ddp"
_REGISTERED: list[type] = []  # the strategy classes registered as "sparse_ddp": they shard and step tables
# For the error below, per kind of strategy: whose it is, what it would not do, where "sparse_ddp" goes.
_FOREIGN = {
    "Trainer": ("Lightning", "does not shard or step", "the Trainer"),
    "Fabric": ("Fabric", "does not shard, step or save", "Fabric"),
}


def place_tables(
    module: nn.Module,
    shard_group: dist.ProcessGroup | None = None,
    replica_group: dist.ProcessGroup | None = None,
    shared_memory: bool = False,
) -> tuple[list[SparseEmbedding], list[SparseEmbeddingCollection]]:
    """Name, number and shard every table of ``module``; return its tables and its collections.

    Each SparseEmbedding takes its module path as name and its position in ``named_modules`` as
    ``table_index``, and materializes over ``shard_group`` (default: the default group); the
    collections are numbered after the tables. Every rank must place the same module alike: the
    numbers ride with each lookup (:func:`~lightning_sparse.lookup.engine.serve_lookups`). Local only.
    ``shared_memory``: every table of its own (outside a collection, and not a DynamicEmbedding) takes
    ``shared_memory=True`` before it is placed (:meth:`SparseEmbedding.use_shared_memory`).
    """
    tables = [(name, m) for name, m in module.named_modules() if isinstance(m, SparseEmbedding)]
    collections = [(name, m) for name, m in module.named_modules() if isinstance(m, SparseEmbeddingCollection)]
    in_collections = {id(m) for _, collection in collections for m in collection.modules()}
    for index, (name, table) in enumerate(tables):
        table.adopt(name, index)
        if shared_memory and not (table.shared_memory or id(table) in in_collections or isinstance(table, DynamicEmbedding)):
            table.use_shared_memory()
        table.materialize(shard_group, replica_group)
    for index, (name, collection) in enumerate(collections, start=len(tables)):
        collection.adopt(name, index)
        collection.materialize()
    return [t for _, t in tables], [c for _, c in collections]


class ShardingGroups:
    """The groups a strategy places its tables over: groups of ``size`` consecutive ranks (2-D sharding), or all ranks.

    ``size=G`` shards every table over groups of ``G`` ranks and replicates it across the ``W / G``
    groups (:mod:`lightning_sparse.wire.replicas`); ``None``: over all ranks.
    """

    def __init__(self, size: int | None) -> None:
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"Invalid sharding_group_size: {size!r}. HINT: pass a positive divisor of the world size.")
        self.size = size
        self._groups: tuple[dist.ProcessGroup, dist.ProcessGroup | None] | None = None

    def of_rank(self, world_size: int, timeout: timedelta | None) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """(sharding group, replica group) of this rank, made at the first call (every rank must make it), or
        ``(None, None)``: the default group."""
        if self.size is None or self.size == world_size or not dist.is_initialized():
            return None, None
        if self._groups is None:
            try:
                self._groups = sharding_groups(self.size, timeout=timeout)
            except ValueError as err:
                raise MisconfigurationException(str(err)) from None
            log.debug("SparseDDPStrategy: 2-D sharding, groups of %d ranks, %d replicas", self.size, world_size // self.size)
        return self._groups


def register(cls: type, registry: compat.StrategyRegistry) -> None:
    """Register ``cls`` as ``"sparse_ddp"`` in a Trainer or Fabric strategy registry (once)."""
    if cls not in _REGISTERED:
        _REGISTERED.append(cls)
    if STRATEGY_NAME not in registry:
        registry.register(
            STRATEGY_NAME, cls, description="DDP for dense parameters; row-sharded SparseEmbedding tables with sparse optimizers"
        )


def refuse_foreign_strategy(table: SparseEmbedding) -> None:
    """Refuse a table's first lookup under a Trainer or Fabric strategy other than ``"sparse_ddp"``.

    Under plain ``ddp`` or a single-device strategy nothing would step the table (Trainer), or
    ``fabric.save`` would write rank 0's shard only (Fabric). The strategy is found on the call
    stack, so that plain PyTorch use pays nothing but this one look.
    """
    found = compat.running_strategy()
    if found is None or isinstance(found[1], tuple(_REGISTERED)):
        return
    kind, strategy = found
    owner, lacks, where = _FOREIGN[kind]
    raise RuntimeError(
        f"{table.name} is used under {owner}'s {type(strategy).__name__}, which {lacks} SparseEmbeddings. "
        f'HINT: pass strategy="sparse_ddp" to {where} (import lightning_sparse first).'
    )


SparseEmbedding.first_lookup_checks.append(refuse_foreign_strategy)


def shard_in_dense_optimizer(optimizer: Optimizer, tables: list[SparseEmbedding]) -> str | None:
    """The name of a table whose shard ``optimizer`` (a dense one) was given, if any: each strategy raises its own error."""
    shards = {id(t.shard): t.name for t in tables}
    return next((shards[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in shards), None)


# ---------------------------------------------------------------- the tables beside Lightning's model summary
HEADER = ("", "Table", "Rows", "Dim", "Dtype", "Sharding", "Rows per rank", "Bytes per rank", "Optimizer state per rank")


def summarize(tables: list[SparseEmbedding], optimizers: list[SparseOptimizer]) -> str:
    """The tables as a table, with this rank's share (materializes them), then the totals.

    Logged on rank 0 by the Trainer's strategy when the Trainer has a model summary (``enable_model_summary``),
    right before Lightning's own table, which counts parameters only (a table's shard is not one):

    >>> import lightning_sparse as ls
    >>> print(summarize([ls.SparseEmbedding(1000, 8, name="users")], []))  # doctest: +NORMALIZE_WHITESPACE
      | Table | Rows  | Dim | Dtype   | Sharding        | Rows per rank | Bytes per rank | Optimizer state per rank
    ---------------------------------------------------------------------------------------------------------------
    0 | users | 1.0 K | 8   | float32 | mod over 1 rank | 1.0 K         | 32.0 KB        | 0 B
    ---------------------------------------------------------------------------------------------------------------
    Sparse tables: 1.0 K rows, 32.0 KB per rank, 0 B of optimizer state per rank
    """
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


# ---------------------------------------------------------------- what a captured step needs of optimizers and tables
STEPS_WITHOUT_STATE = (torch.optim.SGD,)  # torch optimizers without a step count: capturable without the flag


def optimizer_problems(optimizers: list[Optimizer], scheduler_configs: list[Any]) -> list[tuple[str, str]]:
    """(what, fix) of each optimizer whose step a graph cannot replay, and of each scheduler of a float learning rate."""
    problems = []
    for optimizer in optimizers:
        groups, name = optimizer.param_groups, type(optimizer).__name__
        if isinstance(optimizer, compat.MockOptimizer) or not groups:
            continue
        if all("capturable" in g for g in groups) and not all(g["capturable"] for g in groups):
            problems.append((f"{name}(capturable=False) steps with host values", f"{name}(..., capturable=True)"))
        elif not all("capturable" in g for g in groups) and not isinstance(optimizer, STEPS_WITHOUT_STATE):
            problems.append((f"{name} has no capturable step (its step count is read on the host)",
                             "a torch optimizer with capturable=True (Adam, AdamW), or SGD"))  # fmt: skip
    for config in scheduler_configs:
        optimizer = config.scheduler.optimizer
        if not all(isinstance(g["lr"], Tensor) for g in optimizer.param_groups):
            problems.append((f"{type(config.scheduler).__name__} schedules {type(optimizer).__name__}'s learning rate, a "
                             f"float, which the graph would keep", "give that optimizer lr=torch.tensor(lr) (on the "
                             "optimizer's device for torch's): schedulers then fill the tensor"))  # fmt: skip
    return problems


def collection_problems(collection: SparseEmbeddingCollection) -> list[tuple[str, str]]:
    """(what, fix) of a collection that steps table by table after a host read: one holding a stochastically rounded half table.

    Tables of several dims or dtypes, and dynamic tables, take the joint path on one GPU, in parts
    (:class:`~lightning_sparse.lookup.joint.Joint`): no host read.
    """
    rounded = [t.name for t in collection.table_list if t.dtype in HALF and t.stochastic_rounding is not False]
    if rounded:
        return [(f"the collection of {', '.join(t.name for t in collection.table_list)} holds {', '.join(rounded)}, rounded "
                 f"stochastically (draws keyed by the host's step count): it steps table by table after a host read",
                 "stochastic_rounding=False for its half tables, or leave capture off")]  # fmt: skip
    return []


def fingerprint(optimizers: list[Optimizer]) -> tuple:
    """Where the optimizers' tensors are and their hyperparameters: what a captured step has baked in."""
    parts: list[Any] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            parts += [(k, v.data_ptr() if isinstance(v, Tensor) else v) for k, v in group.items() if k != "params"]
            parts += [p.data_ptr() for p in group["params"]]
        parts += [v.data_ptr() for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)]
    return tuple(parts)
