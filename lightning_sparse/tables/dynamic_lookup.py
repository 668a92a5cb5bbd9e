"""A DynamicEmbedding's lookup rounds (a mixin of it): keyed lookups, ids to rows, and serving others.

See :mod:`lightning_sparse.tables.dynamic` for the round trip. The host provides the table's placement
(``world_size``, ``rank``, ``process_group``, ``device``, ``_shard``, ``stats``, ``pending``,
``lookup_unit``), ``rows_per_rank`` and ``_assign`` (an owner's slots for keys, admitting new ones).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lightning_sparse.kernels import gpu_path
from lightning_sparse.kernels.host import to_device
from lightning_sparse.lookup.engine import serve
from lightning_sparse.lookup.features import Problem, read_ids
from lightning_sparse.lookup.outputs import expand, gather
from lightning_sparse.lookup.verdict import check_round, header_of
from lightning_sparse.wire.exchange import Route, ids_to_owners, rows_to_requesters
from lightning_sparse.wire.grouping import SortedKeys
from lightning_sparse.wire.hashing import HashSharding, mix
from lightning_sparse.wire.header import OK, Headers, LookupHeader

# ``LookupHeader.stage`` of a round that turns ids into rows (a collection's dynamic tables), and of one
# that sends ids to their owners and gets their rows back at once (a table's own lookup).
RESOLVE, KEYED = 1, 2


class DynamicLookupMixin:
    """The lookups of a dynamic table: one keyed round trip on 2 or more ranks, one sort on one."""

    def _read(self, ids: Any, stage: int = 0) -> tuple[Tensor, LookupHeader, Problem]:
        """Flat int64 ids on the table's device, this rank's header for a round of ``stage``, and its problem (none raises here)."""
        read, problem = read_ids(ids, self.name, self.device)
        flat = read[0].ids if read else torch.empty(0, dtype=torch.int64, device=self.device)
        return flat, header_of(self.table_index, problem, read, stage=stage, tables=[self]), problem

    @torch.compiler.disable
    def lookup_rows(self, ids: Tensor) -> Tensor:
        """Rows for ``ids`` (any shape, integer dtype, any value) -> ``[*ids.shape, embedding_dim]``: the eager ``forward``.

        Collective: every rank of the group must call it (with possibly empty ``ids``), in the
        same order as the other tables of the group. Ids without a row read zeros.
        """
        self.check_first_lookup()
        self.materialize()
        if self.world_size == 1:
            return self._local_lookup(ids)
        return self._keyed_lookup(ids)

    def _local_lookup(self, ids: Any) -> Tensor:
        """One rank: the slots of the distinct ids, then the rows at each id's slot, as a SparseEmbedding of one rank reads them.

        The gradient is recorded per id and summed at the step (:func:`~lightning_sparse.lookup.outputs.gather`),
        in the same order as for a SparseEmbedding: both tables train alike, bit for bit.
        """
        slots, runs = self._local_slots(ids)
        self.stats.ids_looked_up += len(runs.sorted)
        rows = gather(self, slots.index_select(0, runs.inverse()))
        return rows.view(*ids.shape, self.embedding_dim)

    def _local_slots(self, ids: Any) -> tuple[Tensor, SortedKeys]:
        """One rank, the owner of every id: the slot of each distinct id (one sort of their keys), and the sort."""
        flat, header, problem = self._read(ids)
        if problem.error != OK:
            check_round(self.lookup_unit, Headers.of(header), problem)  # raises
        runs, valid = SortedKeys(mix(flat)), None
        if gpu_path(flat) and len(flat):
            valid = runs.finish_padded()  # no host read for the number of distinct ids
        else:
            runs.finish()

        def ids_of(index: Tensor) -> Tensor:  # the ids of the distinct keys at ``index`` (only new ones are asked for)
            return flat.index_select(0, runs.perm.index_select(0, runs.offsets.index_select(0, index)))

        return self._assign(runs.unique, int(torch.is_grad_enabled()), ids_of=ids_of, distinct=True, valid=valid), runs

    def _keyed_lookup(self, ids: Any) -> Tensor:
        """One round on 2 or more ranks: keys to their owners, which find or admit them and send back rows and slots."""
        runs, sharding, route = self._keys_to_owners(ids, KEYED)
        self.stats.ids_looked_up += len(runs.sorted)
        self.stats.unique_ids += len(runs.unique)
        back, route = self._answer_rows(route)
        rows, slots = back[:, : self.embedding_dim], back[:, self.embedding_dim :].flatten().clone().view(torch.int64)
        record = None
        if torch.is_grad_enabled():
            # The record names rows as a "range" SparseEmbedding does (owner-major), so that gradients of
            # lookups other than the last go to their owners as any table's do.
            global_rows = sharding.owner_of_key(runs.unique) * self.rows_per_rank() + slots
            record = self.pending.new_record(route, global_rows, occurrences=runs.counts)
        return expand(self, rows, record, runs, ids.shape)

    def _answer_rows(self, route: Route) -> tuple[Tensor, Route]:
        """The owner's side of a keyed round: slots for the keys received, then their rows and slots sent back. Collective.

        Returns the rows this rank asked for, each followed by its slot (an int64 in the rows'
        dtype, bit for bit), and the route with the slots (local rows) as what it received, so
        that the gradients of this lookup come back to them.
        """
        route = replace(route, received=self._resolve_received(route))
        slot_columns = route.received.unsqueeze(1).view(self._shard.dtype)
        with torch.no_grad():
            rows = torch.cat([self._shard.index_select(0, route.received), slot_columns], dim=1)
        back = rows_to_requesters(rows, route, self.peers)
        if route.records:
            self.pending.route = route
        return back, route

    def rows_of(self, ids: Any) -> Tensor:
        """Stage 1: the row of each id (flat int64), admitting ids on a training lookup. Collective.

        Bad input (not a tensor, not integers) raises on every rank, as for ``SparseEmbedding``.
        """
        if self.world_size == 1:
            slots, runs = self._local_slots(ids)
            return slots.index_select(0, runs.inverse())
        runs, sharding, route = self._keys_to_owners(ids, RESOLVE)
        slots = self.answer(route)
        rows = sharding.owner_of_key(runs.unique) * self.rows_per_rank() + slots
        return rows.index_select(0, runs.inverse())

    def _keys_to_owners(self, ids: Any, stage: int) -> tuple[SortedKeys, HashSharding, Route]:
        """The requester's side of a round: this rank's distinct keys, sorted by owner, sent with its header. Collective.

        Bad input (not a tensor, not integers) raises on every rank, as for ``SparseEmbedding``.
        """
        flat, header, problem = self._read(ids, stage)
        runs, sharding = SortedKeys(mix(flat)), HashSharding(self.world_size)
        fields = header.fields(self.device)
        check = partial(check_round, self.lookup_unit, problem=problem)
        route = ids_to_owners(runs, sharding, fields, self.peers, check)
        return runs, sharding, route  # (stage 1 finished the sort)

    def answer(self, route: Route) -> Tensor:
        """Stage 1 on the owner: give the ids that ranks sent their slots and send them back; returns this rank's own. Collective."""
        slots = self._resolve_received(route)
        back = rows_to_requesters(slots.unsqueeze(1), route, self.peers)
        return back.view(-1)

    def _resolve_received(self, route: Route) -> Tensor:
        """The owner's slots for the keys of a round (see :meth:`_assign`); local, no collective."""
        # Each requester sent its distinct keys: a key that came from k training ranks is k requests.
        recording = to_device(torch.repeat_interleave(route.headers.column("record"), route.recv_counts), self.device)
        return self._assign(route.received, recording)

    def serve(self, route: Route) -> None:
        """Answer a round of this table's lookups made by other ranks (see ``serve_lookups``)."""
        stages = route.headers.active_stages()
        if stages in ([RESOLVE], [KEYED]):
            check_round(self.lookup_unit, route.headers)
            if stages == [RESOLVE]:
                self.answer(route)
            else:
                self._answer_rows(route)
        else:
            serve(self.lookup_unit, route)

    # ------------------------------------------------------------------ optimizer steps
