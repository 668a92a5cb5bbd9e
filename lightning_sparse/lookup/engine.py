"""A lookup round, step by step: read -> one sort -> ids to owners -> rows back -> expand or pool.

One engine answers every lookup. Its unit is a set of tables looked up together: a
:class:`~lightning_sparse.tables.collection.SparseEmbeddingCollection`, or a single
:class:`~lightning_sparse.SparseEmbedding` as a collection of one (:class:`OneTable`: one
feature, named like the table, unpooled).

1. **Read.** Each feature's ids (and bags) are read without raising
   (:mod:`lightning_sparse.lookup.features`); a problem, an id out of its table's range or offsets
   that do not fit go into the header with the feature's position (:mod:`lightning_sparse.lookup.verdict`).
2. **One sort.** Every id gets a joint key (:class:`~lightning_sparse.wire.sharding.JointSharding`:
   owner, then table, then row; for one table, the table's own owner-major key); one sort
   (:class:`~lightning_sparse.wire.grouping.SortedKeys`) deduplicates the ids of all tables
   (features that share a table share its rows) and groups them by owner, then table.
3. **Ids to owners** (the wire's stage 1), one all-to-all for all tables; every rank checks every rank's header,
   so bad input raises on every rank alike and the group stays usable. The step's one host
   read is the headers (and, for several tables, the ids per (rank, table) both ways).
4. **Rows back** (stage 2), one all-to-all: each owner gathers the requested rows with ``index_select``
   and sends them in one buffer (:mod:`lightning_sparse.lookup.joint_rows`); they arrive as the
   requester's distinct rows in key order.
5. **Expand or pool** on the requester from the distinct rows: ``index_select`` for
   ``pooling="none"``, ``F.embedding_bag`` for ``"sum"``/``"mean"`` (:mod:`lightning_sparse.lookup.pooling`).
   The distinct rows of each table are where the gradient stops: their backward hands
   ``[distinct rows, dim]`` to the table's pending gradients (:mod:`lightning_sparse.lookup.pending`);
   backward communicates nothing.

With one rank the round is the same and the mechanisms have nothing to send: step 3 keeps
the ids where they are, with one host read for the verdict and the ids per table
(:func:`~lightning_sparse.wire.exchange.ids_to_owners`), and step 4 gathers each table's rows
in place (:func:`~lightning_sparse.lookup.joint_rows.rows_from_owners`).

The round is one of the lookup paths a unit takes, chosen when its tables are placed
(:class:`Round`; the others are a lone table's gather, :class:`~lightning_sparse.lookup.outputs.Gather`,
a collection's kernel on one GPU, :class:`~lightning_sparse.lookup.joint.Joint`, and a dynamic
table's own rounds).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lightning_sparse.lookup.features import FeatureIds, Problem
from lightning_sparse.lookup.joint_rows import TableMajor, both_ways, rows_from_owners, table_routes
from lightning_sparse.lookup.outputs import distinct_rows, expand_rows
from lightning_sparse.lookup.pooling import pool, select
from lightning_sparse.lookup.torch_compat import version
from lightning_sparse.lookup.units import LookupUnit, ShardedTable
from lightning_sparse.lookup.verdict import check_round, header_of, write_verdicts
from lightning_sparse.wire.ahead import ahead_peers
from lightning_sparse.wire.exchange import IdsSent, Route, ids_to_owners, send_ids
from lightning_sparse.wire.grouping import SortedKeys
from lightning_sparse.wire.header import OK, Headers, LookupHeader
from lightning_sparse.wire.table_counts import served_by_table

if TYPE_CHECKING:
    from lightning_sparse.wire.sharding import JointSharding


class Serving(Protocol):
    """A table or a collection, as :func:`serve_lookups` answers its rounds."""

    def serve(self, route: Route) -> None: ...


class Round:
    """A unit's lookups as rounds over the ranks (any number of ranks, tables and features): the engine's path.

    A round's stage 1 may run ahead (:meth:`prefetch`); the lookup of the same inputs takes it from there.
    """

    def __init__(self, unit: LookupUnit) -> None:
        self.unit = unit
        self._ahead: list[_Ahead] = []  # rounds issued ahead, oldest first

    def lookup(self, inputs: Any) -> dict[str, Tensor]:
        """Every given feature's rows or pooled bags. Collective (see the table's and the collection's ``forward``).

        If ``inputs`` are those of a round issued ahead (the same objects), the round goes on from its stage 1;
        rounds issued before that one are dropped unfinished, on every rank alike.
        """
        for i, ahead in enumerate(self._ahead):
            if _same_inputs(ahead.inputs, inputs):
                del self._ahead[: i + 1]
                if _versions(inputs) != ahead.versions:
                    raise ValueError(f"{self.unit.name}'s ids were changed in place after they were sent ahead (a pipelined loop). "
                                     f"HINT: change them in the loader, before the pipeline takes the batch.")  # fmt: skip
                return run_round(self.unit, ahead.read, ahead.problem, ahead=ahead.sent)
        return run_round(self.unit, *self.unit.read(inputs))

    def prefetch(self, inputs: Any, timeout: timedelta | None = None) -> bool:
        """Issue stage 1 of the round for ``inputs`` over the ahead group (:func:`~lightning_sparse.wire.ahead.ahead_peers`).

        Returns whether it did: with one rank there is nothing to send ahead. Its header says the round records as grad
        mode is now, and promises no sole lookup (``LookupHeader.sole``): the step reads its control codes. At most
        :data:`AHEAD_LIMIT` rounds stay issued; the oldest is dropped for a new one. No dynamic tables (their ids find slots
        at the lookup: the caller refuses them). Collective: every rank of the group must call it, in the same order.
        """
        peers = ahead_peers(self.unit.table_list[0].peers, timeout).counting(self.unit.stats)
        if peers.alone:
            return False
        read, problem, bad_offsets = self.unit.read(inputs)
        fields = _header_fields(self.unit, read, problem, bad_offsets, sole=False)
        sent = send_ids(_sorted_keys(self.unit, read), self.unit.joint_sharding, fields, peers, wait=False)
        self._ahead = [*self._ahead[-AHEAD_LIMIT + 1 :], _Ahead(inputs, _versions(inputs), read, problem, sent)]
        return True

    def serve(self, route: Route) -> None:
        """Answer the other ranks' round of this unit on a rank with no lookups of its own (step 4 only)."""
        serve(self.unit, route)


