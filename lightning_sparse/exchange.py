"""The all-to-all stages of the sparse path, named by the direction data moves.

A lookup and an optimizer step move data in three stages:

1. ``ids_to_owners``: each rank sends the distinct rows it looks up to the ranks that own them
   (as local row indices), after a header of split sizes and input checks (:class:`LookupHeader`);
2. ``rows_to_requesters``: owners gather those rows and send them back in the order the ids
   came, so the requester reorders nothing;
3. ``grads_to_owners``: at the optimizer step, row gradients go to the owners. The gradients of
   a table's last lookup go back along that lookup's :class:`Route`: the owner already knows
   which rows it sent, so neither ids nor split sizes travel (the *routed* round). Gradients of
   other lookups (accumulation, a table looked up twice) take the *general* round: a header,
   then ids and values. All tables of one optimizer share each round.

Every stage is a collective: **every rank of the group must call it, in the same order**, even a
rank with nothing to send (it sends empty tensors). Values move with ``all_to_all_single`` and
uneven splits. With one rank nothing is exchanged. Each stage runs under a
``torch.profiler.record_function`` label ``lightning_sparse.<stage>``, reads the host at most
once, and counts what crossed to other ranks in :class:`ExchangeStats`.

Grouping by owner takes one sort: :class:`SortedKeys` sorts owner-major keys
(:meth:`lightning_sparse.sharding.RowSharding.key`), which deduplicates and groups in one go and
yields the runs that a segment sum (``F.embedding_bag``) adds up.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from lightning_sparse.faults import PeerFailure, collective
from lightning_sparse.grouping import SortedKeys, coalesce, transpose_blocks
from lightning_sparse.packing import common_unit, pack, to_device, unpack
from lightning_sparse.sharding import JointSharding, RowSharding

if TYPE_CHECKING:
    from lightning_sparse.hashing import HashSharding

__all__ = ["PeerFailure", "SortedKeys", "coalesce"]  # re-exported: a lost peer's error; the one sort

ProcessGroup = dist.ProcessGroup


@dataclass
class ExchangeStats:
    """Running totals of what the sparse path sent, received and spent; reset by the reader.

    Bytes count what crossed to or from other ranks (headers included), not a rank's split to
    itself; ``collectives`` counts the all-to-all calls.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    exchange_seconds: float = 0.0
    update_seconds: float = 0.0
    ids_looked_up: int = 0
    unique_ids: int = 0
    collectives: int = 0

    def add(self, other: ExchangeStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, type(getattr(self, name))())


