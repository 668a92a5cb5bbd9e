"""Writing a sharded checkpoint: every rank its own rows, band by band, then the link swapped atomically."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from lightning_sparse.checkpoint.contents import is_distributed, row_tensors
from lightning_sparse.checkpoint.files import (
    FORMAT,
    METADATA_FILE,
    ROWS_DIR,
    link,
    new_data_directory,
    record_checksums,
    write_checksums,
)
from lightning_sparse.checkpoint.rows import RowStore
from lightning_sparse.faults.peers import PeerFailure, caused_by_lost_peer, collective
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.wire.sharding import RowSharding


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
    distributed = is_distributed()
    store, entries = RowStore(data / ROWS_DIR, distributed), {}
    try:
        with collective(f"saving checkpoint {path}"), torch.no_grad():
            for item in row_tensors(module, sparse_optimizers):
                entries[item.key] = {**store.save(item.key, item.table, item.rows), "what": item.what}
            dcp.save(dense or {}, checkpoint_id=data, no_dist=not distributed)
            rank = dist.get_rank() if distributed else 0
            if rank == 0:
                torch.save({**(meta or {}), "format": FORMAT, "row_tensors": entries}, data / METADATA_FILE)
            checksums = record_checksums(data, rank, _describer(data, entries, dist.get_world_size() if distributed else 1))
            gathered = [checksums]
            if distributed:
                gathered = [None] * dist.get_world_size() if rank == 0 else None
                dist.gather_object(checksums, gathered, dst=0)  # every rank's files are on disk
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
        return f"{row_tensors[key]['what']} ({key})"

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


def _save_failed(path: Path, err: BaseException) -> Exception:
    if caused_by_lost_peer(err):
        return PeerFailure(
            f"Saving checkpoint {path} failed: another rank died or did not reach the save within the process group's "
            f"timeout ({type(err).__name__}: {err}). The previous checkpoint of that name is intact. HINT: restart all "
            f"ranks and resume from the last checkpoint, e.g. trainer.fit(model, ckpt_path='last')."
        )
    return RuntimeError(
        f"Saving checkpoint {path} failed ({type(err).__name__}: {err}). The previous checkpoint of that name is "
        f"intact. HINT: check free space and permissions in {path.parent}; the half-written data directory is removed "
        f"by the next save of that name."
    )
