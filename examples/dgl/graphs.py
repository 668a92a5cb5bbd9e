"""Graphs with planted communities, generated in the example (no download), their node splits, and
the DataModule and LightningModule bases both examples build on.

A planted-partition graph (a stochastic block model): every node belongs to one of ``communities``
equal-sized communities, draws ``degree_in`` neighbours inside its community and ``degree_out``
anywhere, and the edges are made undirected and simple. How well a model recovers the communities
from the edges alone is the quality figure of both examples.
"""

from __future__ import annotations

from dataclasses import dataclass

import dgl
import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torchmetrics.classification import MulticlassAccuracy


@dataclass(frozen=True)
class PlantedGraph:
    graph: dgl.DGLGraph
    labels: torch.Tensor  # [num_nodes] community of each node
    train: torch.Tensor  # ids of the nodes whose community is known in training
    val: torch.Tensor
    test: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.graph.num_nodes()


def planted_communities(
    num_nodes: int, communities: int, degree_in: int, degree_out: int, labeled: float = 0.1, seed: int = 0
) -> PlantedGraph:
    """A planted-partition graph; ``labeled`` of the nodes train, the rest splits evenly into val and test.

    Every process that calls this with the same arguments gets the same graph.
    """
    if num_nodes % communities:
        raise ValueError(f"num_nodes={num_nodes} is not a multiple of communities={communities}. HINT: round it.")
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randperm(num_nodes, generator=generator) % communities
    members = torch.argsort(labels, stable=True).view(communities, -1)  # row c: the nodes of community c
    size = num_nodes // communities
    inside = torch.randint(0, size, (num_nodes, degree_in), generator=generator)
    inside = members[labels.unsqueeze(1), inside]
    outside = torch.randint(0, num_nodes, (num_nodes, degree_out), generator=generator)
    src = torch.arange(num_nodes).repeat_interleave(degree_in + degree_out)
    dst = torch.cat([inside, outside], dim=1).flatten()
    graph = dgl.graph((src, dst), num_nodes=num_nodes)
    graph = dgl.to_simple(dgl.to_bidirected(dgl.remove_self_loop(graph)), return_counts=None)
    order = torch.randperm(num_nodes, generator=generator)
    n_train = int(labeled * num_nodes)
    n_val = (num_nodes - n_train) // 2
    train, val, test = order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]
    return PlantedGraph(graph, labels, train.sort().values, val.sort().values, test.sort().values)


class PlantedGraphData(LightningDataModule):
    """Holds the planted graph (the same on every rank) and gives each rank its own DGL random stream."""

    def __init__(self, num_nodes: int, communities: int, degree_in: int, degree_out: int, labeled: float, seed: int) -> None:
        super().__init__()
        self.planted = planted_communities(num_nodes, communities, degree_in, degree_out, labeled, seed)
        self.seed = seed

    @property
    def num_nodes(self) -> int:
        return self.planted.num_nodes

    def setup(self, stage: str) -> None:
        dgl.seed(self.seed + (self.trainer.global_rank if self.trainer else 0))  # each rank its own samples


class CommunityModule(LightningModule):
    """Validation and test: the accuracy of ``communities(batch)``, a torchmetrics metric synced over ranks."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.accuracy = torch.nn.ModuleDict(
            {split: MulticlassAccuracy(num_classes, average="micro") for split in ("val", "test")}
        )

    def communities(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted, true) communities of an evaluation batch's nodes."""
        raise NotImplementedError

    def _evaluate(self, batch, split: str) -> None:
        predicted, labels = self.communities(batch)
        self.accuracy[split](predicted, labels)
        self.log(f"{split}_acc", self.accuracy[split], prog_bar=True, batch_size=len(labels))

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")