def host_tensor(values: Sequence[int | float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small tensor of Python values on ``device``; to a GPU through pinned memory, without blocking."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def split_starts(splits: Sequence[int]) -> list[int]:
    """``[0, s0, s0 + s1, ...]``: where each split starts (and, last, the total)."""
    return [0, *accumulate(splits)]


# ---------------------------------------------------------------------------- primitives
def exchange_counts(send: Tensor, group: ProcessGroup | None, world_size: int, stats: ExchangeStats | None = None) -> Tensor:
    """Row ``j`` of ``send`` ([W, K] int64) goes to rank ``j``; row ``i`` of the result came from rank ``i``.

    Collective: every rank of ``group`` must call it with the same ``K``.
    """
    if world_size == 1:
        return send
    send = send.contiguous()
    recv = torch.empty_like(send)
    with collective("all-to-all of split sizes"):
        dist.all_to_all_single(recv, send, group=group)
    if stats is not None:  # what crossed to other ranks: all rows but our own
        row = send[0].numel() * send.element_size()
        stats.bytes_sent += row * (world_size - 1)
        stats.bytes_received += row * (world_size - 1)
        stats.collectives += 1
    return recv


def exchange_values(
    values: Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: ProcessGroup | None,
    world_size: int,
    rank: int,
    stats: ExchangeStats | None = None,
) -> Tensor:
    """Uneven all-to-all along dim 0: ``send_splits[j]`` leading rows go to rank ``j``.

    Collective: every rank of ``group`` must call it; ``recv_splits`` must be what the peers send.
    """
    if world_size == 1:
        return values
    recv = values.new_empty((sum(recv_splits), *values.shape[1:]))
    with collective("all-to-all of values"):
        dist.all_to_all_single(
            recv, values.contiguous(), output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits), group=group
        )
    if stats is not None:  # what crossed to other ranks: our own split stays here
        row = values[0].numel() * values.element_size() if len(values) else 0
        stats.bytes_sent += (sum(send_splits) - send_splits[rank]) * row
        stats.bytes_received += (sum(recv_splits) - recv_splits[rank]) * row
        stats.collectives += 1
    return recv


# ---------------------------------------------------------------------------- stage 1: ids to owners
# Error codes a rank reports in its lookup header; every rank raises the same error for them.
# OUT_OF_RANGE, BAD_INPUT and BAD_OFFSETS are used by collections, whose header names the feature (``part``).
OK, BAD_DTYPE, NOT_A_TENSOR, UNREADABLE, OUT_OF_RANGE, BAD_INPUT, BAD_OFFSETS = 0, 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class LookupHeader:
    """What one rank tells every rank about its part of a lookup round: one row of the header.

    ``count`` differs per destination (the ids sent to it); the other fields are the same in
    every row a rank sends. ``error`` is a code (``OK``, ``BAD_DTYPE``, ``NOT_A_TENSOR``,
    ``UNREADABLE``; for a collection also ``OUT_OF_RANGE``, ``BAD_INPUT`` and ``BAD_OFFSETS``)
    with an argument in ``detail``; ``dtype`` names the dtype of the ids it was
    given; ``id_min``/``id_max`` let every rank check every rank's ids against the table (both 0
    when a rank has none); ``table`` and ``active`` let a rank that has run out of batches
    answer the others (``serve_lookups``) and catch ranks that call tables out of order;
    ``record`` says the rank records the lookup for a gradient (grad mode is on); ``most`` is
    the largest ``count`` the rank sends to anyone, which sizes the next round; ``part`` names
    the feature of a collection that an error is about (``-1``: none); ``stage`` tells a round
    that looks up rows (0) from one that turns a dynamic table's ids into rows (1) and from one
    that sends a dynamic table's ids and gets their rows back (2, :mod:`lightning_sparse.dynamic`),
    so that a rank serving others knows which round it is in.
    """

    count: int = 0
    error: int = OK
    detail: int = 0
    id_min: int = 0
    id_max: int = 0
    table: int = -1
    active: int = 1
    record: int = 0
    most: int = 0
    dtype: int = -1
    part: int = -1
    stage: int = 0

    WIDTH = 12

    def fields(self, device: torch.device, id_range: Tensor | None = None) -> Tensor:
        """The fields after ``count`` as an int64 tensor; ``id_range`` (device ``[min, max]``) fills ``id_min``/``id_max``."""
        fields = host_tensor(astuple(self)[1:], torch.int64, device)
        if id_range is not None:
            fields[self.slot("id_min") : self.slot("id_max") + 1] = id_range
        return fields

    @classmethod
    def slot(cls, name: str) -> int:
        """Where field ``name`` sits in :meth:`fields` (which leaves out ``count``)."""
        return list(cls.__dataclass_fields__).index(name) - 1


class Headers:
    """Every rank's :class:`LookupHeader` of one round, as one host tensor ``[W, WIDTH]`` (``count`` first).

    Questions about all ranks are tensor operations (no Python loop over ranks); ``headers[r]``
    gives rank ``r``'s header as a :class:`LookupHeader`, for the error messages.
    """

    def __init__(self, table: Tensor) -> None:
        self.table = table

    @classmethod
    def of(cls, header: LookupHeader) -> Headers:
        """One rank's header as the headers of a one-rank round."""
        return cls(torch.tensor([astuple(header)], dtype=torch.int64))

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, rank: int) -> LookupHeader:
        return LookupHeader(*self.table[rank].tolist())

    def column(self, name: str) -> Tensor:
        return self.table[:, LookupHeader.slot(name) + 1]

    def first(self, flags: Tensor) -> int | None:
        """The lowest rank whose flag is set, if any."""
        return int(flags.to(torch.int64).argmax()) if bool(flags.any()) else None

    @property
    def records(self) -> bool:
        """Whether any rank records the lookup for a gradient."""
        return bool(self.column("record").any())

    def active_units(self) -> list[int]:
        """The lookup units (tables, collections) that the active ranks called in this round, ascending."""
        return torch.unique(self.column("table")[self.column("active") != 0]).tolist()

    def active_stages(self) -> list[int]:
        """The stages (``LookupHeader.stage``) that the active ranks are in, ascending."""
        return torch.unique(self.column("stage")[self.column("active") != 0]).tolist()


