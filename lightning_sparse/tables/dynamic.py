"""DynamicEmbedding: a table addressed by arbitrary 64-bit ids, each given a row of its own while it fits.

The table is a ``"range"``-sharded :class:`~lightning_sparse.tables.embedding.SparseEmbedding` of
``W * rows_per_rank`` rows: owner ``o``'s slot ``s`` is row ``o * rows_per_rank + s``, and the
owner of an id hands out its slot. A lookup on 2 or more ranks is one round trip:

1. **Keys to owners.** Each rank sorts its ids' keys (:func:`~lightning_sparse.wire.hashing.mix`),
   which groups them by owner (the high bits of the key), and sends the distinct ones with the
   lookup's first stage (:func:`~lightning_sparse.wire.exchange.ids_to_owners`, header checks included,
   ``LookupHeader.kind = 2``).
2. **Rows and slots back.** Each owner finds or admits the keys in its
   :class:`~lightning_sparse.tables.admission.SlotTable`, and sends back each key's row followed by its
   slot (``rows_to_requesters``). An id without a row gets the owner's null slot 0, which stays
   zero. The owner keeps the route with the slots in place of the keys, so the optimizer step
   sends this lookup's gradients to their rows; the requester records its rows by row number,
   so gradients of other lookups go to their owners as a ``SparseEmbedding``'s do.

Every sparse optimizer works as for a ``SparseEmbedding``. A collection's dynamic tables turn
ids into row numbers first (:meth:`DynamicEmbedding.rows_of`, a round per table, of kind 1) and
then join the collection's row round. With one rank there is no round: on a CPU with numba one
loop finds each id's slot (:meth:`DynamicEmbedding.assign_ids`), elsewhere one sort of the keys
gives the distinct ids and their slots.

A sparse optimizer that holds the table resets the optimizer state of every slot given to a new
id, and after each step calls :meth:`DynamicEmbedding.after_step`, which moves the clock (slots
used since the last step are pinned until then), frees expired slots and zeroes the null rows.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse.kernels import gpu_path
from lightning_sparse.kernels.rows import put
from lightning_sparse.lookup.features import FeatureIds
from lightning_sparse.tables import dynamic_state
from lightning_sparse.tables import init as row_init
from lightning_sparse.tables.admission import EVICTION, NULL_SLOT, SlotStats, SlotTable
from lightning_sparse.tables.dynamic_lookup import KeyedRounds, LocalRounds
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.tables.placement import empty_rows
from lightning_sparse.wire.hashing import unmix


class DynamicEmbedding(SparseEmbedding):
    """An embedding table for arbitrary int64 (or uint64) ids, sharded by a hash of the id.

    Args:
        capacity: ids the table holds at most, over all ranks (rank ``r`` holds
            ``capacity // W``, plus one for the first ``capacity % W`` ranks).
        embedding_dim: width of a row.
        admit_after: an id gets a row on the training lookup that asks for it the
            ``admit_after``-th time (counted per rank's lookup, in a count sketch); until then,
            and when no slot can be had, its lookups return zeros and its gradient is dropped.
        eviction: when a rank's slots are full, a new id takes the slot of the id used longest
            ago (``"lru"``) or requested least often (``"lfu"``); slots used since the last
            optimizer step are never taken.
        ttl: if set, ids unused for more than ``ttl`` optimizer steps lose their row.
        sketch_width: counters per row of the admission sketch (default: 4 per slot).
        init: as for :class:`SparseEmbedding`, called with the ids themselves: a new row is
            ``init(ids, embedding_dim, seed)``, so an id that is evicted and admitted again
            starts afresh, and its optimizer state too.
        seed: initial values depend only on ``(seed, id)``.
        dtype: of the rows; ``torch.bfloat16`` or ``torch.float16`` halve their memory, as for
            :class:`SparseEmbedding` (float32 optimizer state, updates written back with
            stochastic rounding).
        stochastic_rounding: for a half-precision table, ``False`` rounds updates to nearest.
        output_dtype: the dtype lookups return (default: the rows' dtype).
        device: of the rows and the slots.
        process_group: the ranks that share the table (see :class:`SparseEmbedding`).
        name: used in error messages and stats; the strategy sets it to the module path.

    Only lookups with grad mode on (training) count requests, admit ids and pin slots; others
    (validation) read what is there. The owner of an id is a fixed mix of its bits modulo the
    ranks, so hash values that share low bits spread evenly.
    """

    resolves_ids = True  # its lookups find (or admit) each id's slot first

    def __init__(
        self,
        capacity: int,
        embedding_dim: int,
        *,
        admit_after: int = 1,
        eviction: str = "lru",
        ttl: int | None = None,
        sketch_width: int | None = None,
        init: row_init.RowInit | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool | None = None,
        output_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"Invalid capacity: {capacity!r}. HINT: a dynamic table holds at least one id.")
        if not isinstance(admit_after, int) or admit_after < 1:
            raise ValueError(f"Invalid admit_after: {admit_after!r}. HINT: 1 admits an id on its first training lookup.")
        if eviction not in EVICTION:
            raise ValueError(f"Invalid eviction: {eviction!r}. HINT: use one of {EVICTION}.")
        if ttl is not None and (not isinstance(ttl, int) or ttl < 1):
            raise ValueError(f"Invalid ttl: {ttl!r}. HINT: a number of optimizer steps >= 1, or None to keep ids.")
        super().__init__(capacity + 1, embedding_dim, sharding="range", init=init, seed=seed, dtype=dtype,
                         stochastic_rounding=stochastic_rounding, output_dtype=output_dtype, device=device,
                         process_group=process_group, name=name or f"DynamicEmbedding({capacity}, {embedding_dim})")  # fmt: skip
        self.has_given_name = name is not None
        self.capacity, self.admit_after, self.eviction, self.ttl = capacity, admit_after, eviction, ttl
        self.sketch_width = sketch_width
        self.slots: SlotTable | None = None
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()  # they reset the state of re-used slots

    # ------------------------------------------------------------------ placement
    def rows_per_rank(self, world_size: int | None = None) -> int:
        """Rows of each rank's shard: the most ids a rank holds, plus the null row."""
        return -(-self.capacity // (world_size or self.world_size)) + 1

    def materialize(
        self, process_group: dist.ProcessGroup | None = None, replica_group: dist.ProcessGroup | None = None
    ) -> DynamicEmbedding:
        """Allocate this rank's slots and rows (local, no collective). See :meth:`SparseEmbedding.materialize`."""
        if replica_group is not None:
            raise ValueError(f"{self.name}: a DynamicEmbedding is sharded over one group. HINT: use 1-D sharding "
                             f"(no sharding_group_size) for models with dynamic tables.")  # fmt: skip
        world_size = self.placement.world_size_of(process_group)
        if self.placement.placed and world_size != self.world_size:
            if self.slots.occupancy or self.world_size != 1:
                raise RuntimeError(f"{self.name} holds ids on {self.world_size} rank(s) and cannot be re-sharded over "
                                   f"{world_size}. HINT: save a checkpoint and load it into a new module.")  # fmt: skip
            self.placement.unplace()  # an unused local table: start over on the group
        if self.num_embeddings != (rows := world_size * self.rows_per_rank(world_size)):  # (every `shard` read asks: no write)
            self.num_embeddings = rows
        super().materialize(process_group)
        if self.slots is None or len(self.slots.last_used) != len(self._shard):
            rank = self.rank
            capacity = self.capacity // world_size + (rank < self.capacity % world_size)
            self.slots = SlotTable(len(self._shard), capacity, admit_after=self.admit_after, eviction=self.eviction,
                                   ttl=self.ttl, sketch_width=self.sketch_width or 4 * capacity, device=self.device)  # fmt: skip
            self._null = torch.zeros(1, dtype=torch.int64, device=self.device)
        return self

    def _initial_rows(self, global_ids: Tensor) -> Tensor:
        # Rows get their values when an id is admitted; the null row stays zero.
        return empty_rows((len(global_ids), self.embedding_dim), self._shard.dtype, self._shard.device).zero_()

    def _lookup_path(self) -> LocalRounds | KeyedRounds:
        return LocalRounds(self) if self.world_size == 1 else KeyedRounds(self)

    def rows_of(self, ids: Any) -> Tensor:
        """The row of each id (flat int64), admitting ids on a training lookup: a collection's first round. Collective."""
        return self.materialize().lookups.rows_of(ids)

    def _apply(self, fn: Any, recurse: bool = True) -> DynamicEmbedding:
        super()._apply(fn, recurse)
        if self.slots is not None and self.slots.map.device != self.device:  # the slots follow the rows
            self.slots.to(self.device)
            self._null = self._null.to(self.device)
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Forget every id: all slots free, all rows zero (optimizer state is reset as ids come back)."""
        self.materialize()
        none = torch.empty(0, dtype=torch.int64, device=self.device)
        self.slots.restore(none, none, none, self.slots.clock)
        self._shard.zero_()

    # ------------------------------------------------------------------ admission
    @torch.no_grad()
    def assign(self, keys: Tensor, requests: Tensor | int, ids_of: Callable[[Tensor], Tensor] | None = None,
                distinct: bool = False, valid: Tensor | None = None) -> Tensor:  # fmt: skip
        """Slots of keys on this owner (see ``SlotTable.resolve``); new ids' rows start from ``init``, their optimizer state afresh.

        ``ids_of(index)``: the ids of ``keys[index]``, where the caller has them (else they are unmixed from the keys).
        ``valid``: the real entries of a padded batch.
        """
        slots, new_slots, new_index = self.slots.resolve(keys, requests, distinct=distinct, valid=valid)
        if len(new_slots):  # on a GPU's path: the batch's bound, padded with the null slot (zeroed again below)
            self._start_rows(new_slots, ids_of(new_index) if ids_of is not None else unmix(keys.index_select(0, new_index)))
        return slots

    @torch.no_grad()
    def assign_ids(self, ids: Tensor, requests: int) -> Tensor:
        """The slot of each of ``ids`` (flat int64, they may repeat) on a CPU with numba: :meth:`assign` without a sort.

        The same slots and decisions as :meth:`assign` of the ids' sorted distinct keys (``SlotTable.resolve_ids``).
        """
        slots, new_slots, new_ids = self.slots.resolve_ids(ids, requests)
        if len(new_slots):
            self._start_rows(new_slots, new_ids)
        return slots

    def _start_rows(self, new_slots: Tensor, new_ids: Tensor) -> None:
        """New ids' rows start from ``init``, their optimizer state afresh (padding: the null slot, zeroed again)."""
        put(self._shard, new_slots, self._init_rows(new_ids), skip=NULL_SLOT)
        for optimizer in self._optimizers:
            optimizer.reset_rows(self._shard, new_slots, skip=NULL_SLOT)
        if gpu_path(new_slots):  # padded: where the torch ops put the padding's rows (a CPU's batches are exact)
            self._shard[NULL_SLOT].zero_()

    # ------------------------------------------------------------------ optimizer steps
    def watch(self, optimizer: Any) -> None:
        """Called by a sparse optimizer that takes this table: it will reset the state of slots given to new ids."""
        self._optimizers.add(optimizer)

    def watchers(self) -> list[Any]:
        """The sparse optimizers that hold this table."""
        return list(self._optimizers)

    @torch.no_grad()
    def after_step(self) -> None:
        """Called by the sparse optimizer after each step: unpin, expire, and put the null row back to zero if it had a gradient."""
        if self.slots.tick():
            self._shard[NULL_SLOT].zero_()
            for optimizer in self._optimizers:
                optimizer.reset_rows(self._shard, self._null)

    # ------------------------------------------------------------------ the whole table and state dicts (dynamic_state.py)
    def export(self) -> tuple[Tensor, Tensor]:
        """``(ids, rows)`` of every id that holds a row, on every rank (ascending ids). Collective."""
        self.materialize()
        return dynamic_state.export(self)

    def slot_state(self) -> dict[str, Tensor]:
        """This rank's per-slot tensors (``dynamic_state.SLOT_STATE``), one entry per row of the shard."""
        self.materialize()
        return self.slots.state()

    def load_ids(self, ids: Tensor, rows: Tensor) -> None:
        """Hold exactly ``ids`` (distinct) with ``rows``: this rank keeps the ids it owns. Local."""
        dynamic_state.load_ids(self, ids, rows)

    def sharded_keys(self) -> tuple[str, ...]:
        return (*super().sharded_keys(), *dynamic_state.SLOT_STATE)

    def full_tensors(self) -> dict[str, Tensor]:
        """``ids`` and their rows as ``weight`` (:meth:`export`); the clock stays. Collective."""
        ids, rows = self.export()
        return {"ids": ids, "weight": rows}

    def get_extra_state(self) -> dict[str, Any]:
        return {**super().get_extra_state(), "capacity": self.capacity}

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        dynamic_state.save(self, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Accepts this rank's ``shard`` and slots (same placement), or ``ids`` with their rows as ``weight`` (any placement)."""
        dynamic_state.load(self, state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs)

    @property
    def slot_stats(self) -> SlotStats:
        """This rank's admissions, evictions, expirations and rejections since the last reset, and its occupancy."""
        self.materialize()
        return self.slots.stats

    def extra_repr(self) -> str:
        held = f", holds={self.slots.occupancy}" if self.slots is not None else ""
        return (f"capacity={self.capacity}, {self.embedding_dim}, admit_after={self.admit_after}, "
                f"eviction={self.eviction!r}, ttl={self.ttl}{held}")  # fmt: skip


def rows_of_features(tables: list[SparseEmbedding], read: list[FeatureIds]) -> list[FeatureIds]:
    """A collection's features with each dynamic table's ids turned into its rows (a round of kind 1 per dynamic table).

    Collective: every rank of the group must call it; each dynamic table of the collection takes
    one round, in the collection's order, also on a rank whose batch has none of its features.
    """
    for t, table in enumerate(tables):
        if not isinstance(table, DynamicEmbedding):
            continue
        mine = [index for index, feature in enumerate(read) if feature.table == t]
        ids = [read[index].ids for index in mine]
        rows = table.rows_of(torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64, device=table.device))
        for index, feature_rows in zip(mine, rows.split([len(i) for i in ids])):
            read[index] = replace(read[index], ids=feature_rows)
    return read
