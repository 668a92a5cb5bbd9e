"""Step 5 of a round: the rows a lookup returns, and where their gradient stops.

A lookup's rows leave the graph at :class:`_RecordedRows`: its backward hands the rows'
gradient to the table's :class:`~lightning_sparse.lookup.pending.LookupRecord` and communicates
nothing. The engine records each table's distinct rows (:func:`distinct_rows`); features read
them with ``index_select`` (:func:`expand_rows`, whose backward is the segment sum of the
lookup's sort) or pool them (:mod:`lightning_sparse.lookup.pooling`). With one rank and one table
there is nothing to deduplicate: :class:`Gather`, the lone table's lookup path, reads the shard
straight at the ids (:func:`gather`), as ``nn.Embedding`` does, and records one gradient row per
id, summed at the optimizer step. A table in one host's shared memory reads every owner's rows so
too, at the ids' keys (:class:`SharedReads`).
Every sum of gradient rows is :func:`lightning_sparse.kernels.segment_sum` (or the fused update).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_sparse.kernels import rows as kernel_rows
from lightning_sparse.kernels import uses_triton
from lightning_sparse.lookup.features import read_ids
from lightning_sparse.lookup.verdict import check_gather, raise_if_out_of_range
from lightning_sparse.wire.shared_memory import Fence, map_segment

if TYPE_CHECKING:
    from lightning_sparse.lookup.pending import LookupRecord
    from lightning_sparse.lookup.units import LookupUnit, ShardedTable
    from lightning_sparse.wire.exchange import Route
    from lightning_sparse.wire.grouping import SortedKeys


class _RecordedRows(torch.autograd.Function):
    """Rows a lookup read, in its output dtype; backward hands their gradient to the lookup's record.

    The gradient arrives in the output dtype (e.g. float32 from a bf16 table) and is summed so.
    """

    @staticmethod
    def forward(ctx: Any, token: Tensor, rows: Tensor, record: LookupRecord, dtype: torch.dtype) -> Tensor:
        ctx.record = record
        return rows.to(dtype) if rows.dtype != dtype else rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, None]:
        ctx.record.add_grad(grad)
        return None, None, None, None


class _Expand(torch.autograd.Function):
    """``rows.index_select(0, inverse)`` for a feature that holds all of its table's ids in the round.

    Backward is the segment sum of the round's sort (``runs``): ``[distinct rows, dim]``, with
    no scatter (autograd's ``index_select`` backward adds with atomics on a GPU, in no fixed order).
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, inverse: Tensor, runs: SortedKeys) -> Tensor:
        ctx.runs = runs
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return ctx.runs.segment_sum(grad), None, None


def _token(device: torch.device) -> Tensor:
    """A leaf that requires grad, so that the autograd function's output does (the rows themselves do not)."""
    return torch.empty(0, device=device, requires_grad=True)


def distinct_rows(table: ShardedTable, rows: Tensor, record: LookupRecord | None) -> Tensor:
    """A table's distinct rows of a lookup in its output dtype; differentiable through ``record`` if given."""
    dtype = table.output_dtype or rows.dtype
    if record is None:
        return rows.to(dtype)
    return _RecordedRows.apply(_token(rows.device), rows, record, dtype)


def expand_rows(rows: Tensor, inverse: Tensor, runs: SortedKeys) -> Tensor:
    """``rows.index_select(0, inverse)`` for a feature that holds all of its table's ids in the round (see :class:`_Expand`)."""
    return _Expand.apply(rows, inverse, runs)


def expand(table: ShardedTable, rows: Tensor, record: LookupRecord | None, runs: SortedKeys, shape: torch.Size) -> Tensor:
    """Step 5 of one table's lookup: its distinct rows, one per id of the sort ``runs``, shaped like the ids (``shape``)."""
    return expand_rows(distinct_rows(table, rows, record), runs.inverse(), runs).view(*shape, table.embedding_dim)


def gather(table: ShardedTable, ids: Tensor, dtype_code: int = -1, source: Tensor | None = None) -> Tensor:
    """One rank, one table: the shard's rows at ``ids`` in the output dtype, recorded for their gradient in grad mode.

    The record keeps its own copy of the ids (int32 where they fit): a caller may reuse its ids
    buffer before backward. On a GPU this is one Triton kernel that also checks the ids
    (:mod:`lightning_sparse.lookup.range_check`; ``dtype_code``: the given ids' dtype, for its
    message): no host read. ``source``: the rows read instead of the shard (a table in shared
    memory: its whole segment, at the ids' keys).
    """
    source = table.shard if source is None else source
    dtype = table.output_dtype or source.dtype
    recording = torch.is_grad_enabled()
    with torch.no_grad():
        if uses_triton(source):
            check = table.range_check
            rows, keys = kernel_rows.gather(source, ids, dtype, check.verdict(source.device), keys=recording)
            check.sent(dtype_code)
        else:  # the ids were checked on the host
            rows = source.index_select(0, ids).to(dtype)
            keys = ids.to(kernel_rows.key_dtype(source.shape[0]), copy=True) if recording else None
    if not recording:
        return rows
    return _RecordedRows.apply(_token(ids.device), rows, table.pending.new_record(None, keys), dtype)


