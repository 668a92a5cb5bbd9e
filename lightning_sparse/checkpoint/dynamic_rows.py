"""DynamicEmbedding tables in a checkpoint: their ids find their owners again, on any number of ranks.

A dynamic table is stored like any table, as the logical ``[W * rows_per_rank, dim]`` tensor of
its slots in (rank, slot) order, next to its per-slot state (``state_dict.<prefix>slot_keys``,
``slot_used``, ``slot_last_used``, ``slot_requests``) and its optimizers' per-row state. Where a
row lives depends on the ranks that saved it, so loading *places* the ids first:

1. each rank reads a contiguous block of every band of the slot state and sends each held id
   (with its last use and request count) to its owner under the loading placement;
2. each owner restores the ids it receives (the most deserving first, if more arrive than it
   has room for: a smaller table keeps the most recently used or most requested ids) and sends
   back the slot it gave each one;
3. every per-row tensor (the rows, then each optimizer state) is read block by block again and
   each saved row moves to its new row; rows of ids that found no room are dropped.

The outcome of step 2 (:class:`PlacedIds`) is kept for the table (:data:`PLACED`), so that optimizers
loaded from the same checkpoint afterwards move their state rows the same way.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_sparse.checkpoint.contents import module_key
from lightning_sparse.checkpoint.rows import RowStore, move_rows
from lightning_sparse.faults.peers import collective
from lightning_sparse.tables.dynamic import DynamicEmbedding
from lightning_sparse.tables.dynamic_state import SLOT_STATE
from lightning_sparse.wire.alltoall import exchange_counts, exchange_values
from lightning_sparse.wire.hashing import HashSharding

Reader = Callable[[str], dict[str, Any]]  # key -> the stored tensor's entry in meta.pt


@dataclass
class PlacedIds:
    """Where the saved rows that this rank reads (a block of each band, in order) went: a row of the table, or -1."""

    checkpoint: str
    rows: Tensor


# Each dynamic table's ids as the last checkpoint loaded into it placed them (kept while the table lives).
PLACED: weakref.WeakKeyDictionary[DynamicEmbedding, PlacedIds] = weakref.WeakKeyDictionary()


@torch.no_grad()
def place_ids(path: Path, store: RowStore, prefix: str, table: DynamicEmbedding, entry: Reader, load: Callable) -> PlacedIds:
    """Steps 1 and 2: read the saved slots, send the held ids to their owners, restore them there. Collective."""
    columns = []
    for name in SLOT_STATE:
        key = module_key(prefix + name)
        like = torch.empty(0, dtype=getattr(torch, entry(key)["dtype"]), device=table.device)
        columns.append(torch.cat([block for _, block in store.blocks(key, table, entry(key), load(key), like)]))
    keys, used, last_used, requests = columns
    held = torch.nonzero(used != 0).view(-1)
    keys = keys.index_select(0, held)
    owner = HashSharding(table.world_size).owner_of_key(keys)
    order = torch.argsort(owner, stable=True)
    sent = torch.stack([keys, last_used.index_select(0, held), requests.index_select(0, held)], dim=1).index_select(0, order)
    counts = torch.bincount(owner, minlength=table.world_size)
    peers = table.peers.counting(None)
    received, send_splits, recv_splits = sent, counts.tolist(), counts.tolist()
    if not peers.alone:
        recv_counts = exchange_counts(counts.view(-1, 1), peers).view(-1)
        with collective(f"placing the ids of {table.name}"):
            recv_splits = recv_counts.tolist()
        received = exchange_values(sent, send_splits, recv_splits, peers)
    slots = table.slots.restore(received[:, 0], received[:, 1], received[:, 2], table.slots.clock)
    back = exchange_values(slots, recv_splits, send_splits, peers)
    rows = torch.where(back >= 0, owner.index_select(0, order) * table.rows_per_rank() + back, -1)
    placed = torch.full_like(used, -1, dtype=torch.int64)
    placed.index_copy_(0, held.index_select(0, order), rows)
    return PlacedIds(str(path), placed)


@torch.no_grad()
def read_placed(store: RowStore, key: str, table: DynamicEmbedding, out: Tensor, stored: dict[str, Any], load: Callable,
                placed_ids: PlacedIds) -> None:  # fmt: skip
    """Step 3 for one per-row tensor: each saved row this rank reads goes to its new row of ``out``. Collective."""
    start = 0
    for _, block in store.blocks(key, table, stored, load, out):
        rows = placed_ids.rows[start : start + len(block)]
        start += len(block)
        kept = torch.nonzero(rows >= 0).view(-1)
        move_rows(block.index_select(0, kept), rows.index_select(0, kept), table.sharding, table, out)
