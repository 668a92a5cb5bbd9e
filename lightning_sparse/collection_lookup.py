"""A lookup of many tables in one round: features -> one sort -> ids to owners -> rows back -> pool.

The path of :mod:`lightning_sparse.lookup`, for all features of a
:class:`~lightning_sparse.collection.SparseEmbeddingCollection` at once:

1. **Read.** Each feature's ids (and bags) are read without raising
   (:mod:`lightning_sparse.features`); a problem, an id out of its table's range or offsets
   that do not fit go into the header with the feature's position, so every rank raises alike.
2. **One sort.** Every id gets a joint key (:class:`~lightning_sparse.sharding.JointSharding`:
   owner, then table, then row); one sort deduplicates the ids of all tables (features that
   share a table share its rows) and groups them by owner, then table.
3. **Ids to owners**, one all-to-all for all tables; its one host read also brings the ids per
   (rank, table) both ways.
4. **Rows back**, one all-to-all: each owner gathers every table's requested rows with
   ``index_select`` and sends them in one buffer (the tables' dtypes promoted to one: exact).
5. **Pool** on the requester from the distinct rows: ``index_select`` for ``pooling="none"``,
   ``F.embedding_bag`` for ``"sum"``/``"mean"`` (and per-id weights), so ``[ids, dim]`` is never
   built for a pooled feature. The distinct rows of each table are where the gradient stops:
   its backward hands ``[distinct rows, dim]`` to the table's pending gradients, and each table
   keeps its part of the route, so the optimizer sends all tables' gradients in one round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import record_function

from lightning_sparse.alltoall import exchange_values
from lightning_sparse.dynamic import rows_of_features
from lightning_sparse.exchange import Route, ids_to_owners, parts_received
from lightning_sparse.features import FeatureIds, Problem, read_features
from lightning_sparse.grouping import SortedKeys, transpose_blocks, transposed_places
from lightning_sparse.header import (
    BAD_DTYPE,
    BAD_INPUT,
    BAD_OFFSETS,
    NOT_A_TENSOR,
    OK,
    OUT_OF_RANGE,
    UNREADABLE,
    Headers,
    LookupHeader,
)
from lightning_sparse.lookup import ID_DEVICES, ID_SOURCE_DTYPES, ID_SOURCE_TYPES, ShardedTable, check_one_unit, code_name
from lightning_sparse.packing import common_unit, pack, unpack

if TYPE_CHECKING:
    from lightning_sparse.alltoall import ExchangeStats
    from lightning_sparse.sharding import JointSharding


class CollectionView(Protocol):
    """What a collection lookup reads of a collection (:class:`~lightning_sparse.SparseEmbeddingCollection`
    is one): its tables, their joint sharding and its features. This module needs nothing else of it.
    """

    name: str
    unit_index: int
    stats: ExchangeStats
    feature_names: list[str]
    feature_parts: list[int]
    feature_pooling: list[str]

    @property
    def table_list(self) -> list[ShardedTable]: ...
    @property
    def joint_sharding(self) -> JointSharding: ...
    @property
    def wire_dtype(self) -> torch.dtype: ...
    @property
    def rank(self) -> int: ...
    def describe_feature(self, index: int) -> str: ...


class _DistinctRows(torch.autograd.Function):
    """The distinct rows of one table, as they came back; backward hands their gradient to the record."""

    @staticmethod
    def forward(ctx: Any, token: Tensor, rows: Tensor, record: Any) -> Tensor:
        ctx.record = record
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:
        ctx.record.add_grad(grad)
        return None, None, None


class _Pool(torch.autograd.Function):
    """Bags pooled from distinct rows, both ways without an ``[ids, dim]`` tensor.

    Forward is ``F.embedding_bag`` over the distinct rows. Backward is the same operation
    turned around: each distinct row's gradient is a weighted sum of the gradients of the bags
    that hold it, so one ``F.embedding_bag`` over the bags' gradients, with the ids sorted by
    row, gives ``[distinct rows, dim]`` directly (weights: the per-id weights, or ``1 / bag
    length`` for ``"mean"``). Per-id weights that need a gradient go through ``F.embedding_bag``'s
    own backward instead (see :func:`_pool`).
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, position: Tensor, offsets: Tensor, mode: str, weights: Tensor | None) -> Tensor:
        ctx.save_for_backward(position, offsets, weights)
        ctx.mode, ctx.num_rows = mode, len(rows)
        return F.embedding_bag(position, rows, offsets, mode=mode, per_sample_weights=weights, include_last_offset=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        position, offsets, weights = ctx.saved_tensors
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(len(lengths), device=grad.device), lengths, output_size=len(position))
        scale = weights
        if ctx.mode == "mean":
            scale = (1 / lengths.clamp(min=1).to(grad.dtype)).index_select(0, bag)
        order = torch.argsort(position, stable=True)
        starts = torch.searchsorted(position.index_select(0, order), torch.arange(ctx.num_rows, device=grad.device))
        return F.embedding_bag(bag.index_select(0, order), grad.contiguous(), starts, mode="sum",
                               per_sample_weights=None if scale is None else scale.index_select(0, order)), None, None, None, None  # fmt: skip


