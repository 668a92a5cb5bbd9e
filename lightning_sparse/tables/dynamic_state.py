"""A :class:`~lightning_sparse.DynamicEmbedding` as a whole, and its state dicts: functions the table calls.

A dynamic table's logical content is the ids that hold rows, with their rows (:func:`export`,
:func:`load_ids`); its sharded state adds each slot's key, use flag, last use and request count
(:data:`SLOT_STATE`) and the clock.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_sparse.tables import shard_state
from lightning_sparse.tables.admission import SlotTable
from lightning_sparse.wire.hashing import HashSharding, mix, unmix


class DynamicEmbedding(shard_state.SparseEmbedding, Protocol):
    """What these functions read of a dynamic table (:class:`lightning_sparse.DynamicEmbedding`, which calls them)."""

    slots: SlotTable

    @property
    def device(self) -> torch.device: ...
    def gather_rows(self, local: Tensor) -> Tensor: ...
    def slot_state(self) -> dict[str, Tensor]: ...
    def watchers(self) -> list[Any]: ...


# Per-slot state in a state dict (one entry per row of the shard), and the clock (a 0-d tensor, the same on every rank).
SLOT_STATE, CLOCK = ("slot_keys", "slot_used", "slot_last_used", "slot_requests"), "slot_clock"


@torch.no_grad()
def export(table: DynamicEmbedding) -> tuple[Tensor, Tensor]:
    """``(ids, rows)`` of every id that holds a row, on every rank (ascending ids).

    Collective: every rank of the group must call it. For export and tests: the table is
    gathered on every rank.
    """
    state = table.slot_state()
    keys, used, rows = (table.gather_rows(t) for t in (state["slot_keys"], state["slot_used"], table.shard))
    held = torch.nonzero(used).view(-1)
    ids, order = torch.sort(unmix(keys.index_select(0, held)))
    return ids, rows.index_select(0, held.index_select(0, order))


def save(table: DynamicEmbedding, destination: dict, prefix: str) -> None:
    """Add the slots and the clock to a state dict that holds the table's shard."""
    for name, value in table.slots.state().items():
        destination[prefix + name] = value
    destination[prefix + CLOCK] = torch.tensor(table.slots.clock)


def load(table: DynamicEmbedding, state_dict: dict, prefix: str, strict: bool, missing_keys: list, unexpected_keys: list,
         error_msgs: list) -> None:  # fmt: skip
    """Load this rank's ``shard`` and slots (same placement), or ``ids`` with their rows as ``weight`` (any placement)."""
    ours = {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
    if "ids" in ours or "weight" in ours:
        if "ids" not in ours or "weight" not in ours:
            error_msgs.append(f"{table.name}: a full state of a DynamicEmbedding holds {prefix}ids and {prefix}weight "
                              f"(see lightning_sparse.full_state_dict); got {sorted(ours)}.")  # fmt: skip
            return
        load_ids(table, ours["ids"], ours["weight"])
        if CLOCK in ours:
            table.slots.clock = int(ours[CLOCK])
        if strict:
            unexpected_keys.extend(prefix + k for k in ours if k not in ("ids", "weight", CLOCK, "_extra_state"))
        return
    rest = {key: value for key, value in state_dict.items() if key[len(prefix) :] not in (*SLOT_STATE, CLOCK)}
    errors = len(error_msgs)
    shard_state.load(table, rest, prefix, strict, missing_keys, unexpected_keys, error_msgs)
    if "shard" not in ours or len(error_msgs) > errors:
        return
    if any(name not in ours for name in (*SLOT_STATE, CLOCK)):
        missing_keys.extend(prefix + name for name in (*SLOT_STATE, CLOCK) if name not in ours)
        return
    table.slots.load(*(ours[name].to(table.device) for name in SLOT_STATE), clock=int(ours[CLOCK]))


@torch.no_grad()
def load_ids(table: DynamicEmbedding, ids: Tensor, rows: Tensor) -> None:
    """Hold exactly ``ids`` (distinct) with ``rows``: this rank keeps the ids it owns. Local (every rank gets all of them)."""
    table.materialize()
    keys = mix(ids.to(table.device).view(-1))
    mine = torch.nonzero(HashSharding(table.world_size).owner_of_key(keys) == table.rank).view(-1)
    zeros = torch.zeros(len(mine), dtype=torch.int64, device=table.device)
    slots = table.slots.restore(keys.index_select(0, mine), zeros, zeros, table.slots.clock)
    kept = torch.nonzero(slots >= 0).view(-1)
    shard = table.shard
    shard.zero_()
    shard.index_copy_(0, slots.index_select(0, kept), rows.to(shard).index_select(0, mine.index_select(0, kept)))
    for optimizer in table.watchers():
        optimizer.reset_rows(shard, slots.index_select(0, kept))
