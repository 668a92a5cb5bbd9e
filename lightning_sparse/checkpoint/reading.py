"""Reading a sharded checkpoint: checked against its checksums, each rank loading only its rows, in place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_sparse.checkpoint.contents import (
    MODULE,
    dense_module_state,
    is_distributed,
    module_key,
    optimizer_key,
    optimizer_rows,
    optimizer_state_key,
    table_rows,
    tables,
)
from lightning_sparse.checkpoint.dynamic_rows import PLACED, place_ids, read_placed
from lightning_sparse.checkpoint.files import FORMAT, METADATA_FILE, ROWS_DIR, first_damaged, read_checksums
from lightning_sparse.checkpoint.rows import RowStore
from lightning_sparse.faults.peers import PeerFailure, caused_by_lost_peer, collective
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.tables.dynamic import DynamicEmbedding
from lightning_sparse.tables.dynamic_state import CLOCK
from lightning_sparse.tables.embedding import SparseEmbedding


def verify(path: str | os.PathLike) -> None:
    """Check every file of a sharded checkpoint against the CRC-32 written with it; raise naming the first damaged one.

    Collective when a process group is initialized: each rank reads a share of the files, and
    every rank raises the same error.
    """
    path = Path(path)
    entries = read_checksums(path)
    names = sorted(entries)
    distributed = is_distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    damage = first_damaged(path, entries, names[rank::world])
    if distributed:
        found: list[str | None] = [None] * world
        with collective(f"checking checkpoint {path}"):
            dist.all_gather_object(found, damage)
        damage = next((d for d in found if d), None)
    if damage:
        raise RuntimeError(
            f"Checkpoint {path} is damaged: {damage}. HINT: restore the file from a copy, or resume from an earlier checkpoint."
        )


def _metadata(directory: Path, checkpoint: Path) -> dict[str, Any]:
    try:
        return dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    except Exception as err:
        raise RuntimeError(
            f"{checkpoint} is not a readable sharded checkpoint: {directory / '.metadata'} is missing or damaged "
            f"({type(err).__name__}: {err}). HINT: it may be incomplete (a save that was killed); resume from an "
            f"earlier checkpoint."
        ) from err


@dataclass(frozen=True)
class StoredTensor:
    """What a checkpoint holds under a key: the logical shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def stored_tensors(path: str | os.PathLike, meta: dict[str, Any] | None = None) -> dict[str, StoredTensor]:
    """Every tensor the checkpoint holds, by key (``state_dict.users.weight``, ``optimizer_1.state.0.step``, ...).

    ``meta``: the checkpoint's :func:`load_meta`, if already read.
    """
    path = Path(path)
    meta = load_meta(path) if meta is None else meta
    stored = {
        key: StoredTensor(tuple(item.size), item.properties.dtype)
        for key, item in _metadata(path, path).items()
        if isinstance(item, TensorStorageMetadata)
    }
    for key, item in meta.get("row_tensors", {}).items():
        stored[key] = StoredTensor(tuple(item["shape"]), getattr(torch, item["dtype"]))
    return stored


def _check(stored: dict[str, StoredTensor], key: str, shape: tuple[int, ...], path: Path, what: str,
           fix: str = "load it into the module it was saved from.") -> None:  # fmt: skip
    item = stored.get(key)
    if item is None:
        raise RuntimeError(f"Checkpoint {path} has no {what} (key {key!r}). HINT: {fix}")
    if item.shape != tuple(shape):
        raise RuntimeError(
            f"{what} has shape {item.shape} in checkpoint {path} but {tuple(shape)} in this module. "
            f"HINT: build the module with the same num_embeddings and embedding_dim as when it was saved."
        )


def dcp_load(state: dict[str, Any], directory: Path, checkpoint: Path, what: str, distributed: bool) -> None:
    try:
        with collective(f"loading {what} from {checkpoint}"):
            dcp.load(state, checkpoint_id=directory, no_dist=not distributed)
    except PeerFailure:
        raise
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        if caused_by_lost_peer(err):
            raise PeerFailure(
                f"Loading {what} from checkpoint {checkpoint} failed: another rank died or did not reach the load "
                f"({type(err).__name__}: {err}). HINT: restart all ranks and load again."
            ) from err
        raise RuntimeError(
            f"Could not read {what} from checkpoint {checkpoint} (files in {directory}; {type(err).__name__}: {err}). "
            f"HINT: the checkpoint is truncated or missing files; resume from an earlier checkpoint."
        ) from err


