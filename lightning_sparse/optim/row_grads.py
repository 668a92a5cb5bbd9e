"""A table's gradient rows at an optimizer step, brought to the rows' owner and not yet summed.

They are what :func:`~lightning_sparse.wire.grads_exchange.grads_to_owners` delivered (:func:`owned_grads`):
with one rank the table's pending lookups' gradient rows as they are, one per id for a lookup of
one table (``gather``), one per distinct row for the lookup engine's. Rows may repeat; the update sums them (the fused
:func:`~lightning_sparse.kernels.update_rows` on a GPU, or with numba on a CPU; :func:`summed` otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse.kernels.rounding import compute_dtype
from lightning_sparse.lookup.pending import LookupRecord
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.wire.alltoall import Peers
from lightning_sparse.wire.grads_exchange import IncomingGrads, OutgoingGrads, RowsByOwner
from lightning_sparse.wire.grouping import SortedKeys, coalesce
from lightning_sparse.wire.replicas import OwnedGrads


@dataclass
class TableGrads:
    """One table's gradient rows on their owner: ``values[i]`` is for local row ``rows[i]``.

    ``counts[i]`` is how many occurrences ``values[i]`` sums (for ``duplicate_grads="mean"``;
    ``None``: one each). ``distinct``: no row repeats. ``per_id``: some came from lookups that
    did not count their distinct ids (one per id), so the step counts them. ``placeholders``: some
    values may be a placeholder of a rank without a gradient, whose count is 0 (with ``"sum"``,
    ``counts`` then holds 1 or 0 per value): a row whose counts sum to 0 is not updated.
    ``touched``: the step counts for the table (some rank looked it up since the last one).
    """

    rows: Tensor
    values: Tensor
    counts: Tensor | None = None
    distinct: bool = False
    touched: bool = False
    nonfinite_ranks: list[int] = field(default_factory=list)
    per_id: bool = False
    placeholders: bool = False


def owned_grads(table: SparseEmbedding, grads: IncomingGrads, mean: bool, wire: torch.dtype) -> TableGrads:
    """What arrived for the table's rows (with ``mean``, each value's last column is its count), from other ranks in
    the ``wire`` dtype."""
    bad = grads.nonfinite_ranks
    if bad:  # group ranks -> global ranks
        bad = [dist.get_global_rank(table.process_group, r) for r in bad]
    if grads.rows:
        rows, values = _cat(grads.rows), _cat(grads.values)
    else:  # still in the wire's dtype and width: 2-D sharding sends them to the replicas as they are
        rows, values = _no_rows(table), table.shard.new_empty(0, table.embedding_dim + mean, dtype=wire)
    counts = values[:, -1] if mean else grads.present
    return TableGrads(rows, values[:, : table.embedding_dim], counts, grads.distinct or not grads.rows, grads.touched, bad,
                      per_id=grads.per_id, placeholders=grads.present is not None)  # fmt: skip


def coalesced(table: SparseEmbedding, grads: TableGrads) -> OwnedGrads:
    """The rows summed per row (the count column last with ``counts``), as 2-D sharding sums them over replicas."""
    values = grads.values if grads.counts is None else torch.cat([grads.values, grads.counts.unsqueeze(1)], dim=1)
    rows = grads.rows
    if not grads.distinct and len(rows):
        rows, values = coalesce(rows, values, table.sharding.block_size)
    return OwnedGrads(rows, values, grads.touched, grads.nonfinite_ranks)


def from_replicas(table: SparseEmbedding, owned: OwnedGrads, mean: bool) -> TableGrads:
    counts = owned.values[:, -1] if mean else None
    return TableGrads(owned.rows, owned.values[:, : table.embedding_dim], counts, True, owned.touched, owned.nonfinite_ranks)


def summed(table: SparseEmbedding, grads: TableGrads, mean: bool) -> tuple[Tensor, Tensor]:
    """(distinct local rows, their gradient in the update's dtype): the rows' sum divided by the ranks or by the counts.

    The plain torch path (one sort, :meth:`SortedKeys.segment_sum`); it reads the host for the
    number of distinct rows. Counts the distinct ids of lookups that did not (``per_id``).
    """
    rows, values, counts = grads.rows, grads.values, grads.counts
    if counts is not None:
        counts = counts.to(values.dtype)
    if not grads.distinct:
        runs = SortedKeys(rows, table.sharding.key_bound).finish()
        rows, values = runs.unique, runs.segment_sum(values)
        if mean or grads.placeholders:
            counts = runs.segment_sum(counts.unsqueeze(1)).view(-1) if counts is not None else runs.counts()
        if grads.per_id:
            table.stats.unique_ids += len(rows)
    if grads.placeholders:  # rows only placeholders reached are not updated (a host read: the plain torch path)
        kept = (counts > 0).nonzero().view(-1)
        rows, values, counts = rows.index_select(0, kept), values.index_select(0, kept), counts.index_select(0, kept)
    values = values.to(compute_dtype(table.dtype))
    if mean:
        return rows, values / counts.to(values.dtype).unsqueeze(1)
    ranks = table.world_size * table.replicas  # every rank of the job, as DDP averages dense gradients
    return rows, values / ranks if ranks > 1 else values


def outgoing(table: SparseEmbedding, peers: Peers, mean: bool, check_finite: bool = False, sole: bool = False) -> OutgoingGrads:
    """A table's pending gradients, taken and laid out for ``grads_to_owners`` over ``peers``.

    The last lookup's gradient rows go as they are (routed); the others are coalesced by row
    first, with one sort, which also groups them by owner; with one rank they stay as they came
    (the update sums rows that repeat). ``sole`` (see
    :func:`~lightning_sparse.wire.grads_exchange.only_routed`): the step sends routed rows only, and
    any other gradient stays pending for the next step: one that reached a lookup made before the
    last step after this rank's header promised none (``LookupHeader.sole``).
    """
    taken = table.pending.take(leave_others=sole)
    route, routed, records = taken.route, taken.routed, taken.others
    routed_values = _values(routed, mean) if routed is not None else None
    others = None
    if records and peers.alone:  # one owner, whose keys are its rows: as they came, one per id for a gather's record
        values = _cat([_values(record, mean) for record in records])
        distinct = len(records) == 1 and records[0].distinct
        per_id = not all(record.distinct for record in records)
        others = RowsByOwner(_cat([record.keys for record in records]), values, None, distinct, per_id)
    elif records:
        if len(records) == 1 and records[0].distinct:  # already distinct and ascending
            keys, values = records[0].keys, _values(records[0], mean)
        else:
            runs = SortedKeys(_cat([record.keys for record in records]), table.sharding.key_bound).finish()
            keys, values = runs.unique, runs.segment_sum(_cat([_values(record, mean) for record in records]))
        below = torch.searchsorted(keys, table.sharding.key_boundaries(table.device))
        others = RowsByOwner(table.sharding.local_of_key(keys), values, below[1:] - below[:-1])
    nonfinite = None
    if check_finite:
        flags = [(~torch.isfinite(v)).any() for v in (routed_values, others.values if others else None) if v is not None]
        nonfinite = torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=table.device)
    return OutgoingGrads(route, routed_values, table.embedding_dim + mean, others, nonfinite, taken.looked_up)


def wire_dtype(dtypes: list[torch.dtype], mean: bool) -> torch.dtype:
    """One dtype for all tables' gradients on the wire; at least float32 when occurrence counts ride along."""
    wire = torch.float32 if mean else compute_dtype(dtypes[0])
    for dtype in dtypes:
        if compute_dtype(dtype) != wire:  # (tables of one dtype: no promotion, which is an op of its own)
            wire = torch.promote_types(wire, compute_dtype(dtype))
    return wire


def _values(record: LookupRecord, mean: bool) -> Tensor:
    """A record's gradient rows, with each row's occurrence count as a last column for ``"mean"``."""
    if not mean:
        return record.grad
    return torch.cat([record.grad, _counts(record).to(record.grad.dtype).unsqueeze(1)], dim=1)


def _counts(record: LookupRecord) -> Tensor:
    counts = record.counts()
    return counts if counts is not None else torch.ones(len(record.keys), dtype=torch.int64, device=record.keys.device)


def _cat(pieces: list[Tensor]) -> Tensor:
    if len(pieces) == 1:
        return pieces[0]
    dtype = pieces[0].dtype
    for piece in pieces[1:]:
        dtype = torch.promote_types(dtype, piece.dtype)
    return torch.cat([piece.to(dtype) for piece in pieces])


def _no_rows(table: SparseEmbedding) -> Tensor:
    return torch.empty(0, dtype=torch.int64, device=table.device)
