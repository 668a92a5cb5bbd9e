"""Where a sharded checkpoint lives on disk: a data directory, and a link that is swapped atomically.

A checkpoint ``path`` (what ModelCheckpoint names ``epoch=0-step=6.ckpt``) is a symbolic link to
a data directory beside it. A save writes a new data directory and only then points the link at
it (``os.replace`` of a link is atomic), so a save killed half-way leaves the previous
checkpoint, and ``last.ckpt``, intact. A data directory is named after a hash of its checkpoint's
name (``.sparse-ckpt-<hash>-<id>``): the next save of that name removes those no link points to
(left by a killed save, or replaced), and never touches another name's, so jobs that save into
one folder under different names leave each other's saves in progress alone. The names contain
no checkpoint name, so Lightning's search for ``last`` never finds one.

Integrity: every file of a data directory has a CRC-32 in ``checksums.json``, with what it holds
(for a band of a per-row tensor: the key, the table and the rows), written by rank 0 from every
rank's own files after they are on disk, and checked before a load or an export.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_sparse.faults.peers import collective

METADATA_FILE = "meta.pt"
FORMAT = 3  # 1: tables inside the main DCP checkpoint; 2: bands without checksums
DATA_PREFIX = ".sparse-ckpt-"
LINK_PREFIX = ".sparse-link-"
DCP_METADATA_FILE = ".metadata"
ROWS_DIR = "rows"


def new_data_directory(path: Path) -> Path:
    """Create an empty data directory beside ``path`` (the same on every rank). Collective."""
    distributed = dist.is_available() and dist.is_initialized()
    name = [f"{_owned_prefix(DATA_PREFIX, path)}{uuid.uuid4().hex[:12]}"]
    with collective(f"start of saving {path}"):
        if distributed:
            dist.broadcast_object_list(name, src=0)
        data = path.parent / name[0]
        if not distributed or dist.get_rank() == 0:
            data.mkdir(parents=True)
        if distributed:
            dist.barrier()
    return data


def _owned_prefix(prefix: str, path: Path) -> str:
    """The start of the names of the data directories (or staging links) of checkpoint ``path``."""
    return f"{prefix}{zlib.crc32(path.name.encode()):08x}-"


def link(data: Path, path: Path) -> None:
    """Point ``path`` at ``data`` atomically, then delete the data directories of ``path``'s name no link points to."""
    if path.exists() and not path.is_symlink():  # an older single-file or directory checkpoint
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    staging = path.parent / f"{_owned_prefix(LINK_PREFIX, path)}{uuid.uuid4().hex[:8]}"
    os.symlink(data.name, staging)
    os.replace(staging, path)
    folder = path.parent
    linked = {(folder / os.readlink(p)).resolve() for p in folder.iterdir() if p.is_symlink() and p.exists()}
    for stale in folder.glob(_owned_prefix(DATA_PREFIX, path) + "*"):
        if stale.resolve() not in linked:
            shutil.rmtree(stale, ignore_errors=True)
    for stale in folder.glob(_owned_prefix(LINK_PREFIX, path) + "*"):
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


# ---------------------------------------------------------------------------- checksums
CHECKSUMS_FILE = "checksums.json"
_READ_BYTES = 1 << 22


def crc32(path: Path) -> tuple[int, int]:
    """(CRC-32, size in bytes) of a file, read in chunks."""
    value, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            value, size = zlib.crc32(chunk, value), size + len(chunk)
    return value, size


def files_written_by(data: Path, rank: int) -> list[Path]:
    """The files of a data directory that ``rank`` wrote: its DCP chunks, and on rank 0 the metadata files."""
    mine = list(data.rglob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine += [p for p in data.rglob("*") if p.is_file() and not p.name.endswith(".distcp") and p.name != CHECKSUMS_FILE]
    return sorted(mine)


def record_checksums(data: Path, rank: int, describe: Callable[[Path], str]) -> dict[str, dict[str, Any]]:
    """This rank's entries of ``checksums.json``: relative path -> CRC-32, size and what the file holds."""
    entries = {}
    for path in files_written_by(data, rank):
        value, size = crc32(path)
        entries[str(path.relative_to(data))] = {"crc32": value, "bytes": size, "holds": describe(path)}
    return entries


def write_checksums(data: Path, entries: dict[str, dict[str, Any]]) -> None:
    (data / CHECKSUMS_FILE).write_text(json.dumps(entries, indent=1, sort_keys=True))


def read_checksums(path: Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads((path / CHECKSUMS_FILE).read_text())
    except (OSError, ValueError) as err:
        raise RuntimeError(
            f"Checkpoint {path} has no readable {CHECKSUMS_FILE} ({type(err).__name__}: {err}). HINT: it is incomplete "
            f"or was written by an older version; resume from another checkpoint."
        ) from err


def first_damaged(path: Path, entries: dict[str, dict[str, Any]], files: list[str]) -> str | None:
    """The message for the first of ``files`` whose checksum or size differs from ``entries``, else ``None``."""
    for name in files:
        expected = entries[name]
        try:
            value, size = crc32(path / name)
        except OSError as err:
            return f"{path / name} ({expected['holds']}) cannot be read ({type(err).__name__}: {err})"
        if (value, size) != (expected["crc32"], expected["bytes"]):
            return (
                f"{path / name} ({expected['holds']}) has checksum {value:08x} and {size} bytes, but "
                f"{expected['crc32']:08x} and {expected['bytes']} bytes were written"
            )
    return None