def _pool(rows: Tensor, position: Tensor, offsets: Tensor, mode: str, weights: Tensor | None) -> Tensor:
    if weights is not None and weights.requires_grad:
        return F.embedding_bag(position, rows, offsets, mode=mode, per_sample_weights=weights, include_last_offset=True)
    return _Pool.apply(rows, position, offsets, mode, weights)


def lookup_features(collection: CollectionView, features: Mapping[str, Any] | Any) -> dict[str, Tensor]:
    """Every given feature's rows or pooled bags, all tables in one round. Collective (see the collection's ``forward``)."""
    tables, joint = collection.table_list, collection.joint_sharding
    first = tables[0]
    device, world_size, group, rank = first.device, first.world_size, first.process_group, first.rank
    recording = torch.is_grad_enabled()
    read, problem, bad_offsets = read_features(features, collection.feature_names, collection.feature_parts,
                                               collection.feature_pooling, device)  # fmt: skip
    read = rows_of_features(tables, read)  # dynamic tables: ids to rows first, a round per table
    header = LookupHeader(table=collection.unit_index, record=int(recording), error=problem.error, part=problem.part,
                          detail=problem.detail, dtype=problem.dtype)  # fmt: skip
    fields = header.fields(device)
    if problem.error == OK and read:
        _device_verdicts(fields, read, bad_offsets, tables)
    keys = [joint.key(f.part, f.ids.clamp(0, tables[f.part].num_embeddings - 1)) for f in read]
    runs = SortedKeys(torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64, device=device), joint.key_bound)

    def check(headers: Headers) -> None:
        check_collection_headers(collection, headers, problem)

    if world_size > 1:
        route = ids_to_owners(runs, joint, fields, group, rank, collection.stats, check)
        mine = _TableMajor(route.send_parts, route.device_parts[0])
    else:  # nothing to exchange: one host read for the verdict and the ids per table
        below = runs.counts_below(joint.part_boundaries(device))
        per_table = (below[1:] - below[:-1]).view(1, -1)
        on_host = torch.cat([fields, per_table.view(-1)]).cpu()
        route, mine = None, _TableMajor(on_host[LookupHeader.WIDTH - 1 :].view(1, -1), per_table)
        check(Headers.of(LookupHeader(0, *on_host[: LookupHeader.WIDTH - 1].tolist())))
    runs.finish(mine.total)
    distinct = mine.split(runs.unique)  # each table's distinct joint keys, by owner
    if route is not None:
        theirs = _TableMajor(route.recv_parts, route.device_parts[1])
        table_routes = _table_routes(route, joint, theirs)
        rows = _rows_from_owners(collection, route, mine, theirs, table_routes)
    else:
        with torch.no_grad():  # one owner: a joint local id less the table's offset is the row
            rows = [
                table.shard.index_select(0, keys - joint.offsets[part])
                for part, (table, keys) in enumerate(zip(tables, distinct))
            ]

    used = {f.part for f in read}
    occurrences = mine.split(runs.counts()) if recording else None
    for part, (table, table_keys) in enumerate(zip(tables, distinct)):
        table.stats.unique_ids += len(table_keys)
        if route is not None and route.records:
            table.pending.route = table_routes[part]
        if recording and part in used:
            local = joint.local_of_key(table_keys) - joint.offsets[part]
            if route is not None:  # the table's own owner-major keys
                local = joint.owner_of_key(table_keys) * table.sharding.block_size + local
            record = table.pending.new_record(table.pending.route if route is not None else None, local,
                                              occurrences=occurrences[part])  # fmt: skip
            token = torch.empty(0, device=device, requires_grad=True)
            rows[part] = _DistinctRows.apply(token, rows[part], record)

    within = mine.within_table(runs.inverse().to(torch.int64)).split([len(f.ids) for f in read]) if read else []
    out = {}
    for feature, position in zip(read, within):
        table_rows = rows[feature.part]
        tables[feature.part].stats.ids_looked_up += len(feature.ids)
        mode = collection.feature_pooling[feature.index]
        if mode == "none":
            out[feature.name] = table_rows.index_select(0, position).view(*feature.shape, table_rows.shape[1])
        else:
            weights = feature.weights.to(table_rows.dtype) if feature.weights is not None else None
            out[feature.name] = _pool(table_rows, position, feature.offsets, mode, weights)
    return out