# Rounds of one unit issued ahead and not yet looked up: the batch in training and the next one.
AHEAD_LIMIT = 2


@dataclass(frozen=True)
class _Ahead:
    """A round whose stage 1 was issued ahead: its inputs, as read, and the stage in flight."""

    inputs: Any
    versions: tuple[int, ...]  # of the tensors in ``inputs`` (see :func:`_versions`)
    read: list[FeatureIds]
    problem: Problem
    sent: IdsSent


def _same_inputs(given: Any, inputs: Any) -> bool:
    """Whether ``inputs`` are the objects ``given`` ahead: the same, or a mapping of the same values under the same names."""
    if given is inputs:
        return True
    if isinstance(given, Mapping) and isinstance(inputs, Mapping) and given.keys() == inputs.keys():
        return all(given[name] is inputs[name] for name in given)
    return False


def _versions(inputs: Any) -> tuple[int, ...]:
    """The version counters of the tensors in ``inputs`` (a tensor, a mapping of tensors or ``JaggedIds``): changed in place, larger."""
    items = inputs.values() if isinstance(inputs, Mapping) else [inputs]
    parts = [
        [item] if isinstance(item, Tensor) else [getattr(item, n, None) for n in ("values", "offsets", "lengths", "weights")]
        for item in items
    ]
    return tuple(version(t) for part in parts for t in part if isinstance(t, Tensor))


def run_round(
    unit: LookupUnit, read: list[FeatureIds], problem: Problem, bad_offsets: Tensor | None = None, ahead: IdsSent | None = None
) -> dict[str, Tensor]:
    """Every read feature's rows or pooled bags, all of the unit's tables in one round.

    ``read``, ``problem`` and ``bad_offsets`` are what the unit's ``read`` made of this rank's
    input; ``ahead``: its stage 1, issued ahead (:meth:`Round.prefetch`). Collective: every rank of the
    tables' group must call it for the same unit in the same round (see the collection's and the table's ``forward``).
    """
    tables, joint = unit.table_list, unit.joint_sharding

    def check(headers: Headers) -> None:
        check_round(unit, headers, problem)

    peers = tables[0].peers.counting(unit.stats)
    if ahead is None:
        runs = _sorted_keys(unit, read)
        route = ids_to_owners(runs, joint, _header_fields(unit, read, problem, bad_offsets, sole=True), peers, check)
    else:
        runs, route = ahead.runs, ahead.route(check)
        unit.stats.rounds_ahead += 1
    mine, theirs = both_ways(route.by_table)
    routes = table_routes(route, joint, theirs)
    round_ = _Routed(joint, runs, mine, route, routes, distinct=mine.split(runs.unique))
    rows = rows_from_owners(tables, route, mine, theirs, routes, peers)
    _keep_for_backward(tables, round_, rows, read)
    return _outputs(unit, read, rows, round_)


def _header_fields(unit: LookupUnit, read: list[FeatureIds], problem: Problem, bad_offsets: Tensor | None, sole: bool) -> Tensor:
    """This rank's header fields for a round of ``unit``, with its verdict on the ids; ``sole``: say whether it is the sole lookup."""
    tables = unit.table_list
    fields = header_of(unit.unit_index, problem, read, bad_offsets, tables=tables if sole else ()).fields(tables[0].device)
    if problem.error == OK and read:
        write_verdicts(fields, read, bad_offsets, tables)
    return fields


def _sorted_keys(unit: LookupUnit, read: list[FeatureIds]) -> SortedKeys:
    """The one sort of the round: every read id's joint key (owner, table, row)."""
    tables, joint = unit.table_list, unit.joint_sharding
    keys = [joint.key(f.table, f.ids.clamp(0, tables[f.table].num_embeddings - 1)) for f in read]
    return SortedKeys(_concat(keys, tables[0].device), joint.key_bound)


