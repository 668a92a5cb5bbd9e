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
once, and counts what crossed to other ranks in :class:`~lightning_sparse.wire.alltoall.ExchangeStats`.

Grouping by owner takes one sort: :class:`~lightning_sparse.wire.grouping.SortedKeys` sorts owner-major keys
(:meth:`lightning_sparse.wire.sharding.RowSharding.key`), which deduplicates and groups in one go and
yields the runs that a segment sum (``F.embedding_bag``) adds up.

This module holds stages 1 and 2 (and the :class:`Route` between them); stage 3 is in ``grads_exchange.py``, the header
in ``header.py``, the ids per (rank, table) of a round over several tables in ``table_counts.py``, the all-to-all
primitives and :class:`~lightning_sparse.wire.alltoall.ExchangeStats` in ``alltoall.py``, stage 1 run ahead in ``ahead.py``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from lightning_sparse.faults.peers import collective
from lightning_sparse.kernels.host import to_device
from lightning_sparse.wire.alltoall import Peers, exchange_values, split_starts
from lightning_sparse.wire.grouping import SortedKeys, gather_segments, transpose_blocks
from lightning_sparse.wire.header import Headers, LookupHeader
from lightning_sparse.wire.sharding import JointSharding, RowSharding
from lightning_sparse.wire.table_counts import TableCounts, count_received_by_table, count_received_in_room, count_sent_by_table

if TYPE_CHECKING:
    from lightning_sparse.wire.hashing import HashSharding

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
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
    # The ids per (rank, table) of a round on a JointSharding (several tables, or one); else ``None``.
    by_table: TableCounts | None = None

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


# Room for ids per destination in the next lookup round of each process group. Every rank derives it
# from the same headers (the largest count of the last round, plus a margin), so all ranks agree
# without a word; a lookup on any table of the group, or a rank serving others, uses it.
_ROOM: weakref.WeakKeyDictionary[ProcessGroup, int] = weakref.WeakKeyDictionary()
_ROOM_MARGIN, _ROOM_ALIGN = 1.25, 16


