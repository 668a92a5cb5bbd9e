"""Sharded checkpoints: every rank writes and reads only its own rows, one tensor at a time, through DCP.

Layout of a checkpoint (``path`` is a link to a data directory, see ``files.py``)::

    epoch=0-step=6.ckpt -> .sparse-ckpt-<id>/
        .metadata, __<rank>_0.distcp        DCP: dense tensors (module, dense optimizers, step counters)
        rows/<key>/part-<k>/.metadata, __<rank>_0.distcp
                                            DCP, per table and per per-row optimizer state: band k
                                            of the logical [num_embeddings, ...] tensor
        meta.pt                             everything else Lightning saves, and each per-row
                                            tensor's shape, dtype and bands (loads with weights_only=True)
        checksums.json                      CRC-32 of every file above, and what it holds

``<key>`` is the name the tensor would have in one flat checkpoint: ``state_dict.users.weight``,
``optimizer_1.state.0.exp_avg``. Each per-row tensor is stored in global row order, so a
checkpoint loads on any number of ranks and under either sharding scheme (``rows.py``).

Memory: per-row tensors are written band by band and loaded band by band, in place into the
existing shard and optimizer state. So saving and loading need a fraction of a shard of scratch
on top of what the rank already holds, whatever the number of state tensors.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_sparse.checkpoint.files import (
    DATA_PREFIX,
    ROWS_DIR,
    first_damaged,
    is_sharded,
    link,
    new_data_directory,
    read_checksums,
    record_checksums,
    remove,
    write_checksums,
)
from lightning_sparse.checkpoint.dynamic_rows import place_ids, read_placed
from lightning_sparse.checkpoint.rows import RowStore, export_rows
from lightning_sparse.dynamic import CLOCK, SLOT_STATE, DynamicEmbedding
from lightning_sparse.hashing import unmix
from lightning_sparse.sharding import RowSharding
from lightning_sparse.embedding import SparseEmbedding
from lightning_sparse.faults import PeerFailure, collective, is_peer_failure
from lightning_sparse.optim.base import SparseOptimizer

__all__ = [
    "DATA_PREFIX", "FORMAT", "METADATA_FILE", "StoredTensor", "dense_module_state", "dense_optimizer_state", "export",
    "is_sharded", "load_file", "load_meta", "verify", "load_module", "load_sparse_optimizer", "load_tensors", "remove", "save", "split_tensors",
    "stored_tensors",
]  # fmt: skip

METADATA_FILE = "meta.pt"
FORMAT = 3  # 1: tables inside the main DCP checkpoint; 2: bands without checksums


def tables(module: nn.Module) -> Iterator[tuple[str, SparseEmbedding]]:
    for name, sub in module.named_modules():
        if isinstance(sub, SparseEmbedding):
            yield (f"{name}." if name else ""), sub


def _distributed() -> bool:
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


def _row_tensors(module: nn.Module, sparse_optimizers: Mapping[int, SparseOptimizer]) -> Iterator[tuple[str, SparseEmbedding, Tensor]]:
    """Every per-row tensor to store: (key, its table, this rank's rows in the table's sharding)."""
    for prefix, table in tables(module):
        yield f"state_dict.{prefix}weight", table, table.shard
        if isinstance(table, DynamicEmbedding):
            for name, value in table.slot_state().items():
                yield f"state_dict.{prefix}{name}", table, value
    for index, optimizer in sparse_optimizers.items():
        for p_index, table in enumerate(optimizer.tables):
            for name, value in optimizer.state[table.shard].items():
                if value.dim() > 0:
                    yield f"optimizer_{index}.state.{p_index}.{name}", table, value


# ---------------------------------------------------------------------------- writing
def save(
    path: str | os.PathLike,
    module: nn.Module,
    sparse_optimizers: Mapping[int, SparseOptimizer] | None = None,
    dense: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write a sharded checkpoint of ``module``'s tables and the per-row state of ``sparse_optimizers``.

    ``sparse_optimizers`` maps an optimizer's index in Lightning's list to it; ``dense`` holds
    nested dicts of replicated tensors (written once); ``meta`` everything else (written by rank 0).
    Each per-row tensor is converted and written on its own, then freed.

    Collective: every rank must call it with the same ``path``.
    """
    path = Path(path)
    sparse_optimizers = sparse_optimizers or {}
    data = new_data_directory(path)
    distributed = _distributed()
    store, row_tensors = RowStore(data / ROWS_DIR, distributed), {}
    try:
        with collective(f"saving checkpoint {path}"), torch.no_grad():
            for key, table, local in _row_tensors(module, sparse_optimizers):
                row_tensors[key] = store.save(key, table, local)
            dcp.save(dense or {}, checkpoint_id=data, no_dist=not distributed)
            rank = dist.get_rank() if distributed else 0
            if rank == 0:
                torch.save({**(meta or {}), "format": FORMAT, "row_tensors": row_tensors}, data / METADATA_FILE)
            entries = record_checksums(data, rank, _describer(data, row_tensors, dist.get_world_size() if distributed else 1))
            gathered = [entries]
            if distributed:
                gathered = [None] * dist.get_world_size() if rank == 0 else None
                dist.gather_object(entries, gathered, dst=0)  # every rank's files are on disk
            if rank == 0:
                write_checksums(data, {name: entry for part in gathered for name, entry in part.items()})
            if distributed:
                dist.barrier()  # the checksums are on disk
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise _save_failed(path, err) from err
    with collective(f"saving checkpoint {path}"):
        if not distributed or dist.get_rank() == 0:
            link(data, path)
        if distributed:
            dist.barrier()  # nobody reads the checkpoint before the link exists
    return path