@dataclass
class Route:
    """How one lookup's ids travelled, kept to send the rows back and, later, their gradients.

    On the requester, ids went in ascending owner-major key order, ``send_counts[j]`` of them
    to rank ``j``; rows come back in that order. On the owner, ``received`` holds the local row
    indices that each requester asked for, grouped by requester (``recv_counts``), each group
    ascending. ``headers`` are every rank's :class:`LookupHeader` (the same on every rank).
    """

    # Ids sent to and received from each rank, ``[W]`` host int64 (as lists: ``send_splits``, ``recv_splits``).
    send_counts: Tensor
    recv_counts: Tensor
    received: Tensor
    headers: Headers
    # For several tables in one round (a JointSharding): ids per (rank, table), ``[W, T]`` int64,
    # on the host (``send_parts``, ``recv_parts``) and on the ids' device (``device_parts``: send, recv).
    send_parts: Tensor | None = None
    recv_parts: Tensor | None = None
    device_parts: tuple[Tensor, Tensor] | None = None

    @cached_property
    def send_splits(self) -> list[int]:
        return self.send_counts.tolist()

    @cached_property
    def recv_splits(self) -> list[int]:
        return self.recv_counts.tolist()

    @property
    def records(self) -> bool:
        """Whether any rank records this lookup for a gradient (the same answer on every rank)."""
        return self.headers.records


# Id slots per destination in the next lookup round of each process group. Every rank derives it
# from the same headers (the largest count of the last round, plus a margin), so all ranks agree
# without a word; a lookup on any table of the group, or a rank serving others, uses it.
_SLOTS: weakref.WeakKeyDictionary[ProcessGroup, int] = weakref.WeakKeyDictionary()
_SLOT_MARGIN, _SLOT_ALIGN = 1.25, 16


