"""SparseOptimizer: the one place that exchanges pending row gradients and coalesces duplicates.

Subclasses declare their hyperparameters (validated in ``__init__``), the state of one table
(``init_state``) and the arithmetic for the touched rows (``update``). ``step()`` here:

1. takes each table's pending gradients (:mod:`lightning_sparse.pending`): those of the table's
   last lookup, already summed per distinct row in the order the lookup sent its ids, and any
   others (several backward passes, a table looked up twice), which it coalesces by row;
2. sends them to the rows' owners, all tables of the optimizer at once
   (:func:`lightning_sparse.exchange.grads_to_owners`); the last lookup's rows go back along
   its route, with no ids on the wire;
3. on the owner, coalesces what arrived from several ranks (one sort and a segment sum) and
   scales it: ``duplicate_grads="sum"`` (default) divides the sum by the world size (DDP's
   scaling of dense gradients), ``"mean"`` divides by the number of occurrences over all ranks
   (DGL's semantics);
4. calls the subclass's ``update`` with only the touched rows and their state.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_sparse.alltoall import ExchangeStats
from lightning_sparse.dynamic import DynamicEmbedding
from lightning_sparse.embedding import SparseEmbedding
from lightning_sparse.grads_exchange import IncomingGrads, OutgoingGrads, grads_to_owners
from lightning_sparse.grouping import SortedKeys, coalesce
from lightning_sparse.pending import LookupRecord
from lightning_sparse.replicas import OwnedGrads, grads_over_replicas
from lightning_sparse.rounding import HALF, compute_dtype, writer_for

DUPLICATE_GRADS = ("sum", "mean")


class SparseOptimizer(Optimizer, metaclass=abc.ABCMeta):
    """Base class of the sparse optimizers: a ``torch.optim.Optimizer`` over SparseEmbedding tables.

    Built from SparseEmbedding modules and SparseEmbeddingCollections (whose tables it takes), or param-group dicts
    whose ``"params"`` are those; ``param_groups`` then hold the tables' shards, so LR schedulers, ``state_dict()`` and
    ``load_state_dict()`` work as for any torch optimizer. Optimizer state is sharded like the tables.

    ``step()`` and ``zero_grad()`` act when called. ``step()`` is a collective: every rank of the
    tables' process group must call it, also a rank whose batch used no table.

    Every subclass takes ``duplicate_grads`` (see the module's docstring) and ``check_finite``
    (default ``False``): with it, a step whose sparse gradient holds an inf or NaN on any rank
    raises ``FloatingPointError`` on every rank, naming the table and the ranks, and updates
    nothing (the gradients are dropped: catching the error and going on is safe). The flag rides
    with the gradients, so the check costs one pass over them and no extra collective.
    """

    def __init__(self, params: Iterable[SparseEmbedding] | Iterable[dict[str, Any]], defaults: dict[str, Any]) -> None:
        if not isinstance(defaults.get("check_finite", False), bool):
            raise ValueError(f"Invalid check_finite: {defaults.get('check_finite')!r}. HINT: pass True or False.")
        if defaults.get("duplicate_grads") not in DUPLICATE_GRADS:
            raise ValueError(f"Invalid duplicate_grads: {defaults.get('duplicate_grads')!r}. HINT: use one of {DUPLICATE_GRADS}.")
        self._tables: dict[Tensor, SparseEmbedding] = {}
        self._fresh_rows: dict[Tensor, dict[str, Tensor]] = {}  # per dynamic table: one initial row of each state
        self.stats = ExchangeStats()
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ subclass interface
    @abc.abstractmethod
    def init_state(self, table: SparseEmbedding, group: dict[str, Any]) -> dict[str, Tensor]:
        """State of one table: tensors whose first dim is the table's local rows, or 0-d counters."""

    @abc.abstractmethod
    def update(self, shard: Tensor, rows: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]) -> None:
        """Apply one step to ``shard[rows]`` (local row indices, unique) given their gradients."""

    # ------------------------------------------------------------------ torch.optim API
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        tables = param_group["params"]
        tables = [tables] if hasattr(tables, "lookup_unit") else list(tables)
        # A table's lookup unit lists the table itself; a collection's, all of its tables.
        tables = [t for entry in tables for t in (entry.lookup_unit.table_list if hasattr(entry, "lookup_unit") else [entry])]
        for table in tables:
            if not isinstance(table, SparseEmbedding):
                raise TypeError(
                    f"{type(self).__name__} optimizes SparseEmbedding modules, got {type(table).__name__}. "
                    f"HINT: pass the SparseEmbedding modules themselves; dense parameters go to a torch optimizer."
                )
            table.materialize()
        known = list(self._tables.values())
        for table in tables:
            placement = (table.process_group, table.world_size, table.replica_group, table.replicas)
            if known and placement != (known[0].process_group, known[0].world_size, known[0].replica_group, known[0].replicas):
                raise ValueError(
                    f"{table.name} is sharded over a different process group than {known[0].name}. "
                    f"HINT: use one optimizer per process group."
                )
            self._tables[table.shard] = table
            known.append(table)
        super().add_param_group({**param_group, "params": [table.shard for table in tables]})
        group = self.param_groups[-1]
        for table in tables:
            self.state[table.shard] = self.init_state(table, group)
            if isinstance(table, DynamicEmbedding):  # its slots change ids: their state must start afresh
                self._fresh_rows[table.shard] = {k: v[:1].clone() for k, v in self.state[table.shard].items() if v.dim()}
                table.watch(self)

    def reset_rows(self, shard: Tensor, rows: Tensor) -> None:
        """Put the per-row state of ``rows`` of the table whose shard is ``shard`` back to its initial value.

        Called by a :class:`~lightning_sparse.dynamic.DynamicEmbedding` when it gives slots to new ids.
        """
        state = self.state[shard]
        for key, fresh in self._fresh_rows[shard].items():
            state[key].index_copy_(0, rows, fresh.expand(len(rows), *fresh.shape[1:]).to(state[key]))

    @property
    def tables(self) -> list[SparseEmbedding]:
        return [self._tables[p] for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the pending row gradients of every table now (not at the next step)."""
        for table in self.tables:
            table.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Exchange pending row gradients, coalesce, and update the touched rows. Collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = [(group, p) for group in self.param_groups for p in group["params"]]
        grads = self._grads_to_owners(entries)
        self._raise_if_not_finite(entries, grads)
        start = time.perf_counter()
        with record_function("lightning_sparse.update"):
            for (group, p), (rows, grad, touched, _) in zip(entries, grads):
                if not touched:
                    continue
                state = self.state[p]
                if "step" in state:
                    state["step"] += 1
                if len(rows):
                    write = writer_for(self._tables[p], int(state.get("step", 0)))  # a half table's rows: rounded
                    self.update(p, rows, grad, state, group, **({"write": write} if write is not None else {}))
            for _, p in entries:
                table = self._tables[p]
                if isinstance(table, DynamicEmbedding):
                    table.after_step()
        self.stats.update_seconds += time.perf_counter() - start
        return loss

    def _grads_to_owners(self, entries: list[tuple[dict[str, Any], Tensor]]) -> list[tuple[Tensor, Tensor, bool, list[int]]]:
        """Per table: (distinct local rows this rank owns, their scaled gradient, touched on any rank, ranks with inf/NaN)."""
        if not entries:
            return []
        tables = [self._tables[p] for _, p in entries]
        mean = any(group["duplicate_grads"] == "mean" for group, _ in entries)
        outgoing = [_outgoing(table, group["duplicate_grads"] == "mean", group.get("check_finite", False))
                    for (group, _), table in zip(entries, tables)]  # fmt: skip
        first, wire = tables[0], _wire_dtype([t.dtype for t in tables], mean)
        incoming = grads_to_owners(outgoing, first.process_group, first.world_size, first.rank, wire, first.device, self.stats)
        owned = [_coalesced(table, grads, out.width, wire) for table, grads, out in zip(tables, incoming, outgoing)]
        if first.replicas > 1:  # 2-D sharding: sum each row's gradient over the replicas of the shard
            bounds = [table.sharding.block_size for table in tables]
            owned = grads_over_replicas(owned, bounds, first.replica_group, first.replicas, self.stats)
        return [(*_scaled(table, group["duplicate_grads"], grads), grads.touched, grads.nonfinite_ranks)
                for (group, _), table, grads in zip(entries, tables, owned)]  # fmt: skip

    def _raise_if_not_finite(self, entries: list[tuple[dict[str, Any], Tensor]], grads: list[tuple]) -> None:
        """Every rank learned the same ranks from the exchange, so every rank raises alike (before any update)."""
        bad = [(self._tables[p].name, ranks) for (_, p), (*_, ranks) in zip(entries, grads) if ranks]
        if bad:
            where = "; ".join(f"{name} on rank(s) {ranks}" for name, ranks in bad)
            raise FloatingPointError(
                f"{type(self).__name__}: the sparse gradient is not finite (inf or NaN) for {where}; no row was updated "
                f"and the gradients were dropped. HINT: look for the source (the loss, the learning rate, an fp16 "
                f"overflow: 16-mixed skips such steps by itself); catching this error and going on is safe."
            )

    def full_state_dict(self) -> dict[str, Any]:
        """``state_dict()`` with every per-row state tensor gathered into global row order.

        Collective: every rank of the tables' group must call it. Loads on any number of ranks
        with :meth:`load_full_state_dict`.
        """
        state_dict = self.state_dict()
        for index, p in enumerate(p for group in self.param_groups for p in group["params"]):
            table = self._tables[p]
            state_dict["state"][index] = {  # a new dict: torch's state_dict shares the optimizer's
                key: table.gather_rows(value) if isinstance(value, Tensor) and value.dim() > 0 else value
                for key, value in state_dict["state"].get(index, {}).items()
            }
        return state_dict

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`full_state_dict`, keeping this rank's rows of each per-row state tensor."""
        params = [p for group in self.param_groups for p in group["params"]]
        local = {"param_groups": state_dict["param_groups"], "state": {}}
        for index, entry in state_dict["state"].items():
            table = self._tables[params[index]]
            local["state"][index] = {
                key: table.local_rows(value) if isinstance(value, Tensor) and value.dim() > 0 else value
                for key, value in entry.items()
            }
        self.load_state_dict(local)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts every state tensor but "step" to the parameter's dtype; per-row integer
        # counters (Adam's row_step) must stay exact, and a half table's state float32, so
        # they are put back as saved.
        params = [p for group in self.param_groups for p in group["params"]]
        counters = {
            (index, key): value if not value.is_floating_point() else value.to(compute_dtype(params[index].dtype))
            for index, entry in state_dict["state"].items()
            for key, value in entry.items()
            if isinstance(value, Tensor) and value.dim() > 0 and (not value.is_floating_point() or params[index].dtype in HALF)
        }
        super().load_state_dict(state_dict)
        for (index, key), value in counters.items():
            self.state[params[index]][key] = value.to(params[index].device)
        for p, table in self._tables.items():
            for key, value in self.state[p].items():
                if value.dim() > 0 and value.shape[0] != p.shape[0]:
                    raise ValueError(
                        f"{type(self).__name__} state {key!r} for {table.name} has {value.shape[0]} rows, but this rank "
                        f"holds {p.shape[0]} (rank {table.rank} of {table.world_size}, {table.sharding_scheme}). "
                        f"HINT: load optimizer state saved with the same world size and sharding."
                    )


def _outgoing(table: SparseEmbedding, mean: bool, check_finite: bool = False) -> OutgoingGrads:
    """A table's pending gradients, taken and laid out for ``grads_to_owners``.

    The last lookup's gradient rows go as they are (routed); the others are coalesced by row
    first, with one sort, which also groups them by owner.
    """
    route, routed, others = table.pending.take()
    out = OutgoingGrads(route, _values(routed, mean) if routed is not None else None, table.embedding_dim + mean)
    if others:
        if len(others) == 1:  # already distinct and ascending
            keys, values = others[0].keys, _values(others[0], mean)
        else:
            runs = SortedKeys(torch.cat([record.keys for record in others]), table.sharding.key_bound).finish()
            keys, values = runs.unique, runs.segment_sum(torch.cat([_values(record, mean) for record in others]))
        below = torch.searchsorted(keys, table.sharding.key_boundaries(table.device))
        out.others = (table.sharding.local_of_key(keys), values, below[1:] - below[:-1])
    if check_finite:
        flags = [(~torch.isfinite(v)).any() for v in (out.routed, out.others[1] if out.others else None) if v is not None]
        out.nonfinite = torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=table.device)
    return out


