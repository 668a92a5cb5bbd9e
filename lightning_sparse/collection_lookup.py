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

from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sparse.exchange import (
    BAD_DTYPE,
    BAD_INPUT,
    BAD_OFFSETS,
    NOT_A_TENSOR,
    OK,
    OUT_OF_RANGE,
    UNREADABLE,
    LookupHeader,
    Route,
    _segments,
    exchange_values,
    ids_to_owners,
    parts_received,
    split_starts,
)
from lightning_sparse.features import FeatureIds, Problem, read_features
from lightning_sparse.grouping import SortedKeys
from lightning_sparse.lookup import _DEVICES, _DTYPES, _TYPES, _name, check_one_unit

if TYPE_CHECKING:
    from lightning_sparse.collection import SparseEmbeddingCollection


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


def lookup_features(collection: "SparseEmbeddingCollection", features: Mapping[str, Any] | Any) -> dict[str, Tensor]:
    """Every given feature's rows or pooled bags, all tables in one round. Collective (see the collection's ``forward``)."""
    tables, joint = collection.table_list, collection.joint_sharding
    first = tables[0]
    device, world_size, group, rank = first.device, first.world_size, first.process_group, first.rank
    recording = torch.is_grad_enabled()
    read, problem, bad_offsets = read_features(features, collection.feature_names, collection.feature_parts,
                                               collection.feature_pooling, device)  # fmt: skip
    header = LookupHeader(table=collection.unit_index, record=int(recording), error=problem.error, part=problem.part,
                          detail=problem.detail, dtype=problem.dtype)  # fmt: skip
    fields = header.fields(device)
    if problem.error == OK and read:
        _device_verdicts(fields, read, bad_offsets, tables)
    keys = [joint.key(f.part, f.ids.clamp(0, tables[f.part].num_embeddings - 1)) for f in read]
    runs = SortedKeys(torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64, device=device), joint.key_bound)

    def check(headers: list[LookupHeader]) -> None:
        check_collection_headers(collection, headers, problem)

    if world_size > 1:
        route = ids_to_owners(runs, joint, fields, group, rank, collection.stats, check)
        send_parts = route.send_parts
    else:  # nothing to exchange: one host read for the verdict and the ids per table
        below = runs.counts_below(joint.part_boundaries(device))
        host = torch.cat([fields, below[1:] - below[:-1]]).tolist()
        route, send_parts = None, [host[LookupHeader.WIDTH - 1 :]]
        check([LookupHeader(0, *host[: LookupHeader.WIDTH - 1])])
    runs.finish(sum(map(sum, send_parts)))
    blocks = _Blocks(send_parts)
    distinct = [blocks.take(runs.unique, part) for part in range(len(tables))]  # each table's distinct joint keys
    if route is not None:
        table_routes = [_table_route(route, send_parts, part, joint) for part in range(len(tables))]
        rows = _rows_from_owners(collection, route, send_parts, table_routes)
    else:
        with torch.no_grad():  # one owner: a joint local id less the table's offset is the row
            rows = [table.shard.index_select(0, mine - joint.offsets[part]) for part, (table, mine) in enumerate(zip(tables, distinct))]

    used = {f.part for f in read}
    counts = runs.counts() if recording else None
    for part, (table, mine) in enumerate(zip(tables, distinct)):
        table.stats.unique_ids += len(mine)
        if route is not None and route.records:
            table.pending.route = table_routes[part]
        if recording and part in used:
            if route is None:  # one owner: the joint local id is the table's key
                table_keys = mine - joint.offsets[part]
            else:
                table_keys = joint.owner_of_key(mine) * table.sharding.block_size + (joint.local_of_key(mine) - joint.offsets[part])
            occurrences = blocks.take(counts, part)
            record = table.pending.new_record(table.pending.route if route is not None else None, table_keys,
                                              occurrences=occurrences)  # fmt: skip
            token = torch.empty(0, device=device, requires_grad=True)
            rows[part] = _DistinctRows.apply(token, rows[part], record)

    positions = _positions(runs, read, keys, send_parts, blocks, joint)
    out = {}
    for feature, position in zip(read, positions):
        table_rows = rows[feature.part]
        tables[feature.part].stats.ids_looked_up += len(feature.ids)
        mode = collection.feature_pooling[feature.index]
        if mode == "none":
            out[feature.name] = table_rows.index_select(0, position).view(*feature.shape, table_rows.shape[1])
        else:
            weights = feature.weights.to(table_rows.dtype) if feature.weights is not None else None
            out[feature.name] = _pool(table_rows, position, feature.offsets, mode, weights)
    return out


def serve_collection(collection: "SparseEmbeddingCollection", route: Route) -> None:
    """Answer the other ranks' lookup round of ``collection`` on a rank with no lookups of its own."""
    joint = collection.joint_sharding
    check_collection_headers(collection, route.headers, Problem())
    route.recv_parts = parts_received(route.received, route.recv_splits, joint)  # a host read: this rank is idle
    send_parts = [[0] * joint.num_parts for _ in range(joint.world_size)]
    table_routes = [_table_route(route, send_parts, part, joint) for part in range(joint.num_parts)]
    _rows_from_owners(collection, route, send_parts, table_routes)
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


