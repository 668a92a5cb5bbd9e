"""SparseEmbedding: a row-sharded table whose lookups travel to the rows' owners.

The table owns three parts, each with one job: its :class:`~lightning_sparse.tables.placement.Placement`
(which ranks share it, and this rank's place among them), its shard (this rank's rows, made on
:meth:`SparseEmbedding.materialize`), and its lookup path, chosen when it is placed: with one
rank a gather at the ids (:class:`~lightning_sparse.lookup.outputs.Gather`), with several the
engine's rounds (:class:`~lightning_sparse.lookup.engine.Round`). Its whole-table views and state
dicts are in ``shard_state.py``; the gradients it leaves for the optimizer in ``lookup/pending.py``;
the optimizer step in ``optim/base.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse.kernels.rounding import HALF
from lightning_sparse.lookup import compiled
from lightning_sparse.lookup.engine import Round
from lightning_sparse.lookup.outputs import Gather, SharedReads
from lightning_sparse.lookup.pending import PendingGrads
from lightning_sparse.lookup.range_check import RangeCheck
from lightning_sparse.lookup.units import OneTable
from lightning_sparse.tables import init as row_init
from lightning_sparse.tables import shard_state
from lightning_sparse.tables.placement import Move, Placement, empty_rows
from lightning_sparse.wire.alltoall import ExchangeStats
from lightning_sparse.wire.exchange import Route
from lightning_sparse.wire.sharding import SCHEMES


class SparseEmbedding(shard_state.StateDictHooks):
    """An embedding table whose rows are sharded over the ranks of a process group.

    Args:
        num_embeddings: rows of the logical table.
        embedding_dim: width of a row.
        sharding: ``"mod"`` (row ``r`` on rank ``r % W``) or ``"range"`` (contiguous blocks).
        init: a :data:`lightning_sparse.tables.init.RowInit`, ``init(global_ids, embedding_dim, seed)``;
            default ``lightning_sparse.tables.init.normal()`` (std ``1/sqrt(embedding_dim)``).
        seed: initial values depend only on ``(seed, global row id)``, so the same seed gives the
            same logical table on any number of ranks and under both sharding schemes.
        dtype: of the shard. ``torch.bfloat16`` and ``torch.float16`` halve the table's memory:
            the optimizer state stays float32, updates are computed in float32 and written back
            with stochastic rounding (:mod:`lightning_sparse.kernels.rounding`).
        stochastic_rounding: for a half-precision table, ``False`` writes updates back rounded
            to nearest instead (small steps are then lost); default ``True``.
        output_dtype: the dtype lookups return (default: the table's), e.g. ``torch.float32``
            from a bf16 table; the gradient flows back in it.
        device: of the shard.
        process_group: the ranks that share the table; default: the default group at the time
            the shard materializes, or a plain local table when none is initialized. The table
            holds no strong reference to it: ``destroy_process_group()`` releases it.
        replica_group: for 2-D sharding (:mod:`lightning_sparse.wire.replicas`), the ranks that hold
            the same shard in the other sharding groups (``process_group`` is this rank's
            sharding group); the optimizer sums each row's gradient over them, so the replicas
            stay identical. Both come from :func:`lightning_sparse.sharding_groups`.
        name: used in error messages and stats; the strategy sets it to the module path.
        shared_memory: every rank of the group runs on one host: the whole table lives in one shared-memory
            segment that every rank maps, and a lookup reads any owner's rows in place instead of asking the
            owners (:mod:`lightning_sparse.wire.shared_memory`). CPU tables, 1-D sharding; default ``False``.

    The shard is **not** an ``nn.Parameter``: ``parameters()`` yields nothing, so dense
    optimizers and DDP never see it. It still follows ``.to(device)``. Construction allocates
    nothing table-sized; the shard materializes on first use or on :meth:`materialize`. A row's
    gradient: docs/guide/semantics.md.
    """

    # Whether its lookups turn ids into rows first (a DynamicEmbedding's slots): the one-GPU round of a
    # collection takes only tables that do not (lookup/joint.py).
    resolves_ids: ClassVar[bool] = False
    # Called with the table on its first lookup; the strategy adds its check here, so that this
    # module knows nothing of Lightning.
    first_lookup_checks: ClassVar[list[Callable[[SparseEmbedding], None]]] = []

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        sharding: str = "mod",
        init: row_init.RowInit | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool | None = None,
        output_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        replica_group: dist.ProcessGroup | None = None,
        name: str | None = None,
        shared_memory: bool = False,
    ) -> None:
        super().__init__()
        _check_arguments(num_embeddings, embedding_dim, sharding, dtype, stochastic_rounding, output_dtype)
        self.placement = Placement(name or f"SparseEmbedding({num_embeddings}, {embedding_dim})", process_group, replica_group)
        self.stochastic_rounding = stochastic_rounding  # None: on for half tables (also after .to(torch.bfloat16))
        self.output_dtype = output_dtype
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sharding_scheme = sharding
        self.seed = seed
        self.shared_memory = shared_memory
        self.has_given_name = name is not None
        self._init: row_init.RowInit = init or row_init.normal()
        # Before materialization an empty placeholder records the dtype and device that
        # ``.to()`` asks for; after, it is the shard itself (same tensor object for life).
        self._shard = torch.empty(0, embedding_dim, dtype=dtype, device=device)
        self.pending = PendingGrads()
        self.range_check = RangeCheck()  # of one-process GPU lookups (range_check.py)
        self.stats = ExchangeStats()
        # Set by a strategy that shards this table: its position among the module's tables,
        # which every rank sends along with each lookup.
        self.table_index = -1
        self._first_lookup_checked = False
        self.lookup_unit = OneTable(self)  # this table as a lookup unit of one (units.py)
        self.lookups: Gather | Round | Any = None  # its lookup path: chosen when it is placed
        self.compile_token = compiled.register(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        compiled.register_copy(self)

    name = property(lambda self: self.placement.name, lambda self, value: setattr(self.placement, "name", value),
                    doc="Used in error messages and stats (the strategy sets it to the module path).")  # fmt: skip

    # ------------------------------------------------------------------ placement
    world_size = property(lambda self: self.placement.world_size, doc="Ranks the shard is spread over.")
    rank = property(lambda self: self.placement.rank, doc="This rank's place among them.")
    replicas = property(lambda self: self.placement.replicas, doc="Ranks that hold each shard (2-D sharding: > 1).")
    is_materialized = property(lambda self: self.placement.placed)
    device = property(lambda self: self._shard.device)
    dtype = property(lambda self: self._shard.dtype)

    process_group = property(lambda self: self.placement.process_group, doc="The group (``None``: a local table).")
    peers = property(lambda self: self.placement.peers(self.stats, getattr(self.lookups, "fence", None)),
                     doc="Its ranks as the wire takes them (:class:`Peers`).")  # fmt: skip
    sharding = property(lambda self: self.placement.sharding(self.num_embeddings, self.sharding_scheme))

    @property
    def shard(self) -> Tensor:
        """This rank's rows, ``[num_local_rows, embedding_dim]``, in local order (materializes)."""
        self.materialize()
        return self._shard

    def materialize(
        self, process_group: dist.ProcessGroup | None = None, replica_group: dist.ProcessGroup | None = None
    ) -> SparseEmbedding:
        """Place the table (:meth:`Placement.place`), make or cut its shard, and choose its lookup path. Local: no collective.

        Idempotent for the same placement. Returns ``self``.
        """
        move = self.placement.place(process_group, replica_group, self._shard.device)
        if move is not Move.NONE:
            global_ids = self.sharding.global_ids(self.rank, device=self._shard.device)
            if move is Move.CUT:  # a full local table becomes this rank's shard
                rows = empty_rows((len(global_ids), *self._shard.shape[1:]), self._shard.dtype, self._shard.device)
                self._shard.data = torch.index_select(self._shard.data, 0, global_ids, out=rows)
            else:
                self._shard.data = self._initial_rows(global_ids)
        if move is not Move.NONE or self.lookups is None:
            self.lookups = self._lookup_path()
        return self

    def use_shared_memory(self) -> None:
        """Keep the rows in the host's shared memory from the next :meth:`materialize` on, as ``shared_memory=True`` does."""
        self.shared_memory, self.lookups = True, None  # (its lookup path is chosen again)

    def _lookup_path(self) -> Any:
        """The path of this table's lookups on its placement (a subclass may take its own)."""
        if self.world_size == 1:
            return Gather(self.lookup_unit)
        return SharedReads(self.lookup_unit) if self.shared_memory else Round(self.lookup_unit)

    def _initial_rows(self, global_ids: Tensor) -> Tensor:  # the rows a new shard starts with (a subclass may differ)
        return self._init_rows(global_ids)

    def _init_rows(self, global_ids: Tensor) -> Tensor:
        """The rows ``global_ids`` start from under ``init`` and ``seed``."""
        return row_init.init_rows(self._init, global_ids, self.embedding_dim, self.seed, self._shard, self.name)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw this rank's rows from ``init`` and ``seed``."""
        self.shard.copy_(self._initial_rows(self.sharding.global_ids(self.rank, device=self.device)))
        self.rows_written(fenced=False)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> SparseEmbedding:
        # Keep the shard's identity (optimizers hold it) while following .to()/.cuda()/.half().
        self._shard.data = fn(self._shard)
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------ lookups
    def forward(self, ids: Tensor) -> Tensor:
        """Rows for ``ids`` (any shape, integer dtype) -> ``[*ids.shape, embedding_dim]``.

        Collective: every rank of the group must call it (with possibly empty ``ids``), the same
        number of times and in the same order as the other tables it shares the group with.
        Differentiable with respect to the rows; the gradient waits for a sparse optimizer's ``step()``.
        Under ``torch.compile`` the lookup is one opaque op (:mod:`lightning_sparse.lookup.compiled`).
        """
        if torch.compiler.is_compiling():
            return compiled.run_op(self, ids)[0]
        return self.lookup_rows(ids)

    @torch.compiler.disable
    def lookup_rows(self, ids: Tensor) -> Tensor:
        """The eager lookup of :meth:`forward` (never traced by dynamo: see :mod:`lightning_sparse.lookup.compiled`)."""
        self.check_first_lookup()
        return self.materialize().lookups.lookup(ids)[self.name]

    def eager_lookup(self, ids: Tensor) -> list[Tensor]:
        """The compiled op's run-time work (:mod:`lightning_sparse.lookup.compiled`): the eager lookup's output, as a list."""
        return [self.lookup_rows(ids)]

    def output_specs(self, ids: Tensor) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
        """The shape, dtype and device of :meth:`forward`'s output for ``ids`` (the compiled op's fake kernel)."""
        return [((*ids.shape, self.embedding_dim), self.output_dtype or self.dtype, self.device)]

    def serve(self, route: Route) -> None:
        """Answer a lookup round of this table made by other ranks (see :func:`~lightning_sparse.lookup.engine.serve_lookups`)."""
        self.materialize().lookups.serve(route)

    def check_first_lookup(self) -> None:
        """Run :attr:`first_lookup_checks` once (a collection calls it for its tables)."""
        if not self._first_lookup_checked:
            for check in self.first_lookup_checks:
                check(self)
            self._first_lookup_checked = True

    # ------------------------------------------------------------------ pending gradients and the optimizer
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients received so far. Lookups still awaiting their backward stay."""
        self.pending.zero_grad()

    def pending_grads(self) -> list[Tensor]:
        """The row gradients received since the last step (for unscaling, clipping, inspection)."""
        return self.pending.grads()

    def watch(self, optimizer: Any) -> None:
        """Called by a sparse optimizer that takes this table (a dynamic table keeps it, to reset the state of new slots)."""

    def after_step(self) -> None:
        """Called by the sparse optimizer after each step that held this table (a dynamic table expires ids here)."""
        self.rows_written(fenced=True)

    def rows_written(self, fenced: bool) -> None:
        """Every rank wrote its rows (a step, a load): a table in shared memory fences now, or before its next read."""
        if isinstance(self.lookups, SharedReads):
            self.lookups.after_write(fenced)

    def adopt(self, name: str, table_index: int) -> None:
        """Called by the strategy that shards this table: its module path and position among the tables."""
        if not self.has_given_name:
            self.name = name
        self.table_index = table_index
        self._first_lookup_checked = True

    # ------------------------------------------------------------------ the whole table (its state dicts: shard_state.py)
    def full_weight(self) -> Tensor:
        """The logical ``[num_embeddings, embedding_dim]`` table on every rank (for export and tests). Collective."""
        return shard_state.gather_rows(self, self.shard)

    def gather_rows(self, local: Tensor) -> Tensor:
        """A per-row tensor of this rank's rows gathered into global row order, on every rank. Collective."""
        return shard_state.gather_rows(self, local)

    def local_rows(self, full: Tensor) -> Tensor:
        """This rank's rows of a full per-row tensor (the inverse of :meth:`gather_rows`)."""
        return shard_state.local_rows(self, full)

    def extra_repr(self) -> str:
        shared = ", shared_memory=True" if self.shared_memory else ""
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, sharding={self.sharding_scheme!r}{shared}, {self.placement.describe()}"
        )


