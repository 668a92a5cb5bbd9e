"""2-D sharding: tables sharded inside groups of G ranks and replicated across the W / G groups.

With ``W`` ranks and a *sharding group size* ``G`` (``W = G x R``), ranks ``g*G .. g*G + G - 1``
form sharding group ``g``: a table is row-sharded over them exactly as 1-D sharding shards it
over ``G`` ranks, and lookups and the gradient exchange stay inside the group (all-to-all
fan-out ``G`` instead of ``W``). The ``R`` ranks that hold the same shard (position ``p`` of
every sharding group) form replica group ``p``. Memory per rank: table / G.

After the in-group exchange each owner holds its group's gradient rows, summed per row. To keep
the replicas identical, :func:`grads_over_replicas` gathers every replica's rows (ids and values)
over the replica group and sums them per row, in replica order, so every replica computes the
same sum and applies the same update. A row's gradient is then the sum over all ``W`` ranks'
occurrences, the same as under 1-D sharding over ``W`` ranks up to the order of floating-point
additions. Cost per step: two collectives over the replica group (a header of counts, then the
rows), each rank receiving the touched rows of all ``R`` replicas of its shard.

>>> layout(world_size=8, group_size=4)   # (sharding groups, replica groups)
([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from lightning_sparse.faults.peers import collective
from lightning_sparse.kernels.host import to_device
from lightning_sparse.wire.alltoall import Peers
from lightning_sparse.wire.grouping import coalesce
from lightning_sparse.wire.packing import common_word, read_as, unpack

_ID_BYTES = 8  # an int64 row id leads each row on the wire


def layout(world_size: int, group_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of every sharding group (``group_size`` consecutive ranks) and every replica group."""
    if group_size < 1 or world_size % group_size:
        raise ValueError(
            f"Invalid sharding_group_size: {group_size} for {world_size} ranks. HINT: use a divisor of the world size, "
            f"e.g. the number of GPUs per host."
        )
    groups = world_size // group_size
    shards = [list(range(g * group_size, (g + 1) * group_size)) for g in range(groups)]
    return shards, [list(range(p, world_size, group_size)) for p in range(group_size)]


def sharding_groups(group_size: int, timeout: timedelta | None = None) -> tuple[ProcessGroup, ProcessGroup | None]:
    """Create the 2-D groups of the default group; returns this rank's (sharding group, replica group).

    Collective: every rank of the default group must call it, in the same order as its other
    group creations. The replica group is ``None`` when ``group_size`` is the world size (1-D
    sharding). ``timeout`` defaults to torch's for the backend; pass the one the default group
    was made with. Give the groups to each table:
    ``SparseEmbedding(..., process_group=shard_group, replica_group=replica_group)``.
    """
    shards, replicas = layout(dist.get_world_size(), group_size)
    with collective("creating the sharding groups"):
        shard_group, _ = dist.new_subgroups_by_enumeration(shards, timeout=timeout)
        if len(shards) == 1:
            return shard_group, None
        replica_group, _ = dist.new_subgroups_by_enumeration(replicas, timeout=timeout)
    return shard_group, replica_group


@dataclass
class OwnedGrads:
    """One table's gradient on its owner: distinct local rows, their summed values (wire dtype), and flags."""

    rows: Tensor
    values: Tensor
    touched: bool
    nonfinite_ranks: list[int]  # global ranks


def grads_over_replicas(tables: list[OwnedGrads], bounds: list[int], replicas: Peers) -> list[OwnedGrads]:
    """Sum every table's owned gradient rows over the replicas of this rank's shard.

    ``bounds[t]``: table ``t``'s local rows are below it. Returns, per table, the distinct rows
    touched on any replica (ascending) and their sums, added in replica order: every replica
    gets the same result. ``touched`` and the ranks with inf/NaN (the first of each sharding
    group) are agreed too. ``replicas``: the replica group's ranks. Collective: every rank of the
    replica group must call it, with the same tables in the same order.
    """
    device, group, stats = tables[0].values.device, replicas.group, replicas.stats
    with record_function("lightning_sparse.grads_over_replicas"):
        header = torch.tensor(
            [[len(t.rows) for t in tables], [t.touched for t in tables], [min(t.nonfinite_ranks, default=-1) for t in tables]],
            dtype=torch.int64,
        )  # fmt: skip
        gathered = torch.empty(replicas.world_size * header.numel(), dtype=torch.int64, device=device)
        with collective("all-gather of the replicas' gradient counts"):
            _all_gather(gathered, to_device(header, device).view(-1), group)
            headers = gathered.cpu().view(replicas.world_size, *header.shape)  # the one host read of this stage
        counts = headers[:, 0].t()  # [T, R]
        widths = [_ID_BYTES + t.values.shape[1] * t.values.element_size() for t in tables]
        sent = (counts * torch.tensor(widths).unsqueeze(1)).sum(0)  # bytes from each replica
        most = int(sent.max())
        if stats is not None:
            stats.collectives += 1 + (most > 0)
            stats.bytes_sent += (replicas.world_size - 1) * (header.numel() * 8 + most)
            stats.bytes_received += (replicas.world_size - 1) * header.numel() * 8 + int(sent.sum()) - int(sent[replicas.rank])
        touched, first_bad = headers[:, 1].amax(0).tolist(), headers[:, 2].t().tolist()
        if most == 0:
            summed = [(t.rows, t.values) for t in tables]
        else:
            summed = _sum_rows(tables, bounds, counts, sent, most, widths, group, replicas.world_size)
    return [
        OwnedGrads(rows, values, bool(touched[i]), sorted(r for r in first_bad[i] if r >= 0))
        for i, (rows, values) in enumerate(summed)
    ]


def _sum_rows(tables, bounds, counts, sent, most, widths, group, replicas) -> list[tuple[Tensor, Tensor]]:
    """Gather the replicas' rows as bytes (each row: its id, then its values), unpack by table, coalesce."""
    mine = torch.cat([_as_bytes(t) for t in tables])
    padded = mine.new_zeros(most)
    padded[: len(mine)] = mine
    received = mine.new_empty(replicas * most)
    with collective("all-gather of the replicas' gradient rows"):
        _all_gather(received, padded, group)
    word = common_word(widths)
    pad_words = ((most - sent) // word).unsqueeze(0)  # the tail of each replica's message: one more "table"
    layout_counts = torch.cat([counts, pad_words])
    per_table = unpack(received, layout_counts, to_device(layout_counts, received.device), [*widths, word], word)
    out = []
    for table, rows_bytes, bound in zip(tables, per_table, bounds):
        ids = read_as(rows_bytes[:, :_ID_BYTES], torch.int64).view(-1)
        values = read_as(rows_bytes[:, _ID_BYTES:], table.values.dtype).view(len(ids), table.values.shape[1])
        out.append(coalesce(ids, values, bound) if len(ids) else (table.rows, table.values))
    return out


def _as_bytes(table: OwnedGrads) -> Tensor:
    """``[n, 8 + cols * itemsize]`` bytes per row, flattened: the row's int64 id, then its values."""
    n, width = len(table.rows), table.values.shape[1] * table.values.element_size()
    ids = table.rows.to(torch.int64).contiguous().view(torch.uint8).view(n, _ID_BYTES)
    values = table.values.contiguous().view(torch.uint8).view(n, width)
    return torch.cat([ids, values], dim=1).view(-1)


def _all_gather(output: Tensor, input: Tensor, group: ProcessGroup) -> None:
    """``output`` (1-D) = every rank's ``input`` (1-D, same size), in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the former from torch 2.13 on
    gather(output, input, group=group)
