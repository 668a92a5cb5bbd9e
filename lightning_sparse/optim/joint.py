"""A collection's rounds on one GPU (:mod:`lightning_sparse.lookup.joint`) at the optimizer step: one sort, one launch.

Such a round recorded every id's key over all of the collection's tables (``table << shift | row``),
its bag, its weight, and the bags' gradient. The step sorts the keys of the collection's rounds
once and updates every table in one fused launch (:func:`~lightning_sparse.kernels.update_rows`
with a :class:`~lightning_sparse.kernels.runs.TableSet`): each table with its own step count and
learning rate, its own state and unique-id counter. A round the fused launch cannot take (a table
of the collection with gradients of its own, tables in several optimizers or param groups) is
split into each table's gradient rows first (one host read), and the tables step as usual.
On a CPU the same sort and sums run by torch ops (:mod:`lightning_sparse.optim.joint_cpu`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_sparse.kernels import RuleState, Runs, TableSet, UpdateRule, sort_runs, table_entries, update_rows, uses_triton
from lightning_sparse.lookup.joint import holders
from lightning_sparse.optim import joint_cpu

if TYPE_CHECKING:
    from lightning_sparse.lookup.pending import LookupRecord
    from lightning_sparse.tables.collection import SparseEmbeddingCollection
    from lightning_sparse.tables.embedding import SparseEmbedding


def units_with_rounds(tables: list[SparseEmbedding]) -> list[SparseEmbeddingCollection]:
    """The collections of ``tables`` (or their parts: :class:`~lightning_sparse.lookup.units.Part`) that recorded rounds on one
    GPU since the last step, each once."""
    found: dict[int, SparseEmbeddingCollection] = {}
    for table in tables:
        for unit in holders(table):
            if unit.pending.received:
                found.setdefault(id(unit), unit)
    return list(found.values())


def split_into_tables(unit: SparseEmbeddingCollection, records: list[LookupRecord]) -> None:
    """Hand each table its share of the rounds ``records``, as gradient rows per id (host reads: the verdict, the shares).

    The rounds' input is checked first (waiting for it): their keys are trusted only then.
    """
    from lightning_sparse.lookup.joint import key_shift, raise_failed

    raise_failed(unit, unit.range_check.failed(1, wait=True))
    shift = key_shift(unit)
    for record in records:
        values = _per_key(record)
        owner = record.keys.to(torch.int64) >> shift
        for index in record.tables:
            mine = (owner == index).nonzero().view(-1)  # the host read
            table = unit.table_list[index]
            piece = table.pending.new_record(None, (record.keys.index_select(0, mine).to(torch.int64) - (index << shift)))
            piece.add_grad(values.index_select(0, mine))


def _per_key(record: LookupRecord) -> Tensor:
    """Each key's gradient row: its bag's, times its weight."""
    values = record.grad.index_select(0, record.sources.to(torch.int64))
    return values * record.weights.unsqueeze(1) if record.weights is not None else values


def in_one_launch(unit: SparseEmbeddingCollection, optimizer: Any) -> bool:
    """Whether ``optimizer`` can step the collection's rounds as one launch (else :func:`split_into_tables`)."""
    tables = unit.table_list
    shards = [t.shard for t in tables]
    if any(s not in optimizer.tracked_shards for s in shards) or any(t.pending.received for t in tables):
        return False
    return len({id(optimizer.group_of(s)) for s in shards}) == 1