def serve_collection(collection: CollectionView, route: Route) -> None:
    """Answer the other ranks' lookup round of ``collection`` on a rank with no lookups of its own."""
    joint = collection.joint_sharding
    check_collection_headers(collection, route.headers, Problem())
    device_recv = parts_received(route.received, route.recv_splits, joint)
    route.recv_parts = device_recv.cpu()  # a host read: this rank is idle
    nothing = torch.zeros(joint.world_size, joint.num_parts, dtype=torch.int64)
    route.send_parts, route.device_parts = nothing, (nothing.to(device_recv.device), device_recv)
    theirs = _TableMajor(route.recv_parts, route.device_parts[1])
    table_routes = _table_routes(route, joint, theirs)
    _rows_from_owners(collection, route, _TableMajor(route.send_parts, route.device_parts[0]), theirs, table_routes)
    if route.records:
        for table, table_route in zip(collection.table_list, table_routes):
            table.pending.route = table_route


# ---------------------------------------------------------------------------- pieces
def _device_verdicts(fields: Tensor, read: list[FeatureIds], bad_offsets: Tensor | None, tables: list[Any]) -> None:
    """Write the first feature with an id out of range or misfit offsets into the header, on the device."""
    device = fields.device
    zero = torch.zeros(2, dtype=torch.int64, device=device)
    ranges = torch.stack([torch.stack(torch.aminmax(f.ids)) if len(f.ids) else zero for f in read])  # [F, 2]
    sizes = torch.tensor([tables[f.part].num_embeddings for f in read], device=device)
    codes = torch.where((ranges[:, 0] < 0) | (ranges[:, 1] >= sizes), OUT_OF_RANGE, OK)
    if bad_offsets is not None:
        codes = torch.where((codes == OK) & bad_offsets, BAD_OFFSETS, codes)
    first = (codes != OK).to(torch.int64).argmax()
    bad = codes[first] != OK
    index = torch.tensor([f.index for f in read], device=device)
    fields[LookupHeader.slot("error")] = codes[first]
    fields[LookupHeader.slot("part")] = torch.where(bad, index[first], -1)
    fields[LookupHeader.slot("id_min") : LookupHeader.slot("id_max") + 1] = ranges[first] * bad


class _TableMajor:
    """Items of a round in (rank, table) blocks, seen table by table: (table, rank) blocks.

    A round's distinct keys sort by owner, then table; an owner receives them by requester,
    then table. A table wants its own items, by rank: one gather (:func:`transpose_blocks`)
    turns the whole round around, whatever the number of ranks and tables. ``counts`` is
    ``[W, T]`` on the host, ``device_counts`` the same on the items' device.
    """

    def __init__(self, counts: Tensor, device_counts: Tensor) -> None:
        self.counts, self.device_counts = counts, device_counts
        self.total = int(counts.sum())
        self.per_table = counts.sum(0).tolist()
        self.gather = transpose_blocks(device_counts, self.total)

    def split(self, values: Tensor) -> list[Tensor]:
        """``values`` (one per item, by rank, then table) as one tensor per table, each by rank."""
        return list(values.index_select(0, self.gather).split(self.per_table))

    def within_table(self, items: Tensor) -> Tensor:
        """For items given by their index in the round, each one's index among its table's items."""
        return transposed_places(self.device_counts, self.total, within_b=True).index_select(0, items)