def _loader(path: Path, what: str, distributed: bool) -> Any:
    def load(state: dict[str, Any], directory: Path) -> None:
        dcp_load(state, directory, path, what, distributed)

    return load


def _read_rows(
    path: Path, store: RowStore, entry: dict[str, Any], key: str, table: SparseEmbedding, out: Tensor, what: str
) -> None:
    """Fill ``out`` (this rank's rows in the table's sharding) from the stored tensor ``key``, in place. Collective.

    A dynamic table's rows go where its ids were placed (:mod:`lightning_sparse.checkpoint.dynamic_rows`).
    """
    if not isinstance(table, DynamicEmbedding):
        store.load(key, table, out, entry, _loader(path, what, store.distributed))
        return
    placed = PLACED.get(table)
    if placed is None or placed.checkpoint != str(path):
        raise RuntimeError(f"The rows of {table.name} in {path} can only be read after its ids are placed. "
                           f"HINT: load the module from the same checkpoint first (checkpoint.load_module).")  # fmt: skip
    read_placed(store, key, table, out, entry, _loader(path, what, store.distributed), placed)


def _check_rows(stored: dict[str, StoredTensor], key: str, table: SparseEmbedding, row_shape: tuple[int, ...], path: Path,
                what: str) -> None:  # fmt: skip
    """A per-row tensor's stored shape: the table's rows (a dynamic table: any number, saved on any ranks) x ``row_shape``."""
    rows = stored[key].shape[0] if isinstance(table, DynamicEmbedding) and key in stored else table.num_embeddings
    _check(stored, key, (rows, *row_shape), path, what)


def _place_dynamic(path: Path, store: RowStore, entries: dict[str, Any], prefix: str, table: DynamicEmbedding) -> None:
    """Put a dynamic table's ids where they belong now, and forget every row and optimizer state they held. Collective."""
    PLACED[table] = place_ids(path, store, prefix, table, entries.__getitem__,
                              lambda key: _loader(path, f"slots of {table.name}", store.distributed))  # fmt: skip
    table.shard.zero_()
    for optimizer in table.watchers():
        optimizer.reset_rows(table.shard, torch.arange(len(table.shard), device=table.device))


STRICT_FIX = (
    "load it into the module it was saved from, or load with strict=False (a LightningModule's "
    "strict_loading = False) to leave this module's other tensors as they are."
)


def load_module(path: str | os.PathLike, module: nn.Module, strict: bool = True, meta: dict[str, Any] | None = None) -> None:
    """Load a module's dense tensors and tables, each rank only its rows, into its shards in place. Collective.

    ``meta``: the checkpoint's :func:`load_meta` (read here with ``weights_only=True`` if not given).
    """
    path = Path(path)
    meta = load_meta(path) if meta is None else meta
    stored, entries = stored_tensors(path, meta), meta["row_tensors"]
    dense = {k: v for k, v in dense_module_state(module).items() if isinstance(v, Tensor)}
    if strict:
        for key, value in dense.items():
            _check(stored, module_key(key), tuple(value.shape), path, f"tensor {key}", STRICT_FIX)
    dense = {k: v for k, v in dense.items() if module_key(k) in stored}
    store = RowStore(path / ROWS_DIR, is_distributed())
    for prefix, table in tables(module):  # tables first: the bulk of a checkpoint
        rows = table_rows(prefix, table)[0]  # its slot state (a dynamic table) is read by _place_dynamic
        _check_rows(stored, rows.key, table, (table.embedding_dim,), path, rows.what)
        if isinstance(table, DynamicEmbedding):
            _place_dynamic(path, store, entries, prefix, table)
        _read_rows(path, store, entries[rows.key], rows.key, table, rows.rows, rows.what)
        table.rows_written(fenced=False)  # a table in shared memory: no rank reads the rows before their owners wrote them
    if dense:
        dcp_load({MODULE: dense}, path, path, "the dense tensors", is_distributed())
    for prefix, table in tables(module):
        if isinstance(table, DynamicEmbedding) and f"{prefix}{CLOCK}" in dense:
            table.slots.clock = int(dense[f"{prefix}{CLOCK}"])