def _check_arguments(num_embeddings: int, embedding_dim: int, sharding: str, dtype: torch.dtype,
                     stochastic_rounding: bool | None, output_dtype: torch.dtype | None) -> None:  # fmt: skip
    if num_embeddings < 1:
        raise ValueError(f"Invalid num_embeddings: {num_embeddings}. HINT: a table needs at least one row.")
    if embedding_dim < 1:
        raise ValueError(f"Invalid embedding_dim: {embedding_dim}. HINT: rows need at least one column.")
    if sharding not in SCHEMES:
        raise ValueError(f"Invalid sharding: {sharding!r}. HINT: use one of {SCHEMES}.")
    if not dtype.is_floating_point:
        raise ValueError(f"Invalid dtype: {dtype}. HINT: a table holds floating-point rows, e.g. torch.float32.")
    if stochastic_rounding not in (None, True, False) or (stochastic_rounding and dtype not in HALF):
        raise ValueError(f"Invalid stochastic_rounding={stochastic_rounding!r} for dtype {dtype}. HINT: it applies to "
                         f"torch.bfloat16 and torch.float16 tables (True or False).")  # fmt: skip
    if output_dtype is not None and not output_dtype.is_floating_point:
        raise ValueError(f"Invalid output_dtype: {output_dtype}. HINT: a floating dtype, e.g. torch.float32, or None.")
