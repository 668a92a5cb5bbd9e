"""A DynamicEmbedding's lookup paths: one rank (:class:`LocalRounds`: one numba loop on a CPU, else one sort), a keyed
round trip with several (:class:`KeyedRounds`). The table takes one when it is placed.

See :mod:`lightning_sparse.tables.dynamic` for the round trip. A path reads the table's placement
(``peers``, ``device``, ``rank``), its shard, ``pending``, ``stats`` and ``lookup_unit``, its
``rows_per_rank`` and ``assign`` (an owner's slots for keys, admitting new ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_sparse.kernels import gpu_path
from lightning_sparse.kernels.backend import uses_numba
from lightning_sparse.kernels.host import to_device
from lightning_sparse.lookup.engine import serve
from lightning_sparse.lookup.features import FeatureIds, Problem, read_ids
from lightning_sparse.lookup.outputs import expand, gather
from lightning_sparse.lookup.units import OneTable, ShardedTable
from lightning_sparse.lookup.verdict import check_round, header_of
from lightning_sparse.wire.alltoall import Peers
from lightning_sparse.wire.exchange import Route, ids_to_owners, rows_to_requesters
from lightning_sparse.wire.grouping import SortedKeys
from lightning_sparse.wire.hashing import HashSharding, mix
from lightning_sparse.wire.header import OK, Headers


class DynamicEmbedding(ShardedTable, Protocol):
    """What the paths read of their table (:class:`lightning_sparse.DynamicEmbedding`, which takes one when it is placed)."""

    lookup_unit: OneTable

    @property
    def peers(self) -> Peers: ...
    def rows_per_rank(self) -> int: ...
    def assign(self, keys: Tensor, requests: Tensor | int, ids_of: Callable[[Tensor], Tensor] | None = None,
               distinct: bool = False, valid: Tensor | None = None) -> Tensor: ...  # fmt: skip
    def assign_ids(self, ids: Tensor, requests: int) -> Tensor: ...


# ``LookupHeader.kind`` of a round that turns ids into rows (a collection's dynamic tables), and of one
# that sends ids to their owners and gets their rows back at once (a table's own lookup).
RESOLVE, KEYED = 1, 2


def _read(table: DynamicEmbedding, ids: Any) -> tuple[Tensor, list[FeatureIds], Problem]:
    """Flat int64 ids on the table's device, the feature read (none on a problem), and the problem (none raises here)."""
    read, problem = read_ids(ids, table.name, table.device)
    flat = read[0].ids if read else torch.empty(0, dtype=torch.int64, device=table.device)
    return flat, read, problem


class LocalRounds:
    """One rank, the owner of every id: each id's slot from one numba loop (a CPU's), or from one sort of the ids' keys."""

    def __init__(self, table: DynamicEmbedding) -> None:
        self.table = table

    def lookup(self, ids: Any) -> dict[str, Tensor]:
        """The rows at each id's slot, as a SparseEmbedding of one rank reads them (``[*ids.shape, dim]``).

        The gradient is recorded per id and summed at the step (:func:`~lightning_sparse.lookup.outputs.gather`),
        in the same order as for a SparseEmbedding: both tables train alike, bit for bit.
        """
        table = self.table
        slots = self.rows_of(ids)
        table.stats.ids_looked_up += len(slots)
        rows = gather(table, slots)
        return {table.name: rows.view(*ids.shape, table.embedding_dim)}

    def rows_of(self, ids: Any) -> Tensor:
        """The row (slot) of each id (flat int64), admitting ids on a training lookup.

        On a CPU with numba, one loop finds each id's slot (``DynamicEmbedding.assign_ids``); else
        one sort of the ids' keys gives the distinct ids, their slots, and each id's place among them.
        """
        table = self.table
        flat, read, problem = _read(table, ids)
        if problem.error != OK:  # raises
            header = header_of(table.table_index, problem, read, tables=[table])
            check_round(table.lookup_unit, Headers.of(header), problem)
        if uses_numba(flat):
            return table.assign_ids(flat, int(torch.is_grad_enabled()))
        runs, valid = SortedKeys(mix(flat)), None
        if gpu_path(flat) and len(flat):
            valid = runs.finish_padded()  # no host read for the number of distinct ids
        else:
            runs.finish()

        def ids_of(index: Tensor) -> Tensor:  # the ids of the distinct keys at ``index`` (only new ones are asked for)
            return flat.index_select(0, runs.perm.index_select(0, runs.offsets.index_select(0, index)))

        slots = table.assign(runs.unique, int(torch.is_grad_enabled()), ids_of=ids_of, distinct=True, valid=valid)
        return slots.index_select(0, runs.inverse())

    def serve(self, route: Route) -> None:
        raise RuntimeError(f"{self.table.name} has one rank: no other rank looks it up. HINT: report this.")


