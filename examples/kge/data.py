"""Knowledge-graph triples (``head<TAB>relation<TAB>tail`` files, e.g. WN18RR) as a LightningDataModule.

Every triple ``(h, r, t)`` gives two queries, ``(h, r, ?) -> t`` and ``(t, r + R, ?) -> h`` (a
reciprocal relation per relation), so the model only ever predicts tails. Filtered ranking
removes, for each query, every other entity known to answer it (in train, valid or test).

Evaluation splits are cut into one equal slice per rank (padded with masked queries) so that
every rank runs the same number of batches: scoring against all entities is a collective.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DEFAULT_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "wn18rr"


def read_dict(path: Path) -> dict[str, int]:
    with open(path) as f:
        return {name: int(index) for index, name in (line.rstrip("\n").split("\t") for line in f)}


def read_triples(path: Path, entities: dict[str, int], relations: dict[str, int]) -> torch.Tensor:
    with open(path) as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    return torch.tensor([(entities[h], relations[r], entities[t]) for h, r, t in rows], dtype=torch.int64).view(-1, 3)


def with_reciprocals(triples: torch.Tensor, num_relations: int) -> torch.Tensor:
    """``[n, 3]`` -> ``[2n, 3]``: each triple, then ``(t, r + R, h)``."""
    h, r, t = triples.unbind(1)
    return torch.cat([triples, torch.stack([t, r + num_relations, h], dim=1)])


class SliceSampler(DistributedSampler):
    """This rank's contiguous slice of a padded split: no shuffling, no extra padding (Lightning keeps it)."""

    def __iter__(self):
        per_rank = len(self.dataset) // self.num_replicas
        return iter(range(self.rank * per_rank, (self.rank + 1) * per_rank))

    def __len__(self) -> int:
        return len(self.dataset) // self.num_replicas


class KGDataModule(LightningDataModule):
    """Train, valid and test queries of a knowledge graph, with the filter of known answers.

    Args:
        data_dir: a folder with ``train.txt``, ``valid.txt``, ``test.txt`` and, optionally,
            ``entities.dict`` and ``relations.dict`` (``index<TAB>name``); default WN18RR in
            ``../shared/data/wn18rr`` (never copied into the repository).
        batch_size: training queries per rank and step.
        eval_batch_size: evaluation queries per rank and step.
        limit_train, limit_eval: use only the first triples of each split (CI-sized runs).
    """

    def __init__(
        self,
        data_dir: str | None = None,
        batch_size: int = 512,
        eval_batch_size: int = 256,
        limit_train: int | None = None,
        limit_eval: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = Path(data_dir or os.environ.get("WN18RR_DIR", DEFAULT_DIR))
        if not (self.data_dir / "train.txt").is_file():
            raise FileNotFoundError(
                f"No train.txt in {self.data_dir}. HINT: pass --data.data_dir DIR or set WN18RR_DIR "
                f"(head<TAB>relation<TAB>tail files; docs/kge.md says where to get WN18RR)."
            )
        self.entities, self.relations = self._vocabulary()

    @property
    def num_entities(self) -> int:
        return len(self.entities)

    @property
    def num_relations(self) -> int:
        """Relations including their reciprocals."""
        return 2 * len(self.relations)

    def _vocabulary(self) -> tuple[dict[str, int], dict[str, int]]:
        if (self.data_dir / "entities.dict").is_file() and (self.data_dir / "relations.dict").is_file():
            return read_dict(self.data_dir / "entities.dict"), read_dict(self.data_dir / "relations.dict")
        entities: dict[str, int] = {}
        relations: dict[str, int] = {}
        for split in ("train", "valid", "test"):
            with open(self.data_dir / f"{split}.txt") as f:
                for line in f:
                    h, r, t = line.rstrip("\n").split("\t")
                    entities.setdefault(h, len(entities))
                    entities.setdefault(t, len(entities))
                    relations.setdefault(r, len(relations))
        return entities, relations

    def setup(self, stage: str) -> None:
        h = self.hparams
        splits = {s: read_triples(self.data_dir / f"{s}.txt", self.entities, self.relations) for s in ("train", "valid", "test")}
        self.known = known_answers(torch.cat(list(splits.values())), len(self.relations))
        train = splits["train"][: h.limit_train] if h.limit_train else splits["train"]
        self.train_queries = with_reciprocals(train, len(self.relations))
        self.eval_queries = {
            s: with_reciprocals(splits[s][: h.limit_eval] if h.limit_eval else splits[s], len(self.relations))
            for s in ("valid", "test")
        }

    def train_dataloader(self) -> DataLoader:
        # drop_last: every rank's batches have the same size (the loss scores them against all entities together)
        return DataLoader(TensorDataset(self.train_queries), batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def _eval_loader(self, split: str) -> DataLoader:
        queries = self.eval_queries[split]
        world = self.trainer.world_size if self.trainer is not None else 1
        rank = self.trainer.global_rank if self.trainer is not None else 0
        padded = -(-len(queries) // world) * world
        valid = torch.zeros(padded, dtype=torch.bool)
        valid[: len(queries)] = True
        queries = torch.cat([queries, queries[: padded - len(queries)]]) if padded > len(queries) else queries
        data = TensorDataset(queries, valid)
        return DataLoader(data, batch_size=self.hparams.eval_batch_size,
                          sampler=SliceSampler(data, num_replicas=world, rank=rank, shuffle=False))  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("valid")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


def known_answers(triples: torch.Tensor, num_relations: int) -> dict[int, torch.Tensor]:
    """Query key ``head * 2R + relation`` -> every tail known to answer it (reciprocals included)."""
    queries = with_reciprocals(triples, num_relations)
    keys = queries[:, 0] * (2 * num_relations) + queries[:, 1]
    order = torch.argsort(keys, stable=True)
    keys, tails = keys[order], queries[order, 2]
    unique, counts = torch.unique_consecutive(keys, return_counts=True)
    return dict(zip(unique.tolist(), tails.split(counts.tolist())))