def _describer(data: Path, row_tensors: dict[str, dict[str, Any]], world_size: int) -> Any:
    """What a file of the data directory holds, in words (for checksum errors)."""

    def what(key: str) -> str:
        entry = row_tensors[key]
        if key.startswith("state_dict."):
            return f"table {entry['table']} ({key})"
        return f"optimizer state {key.rsplit('.', 1)[-1]!r} of table {entry['table']} ({key})"

    def describe(path: Path) -> str:
        parts = path.relative_to(data).parts
        if parts[0] == ROWS_DIR:
            key, band = parts[1], int(parts[2].removeprefix("part-"))
            if path.name == ".metadata":
                return f"the DCP metadata of band {band} of {what(key)}"
            entry, rank = row_tensors[key], int(path.name[2:].split("_")[0])
            ranks = entry.get("ranks", world_size)  # the table's sharding group (2-D: its replicas write one copy)
            rank %= ranks
            start = band * entry["part_rows"]
            rows = RowSharding(min(entry["shape"][0], start + entry["part_rows"]) - start, ranks, "range")
            first = start + rank * rows.block_size
            return f"rows {first}..{first + rows.num_local_rows(rank) - 1} of {what(key)}"
        if path.name == METADATA_FILE:
            return "the rest of the checkpoint (loops, callbacks, schedulers, ...)"
        if path.name == ".metadata":
            return "the DCP metadata of the dense tensors"
        return "dense tensors (module parameters and buffers, dense optimizer state, step counters)"

    return describe


def verify(path: str | os.PathLike) -> None:
    """Check every file of a sharded checkpoint against the CRC-32 written with it; raise naming the first damaged one.

    Collective when a process group is initialized: each rank reads a share of the files, and
    every rank raises the same error.
    """
    path = Path(path)
    entries = read_checksums(path)
    names = sorted(entries)
    distributed = _distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    damage = first_damaged(path, entries, names[rank::world])
    if distributed:
        found: list[str | None] = [None] * world
        with collective(f"checking checkpoint {path}"):
            dist.all_gather_object(found, damage)
        damage = next((d for d in found if d), None)
    if damage:
        raise RuntimeError(
            f"Checkpoint {path} is damaged: {damage}. HINT: restore the file from a copy, or resume from an earlier "
            f"checkpoint."
        )


def _lost_peer(err: BaseException) -> bool:
    """Whether ``err`` (or, for DCP's CheckpointException, a rank's failure inside it) is a lost peer."""
    causes = [err, *getattr(err, "failures", {}).values()] if isinstance(err, CheckpointException) else [err]
    return any(isinstance(c, PeerFailure) or (isinstance(c, BaseException) and is_peer_failure(c)) for c in causes)


def _save_failed(path: Path, err: BaseException) -> Exception:
    if _lost_peer(err):
        return PeerFailure(
            f"Saving checkpoint {path} failed: another rank died or did not reach the save within the process group's "
            f"timeout ({type(err).__name__}: {err}). The previous checkpoint of that name is intact. HINT: restart all "
            f"ranks and resume from the last checkpoint, e.g. trainer.fit(model, ckpt_path='last')."
        )
    return RuntimeError(
        f"Saving checkpoint {path} failed ({type(err).__name__}: {err}). The previous checkpoint of that name is "
        f"intact. HINT: check free space and permissions in {path.parent}; the half-written data directory is "
        f"removed by the next save there."
    )


# ---------------------------------------------------------------------------- reading
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


