"""What a sharded checkpoint holds: the module's and optimizers' state, split into dense tensors, per-row tensors and the rest.

The keys of a checkpoint are defined here and nowhere else: each tensor is stored under the
name it would have in one flat Lightning checkpoint (``state_dict.users.weight``,
``optimizer_1.state.0.exp_avg``). A per-row tensor (a table, a dynamic table's slot state, a
sparse optimizer's per-row state) is a :class:`RowTensor`: its key, its table, this rank's rows
and what it is in words; saving and loading both take them from :func:`table_rows` and
:func:`optimizer_rows`, so the two directions cannot disagree on a key.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.tables.dynamic import DynamicEmbedding
from lightning_sparse.tables.embedding import SparseEmbedding

MODULE = "state_dict"  # Lightning's key of the module's state


def module_key(name: str) -> str:
    """The key of the module's tensor ``name`` (``users.weight`` -> ``state_dict.users.weight``)."""
    return f"{MODULE}.{name}"


def module_name(key: str) -> str | None:
    """The module's tensor name of ``key``, or ``None`` for a key that is not the module's."""
    return key[len(MODULE) + 1 :] if key.startswith(f"{MODULE}.") else None


def optimizer_key(index: int) -> str:
    """The key of the state of the optimizer at ``index`` in Lightning's list."""
    return f"optimizer_{index}"


def optimizer_state_key(index: int, table_index: int, name: str) -> str:
    """The key of state ``name`` of the optimizer's ``table_index``-th table (``optimizer_1.state.0.exp_avg``)."""
    return f"{optimizer_key(index)}.state.{table_index}.{name}"


@dataclass(frozen=True)
class RowTensor:
    """A per-row tensor of a checkpoint: its key, its table, this rank's rows (in the table's sharding), in words."""

    key: str
    table: SparseEmbedding
    rows: Tensor
    what: str


def tables(module: nn.Module) -> Iterator[tuple[str, SparseEmbedding]]:
    for name, sub in module.named_modules():
        if isinstance(sub, SparseEmbedding):
            yield (f"{name}." if name else ""), sub


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


# ---------------------------------------------------------------------------- what Lightning holds
def dense_module_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` without the tables (they are written by :func:`save` from the module itself)."""
    state = module.state_dict()
    for prefix, table in tables(module):
        for key in table.sharded_keys():
            state.pop(prefix + key, None)
    return state


def dense_optimizer_state(optimizer: SparseOptimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` without its per-row tensors (written by :func:`save` from the optimizer itself)."""
    state = optimizer.state_dict()
    state["state"] = {index: {k: v for k, v in entry.items() if v.dim() == 0} for index, entry in state["state"].items()}
    return state


def split_tensors(tree: Any) -> tuple[Any, Any]:
    """Split nested dicts into (tensor leaves, everything else), both keeping the nesting."""
    if isinstance(tree, dict):
        tensors, rest = {}, {}
        for key, value in tree.items():
            t, r = split_tensors(value)
            if t is not None:
                tensors[key] = t
            if r is not None:
                rest[key] = r
        return (tensors or None), (rest or None)
    if isinstance(tree, Tensor):
        return tree, None
    return None, tree


def table_rows(prefix: str, table: SparseEmbedding) -> list[RowTensor]:
    """A table's per-row tensors: its rows, then (a dynamic table) its slot state."""
    found = [RowTensor(module_key(f"{prefix}weight"), table, table.shard, f"table {table.name}")]
    if isinstance(table, DynamicEmbedding):
        for name, value in table.slot_state().items():
            found.append(RowTensor(module_key(prefix + name), table, value, f"slot state {name!r} of table {table.name}"))
    return found


def optimizer_rows(index: int, optimizer: SparseOptimizer, state: dict[int, dict[str, Tensor]] | None = None) -> list[RowTensor]:
    """A sparse optimizer's per-row state tensors (``state``: its ``state_dict()["state"]``, if already taken)."""
    if state is None:
        state = {p_index: optimizer.state[table.shard] for p_index, table in enumerate(optimizer.tables)}
    return [
        RowTensor(optimizer_state_key(index, p_index, name), table, value, f"optimizer state {name!r} of table {table.name}")
        for p_index, table in enumerate(optimizer.tables)
        for name, value in state.get(p_index, {}).items()
        if value.dim() > 0
    ]


def row_tensors(module: nn.Module, sparse_optimizers: Mapping[int, SparseOptimizer]) -> Iterator[RowTensor]:
    """Every per-row tensor to store: the tables', then the sparse optimizers'."""
    for prefix, table in tables(module):
        yield from table_rows(prefix, table)
    for index, optimizer in sparse_optimizers.items():
        yield from optimizer_rows(index, optimizer)
