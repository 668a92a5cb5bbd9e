"""DeepWalk node embeddings: DGL random walks and skip-gram with negative sampling, tables in lightning-sparse.

Each batch is a set of start nodes; ``dgl.sampling.random_walk`` walks from them, and every pair of
nodes at most ``window`` steps apart on a walk is a positive (centre, context) pair. Centres are rows of
one ``SparseEmbedding``, contexts and uniformly drawn negatives rows of another (word2vec's two tables),
both sharded over the ranks. Quality: the planted communities recovered from 10% labelled nodes by the
nearest community centroid (cosine) of the learned rows, on nodes never labelled.

    cd examples/dgl && python deepwalk.py fit --config deepwalk.yaml
"""

from __future__ import annotations

import dgl
import torch
import torch.nn.functional as F
from cli import main
from graphs import CommunityModule, PlantedGraphData
from torch.utils.data import DataLoader

import lightning_sparse as ls


class RandomWalks(PlantedGraphData):
    """Training batches: (centres, contexts) pairs from walks; evaluation batches: (nodes, communities)."""

    def __init__(
        self,
        num_nodes: int = 20000,
        communities: int = 10,
        degree_in: int = 5,
        degree_out: int = 5,
        labeled: float = 0.1,
        walks_per_node: int = 2,
        walk_length: int = 20,
        window: int = 5,
        batch_size: int = 128,
        eval_batch_size: int = 4096,
        seed: int = 0,
    ) -> None:
        super().__init__(num_nodes, communities, degree_in, degree_out, labeled, seed)
        self.save_hyperparameters()

    def _pairs(self, starts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        walks, _ = dgl.sampling.random_walk(self.planted.graph, torch.stack(starts), length=self.hparams.walk_length)
        centres, contexts = [], []
        for offset in range(1, self.hparams.window + 1):  # both directions: (a, b) and (b, a)
            a, b = walks[:, :-offset].flatten(), walks[:, offset:].flatten()
            centres += [a, b]
            contexts += [b, a]
        centres, contexts = torch.cat(centres), torch.cat(contexts)
        keep = (centres >= 0) & (contexts >= 0)  # -1 marks a walk that ended early (no edge out)
        return centres[keep], contexts[keep]

    def train_dataloader(self) -> DataLoader:
        starts = torch.arange(self.num_nodes).repeat(self.hparams.walks_per_node)
        return DataLoader(starts, batch_size=self.hparams.batch_size, shuffle=True, collate_fn=self._pairs)

    def _eval_loader(self, nodes: torch.Tensor) -> DataLoader:
        pairs = torch.stack([nodes, self.planted.labels[nodes]], dim=1)
        return DataLoader(pairs, batch_size=self.hparams.eval_batch_size)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.planted.val)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.planted.test)


class DeepWalk(CommunityModule):
    """Skip-gram with ``negatives`` uniform negatives per pair over two sharded tables."""

    def __init__(self, num_nodes: int, num_classes: int = 10, dim: int = 64, negatives: int = 5, lr: float = 0.01) -> None:
        super().__init__(num_classes)
        self.save_hyperparameters()
        self.nodes = ls.SparseEmbedding(num_nodes, dim, init=ls.init.uniform(-0.5 / dim, 0.5 / dim), seed=0)
        self.contexts = ls.SparseEmbedding(num_nodes, dim, init=ls.init.zeros())
        self.centroids: torch.Tensor | None = None  # [communities, dim], set before each evaluation

    def training_step(self, batch, batch_idx):
        centres, contexts = batch
        generator = torch.Generator().manual_seed(int(self.global_step) * 7919 + self.global_rank)
        negatives = torch.randint(0, self.hparams.num_nodes, (len(centres), self.hparams.negatives), generator=generator)
        u = self.nodes(centres)  # [P, d]
        v = self.contexts(torch.cat([contexts.unsqueeze(1), negatives.to(contexts.device)], dim=1))  # [P, 1 + k, d]
        logits = torch.einsum("pd,pkd->pk", u, v)
        loss = -(F.logsigmoid(logits[:, 0]) + F.logsigmoid(-logits[:, 1:]).sum(1)).mean()
        self.log("train_loss", loss, prog_bar=True, batch_size=len(centres))
        return loss

    def on_validation_epoch_start(self) -> None:
        self.centroids = self._centroids()

    def on_test_epoch_start(self) -> None:
        self.centroids = self._centroids()

    def _centroids(self) -> torch.Tensor:
        """Mean unit row of each community over the labelled nodes: every rank looks them all up."""
        planted = self.trainer.datamodule.planted
        rows = F.normalize(self.nodes(planted.train.to(self.device)), dim=1)
        labels = planted.labels[planted.train].to(self.device)
        sums = torch.zeros(self.hparams.num_classes, rows.shape[1], device=self.device).index_add_(0, labels, rows)
        return F.normalize(sums, dim=1)

    def communities(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        nodes, labels = batch.unbind(1)
        return (F.normalize(self.nodes(nodes), dim=1) @ self.centroids.T).argmax(1), labels

    def configure_optimizers(self):
        return None  # tables only

    def configure_sparse_optimizers(self):
        return ls.SparseAdam([self.nodes, self.contexts], lr=self.hparams.lr)


if __name__ == "__main__":
    main(DeepWalk, RandomWalks)