def _next_room(most: int) -> int:
    return -(-int(most * _ROOM_MARGIN) // _ROOM_ALIGN) * _ROOM_ALIGN if most else 0


def ids_to_owners(
    runs: SortedKeys,
    sharding: RowSharding | JointSharding | HashSharding,
    fields: Tensor,
    peers: Peers,
    check: Callable[[Headers], None] | None = None,
) -> Route:
    """Stage 1: every rank's header and its distinct ids, grouped by owner, in one all-to-all.

    ``runs`` sorted this rank's owner-major keys (ids that fall outside the table go nowhere);
    ``fields`` is this rank's header without ``count`` (:meth:`LookupHeader.fields`). Each
    destination gets a row of ``LookupHeader.WIDTH + room`` int64: the header, then up to ``room`` ids.
    ``room`` is agreed from the previous round; a rank with more ids for someone says so in
    its header (``most``), and an overflow round sends the rest. ``check`` sees every rank's
    header before the route is built; every rank sees the same headers, so if it raises, it
    raises on every rank and the group stays usable. One host read: the headers. With a
    :class:`~lightning_sparse.wire.sharding.JointSharding` (several tables), the same read also
    brings the ids per (rank, table) both ways (``Route.by_table``). The same read gives the number
    of distinct ids, with which it finishes ``runs`` (:meth:`SortedKeys.finish`: ``unique`` is then set).

    With one rank nothing is sent (:func:`_to_itself`). It is :func:`send_ids`, then :meth:`IdsSent.route` (a pipelined
    lookup runs the first ahead: :mod:`lightning_sparse.wire.ahead`). Collective: every rank of the group must call it.
    """
    if peers.alone:
        return _to_itself(runs, sharding, fields, check)
    return send_ids(runs, sharding, fields, peers).route(check)


@dataclass
class IdsSent:
    """Stage 1 once its all-to-all is issued (:func:`send_ids`): :meth:`route` waits for it and finishes the stage."""

    runs: SortedKeys
    sharding: RowSharding | JointSharding | HashSharding
    peers: Peers
    counts: Tensor  # ids sent to each rank, [W] on the device
    recv: Tensor  # [W, WIDTH + room]: every rank's header and ids, once ``work`` is done
    room: int
    work: dist.Work | None  # the all-to-all in flight (``None``: done)
    device_sent: Tensor | None  # ids per (rank, table) sent, for several tables
    seconds: float  # spent issuing it

    def route(self, check: Callable[[Headers], None] | None = None) -> Route:
        """Wait for the all-to-all, read the headers (one host read), ``check`` them, run any overflow round.

        Collective: every rank of the group must call it for the stages it issued, in the same order."""
        start = time.perf_counter()
        runs, sharding, peers, recv, room = self.runs, self.sharding, self.peers, self.recv, self.room
        world_size, width, tables = peers.world_size, LookupHeader.WIDTH, self.device_sent is not None
        with record_function("lightning_sparse.ids_to_owners"):
            with collective("all-to-all of lookup ids"):
                if self.work is not None:
                    self.work.wait()
                read = [self.counts, recv[:, :width].reshape(-1)]
                if tables:
                    device_received = count_received_in_room(recv, sharding)
                    read += [self.device_sent.reshape(-1), device_received.reshape(-1)]
                on_host = torch.cat(read).cpu()  # the stage's one host read
            send_splits = on_host[:world_size].tolist()
            headers = Headers(on_host[world_size : world_size * (1 + width)].view(world_size, width))
            if tables:
                sent_by_table, received_by_table = on_host[world_size * (1 + width) :].view(2, world_size, -1).unbind(0)
            most = int(headers.column("most").max())
            _ROOM[peers.group] = _next_room(most)
            if check is not None:
                check(headers)
            runs.finish(sum(send_splits))
            recv_splits = headers.tensor[:, 0].tolist()
            received = gather_segments(
                recv.view(-1), torch.arange(world_size) * (width + room) + width, headers.tensor[:, 0].clamp(max=room)
            )
            if most > room:  # overflow: the ids beyond the room, in a second round
                received = _overflow(runs, sharding, send_splits, recv_splits, room, received, peers)
                if tables:  # the room held only some ids: count them all (a second host read, with the second round)
                    device_received = count_received_by_table(received, recv_splits, sharding)
                    received_by_table = device_received.cpu()
        if peers.stats is not None:
            crossed = world_size * (width + room) * 8 * (world_size - 1) // world_size
            peers.stats.bytes_sent += crossed
            peers.stats.bytes_received += crossed
            peers.stats.collectives += 1
            peers.stats.exchange_seconds += self.seconds + time.perf_counter() - start
        by_table = None
        if tables:
            by_table = TableCounts(sent_by_table, received_by_table, self.device_sent, device_received)
        elif getattr(sharding, "num_tables", 0) == 1:
            by_table = TableCounts(on_host[:world_size].view(-1, 1), headers.tensor[:, :1], self.counts.view(-1, 1), recv[:, :1])
        return Route(on_host[:world_size], headers.tensor[:, 0], received, headers, by_table)


def send_ids(
    runs: SortedKeys, sharding: RowSharding | JointSharding | HashSharding, fields: Tensor, peers: Peers, wait: bool = True
) -> IdsSent:
    """Issue stage 1's all-to-all (:func:`ids_to_owners`; no host read); ``wait=False`` returns while it is in flight.

    Collective: every rank of the group (two or more) must call it, then :meth:`IdsSent.route` on what it returns.
    """
    start = time.perf_counter()
    group, world_size, width = peers.group, peers.world_size, LookupHeader.WIDTH
    device = runs.sorted.device
    with record_function("lightning_sparse.ids_to_owners"):
        room = _ROOM.get(group, 0)
        below = sharding.owner_counts_below(runs, device)
        counts = below[1:] - below[:-1]
        keys = runs.sorted.to(torch.int64)
        owner, local = sharding.owner_of_key(keys), sharding.local_of_key(keys)
        send = _pack(runs, owner, local, below, room, world_size, device)
        rows = send.view(world_size, width + room)
        rows[:, 0] = counts
        rows[:, 1:width] = fields
        rows[:, 1 + LookupHeader.field_index("most")] = counts.max()
        recv = torch.empty(world_size * (width + room), dtype=torch.int64, device=device)
        several = getattr(sharding, "num_tables", 0) > 1  # one table: its ids per rank are the counts themselves
        device_sent = count_sent_by_table(runs, sharding, owner, local) if several else None
        with collective("all-to-all of lookup ids"):
            work = dist.all_to_all_single(recv, send, group=group, async_op=not wait)
    return IdsSent(runs, sharding, peers, counts, recv.view(world_size, width + room), room, work, device_sent,
                   time.perf_counter() - start)  # fmt: skip


def _to_itself(
    runs: SortedKeys,
    sharding: RowSharding | JointSharding | HashSharding,
    fields: Tensor,
    check: Callable[[Headers], None] | None,
) -> Route:
    """Stage 1 on one rank: the distinct ids stay where they are, as their local rows.

    The stage's one host read brings the header, to ``check`` as every rank's headers, and,
    for a :class:`~lightning_sparse.wire.sharding.JointSharding`, the ids per table (with one
    rank, what a rank sends is what it receives).
    """
    device = runs.sorted.device
    num_tables = getattr(sharding, "num_tables", 0)
    boundaries = sharding.table_boundaries(device) if num_tables else sharding.key_boundaries(device)
    below = runs.counts_below(boundaries)
    per_table = (below[1:] - below[:-1]).view(1, -1)  # [1, T]: with one rank, a table's block is its keys
    on_host = torch.cat([per_table.view(-1), fields]).cpu()  # the stage's one host read
    sent, own_fields = on_host[: per_table.shape[1]].view(1, -1), on_host[per_table.shape[1] :]
    count = sent.sum().view(1)
    headers = Headers(torch.cat([count, own_fields]).view(1, LookupHeader.WIDTH))
    if check is not None:
        check(headers)
    runs.finish(int(count))
    by_table = TableCounts(sent, sent, per_table, per_table) if num_tables else None
    return Route(count, count, sharding.local_of_key(runs.unique), headers, by_table)


def _pack(
    runs: SortedKeys, owner: Tensor, local: Tensor, below: Tensor, room: int, world_size: int, device: torch.device
) -> Tensor:
    """The send buffer of stage 1: per destination a header (filled by the caller) and ``room`` ids.

    ``owner`` and ``local`` are the owner and local id of each sorted key. Built without a host
    read: each distinct key goes to place ``its index among its owner's keys``; keys beyond the
    room, outside the table, or repeated go to scratch places past the end, which are not sent.
    """
    width = LookupHeader.WIDTH + room
    n = len(runs.sorted)
    send = torch.zeros(world_size * width + n, dtype=torch.int64, device=device)
    if n == 0 or room == 0:
        return send[: world_size * width]
    inside = (owner >= 0) & (owner < world_size) & runs.is_first
    owner = owner.clamp(0, world_size - 1)
    within = runs.run_index() - below.index_select(0, owner)
    place = owner * width + LookupHeader.WIDTH + within
    scratch = torch.arange(world_size * width, world_size * width + n, device=device)
    send.index_copy_(0, torch.where(inside & (within < room), place, scratch), local)
    return send[: world_size * width]


def _overflow(runs, sharding, send_splits, recv_splits, room, received, peers) -> Tensor:
    """The second round of stage 1: ids beyond the room, then every requester's ids in order."""
    local = sharding.local_of_key(runs.unique)
    starts = split_starts(send_splits)
    extra_send = [max(0, c - room) for c in send_splits]
    extra_recv = [max(0, c - room) for c in recv_splits]
    extra = gather_segments(
        local, torch.tensor(starts[:-1], dtype=torch.int64) + room, torch.tensor(extra_send, dtype=torch.int64)
    )
    extra = exchange_values(extra, extra_send, extra_recv, peers)
    counts = torch.tensor([[min(c, room) for c in recv_splits], extra_recv], dtype=torch.int64)  # [2, W]
    both = torch.cat([received, extra])  # all the room's ids by source, then all extra ids by source
    return both.index_select(0, to_device(transpose_blocks(counts, len(both)), both.device))  # by source


# ---------------------------------------------------------------------------- stage 2: rows to requesters
def rows_to_requesters(rows: Tensor, route: Route, peers: Peers) -> Tensor:
    """Stage 2: send the rows for ``route.received`` back; returns the requested rows in key order.

    Collective: every rank of the group must call it. No host read: the splits are the route's.
    """
    if peers.alone:
        return rows
    start = time.perf_counter()
    with record_function("lightning_sparse.rows_to_requesters"):
        out = exchange_values(rows, route.recv_splits, route.send_splits, peers)
    if peers.stats is not None:
        peers.stats.exchange_seconds += time.perf_counter() - start
    return out
