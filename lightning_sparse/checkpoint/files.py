"""Where a sharded checkpoint lives on disk: a data directory, and a link that is swapped atomically.

A checkpoint ``path`` (what ModelCheckpoint names ``epoch=0-step=6.ckpt``) is a symbolic link to
a data directory beside it. A save writes a new data directory and only then points the link at
it (``os.replace`` of a link is atomic), so a save killed half-way leaves the previous
checkpoint, and ``last.ckpt``, intact. Data directories no link points to (left by a killed save,
or replaced by a newer save of the same name) are removed by the next save in the folder. Their
names contain no checkpoint name, so Lightning's search for ``last`` never finds one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch.distributed as dist

from lightning_sparse.faults import collective

DATA_PREFIX = ".sparse-ckpt-"
LINK_PREFIX = ".sparse-link-"
DCP_METADATA_FILE = ".metadata"
ROWS_DIR = "rows"


def new_data_directory(path: Path) -> Path:
    """Create an empty data directory beside ``path`` (the same on every rank). Collective."""
    distributed = dist.is_available() and dist.is_initialized()
    name = [f"{DATA_PREFIX}{uuid.uuid4().hex[:12]}"]
    with collective(f"start of saving {path}"):
        if distributed:
            dist.broadcast_object_list(name, src=0)
        data = path.parent / name[0]
        if not distributed or dist.get_rank() == 0:
            data.mkdir(parents=True)
        if distributed:
            dist.barrier()
    return data


def link(data: Path, path: Path) -> None:
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