class Gather:
    """A table's lookups with one rank: no round, the rows at the ids, as ``nn.Embedding`` reads them (the lone table's path).

    On a CPU the ids are checked first (one host read). On a GPU the gather checks them on the
    device and the error is raised later without a host read (:mod:`lightning_sparse.lookup.range_check`),
    for an earlier lookup's ids, or at once for a lookup without grad mode (no step to wait for).
    """

    def __init__(self, unit: LookupUnit) -> None:
        self.unit = unit

    def lookup(self, ids: Any) -> dict[str, Tensor]:
        """The table's rows at ``ids``: ``[*ids.shape, dim]``, under the table's name. Bad input raises."""
        table = self.unit.table_list[0]
        read, problem = read_ids(ids, table.name, table.device)
        feature = check_gather(self.unit, read, problem)  # raises for bad input, or a range check that failed
        table.stats.ids_looked_up += len(feature.ids)
        source, at = self._read_at(table, feature.ids)
        rows = gather(table, at, feature.dtype, source)
        if uses_triton(table.shard) and not torch.is_grad_enabled():  # the range check of these ids, read now: no step waits
            raise_if_out_of_range(self.unit, *(table.range_check.failed(table.num_embeddings, wait=True) or (0, 0))[:2],
                                  feature.dtype)  # fmt: skip
        return {feature.name: rows.view(*feature.shape, table.embedding_dim)}

    def _read_at(self, table: ShardedTable, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The tensor a lookup of ``ids`` reads, and the rows it reads there: the lone shard, at the ids."""
        return table.shard, ids

    def serve(self, route: Route) -> None:
        """A lone rank serves nobody; the round's :func:`~lightning_sparse.lookup.engine.serve` would answer."""
        raise RuntimeError(f"{self.unit.name} has one rank: no other rank looks it up. HINT: report this.")


class SharedReads(Gather):
    """A table's lookups when its ranks share one host's memory (``shared_memory=True``): every row read in place, no round.

    The whole table is mapped on every rank in owner-major key order (:mod:`lightning_sparse.wire.shared_memory`),
    each rank's shard its own block, so a lookup is :class:`Gather`'s, reading the segment at its ids' keys
    instead of a lone shard at its ids. It records one gradient row per id, with no route: the step sums
    them by row and sends them to their owners (the general round of
    :func:`~lightning_sparse.wire.grads_exchange.grads_to_owners`), and after the owners' update
    :meth:`after_write` fences. Bad ids raise on the rank that read them (no
    round tells the other ranks: their next collective with it fails, naming the lost rank).

    The segment is made at the first lookup (collective), and again after the shard moved (``.to()``).
    """

    def __init__(self, unit: LookupUnit) -> None:
        table = unit.table_list[0]
        if table.device.type != "cpu":
            raise ValueError(f"{table.name}: shared_memory=True on {table.device}. HINT: a table in shared memory lives in the "
                             f"host's memory: keep it on the CPU, or leave shared_memory off on a GPU.")  # fmt: skip
        if table.replicas > 1:
            raise ValueError(f"{table.name}: shared_memory=True under 2-D sharding ({table.replicas} replicas). HINT: leave "
                             f"replica_group (a strategy's sharding_group_size) out: in shared memory every rank reads every "
                             f"row already.")  # fmt: skip
        super().__init__(unit)
        self.segment: Tensor | None = None  # the whole table, [world_size * block_size, dim], mapped by every rank
        self.fence: Fence | None = None
        self._fence_first = False  # a write that did not fence (a load): the next lookup fences before it reads

    def __getstate__(self) -> dict[str, Any]:
        # A copy (deepcopy, pickle) shares no memory with the ranks: it maps a segment of its own at its next lookup.
        return {"unit": self.unit, "segment": None, "fence": None, "_fence_first": False}

    def _read_at(self, table: ShardedTable, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The whole table's segment (mapped at the first lookup), at the ids' owner-major keys."""
        return self._mapped(table), table.sharding.key(ids)

    def after_write(self, fenced: bool = True) -> None:
        """This rank's rows were written (a step, a load): fence now (every rank calls it), or before the next lookup."""
        if self.fence is None:  # not mapped yet: the rows are this rank's own, and mapping them fences
            return
        if fenced:
            self.fence()
        self._fence_first = not fenced

    def _mapped(self, table: ShardedTable) -> Tensor:
        """The segment, made (collective) if the shard is not a block of it: its first lookup, or after ``.to()``."""
        shard = table.shard
        if self.segment is None or shard.untyped_storage().data_ptr() != self.segment.untyped_storage().data_ptr():
            sharding = table.sharding
            shape = (sharding.key_bound, table.embedding_dim)
            self.segment = map_segment(shape, shard.dtype, table.process_group, table.name)
            self.fence = self.fence or Fence(table.process_group, table.name)  # (collective too: every rank makes one here)
            start = table.rank * sharding.block_size
            block = self.segment[start : start + len(shard)]
            block.copy_(shard)
            shard.data = block
            self._fence_first = True  # every rank's copy lands before any rank reads
        if self._fence_first:
            self.after_write()
        return self.segment

    def serve(self, route: Route) -> None:
        """Nobody asks a table in shared memory for rows: its lookups make no round."""
        raise RuntimeError(f"{self.unit.name} is in shared memory: no other rank asks it for rows. HINT: report this.")
