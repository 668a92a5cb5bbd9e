"""A lookup, step by step: check ids -> one sort -> ids to owners -> gather -> rows to requesters -> expand.

1. **Check.** Ids are flattened to int64 on the table's device; their dtype verdict and their
   ``[min, max]`` go into this rank's :class:`~lightning_sparse.exchange.LookupHeader`.
2. **One sort.** Sorting the ids' owner-major keys deduplicates them and groups them by owner
   (:class:`~lightning_sparse.exchange.SortedKeys`); counts per owner come from a binary search,
   with no host read.
3. **Ids to owners.** Every rank's header and its distinct ids (as local row indices) go to
   the owners in one all-to-all; every rank checks every rank's header, so bad input raises on
   every rank alike and the group stays usable (the one host read of the stage is the header).
4. **Gather and send back.** Owners ``index_select`` the requested rows and send them back in
   the order they were asked for, so they arrive as the requester's distinct rows in key order.
5. **Expand.** The output is ``rows.index_select(0, inverse)``. Its backward adds up the
   gradient per distinct row with one segment sum and keeps it for the optimizer
   (:mod:`lightning_sparse.pending`); it communicates nothing.

With one rank there is nothing to exchange: a lookup checks the ids and gathers straight from
the shard, as ``nn.Embedding`` does; its backward sorts the ids for the segment sum.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lightning_sparse.exchange import Route, ids_to_owners, rows_to_requesters
from lightning_sparse.grouping import SortedKeys
from lightning_sparse.header import BAD_DTYPE, NOT_A_TENSOR, OK, UNREADABLE, Headers, LookupHeader
from lightning_sparse.pending import LookupRecord

if TYPE_CHECKING:
    import torch.distributed as dist

    from lightning_sparse.alltoall import ExchangeStats
    from lightning_sparse.pending import PendingGrads
    from lightning_sparse.sharding import RowSharding


class ShardedTable(Protocol):
    """What a lookup reads of a table (:class:`~lightning_sparse.SparseEmbedding` is one): its shard,
    where its rows live, and where its gradients and stats go. This module needs nothing else of it.
    """

    name: str
    table_index: int
    num_embeddings: int
    embedding_dim: int
    output_dtype: torch.dtype | None
    pending: PendingGrads
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


class LookupUnit(Protocol):
    """A table or a collection, as :func:`serve_lookups` answers its rounds."""

    def serve(self, route: Route) -> None: ...


ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64)
# Dtypes, types and devices are named across ranks by their position here (a header carries integers only).
ID_SOURCE_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128, torch.bool, *ID_DTYPES,
)  # fmt: skip
ID_SOURCE_TYPES = ("list", "tuple", "ndarray", "int", "NoneType")
ID_DEVICES = ("cpu", "cuda", "meta")


def _code(name: Any, names: tuple[Any, ...]) -> int:
    return names.index(name) if name in names else -1


def code_name(code: int, names: tuple[Any, ...], unknown: str = "another kind") -> str:
    return str(names[code]) if 0 <= code < len(names) else unknown


class _Lookup(torch.autograd.Function):
    """The autograd node of a lookup: forward gathers rows, backward hands their gradient to the record."""

    @staticmethod
    def forward(ctx: Any, token: Tensor, source: Tensor, index: Tensor, record: LookupRecord, dtype: torch.dtype) -> Tensor:
        ctx.record = record
        return source.index_select(0, index).to(dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, None, None, None, None]:
        ctx.record.add_grad(grad_output)
        return None, None, None, None, None


def read_ids(table: ShardedTable, ids: Any) -> tuple[Tensor, LookupHeader, str | None]:
    """Flat int64 ids on the table's device, this rank's header, and its own words for a problem.

    Nothing here raises: whatever is wrong with the input (not a tensor, not integers, a tensor
    that cannot be read on the table's device) becomes an error code in the header, so that every
    rank learns it in the same round and raises the same error.
    """
    flat, verdict, problem = flat_ids(ids, table.device)
    return flat, LookupHeader(table=table.table_index, record=int(torch.is_grad_enabled()), **verdict), problem


def flat_ids(ids: Any, device: torch.device) -> tuple[Tensor, dict[str, int], str | None]:
    """``ids`` as flat int64 on ``device``, the header fields that describe them, and words for a problem.

    Never raises: a problem becomes ``error`` (and ``detail``) in the returned fields; the ids
    are then empty.
    """
    empty = torch.empty(0, dtype=torch.int64, device=device)
    if not isinstance(ids, Tensor):
        return empty, {"error": NOT_A_TENSOR, "detail": _code(type(ids).__name__, ID_SOURCE_TYPES)}, type(ids).__name__
    verdict = {"dtype": _code(ids.dtype, ID_SOURCE_DTYPES)}
    if ids.dtype not in ID_DTYPES:
        return empty, {**verdict, "error": BAD_DTYPE}, None
    try:
        flat = ids.reshape(-1)
        if flat.dtype == torch.uint64:  # ids of 2**63 or more turn negative: the range check names them
            flat = flat.view(torch.int64)
        return flat.to(device=device, dtype=torch.int64), verdict, None
    except Exception as err:  # e.g. a meta tensor, or a device that cannot be read from here
        return (
            empty,
            {**verdict, "error": UNREADABLE, "detail": _code(ids.device.type, ID_DEVICES)},
            f"{type(err).__name__}: {err}",
        )


def lookup(table: ShardedTable, ids: Tensor) -> Tensor:
    """Rows of ``table`` for ``ids`` -> ``[*ids.shape, embedding_dim]``. Collective (see ``SparseEmbedding.forward``)."""
    shard, sharding, device = table.shard, table.sharding, table.device
    group, world_size, rank, stats = table.process_group, table.world_size, table.rank, table.stats
    recording = torch.is_grad_enabled()
    flat, header, problem = read_ids(table, ids)
    id_range = torch.stack(torch.aminmax(flat)) if flat.numel() else None
    stats.ids_looked_up += flat.numel()
    check = partial(check_headers, table, own_problem=problem)

    if world_size == 1:  # nothing to exchange: check, then one gather
        if id_range is not None:
            low, high = id_range.tolist()  # the one host read
            header = replace(header, id_min=low, id_max=high)
        check(Headers.of(header))
        record = table.pending.new_record(None, flat) if recording else None
        return lookup_rows(table, shard, flat, ids.shape, record)

    runs = SortedKeys(sharding.key(flat), sharding.key_bound)
    route = ids_to_owners(runs, sharding, header.fields(device, id_range), group, rank, stats, check)
    runs.finish(sum(route.send_splits))
    stats.unique_ids += len(runs.unique)
    with torch.no_grad():
        rows = shard.index_select(0, route.received)
    rows = rows_to_requesters(rows, route, group, world_size, rank, stats)
    if route.records:
        table.pending.route = route
    record = table.pending.new_record(route, runs.unique, runs.perm, runs.offsets) if recording else None
    return lookup_rows(table, rows, runs.inverse(), ids.shape, record)


def lookup_rows(table: ShardedTable, source: Tensor, index: Tensor, shape: torch.Size, record: LookupRecord | None) -> Tensor:
    """``source.index_select(0, index)`` shaped like the ids, in the table's ``output_dtype``; differentiable through ``record`` if given."""
    dtype = table.output_dtype or source.dtype
    if record is None:
        return source.index_select(0, index).to(dtype).view(*shape, table.embedding_dim)
    token = torch.empty(0, device=source.device, requires_grad=True)
    return _Lookup.apply(token, source, index, record, dtype).view(*shape, table.embedding_dim)


def serve_lookups(tables: list[LookupUnit]) -> int:
    """Answer the other ranks' lookups until every rank of the group has called this.

    A Join for lookups: a rank that has run out of batches (uneven validation, test or predict
    loaders) calls this and keeps serving the rows it owns to ranks that still have batches,
    taking part in each of their lookup rounds with no ids of its own. Returns, with the number
    of rounds served, once every rank is serving. ``tables`` are the lookup units: tables (at
    least one: a collection's tables are among them), then any collections; ``tables[i]`` must
    have ``table_index == i`` (a collection ``unit_index == i``) on every rank (the strategy sets them).

    Collective: every rank of the group must call it once it has no lookups left to make.
    """
    first: ShardedTable | None = tables[0] if tables else None  # type: ignore[assignment]  # a table: tables come first
    if first is None or first.world_size == 1:
        return 0
    rounds = 0
    group, rank = first.process_group, first.rank
    nothing = SortedKeys(torch.empty(0, dtype=torch.int64, device=first.device))
    idle = LookupHeader(active=0).fields(first.device)
    while True:
        route = ids_to_owners(nothing, first.sharding, idle, group, rank, first.stats)
        active = route.headers.active_units()
        if not active:
            return rounds
        tables[active[0]].serve(route)  # a table's round, or a collection's (all its tables)
        rounds += 1


def serve_rows(table: ShardedTable, route: Route) -> None:
    """Stage 2 on a rank that looks up nothing in this round: send the rows the others asked for."""
    check_headers(table, route.headers)
    with torch.no_grad():
        rows = table.shard.index_select(0, route.received)
    rows_to_requesters(rows, route, table.process_group, table.world_size, table.rank, table.stats)
    if route.records:
        table.pending.route = route


def check_one_unit(headers: Headers, name: str) -> None:
    """Raise, on every rank alike, if the active ranks looked up different tables or collections in one round."""
    units = headers.active_units()
    if len(units) > 1 or len(headers.active_stages()) > 1:
        raise RuntimeError(
            f"Ranks looked up different tables in the same round (lookup units {units}, this rank: {name}). "
            f"HINT: every rank must call its SparseEmbeddings and collections in the same order, every step, "
            f"also with empty ids."
        )


def check_headers(table: ShardedTable, headers: Headers, own_problem: str | None = None) -> None:
    """Raise, on every rank alike, if any rank's header shows bad input or a different table.

    ``own_problem``: this rank's own account of its bad input, added to the message on this rank.
    The lowest rank with an error code is reported, else the lowest with an id out of range.
    """
    check_one_unit(headers, table.name)
    rank = headers.first(headers.column("error") != OK)
    if rank is not None:
        h = headers[rank]
        where = "this rank" if rank == table.rank else f"rank {rank}"
        if h.error == NOT_A_TENSOR:
            kind = own_problem if rank == table.rank and own_problem else code_name(h.detail, ID_SOURCE_TYPES, "another type")
            raise TypeError(
                f"{table.name} got ids of type {kind} on {where}; ids must be a torch.Tensor of integers. "
                f"HINT: wrap them in torch.tensor(...)."
            )
        if h.error == BAD_DTYPE:
            raise TypeError(
                f"{table.name} got ids of dtype {code_name(h.dtype, ID_SOURCE_DTYPES)} on {where}; ids must be integers "
                f"(int64, int32, ... or unsigned). HINT: convert them with ids.long()."
            )
        if h.error == UNREADABLE:
            detail = f": {own_problem}" if rank == table.rank and own_problem else ""
            raise RuntimeError(
                f"{table.name} could not read the ids on {where} (a {code_name(h.detail, ID_DEVICES)} tensor of dtype "
                f"{code_name(h.dtype, ID_SOURCE_DTYPES)}{detail}). HINT: pass ids that hold data, on the CPU or on the table's "
                f"device ({table.device})."
            )
        raise RuntimeError(f"{table.name}: rank {rank} reported error code {h.error}.")
    rank = headers.first((headers.column("id_min") < 0) | (headers.column("id_max") >= table.num_embeddings))
    if rank is not None:
        h = headers[rank]
        where = "this rank" if rank == table.rank else f"rank {rank}"
        if h.id_min < 0 and code_name(h.dtype, ID_SOURCE_DTYPES) == "torch.uint64":
            raise IndexError(
                f"{table.name} got an id of 2**63 or more (dtype torch.uint64) on {where}; valid ids are "
                f"0..{table.num_embeddings - 1}. HINT: remap ids into range or enlarge the table."
            )
        value = h.id_min if h.id_min < 0 else h.id_max
        raise IndexError(
            f"{table.name} got id {value} on {where}; valid ids are 0..{table.num_embeddings - 1} "
            f"(num_embeddings={table.num_embeddings}). HINT: remap ids into range or enlarge the table."
        )
