"""SparseOptimizer: the one place that exchanges pending row gradients, sums them per row and updates.

Subclasses declare their hyperparameters (validated in ``__init__``), the state of one table
(``init_state``) and, once, what their step is (``rule``: an :class:`~lightning_sparse.kernels.UpdateRule`, the
family, the state it reads, the step's scalars), which :func:`~lightning_sparse.optim.update.update_table` applies
on a GPU or a CPU alike. ``step()`` here:

1. takes each table's pending gradients (:mod:`lightning_sparse.lookup.pending`);
2. with several ranks, sends them to the rows' owners, all tables of the optimizer at once
   (:func:`lightning_sparse.wire.grads_exchange.grads_to_owners`): the last lookup's rows go back
   along its route, with no ids on the wire, others coalesced by row first;
3. on the owner, sums the gradient rows that share a row (from several ranks, lookups, or the
   ids of one lookup) and scales the sum: ``duplicate_grads="sum"`` (default) divides it by
   the world size (DDP's scaling of dense gradients), ``"mean"`` by the number of occurrences
   over all ranks (DGL's semantics);
4. updates only the touched rows and their state. On a GPU, steps 3 and 4 are one sort and
   one fused kernel (:func:`lightning_sparse.kernels.update_rows`): each row's gradient is
   summed and applied in registers, with no host read; on a CPU with numba, one sort and its
   twin (:mod:`lightning_sparse.kernels.numba_runs`); elsewhere (a half CPU table, or without
   numba), one sort and a segment sum, then the rule's torch ops (:mod:`lightning_sparse.optim.functional`).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_sparse.kernels import UpdateRule, uses_triton
from lightning_sparse.kernels.rounding import HALF, compute_dtype
from lightning_sparse.kernels.rows import put as rows_put
from lightning_sparse.optim import checks, fused, joint, joint_cpu, row_grads
from lightning_sparse.optim.row_grads import TableGrads
from lightning_sparse.optim.update import update_table
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.wire.alltoall import ExchangeStats
from lightning_sparse.wire.grads_exchange import grads_to_owners, only_routed
from lightning_sparse.wire.replicas import grads_over_replicas

DUPLICATE_GRADS = ("sum", "mean")


# Where a table lives: one optimizer steps tables that share all of these (its step is one collective).
_PLACEMENT = ("process_group", "world_size", "replica_group", "replicas")


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

    ``capturable`` (default ``False``, torch's word): each table's ``step`` count and the step's
    scalars live on the table's device and a step reads no host value, so that a one-process step
    can be captured in a CUDA graph (docs/guide/gpu.md; :mod:`lightning_sparse.optim.fused`).
    """

    family: str  # the family of its update rule (:class:`~lightning_sparse.kernels.UpdateRule`): "sgd", "adagrad", ...

    def __init__(self, params: Iterable[SparseEmbedding] | Iterable[dict[str, Any]], defaults: dict[str, Any]) -> None:
        if not isinstance(defaults.get("check_finite", False), bool):
            raise ValueError(f"Invalid check_finite: {defaults.get('check_finite')!r}. HINT: pass True or False.")
        if not isinstance(defaults.setdefault("capturable", False), bool):
            raise ValueError(f"Invalid capturable: {defaults['capturable']!r}. HINT: pass True or False.")
        if defaults.get("duplicate_grads") not in DUPLICATE_GRADS:
            raise ValueError(f"Invalid duplicate_grads: {defaults.get('duplicate_grads')!r}. HINT: use one of {DUPLICATE_GRADS}.")
        self._tables: dict[Tensor, SparseEmbedding] = {}
        self._fresh_rows: dict[Tensor, dict[str, Tensor]] = {}  # per dynamic table: one initial row of each state
        self.table_sets = fused.KeptTableSets()  # capturable: the TableSet entries kept, their scalars written on the device
        self.joint_states = joint_cpu.KeptStates()  # a collection's tables' state in one tensor per key, on a CPU
        self.stats = ExchangeStats()
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ subclass interface
    @abc.abstractmethod
    def init_state(self, table: SparseEmbedding, group: dict[str, Any]) -> dict[str, Tensor]:
        """State of one table: tensors whose first dim is the table's local rows, or 0-d counters."""

    @abc.abstractmethod
    def rule(self, state: dict[str, Tensor], group: dict[str, Any], step: int | Tensor) -> UpdateRule:
        """The update of a table with ``state`` at its ``step``-th step (counted already), as the fused kernel and the torch
        ops apply it alike (:mod:`lightning_sparse.optim.update`).

        ``step``: an int, or (``capturable``) a float64 tensor on the device, where the rule's scalars are then
        computed (one per table for a tensor of several tables' steps).
        """

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
            if known and any(getattr(table.placement, name) != getattr(known[0].placement, name) for name in _PLACEMENT):
                raise ValueError(
                    f"{table.name} is sharded over a different process group than {known[0].name}. "
                    f"HINT: use one optimizer per process group."
                )
            self._tables[table.shard] = table
            known.append(table)
        super().add_param_group({**param_group, "params": [table.shard for table in tables]})
        group = self.param_groups[-1]
        for table in tables:
            if group["capturable"]:
                fused.check_capturable(type(self).__name__, table, self.family)
            self.state[table.shard] = self.init_state(table, group)
            if group["capturable"] and "step" in self.state[table.shard]:
                self.state[table.shard]["step"] = self.state[table.shard]["step"].to(table.device)
            # A row's initial state, for tables whose rows change ids (reset_rows); one row per state tensor.
            self._fresh_rows[table.shard] = {k: v[:1].clone() for k, v in self.state[table.shard].items() if v.dim()}
            table.watch(self)

    def reset_rows(self, shard: Tensor, rows: Tensor, skip: int | None = None) -> None:
        """Put the per-row state of ``rows`` of the table whose shard is ``shard`` back to its initial value.

        Called by a table that watches this optimizer (a :class:`~lightning_sparse.tables.dynamic.DynamicEmbedding`)
        when it gives slots to new ids; ``rows`` equal to ``skip`` are a padded batch's filler (see ``kernels.rows.put``).
        """
        state = self.state[shard]
        for key, fresh in self._fresh_rows[shard].items():
            rows_put(state[key], rows, fresh.expand(len(rows), *fresh.shape[1:]).to(state[key]), skip)

    @property
    def tables(self) -> list[SparseEmbedding]:
        return [self._tables[p] for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the pending row gradients of every table (and of its collections' rounds) now, not at the next step."""
        for table in self.tables:
            table.zero_grad(set_to_none)
        for unit in joint.units_with_rounds(self.tables):
            unit.pending.zero_grad()

    @property
    def tracked_shards(self) -> dict[Tensor, SparseEmbedding]:
        """The shards this optimizer steps, to their tables."""
        return self._tables

    def group_of(self, shard: Tensor) -> dict[str, Any]:
        """The param group that holds ``shard``."""
        return next(group for group in self.param_groups if any(p is shard for p in group["params"]))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Exchange pending row gradients, sum them per row, and update the touched rows. Collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = [(group, p) for group in self.param_groups for p in group["params"]]
        rounds = []  # collections' rounds on one GPU: one launch for all their tables; taken now, dropped if the step raises
        for unit in joint.units_with_rounds(self.tables):
            records = unit.pending.take().others
            if joint.in_one_launch(unit, self):
                rounds.append((unit, records))
            else:
                joint.split_into_tables(unit, records)
        grads = self._grads_to_owners(entries)
        tables = [self._tables[p] for _, p in entries]
        checks.raise_if_not_finite(type(self).__name__, tables, grads)
        checks.raise_if_ids_were_out_of_range(tables, [unit for unit, _ in rounds])
        start = time.perf_counter()
        with record_function("lightning_sparse.update"):
            counted = set()  # (a CPU's joint round notes its tables' lookups, so they may be touched below too)
            for unit, records in rounds:
                group = self.group_of(unit.table_list[0].shard)
                shards = joint.step(unit, records, self, group["duplicate_grads"] == "mean", group.get("check_finite", False))
                counted.update(id(shard) for shard in shards)
            for (group, p), table_grads in zip(entries, grads):
                if not table_grads.touched:
                    continue
                state = self.state[p]
                if "step" in state and id(p) not in counted:
                    state["step"] += 1
                if len(table_grads.rows):
                    self._apply(self._tables[p], state, group, table_grads)
            for _, p in entries:
                self._tables[p].after_step()
        self.stats.update_seconds += time.perf_counter() - start
        return loss

    def _apply(self, table: SparseEmbedding, state: dict[str, Tensor], group: dict[str, Any], grads: TableGrads) -> None:
        """Sum the table's gradient rows per row and update those rows by this step's :meth:`rule`."""
        use_fused = fused.applies(table, self.family)
        if use_fused and group["capturable"] and uses_triton(table.shard):  # the step count on the device, the scalars there
            step, table_sets = (state["step"].double() if "step" in state else 0), self.table_sets
        else:
            step, table_sets = int(state.get("step", 0)), None
        update_table(table, grads, self.rule(state, group, step), mean=group["duplicate_grads"] == "mean", step=step,
                     use_fused=use_fused, table_sets=table_sets)  # fmt: skip

    def _grads_to_owners(self, entries: list[tuple[dict[str, Any], Tensor]]) -> list[TableGrads]:
        """Per table: its gradient rows on this rank, their owner (not summed yet)."""
        if not entries:
            return []
        tables = [self._tables[p] for _, p in entries]
        means = [group["duplicate_grads"] == "mean" for group, _ in entries]
        checks = [group.get("check_finite", False) for group, _ in entries]
        first = tables[0]
        peers = first.peers.counting(self.stats)
        sole = only_routed([table.pending.route for table in tables], peers, any(checks), first.replicas)
        outgoing = [row_grads.outgoing(table, peers, mean, check, sole) for table, mean, check in zip(tables, means, checks)]
        wire = row_grads.wire_dtype([t.dtype for t in tables], any(means))
        incoming = grads_to_owners(outgoing, peers, wire, first.device, sole)
        owned = [row_grads.owned_grads(table, grads, mean, wire) for table, grads, mean in zip(tables, incoming, means)]
        if first.replicas > 1:  # 2-D sharding: sum each row's gradient over the replicas of the shard
            summed = [row_grads.coalesced(table, grads) for table, grads in zip(tables, owned)]
            bounds = [table.sharding.block_size for table in tables]
            summed = grads_over_replicas(summed, bounds, first.placement.replica_peers(self.stats))
            owned = [row_grads.from_replicas(table, grads, mean) for table, grads, mean in zip(tables, summed, means)]
        return owned

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
