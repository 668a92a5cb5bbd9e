"""GraphSAGE whose input node features are learnable lightning-sparse rows, with DGL neighbour sampling.

Graphs without node features (or with features worth learning) give every node a learnable row.
Here those rows live in a ``SparseEmbedding`` sharded over the ranks, DGL samples the neighbourhoods
(``NeighborSampler`` as the ``collate_fn`` of the loader that Lightning shards), and the GraphSAGE
layers are dense parameters in DDP. The task: find each node's planted community from half of the nodes
labelled and the edges (with 10% labelled, learnable rows overfit: see docs/graphs.md).

    cd examples/dgl && python sage.py fit --config sage.yaml
"""

from __future__ import annotations

import dgl
import torch
import torch.nn.functional as F
from cli import main
from dgl.nn import SAGEConv
from graphs import CommunityModule, PlantedGraphData
from torch.utils.data import DataLoader

import lightning_sparse as ls


class SampledCommunities(PlantedGraphData):
    """Batches ``(input_nodes, blocks, labels)`` of DGL-sampled neighbourhoods around labelled seed nodes."""

    def __init__(
        self,
        num_nodes: int = 20000,
        communities: int = 10,
        degree_in: int = 5,
        degree_out: int = 5,
        labeled: float = 0.5,
        fanouts: tuple[int, ...] = (10, 10),
        batch_size: int = 256,
        seed: int = 0,
    ) -> None:
        super().__init__(num_nodes, communities, degree_in, degree_out, labeled, seed)
        self.save_hyperparameters()
        self.sampler = dgl.dataloading.NeighborSampler(list(fanouts))

    def _sample(self, seeds: list[torch.Tensor]) -> tuple[torch.Tensor, list, torch.Tensor]:
        input_nodes, output_nodes, blocks = self.sampler.sample(self.planted.graph, torch.stack(seeds))
        return input_nodes, blocks, self.planted.labels[output_nodes]

    def _loader(self, nodes: torch.Tensor, shuffle: bool) -> DataLoader:
        # A plain loader over node ids: Lightning adds its DistributedSampler, DGL samples in collate_fn.
        return DataLoader(nodes, batch_size=self.hparams.batch_size, shuffle=shuffle, collate_fn=self._sample)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.planted.train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.planted.val, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.planted.test, shuffle=False)


class GraphSAGE(CommunityModule):
    """Two mean-aggregating SAGE layers over learnable node rows; cross entropy on the communities."""

    def __init__(
        self,
        num_nodes: int,
        num_classes: int = 10,
        dim: int = 32,
        hidden: int = 64,
        dropout: float = 0.2,
        lr: float = 0.01,
        sparse_lr: float = 0.05,
    ) -> None:
        super().__init__(num_classes)
        self.save_hyperparameters()
        self.features = ls.SparseEmbedding(num_nodes, dim, init=ls.init.normal(0.1), seed=0)
        self.layers = torch.nn.ModuleList([SAGEConv(dim, hidden, "mean"), SAGEConv(hidden, num_classes, "mean")])

    def forward(self, input_nodes: torch.Tensor, blocks: list) -> torch.Tensor:
        h = self.features(input_nodes)  # the sampled neighbourhood's rows, from their owner ranks
        for i, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if i < len(self.layers) - 1:
                h = F.dropout(F.relu(h), self.hparams.dropout, self.training)
        return h

    def training_step(self, batch, batch_idx):
        input_nodes, blocks, labels = batch
        loss = F.cross_entropy(self(input_nodes, blocks), labels)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(labels))
        return loss

    def communities(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        input_nodes, blocks, labels = batch
        return self(input_nodes, blocks).argmax(1), labels

    def configure_optimizers(self):
        return torch.optim.Adam(self.layers.parameters(), lr=self.hparams.lr)

    def configure_sparse_optimizers(self):
        return ls.SparseAdam([self.features], lr=self.hparams.sparse_lr)


if __name__ == "__main__":
    main(GraphSAGE, SampledCommunities)
