"""Read the WN18RR knowledge graph from ../shared/data/wn18rr (never copied into the repo)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "wn18rr"


def data_dir(path: str | os.PathLike | None = None) -> Path:
    found = Path(path or os.environ.get("WN18RR_DIR", DEFAULT_DIR))
    if not (found / "train.txt").is_file():
        raise FileNotFoundError(
            f"WN18RR not found in {found}. HINT: pass --data DIR or set WN18RR_DIR (docs/kge.md says where to get it)."
        )
    return found


def load_split(directory: Path, split: str) -> tuple[torch.Tensor, int, int]:
    """Triples of ``split`` as a [n, 3] int64 tensor (head, relation, tail), and the entity/relation counts."""
    entities = _read_dict(directory / "entities.dict")
    relations = _read_dict(directory / "relations.dict")
    rows = []
    with open(directory / f"{split}.txt") as f:
        for line in f:
            head, relation, tail = line.strip().split("\t")
            rows.append((entities[head], relations[relation], entities[tail]))
    return torch.tensor(rows, dtype=torch.int64), len(entities), len(relations)


def _read_dict(path: Path) -> dict[str, int]:
    with open(path) as f:
        return {name: int(index) for index, name in (line.strip().split("\t") for line in f)}