def _table_routes(route: Route, joint: Any, theirs: _TableMajor) -> list[Route]:
    """Each table's share of a joint route: its splits, and the local rows the owner sent (by requester).

    ``theirs``: the round's received ids per (requester, table), as the owner turns them by table.
    """
    received = theirs.split(route.received)
    return [Route(route.send_parts[:, part], route.recv_parts[:, part], rows - joint.offsets[part], route.headers)
            for part, rows in enumerate(received)]  # fmt: skip


def _rows_from_owners(
    collection: CollectionView, route: Route, mine: _TableMajor, theirs: _TableMajor, table_routes: list[Route]
) -> list[Tensor]:
    """Stage 2 for all tables: owners gather every table's rows and send them in one buffer; returns each table's rows.

    When all tables have one width, a row is one unit of the buffer, and the turns between
    (rank, table) and (table, rank) order are the ones ``mine`` and ``theirs`` made already.
    """
    tables, joint = collection.table_list, collection.joint_sharding
    first, wire = tables[0], collection.wire_dtype
    widths = [t.embedding_dim for t in tables]
    unit = common_unit(widths)
    one_width = len(set(widths)) == 1
    with record_function("lightning_sparse.rows_to_requesters"), torch.no_grad():
        gathered = [
            table.shard.index_select(0, table_route.received).to(wire) for table, table_route in zip(tables, table_routes)
        ]
        send, send_sizes = pack(
            gathered, route.recv_parts.t(), route.device_parts[1].t(), unit, theirs.gather if one_width else None
        )
        recv_sizes = (mine.counts * torch.tensor(widths)).sum(1).tolist()
        back = exchange_values(send, send_sizes, recv_sizes, first.process_group, joint.world_size, first.rank, collection.stats)
        rows = unpack(back, mine.counts.t(), mine.device_counts.t(), widths, unit, mine.gather if one_width else None)
    return [piece.to(table.dtype) for piece, table in zip(rows, tables)]


def check_collection_headers(collection: CollectionView, headers: Headers, problem: Problem) -> None:
    """Raise, on every rank alike, if any rank's header shows bad input or another lookup unit in this round.

    The lowest rank with an error code is reported.
    """
    check_one_unit(headers, collection.name)
    rank = headers.first(headers.column("error") != OK)
    if rank is not None:
        h = headers[rank]
        own = rank == collection.rank
        where = "this rank" if own else f"rank {rank}"
        feature = collection.describe_feature(h.part)
        if h.error == NOT_A_TENSOR:
            kind = problem.words if own and problem.words else code_name(h.detail, ID_SOURCE_TYPES, "another type")
            raise TypeError(f"{feature} got ids of type {kind} on {where}; ids must be a torch.Tensor of integers or "
                            f"JaggedIds. HINT: wrap them in torch.tensor(...).")  # fmt: skip
        if h.error == BAD_DTYPE:
            raise TypeError(f"{feature} got ids of dtype {code_name(h.dtype, ID_SOURCE_DTYPES)} on {where}; ids must be integers. "
                            f"HINT: convert them with ids.long().")  # fmt: skip
        if h.error == UNREADABLE:
            detail = f": {problem.words}" if own and problem.words else ""
            raise RuntimeError(f"{feature} could not read the ids on {where} (a {code_name(h.detail, ID_DEVICES)} tensor{detail}). "
                               f"HINT: pass ids that hold data, on the CPU or on the tables' device.")  # fmt: skip
        if h.error == OUT_OF_RANGE:
            table = collection.table_list[collection.feature_parts[h.part]]
            value = h.id_min if h.id_min < 0 else h.id_max
            raise IndexError(f"{feature} got id {value} on {where}; valid ids are 0..{table.num_embeddings - 1}. "
                             f"HINT: remap ids into range or enlarge the table.")  # fmt: skip
        if h.error == BAD_OFFSETS:
            raise ValueError(f"{feature} got bag offsets that do not fit its values on {where}: offsets must start at 0, "
                             f"never decrease, and end at len(values). HINT: build them with JaggedIds(values, "
                             f"lengths=...).")  # fmt: skip
        if h.error == BAD_INPUT:
            words = (
                problem.words if own and problem.words else f"HINT: the error raised on rank {rank} names the problem and its fix"
            )
            raise ValueError(f"{feature} got input it cannot use on {where}: {words}")
        raise RuntimeError(f"{collection.name}: rank {rank} reported error code {h.error}.")