def _next_slots(most: int) -> int:
    return -(-int(most * _SLOT_MARGIN) // _SLOT_ALIGN) * _SLOT_ALIGN if most else 0


def ids_to_owners(
    runs: SortedKeys,
    sharding: RowSharding | JointSharding | HashSharding,
    fields: Tensor,
    group: ProcessGroup,
    rank: int,
    stats: ExchangeStats | None = None,
    check: Callable[[Headers], None] | None = None,
) -> Route:
    """Stage 1: every rank's header and its distinct ids, grouped by owner, in one all-to-all.

    ``runs`` sorted this rank's owner-major keys (ids that fall outside the table go nowhere);
    ``fields`` is this rank's header without ``count`` (:meth:`LookupHeader.fields`). Each
    destination gets a row of ``11 + slots`` int64: the header, then up to ``slots`` ids.
    ``slots`` is agreed from the previous round; a rank with more ids for someone says so in
    its header (``most``), and an overflow round sends the rest. ``check`` sees every rank's
    header before the route is built; every rank sees the same headers, so if it raises, it
    raises on every rank and the group stays usable. One host read: the headers. With a
    :class:`~lightning_sparse.sharding.JointSharding` (several tables), the same read also
    brings the ids per (rank, table) both ways (``Route.send_parts``, ``Route.recv_parts``).

    Collective: every rank of ``group`` must call it.
    """
    start = time.perf_counter()
    world_size, width = sharding.world_size, LookupHeader.WIDTH
    device = runs.sorted.device
    with record_function("lightning_sparse.ids_to_owners"):
        slots = _SLOTS.get(group, 0)
        below = sharding.owner_counts_below(runs, device)
        counts = below[1:] - below[:-1]
        keys = runs.sorted.to(torch.int64)
        owner, local = sharding.owner_of_key(keys), sharding.local_of_key(keys)
        send = _pack(runs, owner, local, below, slots, world_size, device)
        rows = send.view(world_size, width + slots)
        rows[:, 0] = counts
        rows[:, 1:width] = fields
        rows[:, 1 + LookupHeader.slot("most")] = counts.max()
        recv = torch.empty(world_size * (width + slots), dtype=torch.int64, device=device)
        parts = getattr(sharding, "num_parts", 0)
        with collective("all-to-all of lookup ids"):
            dist.all_to_all_single(recv, send, group=group)
            recv = recv.view(world_size, width + slots)
            read = [counts, recv[:, :width].reshape(-1)]
            if parts:
                device_parts = (_parts_sent(runs, sharding, owner, local), _parts_in_slots(recv, sharding))
                read += [part.reshape(-1) for part in device_parts]
            on_host = torch.cat(read).cpu()  # the stage's one host read
        send_splits = on_host[:world_size].tolist()
        headers = Headers(on_host[world_size : world_size * (1 + width)].view(world_size, width))
        if parts:
            send_parts, recv_parts = on_host[world_size * (1 + width) :].view(2, world_size, parts).unbind(0)
        most = int(headers.column("most").max())
        _SLOTS[group] = _next_slots(most)
        if check is not None:
            check(headers)
        recv_splits = headers.table[:, 0].tolist()
        received = _segments(
            recv.view(-1), torch.arange(world_size) * (width + slots) + width, headers.table[:, 0].clamp(max=slots)
        )
        if most > slots:  # overflow: the ids beyond the slots, in a second round
            received = _overflow(runs, sharding, send_splits, recv_splits, slots, received, group, rank, stats)
            if parts:  # the slots held only some ids: count them all (a second host read, with the second round)
                device_parts = (device_parts[0], parts_received(received, recv_splits, sharding))
                recv_parts = device_parts[1].cpu()
    if stats is not None:
        sent = world_size * (width + slots) * 8
        stats.bytes_sent += sent * (world_size - 1) // world_size
        stats.bytes_received += sent * (world_size - 1) // world_size
        stats.collectives += 1
        stats.exchange_seconds += time.perf_counter() - start
    route = Route(on_host[:world_size], headers.table[:, 0], received, headers)
    if parts:
        route.send_parts, route.recv_parts, route.device_parts = send_parts, recv_parts, device_parts
    return route


# Binary searches per (owner, table) boundary beat one pass over the keys while the keys outnumber
# the blocks this many times (a pass costs several tensor ops per key, a search ~log2(keys) steps per block).
_KEYS_PER_BLOCK_TO_SEARCH = 16


def _parts_sent(runs: SortedKeys, sharding: JointSharding, owner: Tensor, local: Tensor) -> Tensor:
    """This rank's distinct ids per (owner, table), ``[W, T]``, without a host read.

    ``owner`` and ``local``: each sorted key's owner and joint local id. Few blocks for the keys:
    a binary search per block boundary; about as many blocks as keys (thousands of ranks): one
    pass over the keys.
    """
    blocks = sharding.world_size * sharding.num_parts
    if blocks * _KEYS_PER_BLOCK_TO_SEARCH < len(runs.sorted):
        below = runs.counts_below(sharding.part_boundaries(owner.device))
        counts = below[1:] - below[:-1]
    else:
        counts = runs.counts_in_blocks(sharding.block(owner, local), blocks)
    return counts.view(sharding.world_size, sharding.num_parts)


def _parts_in_slots(recv: Tensor, sharding: JointSharding) -> Tensor:
    """Ids per (source, table) among the received slots, ``[W, T]``, without a host read."""
    world_size, parts, width = sharding.world_size, sharding.num_parts, LookupHeader.WIDTH
    ids = recv[:, width:].contiguous()  # a view with a row stride; bucketize wants contiguous values
    used = torch.arange(ids.shape[1], device=recv.device).unsqueeze(0) < recv[:, :1]
    where = sharding.part_of_local(ids) + torch.arange(world_size, device=recv.device).unsqueeze(1) * parts
    where = torch.where(used, where, world_size * parts).reshape(-1)  # unused slots count in a last bin, dropped
    counts = torch.zeros(world_size * parts + 1, dtype=torch.int64, device=recv.device)
    return counts.scatter_add_(0, where, torch.ones_like(where))[:-1].view(world_size, parts)


def parts_received(received: Tensor, recv_splits: Sequence[int], sharding: JointSharding) -> Tensor:
    """Ids per (source, table) in a route's ``received`` joint local ids, ``[W, T]`` on their device (no host read)."""
    world_size, parts = sharding.world_size, sharding.num_parts
    source = torch.repeat_interleave(
        torch.arange(world_size, device=received.device), host_tensor(recv_splits, torch.int64, received.device),
        output_size=len(received),
    )  # fmt: skip
    where = source * parts + sharding.part_of_local(received)
    counts = torch.zeros(world_size * parts, dtype=torch.int64, device=received.device)
    return counts.scatter_add_(0, where, torch.ones_like(where)).view(world_size, parts)


def _pack(
    runs: SortedKeys, owner: Tensor, local: Tensor, below: Tensor, slots: int, world_size: int, device: torch.device
) -> Tensor:
    """The send buffer of stage 1: per destination a header (filled by the caller) and ``slots`` ids.

    ``owner`` and ``local`` are the owner and local id of each sorted key. Built without a host
    read: each distinct key goes to slot ``its index among its owner's keys``; keys beyond the
    slots, outside the table, or repeated go to scratch places past the end, which are not sent.
    """
    width = LookupHeader.WIDTH + slots
    n = len(runs.sorted)
    send = torch.zeros(world_size * width + n, dtype=torch.int64, device=device)
    if n == 0 or slots == 0:
        return send[: world_size * width]
    inside = (owner >= 0) & (owner < world_size) & runs.is_first
    owner = owner.clamp(0, world_size - 1)
    within = runs.run_index() - below.index_select(0, owner)
    place = owner * width + LookupHeader.WIDTH + within
    scratch = torch.arange(world_size * width, world_size * width + n, device=device)
    send.index_copy_(0, torch.where(inside & (within < slots), place, scratch), local)
    return send[: world_size * width]


def _segments(flat: Tensor, starts: Tensor, lengths: Tensor) -> Tensor:
    """``flat[starts[0] : starts[0] + lengths[0]]``, then the next segment, ... as one tensor (one gather).

    ``starts`` and ``lengths`` are host int64 tensors (one per rank: no Python loop over ranks).
    """
    total = int(lengths.sum())
    offsets = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths, output_size=total)
    index = torch.arange(total) + offsets
    return flat.index_select(0, index.to(flat.device, non_blocking=True))


