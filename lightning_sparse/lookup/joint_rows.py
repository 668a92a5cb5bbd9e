"""Stage 2 of a round over several tables: every owner sends every table's rows in one buffer.

A round's distinct keys sort by owner, then table (:class:`~lightning_sparse.wire.sharding.JointSharding`);
an owner receives them by requester, then table. Each table wants its own items, by rank.
:class:`TableMajor` makes that turn with one gather for the whole round; :func:`table_routes`
cuts the round's route into one per table (the way its gradients go back), and
:func:`rows_from_owners` gathers and sends the rows. With one table (a
:class:`~lightning_sparse.SparseEmbedding` on its own), or with one rank, every turn is the
identity and is skipped: each table's rows go back as ``rows_to_requesters`` sends them (with
one rank, nowhere).
"""

from __future__ import annotations

from functools import reduce
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.profiler import record_function

from lightning_sparse.wire.alltoall import exchange_values
from lightning_sparse.wire.exchange import Route, rows_to_requesters
from lightning_sparse.wire.grouping import transpose_blocks, transposed_places
from lightning_sparse.wire.packing import common_word, pack, unpack

if TYPE_CHECKING:
    from lightning_sparse.lookup.units import ShardedTable
    from lightning_sparse.wire.alltoall import Peers
    from lightning_sparse.wire.sharding import JointSharding
    from lightning_sparse.wire.table_counts import TableCounts


class TableMajor:
    """Items of a round in (rank, table) blocks, seen table by table: (table, rank) blocks.

    One gather (:func:`transpose_blocks`) turns the whole round around, whatever the number of
    ranks and tables; with one table or one rank there is nothing to turn (``gather`` is
    ``None``). ``counts`` is ``[W, T]`` on the host, ``device_counts`` the same on the items' device.
    """

    def __init__(self, counts: Tensor, device_counts: Tensor) -> None:
        self.counts, self.device_counts = counts, device_counts
        self.total = int(counts.sum())
        self.per_table = counts.sum(0).tolist()
        self.gather = transpose_blocks(device_counts, self.total) if min(counts.shape) > 1 else None

    def split(self, values: Tensor) -> list[Tensor]:
        """``values`` (one per item, by rank, then table) as one tensor per table, each by rank."""
        if self.gather is None:
            return list(values.split(self.per_table))
        return list(values.index_select(0, self.gather).split(self.per_table))

    def within_table(self, items: Tensor) -> Tensor:
        """For items given by their index in the round, each one's index among its table's items."""
        if self.counts.shape[1] == 1:
            return items
        return transposed_places(self.device_counts, self.total, within_b=True).index_select(0, items)


def both_ways(counts: TableCounts) -> tuple[TableMajor, TableMajor]:
    """The round's ids per (rank, table) as this rank sent them and as it received them: one object where they are one (one rank)."""
    mine = TableMajor(counts.sent, counts.device_sent)
    if counts.received is counts.sent:
        return mine, mine
    return mine, TableMajor(counts.received, counts.device_received)


def table_routes(route: Route, joint: JointSharding, theirs: TableMajor) -> list[Route]:
    """Each table's share of a joint route: its splits, and the local rows the owner sent (by requester).

    ``theirs``: the round's received ids per (requester, table), as the owner turns them by table.
    """
    if joint.num_tables == 1:  # the table's share is the whole route
        return [route]
    sent, received = route.by_table.sent.t().unbind(0), route.by_table.received.t().unbind(0)
    return [Route(sent[t], received[t], rows - joint.offsets[t], route.headers)
            for t, rows in enumerate(theirs.split(route.received))]  # fmt: skip


def rows_from_owners(
    tables: list[ShardedTable],
    route: Route,
    mine: TableMajor,
    theirs: TableMajor,
    routes: list[Route],
    peers: Peers,
) -> list[Tensor]:
    """Stage 2 for all tables: owners gather every table's rows and send them in one buffer; returns each table's rows.

    ``mine``/``theirs``: the round's ids per (rank, table) both ways. The rows travel in one
    dtype that holds every table's rows exactly. When all tables have one width, a row is one word of the
    buffer, and the turns between (rank, table) and (table, rank) order are the ones ``mine``
    and ``theirs`` made already. With one table, or one rank, there is nothing to pack: each
    table's rows go as they are (and with one rank nowhere). Collective: every rank of the
    tables' group must call it.
    """
    if len(tables) == 1 or peers.alone:
        with torch.no_grad():
            rows = [table.shard.index_select(0, table_route.received) for table, table_route in zip(tables, routes)]
        return [rows_to_requesters(r, table_route, peers) for r, table_route in zip(rows, routes)]
    widths = [t.embedding_dim for t in tables]
    word = common_word(widths)
    one_width = len(set(widths)) == 1
    wire = reduce(torch.promote_types, (table.dtype for table in tables))
    with record_function("lightning_sparse.rows_to_requesters"), torch.no_grad():
        gathered = [table.shard.index_select(0, table_route.received).to(wire) for table, table_route in zip(tables, routes)]
        send, send_sizes = pack(
            gathered, route.by_table.received.t(), route.by_table.device_received.t(), word, theirs.gather if one_width else None
        )
        recv_sizes = (mine.counts * torch.tensor(widths)).sum(1).tolist()
        back = exchange_values(send, send_sizes, recv_sizes, peers)
        rows = unpack(back, mine.counts.t(), mine.device_counts.t(), widths, word, mine.gather if one_width else None)
    return [piece.to(table.dtype) for piece, table in zip(rows, tables)]