class _Blocks:
    """Where each (owner, table) block of a round's distinct keys starts, computed once per round.

    Distinct keys sort by owner, then table: table ``t``'s keys are one block per owner.
    """

    def __init__(self, send_parts: list[list[int]]) -> None:
        self.world_size, self.parts = len(send_parts), len(send_parts[0])
        self.counts = [count for row in send_parts for count in row]
        self.starts = split_starts(self.counts)

    def take(self, values: Tensor, part: int) -> Tensor:
        """The entries of ``values`` (one per distinct key, in key order) of table ``part``: a view for one rank."""
        blocks = [values.narrow(0, self.starts[b], self.counts[b])
                  for b in (owner * self.parts + part for owner in range(self.world_size))]  # fmt: skip
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def _positions(
    runs: SortedKeys, read: list[FeatureIds], keys: list[Tensor], send_parts: list[list[int]], blocks: _Blocks, joint: Any
) -> list[Tensor]:
    """For each feature, each id's row among its table's distinct rows (table order: owner, then row).

    ``keys`` are the features' joint keys. A distinct key in block (owner ``j``, table ``t``)
    moves from its place among all distinct keys to its place among table ``t``'s: by the
    number of table ``t``'s keys of owners before ``j`` less the number of all keys before the block.
    """
    if not read:
        return []
    parts, world_size = joint.num_parts, joint.world_size
    table_starts = [sum(send_parts[o][t] for o in range(j)) for j in range(world_size) for t in range(parts)]
    shift = [table_starts[b] - blocks.starts[b] for b in range(len(blocks.counts))]
    inverse = runs.inverse().to(torch.int64).split([len(f.ids) for f in read])
    if world_size == 1:  # one block per table
        return [run + shift[feature.part] for feature, run in zip(read, inverse)]
    delta = torch.tensor(shift, device=runs.sorted.device)
    return [
        run + delta.index_select(0, joint.owner_of_key(key) * parts + feature.part)
        for feature, run, key in zip(read, inverse, keys)
    ]


def _table_route(route: Route, send_parts: list[list[int]], part: int, joint: Any) -> Route:
    """Table ``part``'s share of a joint route: its splits, and the local rows the owner sent."""
    world_size = joint.world_size
    starts = split_starts(route.recv_splits)
    seg_starts = [starts[r] + sum(route.recv_parts[r][:part]) for r in range(world_size)]
    recv = [route.recv_parts[r][part] for r in range(world_size)]
    received = _segments(route.received, seg_starts, recv) - joint.offsets[part]
    return Route([send_parts[r][part] for r in range(world_size)], recv, received, route.headers)


def _rows_from_owners(
    collection: "SparseEmbeddingCollection", route: Route, send_parts: list[list[int]], table_routes: list[Route]
) -> list[Tensor]:
    """Stage 2 for all tables: owners gather and send every table's rows in one buffer; returns each table's rows."""
    tables, joint = collection.table_list, collection.joint_sharding
    world_size, first = joint.world_size, tables[0]
    wire = collection.wire_dtype
    widths = [t.embedding_dim for t in tables]
    pieces = []
    with torch.no_grad():
        gathered = []
        for table, table_route in zip(tables, table_routes):
            gathered.append(table.shard.index_select(0, table_route.received).to(wire))
        starts = [split_starts(route.recv_parts[r][part] for r in range(world_size)) for part in range(len(tables))]
        for dest in range(world_size):
            for part, rows in enumerate(gathered):
                pieces.append(rows.narrow(0, starts[part][dest], route.recv_parts[dest][part]).reshape(-1))
    send_sizes = [sum(c * w for c, w in zip(route.recv_parts[r], widths)) for r in range(world_size)]
    recv_sizes = [sum(c * w for c, w in zip(send_parts[r], widths)) for r in range(world_size)]
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=wire, device=first.device)
    back = exchange_values(send, send_sizes, recv_sizes, first.process_group, world_size, first.rank, collection.stats)
    blocks = back.split([c * w for row in send_parts for c, w in zip(row, widths)])
    parts = len(tables)
    return [
        torch.cat([blocks[r * parts + part] for r in range(world_size)]).view(-1, table.embedding_dim).to(table.dtype)
        for part, table in enumerate(tables)
    ]


def check_collection_headers(collection: "SparseEmbeddingCollection", headers: list[LookupHeader], problem: Problem) -> None:
    """Raise, on every rank alike, if any rank's header shows bad input or another lookup unit in this round."""
    check_one_unit(headers, collection.name)
    for rank, h in enumerate(headers):
        if h.error == OK:
            continue
        own = rank == collection.rank
        where = "this rank" if own else f"rank {rank}"
        feature = collection.describe_feature(h.part)
        if h.error == NOT_A_TENSOR:
            kind = problem.words if own and problem.words else _name(h.detail, _TYPES, "another type")
            raise TypeError(f"{feature} got ids of type {kind} on {where}; ids must be a torch.Tensor of integers or "
                            f"JaggedIds. HINT: wrap them in torch.tensor(...).")  # fmt: skip
        if h.error == BAD_DTYPE:
            raise TypeError(f"{feature} got ids of dtype {_name(h.dtype, _DTYPES)} on {where}; ids must be integers. "
                            f"HINT: convert them with ids.long().")  # fmt: skip
        if h.error == UNREADABLE:
            detail = f": {problem.words}" if own and problem.words else ""
            raise RuntimeError(f"{feature} could not read the ids on {where} (a {_name(h.detail, _DEVICES)} tensor{detail}). "
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
            words = problem.words if own and problem.words else f"HINT: the error raised on rank {rank} names the problem and its fix"
            raise ValueError(f"{feature} got input it cannot use on {where}: {words}")
        raise RuntimeError(f"{collection.name}: rank {rank} reported error code {h.error}.")