def stored_tensors(path: str | os.PathLike) -> dict[str, StoredTensor]:
    """Every tensor the checkpoint holds, by key (``state_dict.users.weight``, ``optimizer_1.state.0.step``, ...)."""
    path = Path(path)
    stored = {
        key: StoredTensor(tuple(item.size), item.properties.dtype)
        for key, item in _metadata(path, path).items()
        if isinstance(item, TensorStorageMetadata)
    }
    for key, item in load_meta(path).get("row_tensors", {}).items():
        stored[key] = StoredTensor(tuple(item["shape"]), getattr(torch, item["dtype"]))
    return stored


def _check(stored: dict[str, StoredTensor], key: str, shape: tuple[int, ...], path: Path, what: str) -> None:
    item = stored.get(key)
    if item is None:
        raise RuntimeError(f"Checkpoint {path} has no {what} (key {key!r}). HINT: load it into the module it was saved from.")
    if item.shape != tuple(shape):
        raise RuntimeError(
            f"{what} has shape {item.shape} in checkpoint {path} but {tuple(shape)} in this module. "
            f"HINT: build the module with the same num_embeddings and embedding_dim as when it was saved."
        )


def _dcp_load(state: dict[str, Any], directory: Path, checkpoint: Path, what: str, distributed: bool) -> None:
    try:
        with collective(f"loading {what} from {checkpoint}"):
            dcp.load(state, checkpoint_id=directory, no_dist=not distributed)
    except PeerFailure:
        raise
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        if _lost_peer(err):
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
        _dcp_load(state, directory, path, what, distributed)

    return load


def _read_rows(path: Path, store: RowStore, key: str, table: SparseEmbedding, out: Tensor, what: str) -> None:
    """Fill ``out`` (this rank's rows in the table's sharding) from the stored tensor ``key``, in place. Collective.

    A dynamic table's rows go where its ids were placed (:mod:`lightning_sparse.checkpoint.dynamic_rows`).
    """
    entry = load_meta(path)["row_tensors"][key]
    if not isinstance(table, DynamicEmbedding):
        store.load(key, table, out, entry, _loader(path, what, store.distributed))
        return
    placement = getattr(table, "placement", None)
    if placement is None or placement.checkpoint != str(path):
        raise RuntimeError(f"The rows of {table.name} in {path} can only be read after its ids are placed. "
                           f"HINT: load the module from the same checkpoint first (checkpoint.load_module).")  # fmt: skip
    read_placed(store, key, table, out, entry, _loader(path, what, store.distributed), placement)


def _check_rows(stored: dict[str, StoredTensor], key: str, table: SparseEmbedding, row_shape: tuple[int, ...], path: Path,
                what: str) -> None:  # fmt: skip
    """A per-row tensor's stored shape: the table's rows (a dynamic table: any number, saved on any ranks) x ``row_shape``."""
    rows = stored[key].shape[0] if isinstance(table, DynamicEmbedding) and key in stored else table.num_embeddings
    _check(stored, key, (rows, *row_shape), path, what)


def _place_dynamic(path: Path, store: RowStore, prefix: str, table: DynamicEmbedding) -> None:
    """Put a dynamic table's ids where they belong now, and forget every row and optimizer state they held. Collective."""
    entries = load_meta(path)["row_tensors"]
    table.placement = place_ids(path, store, prefix, table, entries.__getitem__,
                                lambda key: _loader(path, f"slots of {table.name}", store.distributed))  # fmt: skip
    table.shard.zero_()
    for optimizer in table.watchers():
        optimizer.reset_rows(table.shard, torch.arange(len(table.shard), device=table.device))


def load_module(path: str | os.PathLike, module: nn.Module, strict: bool = True) -> None:
    """Load a module's dense tensors and tables, each rank only its rows, into its shards in place. Collective."""
    path = Path(path)
    stored = stored_tensors(path)
    dense = {k: v for k, v in dense_module_state(module).items() if isinstance(v, Tensor)}
    if strict:
        for key, value in dense.items():
            _check(stored, f"state_dict.{key}", tuple(value.shape), path, f"tensor {key}")
    dense = {k: v for k, v in dense.items() if f"state_dict.{k}" in stored}
    store = RowStore(path / ROWS_DIR, _distributed())
    for prefix, table in tables(module):  # tables first: the bulk of a checkpoint
        key, what = f"state_dict.{prefix}weight", f"table {table.name}"
        _check_rows(stored, key, table, (table.embedding_dim,), path, what)
        if isinstance(table, DynamicEmbedding):
            _place_dynamic(path, store, prefix, table)
        _read_rows(path, store, key, table, table.shard, what)
    if dense:
        _dcp_load({"state_dict": dense}, path, path, "the dense tensors", _distributed())
    for prefix, table in tables(module):
        if isinstance(table, DynamicEmbedding) and f"{prefix}{CLOCK}" in dense:
            table.slots.clock = int(dense[f"{prefix}{CLOCK}"])