def load_sparse_optimizer(path: str | os.PathLike, index: int, optimizer: SparseOptimizer, param_groups: list[dict],
                          meta: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Load the sparse optimizer saved as ``optimizer_<index>``, each rank only its rows, into its state in place. Collective.

    ``meta``: the checkpoint's :func:`load_meta` (read here with ``weights_only=True`` if not given).
    """
    path = Path(path)
    meta = load_meta(path) if meta is None else meta
    stored = stored_tensors(path, meta)
    current = optimizer.state_dict()  # the optimizer's own state tensors, not copies
    store, counters = RowStore(path / ROWS_DIR, is_distributed()), {}
    for rows in optimizer_rows(index, optimizer, current["state"]):
        _check_rows(stored, rows.key, rows.table, tuple(rows.rows.shape[1:]), path, rows.what)
        _read_rows(path, store, meta["row_tensors"][rows.key], rows.key, rows.table, rows.rows, rows.what)
    for p_index, table in enumerate(optimizer.tables):  # the 0-d counters ride with the dense tensors
        for name, value in current["state"].get(p_index, {}).items():
            if value.dim() == 0:
                what = f"optimizer state {name!r} of table {table.name}"
                _check(stored, optimizer_state_key(index, p_index, name), (), path, what)
                counters.setdefault(p_index, {})[name] = value.clone()
    if counters:
        dcp_load({optimizer_key(index): {"state": counters}}, path, path, f"the step counters of optimizer {index}",
                 is_distributed())  # fmt: skip
    for p_index, entry in counters.items():
        current["state"][p_index].update(entry)
    optimizer.load_state_dict({"state": current["state"], "param_groups": param_groups})


def load_tensors(path: str | os.PathLike, tensors: dict[str, Any], what: str) -> None:
    """Fill ``tensors`` (nested like the saved dense state, replicated) from the checkpoint. Collective."""
    dcp_load(tensors, Path(path), Path(path), what, is_distributed())


def load_file(path: str | os.PathLike, weights_only: bool = True) -> tuple[str, dict[str, Any]]:
    """A single-file checkpoint: ``("lightning", checkpoint)`` for one Lightning wrote, ``("export", state_dict)``
    for a plain state dict (what :func:`export` writes). Memory-mapped: each rank then reads only the rows it loads.
    """
    path = Path(path)
    try:
        loaded = torch.load(path, mmap=True, weights_only=weights_only, map_location="cpu")
    except Exception as err:
        raise RuntimeError(
            f"{path} is neither a sharded checkpoint (no .metadata inside) nor a file torch.load can read "
            f"({type(err).__name__}: {str(err).splitlines()[0]}). HINT: pass a checkpoint written by "
            f"Trainer(strategy='sparse_ddp') or a file written by `python -m lightning_sparse export`."
        ) from err
    if isinstance(loaded, dict) and "pytorch-lightning_version" in loaded:
        return "lightning", loaded
    if isinstance(loaded, dict) and loaded and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()):
        return "export", loaded
    raise RuntimeError(
        f"{path} holds {type(loaded).__name__}, neither a Lightning checkpoint nor a state dict of tensors. "
        f"HINT: pass a checkpoint written by Trainer(strategy='sparse_ddp') or a file written by "
        f"`python -m lightning_sparse export`."
    )


def load_meta(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    path = Path(path)
    try:
        meta = torch.load(path / METADATA_FILE, weights_only=weights_only, map_location="cpu")
    except FileNotFoundError as err:
        raise RuntimeError(
            f"Checkpoint {path} has no {METADATA_FILE}. HINT: it is incomplete; use an earlier checkpoint."
        ) from err
    except Exception as err:  # torch's own message advises weights_only=False: not a fix for a damaged file
        raise RuntimeError(
            f"{path / METADATA_FILE} of checkpoint {path} cannot be read ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}). HINT: the file is damaged; restore it from a copy, or resume from an "
            f"earlier checkpoint."
        ) from err
    if meta.get("format") != FORMAT:
        raise RuntimeError(
            f"Checkpoint {path} was written in sparse checkpoint format {meta.get('format', 1)}; this version reads "
            f"format {FORMAT}. HINT: load it with the lightning_sparse version that wrote it and save it again."
        )
    return meta
