"""The whole-table view and the state dict of a :class:`~lightning_sparse.DynamicEmbedding` (a mixin of it).

Kept apart from its placement and lookups (one job per class): a dynamic table's logical content
is the ids that hold rows, with their rows (``export``, ``full_tensors``, ``load_ids``); its
sharded state adds each slot's key, use flag, last use and request count (:data:`SLOT_STATE`)
and the clock. The host provides ``slots``, ``capacity``, ``name``, ``world_size``, ``rank``,
``device``, ``shard`` and the optimizers it resets (``_optimizers``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_sparse.wire.hashing import HashSharding, mix, unmix

# Per-slot state in a state dict (one entry per row of the shard), and the clock (a 0-d tensor, the same on every rank).
SLOT_STATE, CLOCK = ("slot_keys", "slot_used", "slot_last_used", "slot_requests"), "slot_clock"


class DynamicStateMixin:
    """A dynamic table as ids and rows (any placement), or as this rank's shard and slots (same placement)."""

    @torch.no_grad()
    def export(self) -> tuple[Tensor, Tensor]:
        """``(ids, rows)`` of every id that holds a row, on every rank (ascending ids).

        Collective: every rank of the group must call it. For export and tests: the table is
        gathered on every rank.
        """
        self.materialize()
        state = self.slots.state()
        keys, used, rows = (self.gather_rows(t) for t in (state["slot_keys"], state["slot_used"], self.shard))
        held = torch.nonzero(used).view(-1)
        ids, order = torch.sort(unmix(keys.index_select(0, held)))
        return ids, rows.index_select(0, held.index_select(0, order))

    # ------------------------------------------------------------------ state dict
    def sharded_keys(self) -> tuple[str, ...]:
        return (*super().sharded_keys(), *SLOT_STATE)

    def full_tensors(self) -> dict[str, Tensor]:
        """``ids`` and their rows as ``weight`` (:meth:`export`); the clock stays. Collective."""
        ids, rows = self.export()
        return {"ids": ids, "weight": rows}

    def slot_state(self) -> dict[str, Tensor]:
        """This rank's per-slot tensors (:data:`SLOT_STATE`), one entry per row of the shard."""
        self.materialize()
        return self.slots.state()

    def get_extra_state(self) -> dict[str, Any]:
        return {**super().get_extra_state(), "capacity": self.capacity}

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, value in self.slots.state().items():
            destination[prefix + name] = value
        destination[prefix + CLOCK] = torch.tensor(self.slots.clock)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Accepts this rank's ``shard`` and slots (same placement), or ``ids`` with their rows as ``weight`` (any placement)."""
        ours = {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
        if "ids" in ours or "weight" in ours:
            if "ids" not in ours or "weight" not in ours:
                error_msgs.append(f"{self.name}: a full state of a DynamicEmbedding holds {prefix}ids and {prefix}weight "
                                  f"(see lightning_sparse.full_state_dict); got {sorted(ours)}.")  # fmt: skip
                return
            self.load_ids(ours["ids"], ours["weight"])
            if CLOCK in ours:
                self.slots.clock = int(ours[CLOCK])
            if strict:
                unexpected_keys.extend(prefix + k for k in ours if k not in ("ids", "weight", CLOCK, "_extra_state"))
            return
        rest = {key: value for key, value in state_dict.items() if key[len(prefix) :] not in (*SLOT_STATE, CLOCK)}
        errors = len(error_msgs)
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if "shard" not in ours or len(error_msgs) > errors:
            return
        if any(name not in ours for name in (*SLOT_STATE, CLOCK)):
            missing_keys.extend(prefix + name for name in (*SLOT_STATE, CLOCK) if name not in ours)
            return
        self.slots.load(*(ours[name].to(self.device) for name in SLOT_STATE), clock=int(ours[CLOCK]))

    @torch.no_grad()
    def load_ids(self, ids: Tensor, rows: Tensor) -> None:
        """Hold exactly ``ids`` (distinct) with ``rows``: this rank keeps the ids it owns. Local (every rank gets all of them)."""
        self.materialize()
        keys = mix(ids.to(self.device).view(-1))
        mine = torch.nonzero(HashSharding(self.world_size).owner_of_key(keys) == self.rank).view(-1)
        zeros = torch.zeros(len(mine), dtype=torch.int64, device=self.device)
        slots = self.slots.restore(keys.index_select(0, mine), zeros, zeros, self.slots.clock)
        kept = torch.nonzero(slots >= 0).view(-1)
        self._shard.zero_()
        self._shard.index_copy_(0, slots.index_select(0, kept), rows.to(self._shard).index_select(0, mine.index_select(0, kept)))
        for optimizer in self._optimizers:
            optimizer.reset_rows(self._shard, slots.index_select(0, kept))