def load_sparse_optimizer(path: str | os.PathLike, index: int, optimizer: SparseOptimizer, param_groups: list[dict]) -> None:
    """Load the sparse optimizer saved as ``optimizer_<index>``, each rank only its rows, into its state in place. Collective."""
    path = Path(path)
    stored = stored_tensors(path)
    current = optimizer.state_dict()  # the optimizer's own state tensors, not copies
    store, counters = RowStore(path / ROWS_DIR, _distributed()), {}
    for p_index, table in enumerate(optimizer.tables):
        for name, value in current["state"].get(p_index, {}).items():
            key, what = f"optimizer_{index}.state.{p_index}.{name}", f"optimizer state {name!r} of table {table.name}"
            if value.dim() == 0:
                _check(stored, key, (), path, what)
                counters.setdefault(p_index, {})[name] = value.clone()
                continue
            _check_rows(stored, key, table, tuple(value.shape[1:]), path, what)
            _read_rows(path, store, key, table, value, what)
    if counters:
        _dcp_load({f"optimizer_{index}": {"state": counters}}, path, path, f"the step counters of optimizer {index}", _distributed())
    for p_index, entry in counters.items():
        current["state"][p_index].update(entry)
    optimizer.load_state_dict({"state": current["state"], "param_groups": param_groups})


def load_tensors(path: str | os.PathLike, tensors: dict[str, Any], what: str) -> None:
    """Fill ``tensors`` (nested like the saved dense state, replicated) from the checkpoint. Collective."""
    _dcp_load(tensors, Path(path), Path(path), what, _distributed())


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
        raise RuntimeError(f"Checkpoint {path} has no {METADATA_FILE}. HINT: it is incomplete; use an earlier checkpoint.") from err
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


# ---------------------------------------------------------------------------- export
def export(path: str | os.PathLike, out: str | os.PathLike) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    """Write the module state of a sharded checkpoint as one plain ``torch.save`` state dict.

    Tables become full ``<prefix>weight`` tensors loadable into ``nn.Embedding``. Runs in one
    process: each tensor is read into a memory-mapped scratch file, so memory stays O(one band),
    not O(checkpoint). Returns ``(key, shape, dtype, bytes)`` for every tensor written.
    """
    path = Path(path)
    verify(path)
    rows = load_meta(path).get("row_tensors", {})
    state: dict[str, Tensor] = {}

    def load(what: str) -> Any:
        return lambda state, directory: _dcp_load(state, directory, path, what, distributed=False)

    with tempfile.TemporaryDirectory(dir=Path(out).resolve().parent) as scratch:
        for flat, item in sorted(stored_tensors(path).items()):
            if not flat.startswith("state_dict."):
                continue
            key = flat[len("state_dict.") :]
            numel = int(torch.Size(item.shape).numel())
            if numel:
                target = torch.from_file(os.path.join(scratch, f"{len(state)}.bin"), shared=True, size=numel, dtype=item.dtype)
                target = target.view(item.shape)
            else:
                target = torch.empty(item.shape, dtype=item.dtype)
            if flat in rows:
                export_rows(path / ROWS_DIR, flat, rows[flat], target, load(f"tensor {key}"))
            else:
                load(f"tensor {key}")({"state_dict": {key: target}}, path)
            state[key] = target
        for prefix in [key[: -len(SLOT_STATE[0])] for key in state if key.endswith(SLOT_STATE[0])]:
            _ids_and_rows(state, prefix)
        summary = [(key, tuple(t.shape), t.dtype, t.numel() * t.element_size()) for key, t in state.items()]
        torch.save(state, out)
    return summary


def _ids_and_rows(state: dict[str, Tensor], prefix: str) -> None:
    """A dynamic table's slots in an export, as ``<prefix>ids`` (ascending) and their rows ``<prefix>weight``."""
    keys, used = state.pop(prefix + "slot_keys"), state.pop(prefix + "slot_used")
    for name in SLOT_STATE[2:]:
        state.pop(prefix + name)
    held = torch.nonzero(used).view(-1)
    ids, order = torch.sort(unmix(keys.index_select(0, held)))
    state[prefix + "ids"] = ids
    state[prefix + "weight"] = state[prefix + "weight"].index_select(0, held.index_select(0, order))