@dataclass(frozen=True)
class _Routed:
    """A lookup round once its ids are sorted and routed: what the outputs and the backward need."""

    joint: JointSharding
    runs: SortedKeys  # the one sort of the round's joint keys
    mine: TableMajor  # this rank's distinct keys in (owner, table) blocks
    route: Route
    routes: list[Route]  # each table's share of ``route``
    distinct: list[Tensor]  # each table's distinct joint keys, by owner


def _concat(keys: list[Tensor], device: torch.device) -> Tensor:
    if len(keys) == 1:
        return keys[0]
    return torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64, device=device)


def _keep_for_backward(tables: list[ShardedTable], round_: _Routed, rows: list[Tensor], read: list[FeatureIds]) -> None:
    """Each table's distinct rows in its output dtype (``rows``, in place), recorded for their gradient in grad mode.

    Also counts each table's distinct ids and keeps the round's route as the table's last.
    """
    joint, runs, mine = round_.joint, round_.runs, round_.mine
    used = {f.table for f in read}
    recording, keeps_route = torch.is_grad_enabled(), round_.route.records

    def occurrences(t: int) -> Callable[[], Tensor]:  # counted only if asked (duplicate_grads="mean")
        return lambda: mine.split(runs.counts())[t]

    for t, (table, table_keys, route) in enumerate(zip(tables, round_.distinct, round_.routes)):
        table.stats.unique_ids += len(table_keys)
        if keeps_route:
            table.pending.keep_route(route)
        if not (recording and t in used):
            rows[t] = distinct_rows(table, rows[t], None)
            continue
        record = table.pending.new_record(route, joint.table_keys(t, table_keys), occurrences=occurrences(t))
        rows[t] = distinct_rows(table, rows[t], record)


def _outputs(unit: LookupUnit, read: list[FeatureIds], rows: list[Tensor], round_: _Routed) -> dict[str, Tensor]:
    """Step 5: each feature's rows (``index_select`` from its table's distinct rows) or pooled bags.

    A round's only feature holds all the ids of the sort: its rows' backward is the sort's
    segment sum (:func:`~lightning_sparse.lookup.outputs.expand_rows`).
    """
    tables, mine, runs = unit.table_list, round_.mine, round_.runs
    within = mine.within_table(runs.inverse().to(torch.int64))
    out = {}
    for feature, position in zip(read, within.split([len(f.ids) for f in read])):
        table_rows = rows[feature.table]
        tables[feature.table].stats.ids_looked_up += len(feature.ids)
        mode = unit.feature_pooling[feature.index]
        if mode == "none" and len(read) == 1 and table_rows.requires_grad:
            out[feature.name] = expand_rows(table_rows, position, runs).view(*feature.shape, table_rows.shape[1])
        elif mode == "none":
            out[feature.name] = select(table_rows, position).view(*feature.shape, table_rows.shape[1])
        else:
            weights = feature.weights.to(table_rows.dtype) if feature.weights is not None else None
            out[feature.name] = pool(table_rows, position, feature.offsets, mode, weights)
    return out


def serve(unit: LookupUnit, route: Route) -> None:
    """Answer the other ranks' lookup round of ``unit`` on a rank with no lookups of its own (step 4 only)."""
    joint = unit.joint_sharding
    check_round(unit, route.headers)
    route = replace(route, by_table=served_by_table(route.received, route.recv_counts, joint))
    mine, theirs = both_ways(route.by_table)
    routes = table_routes(route, joint, theirs)
    rows_from_owners(unit.table_list, route, mine, theirs, routes, unit.table_list[0].peers.counting(unit.stats))
    if route.records:
        for table, table_route in zip(unit.table_list, routes):
            table.pending.keep_route(table_route)


def serve_lookups(units: list[Serving]) -> int:
    """Answer the other ranks' lookups until every rank of the group has called this.

    A Join for lookups: a rank that has run out of batches (uneven validation, test or predict
    loaders) calls this and keeps serving the rows it owns to ranks that still have batches,
    taking part in each of their lookup rounds with no ids of its own. Returns, with the number
    of rounds served, once every rank is serving. ``units`` are the module's tables (at least
    one: a collection's tables are among them), then any collections; ``units[i]`` must have
    ``table_index == i`` (a collection ``unit_index == i``) on every rank (the strategy sets them).
    Each has ``serve(route)``.

    Collective: every rank of the group must call it once it has no lookups left to make.
    """
    first: ShardedTable | None = units[0] if units else None  # type: ignore[assignment]  # a table: tables come first
    if first is None:
        return 0
    rounds = 0
    nothing = SortedKeys(torch.empty(0, dtype=torch.int64, device=first.device))
    idle = LookupHeader(active=0).fields(first.device)
    peers = replace(first.peers, fence=None)  # the others' rounds go over the group (a table in shared memory makes none)
    while True:
        route = ids_to_owners(nothing, first.sharding, idle, peers)
        active = route.headers.active_units()
        if not active:
            return rounds
        units[active[0]].serve(route)  # a table's round, or a collection's (all its tables)
        rounds += 1
