"""Export: a sharded checkpoint's module state as one plain ``torch.save`` state dict, in one process."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_sparse.checkpoint.contents import MODULE, module_name
from lightning_sparse.checkpoint.files import ROWS_DIR
from lightning_sparse.checkpoint.reading import dcp_load, load_meta, stored_tensors, verify
from lightning_sparse.checkpoint.rows import export_rows
from lightning_sparse.tables.dynamic_state import SLOT_STATE
from lightning_sparse.wire.hashing import unmix


def export(path: str | os.PathLike, out: str | os.PathLike) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    """Write the module state of a sharded checkpoint as one plain ``torch.save`` state dict.

    Tables become full ``<prefix>weight`` tensors loadable into ``nn.Embedding``. Runs in one
    process: each tensor is read into a memory-mapped scratch file, so memory stays O(one band),
    not O(checkpoint). Returns ``(key, shape, dtype, bytes)`` for every tensor written.
    """
    path = Path(path)
    verify(path)
    meta = load_meta(path)
    rows = meta.get("row_tensors", {})
    state: dict[str, Tensor] = {}

    def load(what: str) -> Any:
        return lambda state, directory: dcp_load(state, directory, path, what, distributed=False)

    with tempfile.TemporaryDirectory(dir=Path(out).resolve().parent) as scratch:
        for flat, item in sorted(stored_tensors(path, meta).items()):
            key = module_name(flat)
            if key is None:  # an optimizer's state: not part of an export
                continue
            numel = int(torch.Size(item.shape).numel())
            if numel:
                target = torch.from_file(os.path.join(scratch, f"{len(state)}.bin"), shared=True, size=numel, dtype=item.dtype)
                target = target.view(item.shape)
            else:
                target = torch.empty(item.shape, dtype=item.dtype)
            if flat in rows:
                export_rows(path / ROWS_DIR, flat, rows[flat], target, load(f"tensor {key}"))
            else:
                load(f"tensor {key}")({MODULE: {key: target}}, path)
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