def _overflow(runs, sharding, send_splits, recv_splits, slots, received, group, rank, stats) -> Tensor:
    """The second round of stage 1: ids beyond the slots, then every requester's ids in order."""
    world_size = sharding.world_size
    runs.finish(sum(send_splits))
    local = sharding.local_of_key(runs.unique)
    starts = split_starts(send_splits)
    extra_send = [max(0, c - slots) for c in send_splits]
    extra_recv = [max(0, c - slots) for c in recv_splits]
    extra = _segments(local, torch.tensor(starts[:-1], dtype=torch.int64) + slots, torch.tensor(extra_send, dtype=torch.int64))
    extra = exchange_values(extra, extra_send, extra_recv, group, world_size, rank, stats)
    counts = torch.tensor([[min(c, slots) for c in recv_splits], extra_recv], dtype=torch.int64)  # [2, W]
    both = torch.cat([received, extra])  # all slots' ids by source, then all extra ids by source
    return both.index_select(0, to_device(transpose_blocks(counts, len(both)), both.device))  # by source


# ---------------------------------------------------------------------------- stage 2: rows to requesters
def rows_to_requesters(
    rows: Tensor, route: Route, group: ProcessGroup | None, world_size: int, rank: int, stats: ExchangeStats | None = None
) -> Tensor:
    """Stage 2: send the rows for ``route.received`` back; returns the requested rows in key order.

    Collective: every rank of ``group`` must call it. No host read: the splits are the route's.
    """
    if world_size == 1:
        return rows
    start = time.perf_counter()
    with record_function("lightning_sparse.rows_to_requesters"):
        out = exchange_values(rows, route.recv_splits, route.send_splits, group, world_size, rank, stats)
    if stats is not None:
        stats.exchange_seconds += time.perf_counter() - start
    return out


# ---------------------------------------------------------------------------- stage 3: grads to owners
@dataclass
class OutgoingGrads:
    """One table's row gradients on the requester, ready for :func:`grads_to_owners`.

    ``route`` is the table's last lookup (``None`` if no lookup since the last step recorded
    gradients) and ``routed`` this rank's gradient rows for it, in the route's order (``None``
    if this rank has none). ``others`` holds any other gradient rows as (local row index, values)
    grouped by owner, ``counts[j]`` of them for rank ``j``; ``None`` if there are none.
    """

    route: Route | None
    routed: Tensor | None
    width: int
    others: tuple[Tensor, Tensor, Tensor] | None = None  # (local ids, values, counts per owner)
    nonfinite: Tensor | None = None  # a 0-d device flag: 1 if a value above is inf or NaN (when checked)