def step(unit: SparseEmbeddingCollection, records: list[LookupRecord], optimizer: Any, mean: bool, check_finite: bool
         ) -> list[Tensor]:  # fmt: skip
    """Update the collection's tables in one launch with the rounds ``records`` taken from it (after :func:`in_one_launch`).

    Returns the shards of the tables whose step it counted (the optimizer's loop over its tables does not count them again).
    """
    from lightning_sparse.lookup.joint import key_shift

    tables, shift = unit.table_list, key_shift(unit)
    keys = _cat([r.keys for r in records])
    values = _cat([r.grad for r in records])
    starts, sources = 0, []
    for record in records:  # each round's bags follow the previous rounds'
        sources.append(record.sources.to(torch.int64) + starts if starts else record.sources)
        starts += len(record.grad)
    weights = _cat([r.weights if r.weights is not None else torch.ones(len(r.keys), device=r.keys.device) for r in records]) \
        if any(r.weights is not None for r in records) else None  # fmt: skip
    if check_finite and bool((~torch.isfinite(values)).any()):  # a host read, only when checking
        raise FloatingPointError(f"{type(optimizer).__name__}: the sparse gradient of {unit.name} is not finite (inf or NaN); "
                                 f"no row was updated and the gradients were dropped. HINT: look for the source (the loss, the "
                                 f"learning rate, an fp16 overflow); catching this error and going on is safe.")  # fmt: skip
    group = optimizer.group_of(tables[0].shard)
    touched = sorted({i for r in records for i in r.tables})
    if not touched:
        return []
    for index in touched:
        state = optimizer.state[tables[index].shard]
        if "step" in state:
            state["step"] += 1
    if not uses_triton(tables[0].shard):  # a CPU: the same sort and sums by torch ops, each table's step count on the host
        states = [optimizer.state[t.shard] for t in tables]
        joint = optimizer.joint_states.joined(unit, states)  # first: the rules then read the joined state's views
        rules = {i: optimizer.rule(states[i], group, int(states[i].get("step", 0))) for i in touched}
        joint_cpu.update(tables, keys, values, _cat(sources), weights, rules, mean, shift, joint)
    else:
        runs = sort_runs(keys, len(tables) << shift)
        by_bag = _cat(sources).index_select(0, runs.perm)
        sorted_weights = weights.index_select(0, runs.perm) if weights is not None else None
        table_set, rule = _table_set(unit, optimizer, group, touched, shift)
        update_rows(Runs(runs.keys, by_bag), values, table_set, rule, weights=sorted_weights, mean=mean,
                    verdict=unit.range_check.device_verdict)  # fmt: skip
    return [tables[index].shard for index in touched]


def _table_set(unit: SparseEmbeddingCollection, optimizer: Any, group: dict[str, Any], touched: list[int], shift: int
               ) -> tuple[TableSet, UpdateRule]:  # fmt: skip
    """The collection's tables as one set, and the first touched table's rule (what the tables share): an entry made from
    the host's step counts, or (capturable) kept, with scalars computed on the device from the tables' device counts
    (:class:`~lightning_sparse.optim.fused.KeptTableSets`)."""
    tables, states, first = unit.table_list, [optimizer.state[t.shard] for t in unit.table_list], touched[0]
    if group["capturable"]:  # one rule for all tables: their steps in one tensor give one lr and step size per table
        rule = optimizer.rule(states[first], group, torch.stack([state["step"] for state in states]).double())
        keys = [next((k for k, v in states[first].items() if v is t), None) for t in rule.state]  # its state's names
        table_states = [RuleState(*(state[k] if k is not None else None for k in keys)) for state in states]
        return optimizer.table_sets.table_set(unit, tables, rule, table_states, shift, like=first), rule
    rules = {i: optimizer.rule(states[i], group, int(states[i].get("step", 0))) for i in touched}  # no key reaches the others
    counters = [t.stats.on_device("unique_ids", t.device) if i in rules else None for i, t in enumerate(tables)]
    entries = table_entries([t.shard for t in tables], [rules[i].state if i in rules else RuleState() for i in range(len(tables))],
                            counters, [(r.lr, r.step_size, 1.0 - r.lr * r.weight_decay) if (r := rules.get(i)) else (0.0, 0.0, 1.0)
                                       for i in range(len(tables))])  # fmt: skip
    return TableSet(entries, shift, tables[first].shard, rules[first].state, counters[first]), rules[first]


def _cat(pieces: list[Tensor]) -> Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
