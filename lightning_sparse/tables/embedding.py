"""SparseEmbedding: a row-sharded table whose lookups travel to the rows' owners.

This module holds the table: its arguments, its initial rows and its forward. Where its rows
live (``materialize``, the shard) is in ``shard_placement.py``, its state dicts in
``shard_state.py``. A lookup is the engine's (``lookup/engine.py``: the table as a collection of one);
the gradients it leaves for the optimizer are in ``lookup/pending.py``; the optimizer step in
``optim/base.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sparse.kernels import gpu_path
from lightning_sparse.kernels.rounding import HALF
from lightning_sparse.lookup import compiled
from lightning_sparse.lookup.compiled import CompiledLookups
from lightning_sparse.lookup.engine import lookup_ids, serve
from lightning_sparse.lookup.pending import PendingGrads
from lightning_sparse.lookup.range_check import RangeCheck
from lightning_sparse.lookup.units import OneTable
from lightning_sparse.tables import init as row_init
from lightning_sparse.tables.shard_state import ShardStateMixin
from lightning_sparse.wire.alltoall import ExchangeStats
from lightning_sparse.wire.exchange import Route
from lightning_sparse.wire.sharding import SCHEMES

# Elements initialized per chunk. On a CPU the int64/float64 hash temporaries of a chunk stay in
# cache (10x faster for wide tables than one pass). On the GPU's path a chunk only bounds their
# memory (16M elements: 128 MiB a temporary), so a batch's new rows are one chunk (one launch).
_INIT_CHUNK_ELEMENTS, _GPU_INIT_CHUNK_ELEMENTS = 1 << 16, 1 << 24


class SparseEmbedding(ShardStateMixin, CompiledLookups, nn.Module):
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

    The shard is **not** an ``nn.Parameter``: ``parameters()`` yields nothing, so dense
    optimizers and DDP never see it. It still follows ``.to(device)``. Construction allocates
    nothing table-sized; the shard materializes on first use or on :meth:`materialize`.

    Gradient of a row (what a sparse optimizer applies): the sum over its occurrences on each
    rank, averaged over ranks, as DDP scales dense gradients; see the optimizers'
    ``duplicate_grads`` for DGL's mean over occurrences.
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
    ) -> None:
        super().__init__()
        _check_arguments(num_embeddings, embedding_dim, sharding, dtype, stochastic_rounding, output_dtype)
        self.stochastic_rounding = stochastic_rounding  # None: on for half tables (also after .to(torch.bfloat16))
        self.output_dtype = output_dtype
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sharding_scheme = sharding
        self.seed = seed
        self.name = name or f"SparseEmbedding({num_embeddings}, {embedding_dim})"
        self.has_given_name = name is not None
        self._init: row_init.RowInit = init or row_init.normal()
        # Weak references only: destroy_process_group() must really release a group (see ``process_group``).
        if replica_group is not None and process_group is None:
            raise ValueError(
                f"{self.name}: a replica_group needs the sharding group as process_group. "
                f"HINT: shard_group, replica_group = lightning_sparse.sharding_groups(group_size)."
            )
        self._requested_group = weakref.ref(process_group) if process_group is not None else None
        self._group: weakref.ref[dist.ProcessGroup] | None = None  # None: the default group
        self._replica_group = weakref.ref(replica_group) if replica_group is not None else None
        self._rank, self._world_size, self._replicas = 0, 1, 1
        self._materialized = False
        # Before materialization an empty placeholder records the dtype and device that
        # ``.to()`` asks for; after, it is the shard itself (same tensor object for life).
        self._shard = torch.empty(0, embedding_dim, dtype=dtype, device=device)
        self.pending = PendingGrads()
        self.range_check = RangeCheck()  # of one-process GPU lookups (range_check.py)
        self.joint_units: list[weakref.ref] = []  # the collections that hold it (their rounds on one GPU: lookup/joint.py)
        self.stats = ExchangeStats()
        # Set by a strategy that shards this table: its position among the module's tables,
        # which every rank sends along with each lookup.
        self.table_index = -1
        self._first_lookup_checked = False
        self.lookup_unit = OneTable(self)  # this table as a lookup unit of one (units.py)
        self.enable_compiled_lookups()

    def __getstate__(self) -> dict[str, Any]:  # weak references do not pickle: a collection links itself again
        return {**self.__dict__, "joint_units": []}

    def _initial_rows(self, global_ids: Tensor) -> Tensor:
        """The rows a new shard starts with (a subclass may start them otherwise)."""
        return self._init_rows(global_ids)

    def _init_rows(self, global_ids: Tensor) -> Tensor:
        """The rows ``global_ids`` start from, in the shard's dtype and device, a chunk at a time (see the chunks above)."""
        elements = _GPU_INIT_CHUNK_ELEMENTS if gpu_path(global_ids) else _INIT_CHUNK_ELEMENTS
        rows_per_chunk = max(1, elements // self.embedding_dim)
        if len(global_ids) <= rows_per_chunk:  # one chunk: no copy
            return self._init_chunk(global_ids).to(device=self._shard.device, dtype=self._shard.dtype)
        shard = torch.empty(len(global_ids), self.embedding_dim, dtype=self._shard.dtype, device=self._shard.device)
        for start in range(0, len(global_ids), rows_per_chunk):
            chunk = global_ids[start : start + rows_per_chunk]
            shard[start : start + len(chunk)] = self._init_chunk(chunk)
        return shard

    @torch.no_grad()
    def _init_chunk(self, global_ids: Tensor) -> Tensor:
        rows = self._init(global_ids, self.embedding_dim, self.seed)
        if tuple(rows.shape) != (len(global_ids), self.embedding_dim):
            raise ValueError(
                f"init for {self.name} returned shape {tuple(rows.shape)} for {len(global_ids)} ids. "
                f"HINT: init(global_ids, embedding_dim, seed) must return [len(global_ids), embedding_dim]."
            )
        return rows

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw this rank's rows from ``init`` and ``seed``."""
        self._shard.copy_(self._init_rows(self.sharding.global_ids(self._rank, device=self.device)))

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> SparseEmbedding:
        # Keep the shard's identity (optimizers hold it) while following .to()/.cuda()/.half().
        self._shard.data = fn(self._shard)
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------ lookups
    def forward(self, ids: Tensor) -> Tensor:
        """Rows for ``ids`` (any shape, integer dtype) -> ``[*ids.shape, embedding_dim]``.

        Collective: every rank of the group must call it (with possibly empty ``ids``), the same
        number of times and in the same order as the other tables it shares the group with.
        Differentiable with respect to the looked-up rows when grad mode is on; the gradient
        waits for a sparse optimizer's ``step()`` and backward communicates nothing. Under
        ``torch.compile`` the lookup is one opaque op (:mod:`lightning_sparse.lookup.compiled`).
        """
        if torch.compiler.is_compiling():
            return compiled.lookup(self, ids)[0]
        return self.lookup_rows(ids)

    @torch.compiler.disable
    def lookup_rows(self, ids: Tensor) -> Tensor:
        """The eager lookup of :meth:`forward` (never traced by dynamo: see :mod:`lightning_sparse.lookup.compiled`)."""
        self.check_first_lookup()
        self.materialize()
        return lookup_ids(self.lookup_unit, ids)

    def eager_lookup(self, ids: Tensor) -> list[Tensor]:
        """The compiled op's run-time work (:mod:`lightning_sparse.lookup.compiled`): the eager lookup's output, as a list."""
        return [self.lookup_rows(ids)]

    def output_specs(self, ids: Tensor) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
        """The shape, dtype and device of :meth:`forward`'s output for ``ids`` (the compiled op's fake kernel)."""
        return [((*ids.shape, self.embedding_dim), self.output_dtype or self.dtype, self.device)]

    def serve(self, route: Route) -> None:
        """Answer a lookup round of this table made by other ranks (see :func:`~lightning_sparse.lookup.engine.serve_lookups`)."""
        serve(self.lookup_unit, route)

    def check_first_lookup(self) -> None:
        """Run :attr:`first_lookup_checks` once (a collection calls it for its tables)."""
        if not self._first_lookup_checked:
            for check in self.first_lookup_checks:
                check(self)
            self._first_lookup_checked = True

    # ------------------------------------------------------------------ pending gradients
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients received so far. Lookups still awaiting their backward stay."""
        self.pending.zero_grad()

    def pending_grads(self) -> list[Tensor]:
        """The row gradients received since the last step (for unscaling, clipping, inspection)."""
        return self.pending.grads()

    # ------------------------------------------------------------------ optimizer hooks
    def watch(self, optimizer: Any) -> None:
        """Called by a sparse optimizer that takes this table. A row's id never changes here: nothing to do.

        (A :class:`~lightning_sparse.tables.dynamic.DynamicEmbedding` keeps the optimizer, to reset
        the state of slots it gives to new ids.)
        """

    def after_step(self) -> None:
        """Called by the sparse optimizer after each step that held this table (a dynamic table expires ids here)."""

    def adopt(self, name: str, table_index: int) -> None:
        """Called by the strategy that shards this table: its module path and position among the tables."""
        if not self.has_given_name:
            self.name = name
        self.table_index = table_index
        self._first_lookup_checked = True

    def extra_repr(self) -> str:
        placement = f"rank={self._rank}/{self._world_size}" if self._materialized else "not materialized"
        return f"{self.num_embeddings}, {self.embedding_dim}, sharding={self.sharding_scheme!r}, {placement}"


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


def full_state_dict(module: nn.Module, state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    """``module.state_dict()`` with every SparseEmbedding shard replaced by its full table.

    Collective: every rank of each table's group must call it. The result holds each table as
    ``<prefix>weight`` of shape ``[num_embeddings, embedding_dim]``, loadable on any number of
    ranks and into ``nn.Embedding`` (a DynamicEmbedding as ``<prefix>ids`` and their rows as
    ``<prefix>weight``, loadable on any number of ranks).
    """
    state_dict = dict(module.state_dict() if state_dict is None else state_dict)
    for name, sub in module.named_modules():
        if isinstance(sub, SparseEmbedding):
            prefix = f"{name}." if name else ""
            for key in sub.sharded_keys():
                state_dict.pop(prefix + key, None)
            state_dict.update({prefix + key: value for key, value in sub.full_tensors().items()})
    return state_dict