class KeyedRounds:
    """Two or more ranks: each lookup is one round trip, keys to their owners, which find or admit them and send back rows."""

    def __init__(self, table: DynamicEmbedding) -> None:
        self.table = table

    def lookup(self, ids: Any) -> dict[str, Tensor]:
        """Rows for ``ids`` (ids without a row read zeros). Collective: every rank of the group must call it."""
        table = self.table
        runs, sharding, route = self._keys_to_owners(ids, KEYED)
        table.stats.ids_looked_up += len(runs.sorted)
        table.stats.unique_ids += len(runs.unique)
        back, route = self._answer_rows(route)
        rows, slots = back[:, : table.embedding_dim], back[:, table.embedding_dim :].flatten().clone().view(torch.int64)
        record = None
        if torch.is_grad_enabled():
            # The record names rows as a "range" SparseEmbedding does (owner-major), so that gradients of
            # lookups other than the last go to their owners as any table's do.
            global_rows = sharding.owner_of_key(runs.unique) * table.rows_per_rank() + slots
            record = table.pending.new_record(route, global_rows, occurrences=runs.counts)
        return {table.name: expand(table, rows, record, runs, ids.shape)}

    def _answer_rows(self, route: Route) -> tuple[Tensor, Route]:
        """The owner's side of a keyed round: slots for the keys received, then their rows and slots sent back. Collective.

        Returns the rows this rank asked for, each followed by its slot (an int64 in the rows'
        dtype, bit for bit), and the route with the slots (local rows) as what it received, so
        that the gradients of this lookup come back to them.
        """
        table = self.table
        route = replace(route, received=self._resolve_received(route))
        slot_columns = route.received.unsqueeze(1).view(table.dtype)
        with torch.no_grad():
            rows = torch.cat([table.shard.index_select(0, route.received), slot_columns], dim=1)
        back = rows_to_requesters(rows, route, table.peers)
        if route.records:
            table.pending.keep_route(route)
        return back, route

    def rows_of(self, ids: Any) -> Tensor:
        """The row of each id (flat int64), admitting ids on a training lookup. Collective.

        Bad input (not a tensor, not integers) raises on every rank, as for ``SparseEmbedding``.
        """
        runs, sharding, route = self._keys_to_owners(ids, RESOLVE)
        slots = self.answer(route)
        rows = sharding.owner_of_key(runs.unique) * self.table.rows_per_rank() + slots
        return rows.index_select(0, runs.inverse())

    def _keys_to_owners(self, ids: Any, kind: int) -> tuple[SortedKeys, HashSharding, Route]:
        """The requester's side of a round: this rank's distinct keys, sorted by owner, sent with its header. Collective."""
        table = self.table
        flat, read, problem = _read(table, ids)
        header = header_of(table.table_index, problem, read, kind=kind, tables=[table])
        runs, sharding = SortedKeys(mix(flat)), HashSharding(table.world_size)
        check = partial(check_round, table.lookup_unit, problem=problem)
        route = ids_to_owners(runs, sharding, header.fields(table.device), table.peers, check)
        return runs, sharding, route  # (stage 1 finished the sort)

    def answer(self, route: Route) -> Tensor:
        """The owner's side of a resolving round: the slots of the ids ranks sent, sent back; returns this rank's own. Collective."""
        slots = self._resolve_received(route)
        back = rows_to_requesters(slots.unsqueeze(1), route, self.table.peers)
        return back.view(-1)

    def _resolve_received(self, route: Route) -> Tensor:
        """The owner's slots for the keys of a round (see ``DynamicEmbedding.assign``); local, no collective."""
        # Each requester sent its distinct keys: a key that came from k training ranks is k requests.
        recording = to_device(torch.repeat_interleave(route.headers.column("record"), route.recv_counts), self.table.device)
        return self.table.assign(route.received, recording)

    def serve(self, route: Route) -> None:
        """Answer a round of this table's lookups made by other ranks (see ``serve_lookups``)."""
        kinds = route.headers.active_kinds()
        if kinds in ([RESOLVE], [KEYED]):
            check_round(self.table.lookup_unit, route.headers)
            if kinds == [RESOLVE]:
                self.answer(route)
            else:
                self._answer_rows(route)
        else:
            serve(self.table.lookup_unit, route)
