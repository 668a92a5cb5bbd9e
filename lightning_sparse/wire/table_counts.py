"""Ids per (rank, table) of a lookup round over several tables, counted on the device.

A round over a :class:`~lightning_sparse.wire.sharding.JointSharding` sends each owner the
ids of all tables in one block; the tables' turns of stage 2 and their routes
(:mod:`lightning_sparse.lookup.joint_rows`) need how many ids of each table went to and came
from each rank. Stage 1 counts them without a host read and brings them to the host with its
header (:func:`~lightning_sparse.wire.exchange.ids_to_owners`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_sparse.kernels.host import host_tensor, to_device
from lightning_sparse.wire.header import LookupHeader

if TYPE_CHECKING:
    from lightning_sparse.wire.grouping import SortedKeys
    from lightning_sparse.wire.sharding import JointSharding


@dataclass(frozen=True)
class TableCounts:
    """Ids per (rank, table) of a round on a JointSharding, ``[W, T]`` int64: sent and received, on the host and on the ids' device."""

    sent: Tensor
    received: Tensor
    device_sent: Tensor
    device_received: Tensor


# Binary searches per (owner, table) boundary beat one pass over the keys while the keys outnumber
# the blocks this many times (a pass costs several tensor ops per key, a search ~log2(keys) steps per block).
_KEYS_PER_BLOCK_TO_SEARCH = 16


def count_sent_by_table(runs: SortedKeys, sharding: JointSharding, owner: Tensor, local: Tensor) -> Tensor:
    """This rank's distinct ids per (owner, table), ``[W, T]``, without a host read.

    ``owner`` and ``local``: each sorted key's owner and joint local id. Few blocks for the keys:
    a binary search per block boundary; about as many blocks as keys (thousands of ranks): one
    pass over the keys.
    """
    blocks = sharding.world_size * sharding.num_tables
    if blocks * _KEYS_PER_BLOCK_TO_SEARCH < len(runs.sorted):
        below = runs.counts_below(sharding.table_boundaries(owner.device))
        counts = below[1:] - below[:-1]
    else:
        counts = runs.counts_in_blocks(sharding.block(owner, local), blocks)
    return counts.view(sharding.world_size, sharding.num_tables)


def count_received_in_room(recv: Tensor, sharding: JointSharding) -> Tensor:
    """Ids per (source, table) in the received room, ``[W, T]``, without a host read."""
    world_size, tables, width = sharding.world_size, sharding.num_tables, LookupHeader.WIDTH
    ids = recv[:, width:].contiguous()  # a view with a row stride; bucketize wants contiguous values
    used = torch.arange(ids.shape[1], device=recv.device).unsqueeze(0) < recv[:, :1]
    where = sharding.table_of_local(ids) + torch.arange(world_size, device=recv.device).unsqueeze(1) * tables
    where = torch.where(used, where, world_size * tables).reshape(-1)  # unused places count in a last bin, dropped
    counts = torch.zeros(world_size * tables + 1, dtype=torch.int64, device=recv.device)
    return counts.scatter_add_(0, where, torch.ones_like(where))[:-1].view(world_size, tables)


def served_by_table(received_ids: Tensor, recv_counts: Tensor, sharding: JointSharding) -> TableCounts:
    """The ids per (rank, table) of a round that this rank only serves (it sent no ids).

    ``received_ids`` and ``recv_counts``: the route's joint local ids by source, and how many
    came from each. With one table the counts are the route's own. With several, one host read
    (the rank is idle): the counts that a rank with ids of its own learns with its headers.
    """
    nothing = torch.zeros(sharding.world_size, sharding.num_tables, dtype=torch.int64)
    if sharding.num_tables == 1:
        received = recv_counts.view(-1, 1)
        device_received = to_device(received, received_ids.device)
    else:
        device_received = count_received_by_table(received_ids, recv_counts.tolist(), sharding)
        received = device_received.cpu()
    return TableCounts(nothing, received, nothing.to(device_received.device), device_received)


def count_received_by_table(received: Tensor, recv_splits: Sequence[int], sharding: JointSharding) -> Tensor:
    """Ids per (source, table) in a route's ``received`` joint local ids, ``[W, T]`` on their device (no host read)."""
    world_size, tables = sharding.world_size, sharding.num_tables
    source = torch.repeat_interleave(
        torch.arange(world_size, device=received.device), host_tensor(recv_splits, torch.int64, received.device),
        output_size=len(received),
    )  # fmt: skip
    where = source * tables + sharding.table_of_local(received)
    counts = torch.zeros(world_size * tables, dtype=torch.int64, device=received.device)
    return counts.scatter_add_(0, where, torch.ones_like(where)).view(world_size, tables)