@dataclass
class IncomingGrads:
    """One table's gradient rows as received by the owner: pieces of (local rows, values).

    Each piece from the routed round (or kept locally) holds distinct rows; a row may appear in
    several pieces, and repeat within the piece of the general round (``merged``).
    """

    rows: list[Tensor]
    values: list[Tensor]
    touched: bool = False  # whether any rank had a gradient for the table
    merged: bool = False  # a piece holds rows from several ranks
    nonfinite_ranks: list[int] = field(default_factory=list)  # ranks whose gradient held inf or NaN (when checked)

    @property
    def distinct(self) -> bool:
        """Whether the rows are distinct as they are (one piece, from one source)."""
        return len(self.rows) == 1 and not self.merged


# Control code per table that rides with the routed rows to every destination.
_HAS_ROUTED, _HAS_OTHERS, _NONFINITE = 1, 2, 4


def grads_to_owners(
    tables: Sequence[OutgoingGrads],
    group: ProcessGroup | None,
    world_size: int,
    rank: int,
    wire_dtype: torch.dtype,
    device: torch.device,
    stats: ExchangeStats | None = None,
) -> list[IncomingGrads]:
    """Stage 3: send every table's row gradients to the rows' owners.

    The routed round always runs: its sizes follow from the routes, which every rank knows.
    To each destination it carries each table's routed rows, then one control code per table
    (whether this rank had routed rows, whether it has others). Every rank thereby learns what
    every rank has; if any rank has other rows, the general round follows (a header of counts,
    then ids and values). One host read per round: the control codes, the header.

    A table's ``nonfinite`` flag rides in its control code too, so every rank learns which
    ranks' gradients held an inf or NaN (``IncomingGrads.nonfinite_ranks``).

    Collective: every rank of ``group`` must call it with the same tables in the same order.
    """
    if world_size == 1:
        return [_keep_local(t) for t in tables]
    start = time.perf_counter()
    with record_function("lightning_sparse.grads_to_owners"):
        incoming, codes = _routed_round(tables, group, world_size, rank, wire_dtype, device, stats)
        if bool((codes & _HAS_OTHERS).any()):
            general = _general_round(tables, group, world_size, rank, wire_dtype, device, stats)
            for table, (rows, values) in zip(incoming, general):
                if len(rows):
                    table.rows.append(rows)
                    table.values.append(values)
                    table.merged = True
    if stats is not None:
        stats.exchange_seconds += time.perf_counter() - start
    return incoming


def _keep_local(table: OutgoingGrads) -> IncomingGrads:
    incoming = IncomingGrads([], [])
    if table.nonfinite is not None and bool(table.nonfinite):  # a host read, only when checking
        incoming.nonfinite_ranks = [0]
    if table.routed is not None:
        incoming.rows.append(table.route.received)
        incoming.values.append(table.routed)
    if table.others is not None:
        incoming.rows.append(table.others[0])
        incoming.values.append(table.others[1])
    incoming.touched = bool(incoming.rows)
    return incoming