def _coalesced(table: SparseEmbedding, grads: IncomingGrads, width: int, wire: torch.dtype) -> OwnedGrads:
    """The received gradient rows of a table, coalesced by row: ``[rows, width]`` in the wire dtype, not scaled yet."""
    bad = grads.nonfinite_ranks
    if bad and table.world_size > 1:  # group ranks -> global ranks
        bad = [dist.get_global_rank(table.process_group, r) for r in bad]
    if not grads.rows:
        return OwnedGrads(grads_empty_rows(table), table.shard.new_empty(0, width, dtype=wire), grads.touched, bad)
    if grads.distinct:
        rows, values = grads.rows[0], grads.values[0]
    else:  # a row may have come from several ranks or lookups
        rows, values = (torch.cat(pieces) if len(pieces) > 1 else pieces[0] for pieces in (grads.rows, grads.values))
        rows, values = coalesce(rows, values, table.sharding.block_size)
    return OwnedGrads(rows, values.to(wire), grads.touched, bad)


def _scaled(table: SparseEmbedding, duplicate_grads: str, grads: OwnedGrads) -> tuple[Tensor, Tensor]:
    """(local rows, gradient in the table's dtype): the sum over all ranks divided by their number, or by the occurrences."""
    rows, values = grads.rows, grads.values.to(compute_dtype(table.dtype))
    if not len(rows):
        return rows, values[:, : table.embedding_dim]
    if duplicate_grads == "mean":
        return rows, values[:, :-1] / values[:, -1:]
    ranks = table.world_size * table.replicas  # every rank of the job, as DDP averages dense gradients
    return rows, values / ranks if ranks > 1 else values


def _values(record: LookupRecord, mean: bool) -> Tensor:
    """A record's gradient rows, with each row's occurrence count as a last column for ``"mean"``."""
    if not mean:
        return record.grad
    return torch.cat([record.grad, record.counts().to(record.grad.dtype).unsqueeze(1)], dim=1)


def _wire_dtype(dtypes: list[torch.dtype], mean: bool) -> torch.dtype:
    """One dtype for all tables' gradients on the wire; at least float32 when occurrence counts ride along."""
    wire = torch.float32 if mean else compute_dtype(dtypes[0])
    for dtype in dtypes:
        wire = torch.promote_types(wire, compute_dtype(dtype))
    return wire


def grads_empty_rows(table: SparseEmbedding) -> Tensor:
    return torch.empty(0, dtype=torch.int64, device=table.device)
