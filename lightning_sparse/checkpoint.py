"""Sharded checkpoints: every rank writes and reads only its own rows, through torch.distributed.checkpoint.

A checkpoint ``path`` (what ModelCheckpoint names ``epoch=0-step=6.ckpt``) is a symbolic link to
a data directory beside it::

    epoch=0-step=6.ckpt -> .sparse-ckpt-<id>/
        .metadata, __<rank>_0.distcp   DCP: module tensors and optimizer state tensors
        meta.pt                        everything else Lightning saves (loads with weights_only=True)

Each table, and each per-row optimizer state (Adam's moments and ``row_step``, Adagrad's sums), is
stored as the logical tensor ``[num_embeddings, ...]`` in global row order, written by the ranks
in contiguous row blocks (``torch.chunk`` blocks, a ``DTensor`` sharded on dim 0). So a checkpoint
loads on any number of ranks and under either sharding scheme: ``"mod"`` rows move to and from
row blocks with one all-to-all, and DCP reads whichever block a rank needs. No rank ever holds
more than its own rows. Dense tensors are replicated and written once.

Crash safety: a save writes a new data directory and only then points the link at it
(``os.replace`` of a link is atomic), so a save killed half-way leaves the previous checkpoint,
and ``last.ckpt``, intact. Data directories no link points to (left by a killed save, or
replaced by a newer save of the same name) are removed by the next save in the folder. Their
names contain no checkpoint name, so Lightning's search for ``last`` never finds one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_sparse.embedding import SparseEmbedding
from lightning_sparse.exchange import PeerFailure, SortedKeys, exchange_counts, exchange_values
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.sharding import RowSharding

METADATA_FILE = "meta.pt"
DCP_METADATA_FILE = ".metadata"
DATA_PREFIX = ".sparse-ckpt-"
LINK_PREFIX = ".sparse-link-"


# ---------------------------------------------------------------------------- rows <-> row blocks
# Rows move between layouts in this many all-to-all rounds, so that the scratch memory of a move
# is about 1/MOVE_ROUNDS of a shard on top of its output.
MOVE_ROUNDS = 8


def move_rows(
    values: Tensor, global_ids: Tensor, target: RowSharding, table: SparseEmbedding, out: Tensor | None = None
) -> Tensor:
    """Send each row of ``values`` (global row ``global_ids[i]``) to its owner under ``target``.

    Returns this rank's rows under ``target`` in its local order, written into ``out`` if given.
    Collective over the table's group: every rank runs the same ``MOVE_ROUNDS`` rounds.
    """
    rank, world = table.rank, table.world_size
    if out is None:
        out = values.new_empty(target.num_local_rows(rank), *values.shape[1:])
    if world == 1:
        return out.index_copy_(0, target.to_local(global_ids), values)
    group, boundaries = table.process_group, target.key_boundaries(global_ids.device)
    for ids_part, values_part in zip(global_ids.tensor_split(MOVE_ROUNDS), values.tensor_split(MOVE_ROUNDS)):
        keys = target.key(ids_part)
        runs = SortedKeys(keys)
        if not torch.equal(runs.sorted, keys):  # else already grouped by owner (always so from "mod" to row blocks)
            ids_part, values_part = ids_part.index_select(0, runs.perm), values_part.index_select(0, runs.perm)
        below = runs.counts_below(boundaries)
        send = (below[1:] - below[:-1]).view(-1, 1)
        recv = exchange_counts(send, group, world).view(-1)
        send_splits, recv_splits = send.view(-1).tolist(), recv.tolist()
        ids = exchange_values(ids_part, send_splits, recv_splits, group, world, rank)
        rows = exchange_values(values_part, send_splits, recv_splits, group, world, rank)
        out.index_copy_(0, target.to_local(ids), rows)
    return out


def _blocks(table: SparseEmbedding) -> RowSharding:
    return RowSharding(table.num_embeddings, table.world_size, "range")


def to_row_block(table: SparseEmbedding, local: Tensor) -> Tensor:
    """This rank's contiguous block of a per-row tensor held in the table's sharding. Collective."""
    if table.sharding_scheme == "range":
        return local
    return move_rows(local, table.sharding.global_ids(table.rank, device=local.device), _blocks(table), table)


def from_row_block(table: SparseEmbedding, block: Tensor, out: Tensor | None = None) -> Tensor:
    """Inverse of :func:`to_row_block`, written into ``out`` if given. Collective."""
    if table.sharding_scheme == "range":
        return block if out is None else out.copy_(block)
    return move_rows(block, _blocks(table).global_ids(table.rank, device=block.device), table.sharding, table, out)


def _as_dtensor(table: SparseEmbedding, block: Tensor) -> Any:
    """The logical ``[num_embeddings, ...]`` tensor of which ``block`` is this rank's chunk."""
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh(table.device.type, (table.world_size,))
    shape = torch.Size([table.num_embeddings, *block.shape[1:]])
    stride = torch.empty(0).new_empty(shape, device="meta").stride()
    return DTensor.from_local(block.contiguous(), mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def _tables(module: nn.Module) -> Iterator[tuple[str, SparseEmbedding]]:
    for name, sub in module.named_modules():
        if isinstance(sub, SparseEmbedding):
            yield (f"{name}." if name else ""), sub


# ---------------------------------------------------------------------------- state to save
def sharded_module_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with each table as the DTensor ``<prefix>weight``. Collective."""
    state = module.state_dict()
    for prefix, table in _tables(module):
        state.pop(prefix + "shard")
        state.pop(prefix + "_extra_state", None)
        state[prefix + "weight"] = _as_dtensor(table, to_row_block(table, table.shard))
    return state


def sharded_optimizer_state(optimizer: SparseOptimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each per-row state tensor as a logical DTensor. Collective."""
    state = optimizer.state_dict()
    for index, table in enumerate(optimizer.tables):
        state["state"][index] = {
            key: _as_dtensor(table, to_row_block(table, value)) if value.dim() > 0 else value
            for key, value in state["state"].get(index, {}).items()
        }
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


# ---------------------------------------------------------------------------- writing
def save(path: str | os.PathLike, tensors: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write ``tensors`` with DCP (each rank its own chunks) and ``meta`` from rank 0, then link ``path``.

    Collective: every rank must call it with the same ``path``.
    """
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    name = [f"{DATA_PREFIX}{uuid.uuid4().hex[:12]}"]
    if distributed:
        dist.broadcast_object_list(name, src=0)  # one data directory for all ranks
    data = path.parent / name[0]
    if rank == 0:
        data.mkdir(parents=True)
    if distributed:
        dist.barrier()
    try:
        dcp.save(tensors, checkpoint_id=data, no_dist=not distributed)
        if rank == 0:
            torch.save(meta, data / METADATA_FILE)
        if distributed:
            dist.barrier()  # every rank's chunks are on disk
    except (RuntimeError, CheckpointException) as err:
        raise PeerFailure(
            f"Saving checkpoint {path} failed ({type(err).__name__}: {err}); the previous checkpoint of that name is "
            f"intact. HINT: if a rank died, restart all ranks and resume from the last checkpoint."
        ) from err
    if rank == 0:
        _link(data, path)
    if distributed:
        dist.barrier()  # nobody reads the checkpoint before the link exists
    return path


def _link(data: Path, path: Path) -> None:
    """Point ``path`` at ``data`` atomically, then delete data directories no link points to."""
    if path.exists() and not path.is_symlink():  # an older single-file or directory checkpoint
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    staging = path.parent / f"{LINK_PREFIX}{uuid.uuid4().hex[:8]}"
    os.symlink(data.name, staging)
    os.replace(staging, path)
    folder = path.parent
    linked = {(folder / os.readlink(p)).resolve() for p in folder.iterdir() if p.is_symlink() and p.exists()}
    for stale in folder.glob(DATA_PREFIX + "*"):
        if stale.resolve() not in linked:
            shutil.rmtree(stale, ignore_errors=True)
    for stale in folder.glob(LINK_PREFIX + "*"):
        stale.unlink()


def remove(path: str | os.PathLike) -> None:
    """Delete a sharded checkpoint: the link and its data directory."""
    path = Path(path)
    if path.is_symlink():
        target = path.parent / os.readlink(path)
        path.unlink()
        shutil.rmtree(target, ignore_errors=True)
    elif path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def is_sharded(path: str | os.PathLike) -> bool:
    return (Path(path) / DCP_METADATA_FILE).is_file()


# ---------------------------------------------------------------------------- reading
def _stored(path: Path) -> dict[str, Any]:
    try:
        return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as err:
        raise RuntimeError(
            f"{path} is not a readable sharded checkpoint ({type(err).__name__}: {err}). "
            f"HINT: it may be incomplete (a save that was killed); resume from an earlier checkpoint."
        ) from err


def _check(stored: dict[str, Any], key: str, shape: tuple[int, ...], path: Path, what: str) -> None:
    item = stored.get(key)
    if not isinstance(item, TensorStorageMetadata):
        raise RuntimeError(f"Checkpoint {path} has no {what} (key {key!r}). HINT: load it into the module it was saved from.")
    if tuple(item.size) != tuple(shape):
        raise RuntimeError(
            f"{what} has shape {tuple(item.size)} in checkpoint {path} but {tuple(shape)} in this module. "
            f"HINT: build the module with the same num_embeddings and embedding_dim as when it was saved."
        )


def _dcp_load(state: dict[str, Any], path: Path, what: str, distributed: bool) -> None:
    try:
        dcp.load(state, checkpoint_id=path, no_dist=not distributed)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise RuntimeError(
            f"Could not read {what} from checkpoint {path} ({type(err).__name__}: {err}). "
            f"HINT: the checkpoint is truncated or missing shards; resume from an earlier checkpoint."
        ) from err


def load_module(path: str | os.PathLike, module: nn.Module, strict: bool = True) -> None:
    """Load a module's dense tensors and tables (each rank reads only its rows). Collective."""
    path = Path(path)
    stored = _stored(path)
    distributed = dist.is_available() and dist.is_initialized()
    state = module.state_dict()
    table_keys = {prefix + name for prefix, _ in _tables(module) for name in ("shard", "_extra_state")}
    dense = {k: v for k, v in state.items() if isinstance(v, Tensor) and k not in table_keys}
    if strict:
        for key, value in dense.items():
            _check(stored, f"state_dict.{key}", tuple(value.shape), path, f"tensor {key}")
    dense = {k: v for k, v in dense.items() if f"state_dict.{k}" in stored}
    for prefix, table in _tables(module):  # tables first: the bulk of a checkpoint
        key = prefix + "weight"
        what = f"table {table.name}"
        _check(stored, f"state_dict.{key}", (table.num_embeddings, table.embedding_dim), path, what)
        block = torch.empty(_blocks(table).num_local_rows(table.rank), table.embedding_dim, dtype=table.dtype, device=table.device)
        _dcp_load({"state_dict": {key: _as_dtensor(table, block)}}, path, what, distributed)
        with torch.no_grad():
            from_row_block(table, block, out=table.shard)
    if dense:
        _dcp_load({"state_dict": dense}, path, "the dense tensors", distributed)


def load_sparse_optimizer(path: str | os.PathLike, key: str, optimizer: SparseOptimizer, param_groups: list[dict]) -> None:
    """Load one sparse optimizer saved under ``key`` (each rank reads only its rows). Collective."""
    path = Path(path)
    stored = _stored(path)
    distributed = dist.is_available() and dist.is_initialized()
    current = optimizer.state_dict()
    local: dict[str, Any] = {"state": {}, "param_groups": param_groups}
    for index, table in enumerate(optimizer.tables):
        entry = {}
        for name, value in current["state"].get(index, {}).items():
            flat = f"{key}.state.{index}.{name}"
            what = f"optimizer state {name!r} of table {table.name}"
            if value.dim() == 0:
                _check(stored, flat, (), path, what)
                target = value.clone()
                _dcp_load({key: {"state": {index: {name: target}}}}, path, what, distributed)
                entry[name] = target
                continue
            _check(stored, flat, (table.num_embeddings, *value.shape[1:]), path, what)
            block = value.new_empty(_blocks(table).num_local_rows(table.rank), *value.shape[1:])
            _dcp_load({key: {"state": {index: {name: _as_dtensor(table, block)}}}}, path, what, distributed)
            entry[name] = from_row_block(table, block)
        local["state"][index] = entry
    optimizer.load_state_dict(local)


def load_tensors(path: str | os.PathLike, tensors: dict[str, Any], what: str) -> None:
    """Fill ``tensors`` (nested like the saved state, replicated) from the checkpoint. Collective."""
    _dcp_load(tensors, Path(path), what, dist.is_available() and dist.is_initialized())


def load_meta(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    path = Path(path)
    try:
        return torch.load(path / METADATA_FILE, weights_only=weights_only, map_location="cpu")
    except FileNotFoundError as err:
        raise RuntimeError(f"Checkpoint {path} has no {METADATA_FILE}. HINT: it is incomplete; use an earlier checkpoint.") from err


# ---------------------------------------------------------------------------- export
def export(path: str | os.PathLike, out: str | os.PathLike) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    """Write the module state of a sharded checkpoint as one plain ``torch.save`` state dict.

    Tables become full ``<prefix>weight`` tensors loadable into ``nn.Embedding``. Runs in one
    process: each tensor is read into a memory-mapped scratch file, so memory stays O(one table
    chunk), not O(checkpoint). Returns ``(key, shape, dtype, bytes)`` for every tensor written.
    """
    path = Path(path)
    stored = _stored(path)
    state: dict[str, Tensor] = {}
    summary = []
    with tempfile.TemporaryDirectory(dir=Path(out).resolve().parent) as scratch:
        for flat, item in sorted(stored.items()):
            if not flat.startswith("state_dict.") or not isinstance(item, TensorStorageMetadata):
                continue
            key = flat[len("state_dict.") :]
            dtype, shape = item.properties.dtype, tuple(item.size)
            numel = int(torch.Size(shape).numel())
            if numel:
                target = torch.from_file(os.path.join(scratch, f"{len(state)}.bin"), shared=True, size=numel, dtype=dtype)
                target = target.view(shape)
            else:
                target = torch.empty(shape, dtype=dtype)
            _dcp_load({"state_dict": {key: target}}, path, f"tensor {key}", distributed=False)
            state[key] = target
            summary.append((key, shape, dtype, numel * target.element_size()))
        torch.save(state, out)
    return summary