def _routed_round(tables, group, world_size, rank, wire_dtype, device, stats) -> tuple[list[IncomingGrads], Tensor]:
    """Every table's routed rows and this rank's control codes, one message per destination (:func:`pack`)."""
    codes = [_HAS_ROUTED * (t.routed is not None) + _HAS_OTHERS * (t.others is not None) for t in tables]
    code_values = host_tensor(codes, wire_dtype, device)
    for index, table in enumerate(tables):
        if table.nonfinite is not None:  # device flag: no host read here
            code_values[index] += _NONFINITE * table.nonfinite.to(wire_dtype)
    routed = [t for t in tables if t.route is not None]
    unit = common_unit([t.width for t in routed])
    code_width = -(-len(tables) // unit) * unit  # the codes ride as one row per destination
    code_row = torch.zeros(code_width, dtype=wire_dtype, device=device)
    code_row[: len(tables)] = code_values
    rows = [t.routed.to(wire_dtype) if t.routed is not None  # else placeholders, marked unused by the code
            else torch.zeros(sum(t.route.send_splits), t.width, dtype=wire_dtype, device=device) for t in routed]  # fmt: skip
    rows.append(code_row.expand(world_size, code_width))
    one_each = torch.ones(world_size, dtype=torch.int64)
    send_counts = torch.stack([t.route.send_counts for t in routed] + [one_each])  # [tables + 1, W]
    recv_counts = torch.stack([t.route.recv_counts for t in routed] + [one_each])
    widths = [t.width for t in routed] + [code_width]
    flat, send_sizes = pack(rows, send_counts, to_device(send_counts, device), unit)
    recv_sizes = (recv_counts * torch.tensor(widths).unsqueeze(1)).sum(0).tolist()
    recv = exchange_values(flat, send_sizes, recv_sizes, group, world_size, rank, stats)
    *pieces, sources_codes = unpack(recv, recv_counts, to_device(recv_counts, device), widths, unit)
    with collective("all-to-all of gradients"):
        all_codes = sources_codes[:, : len(tables)].to(torch.int64).cpu()  # [W, T], the round's one host read
    touched = ((all_codes & (_HAS_ROUTED | _HAS_OTHERS)) != 0).any(0).tolist()
    nonfinite = (all_codes & _NONFINITE) != 0
    any_nonfinite = nonfinite.any(0).tolist()
    incoming = [IncomingGrads([], [], touched=touched[i],
                              nonfinite_ranks=nonfinite[:, i].nonzero().view(-1).tolist() if any_nonfinite[i] else [])
                for i in range(len(tables))]  # fmt: skip
    if not routed:
        return incoming, all_codes
    # Sources that sent this rank rows of each routed table, and those that marked them as placeholders.
    with_rows = recv_counts[:-1] > 0  # [routed, W]
    routed_index = torch.tensor([i for i, t in enumerate(tables) if t.route is not None])
    sent = ((all_codes.index_select(1, routed_index) & _HAS_ROUTED) != 0).t() & with_rows
    senders, complete = sent.sum(1).tolist(), (sent == with_rows).all(1).tolist()
    for k, (index, values) in enumerate(zip(routed_index.tolist(), pieces)):
        if not senders[k]:
            continue
        received = tables[index].route.received
        if not complete[k]:  # drop the placeholders of sources without a gradient (a host-side index)
            keep = to_device(torch.repeat_interleave(sent[k], recv_counts[k]).nonzero().view(-1), device)
            received, values = received.index_select(0, keep), values.index_select(0, keep)
        incoming[index].rows.append(received)
        incoming[index].values.append(values)
        incoming[index].merged = senders[k] > 1  # rows of several sources: a row may repeat
    return incoming, all_codes


def _general_round(tables, group, world_size, rank, wire_dtype, device, stats) -> list[tuple[Tensor, Tensor]]:
    """A header of counts per (owner, table), then rows of (local id, values) of every table in one buffer."""
    empty_counts = torch.zeros(world_size, dtype=torch.int64, device=device)
    counts = torch.stack([t.others[2] if t.others is not None else empty_counts for t in tables])  # [T, W]
    recv_counts = exchange_counts(counts.t().contiguous(), group, world_size, stats).t()  # [T, W]: from each source
    with collective("all-to-all of gradient counts"):
        host = torch.stack([counts, recv_counts]).cpu()  # the round's one host read
    id_width = 8 // torch.empty(0, dtype=wire_dtype).element_size()
    widths = [id_width + t.width for t in tables]
    wire = []
    for t, width in zip(tables, widths):
        if t.others is None:
            wire.append(torch.empty(0, width, dtype=wire_dtype, device=device))
            continue
        ids, values = t.others[0], t.others[1]
        # Each row: its local id's 8 bytes reinterpreted in the wire dtype (exact), then its values.
        wire.append(torch.cat([ids.contiguous().view(wire_dtype).view(-1, id_width), values.to(wire_dtype)], dim=1))
    unit = common_unit(widths)
    flat, send_sizes = pack(wire, host[0], counts, unit)
    recv_sizes = (host[1] * torch.tensor(widths).unsqueeze(1)).sum(0).tolist()
    recv = exchange_values(flat, send_sizes, recv_sizes, group, world_size, rank, stats)
    # the ids' values are copied out first: a view into the buffer may start at an offset that is no multiple of 8 bytes
    return [(rows[:, :id_width].reshape(-1).clone().view(torch.int64), rows[:, id_width:])
            for rows in unpack(recv, host[1], recv_counts, widths, unit)]  # fmt: skip
