"""DLRM (Naumov et al., 2019) with its 26 sparse features in one SparseEmbeddingCollection.

bottom MLP(dense features) -> one vector; collection(26 features) -> 26 vectors (the multi-hot
ones pooled: mean, or a weighted sum); pairwise dot products of the 27 vectors; top MLP(bottom
vector, dot products) -> click logit. All 26 tables travel in one exchange round per forward
and one gradient round per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torchmetrics.classification import BinaryAUROC
from typing_extensions import override

import lightning_sparse as ls
from data import DENSE, MULTI_HOT, SPARSE, WEIGHTED, cardinalities


def mlp(sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(LightningModule):
    """DLRM on Criteo-shaped input: ``(dense [B, 13], features {C1..C26: ids or JaggedIds}, labels [B])``."""

    def __init__(
        self,
        embedding_dim: int = 16,
        bottom: list[int] = [64, 32],  # noqa: B006 - LightningCLI reads the default
        top: list[int] = [128, 64],  # noqa: B006
        max_rows: int = 200_000,
        sharding: str = "mod",
        sparse_lr: float = 0.01,
        dense_lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        tables = {
            name: ls.SparseEmbedding(rows, embedding_dim, seed=i, sharding=sharding)
            for i, (name, rows) in enumerate(zip(SPARSE, cardinalities(max_rows)))
        }
        pooling = {name: "sum" if name in WEIGHTED else "mean" for name in MULTI_HOT}
        self.embeddings = ls.SparseEmbeddingCollection(tables, pooling=pooling)
        self.bottom = mlp([DENSE, *bottom, embedding_dim])
        vectors = len(SPARSE) + 1
        self.top = mlp([embedding_dim + vectors * (vectors - 1) // 2, *top, 1], last_activation=False)
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pairs", rows * vectors + cols, persistent=False)
        self.val_auroc = BinaryAUROC()

    def forward(self, dense: torch.Tensor, features: dict) -> torch.Tensor:
        x = self.bottom(dense)
        embedded = self.embeddings(features)
        vectors = torch.stack([x, *(embedded[name] for name in SPARSE)], dim=1)  # [B, 27, dim]
        dots = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1).index_select(1, self.pairs)
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)

    def training_step(self, batch, batch_idx):
        dense, features, labels = batch
        loss = F.binary_cross_entropy_with_logits(self(dense, features), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        dense, features, labels = batch
        logits = self(dense, features)
        self.val_auroc(logits, labels.long())
        self.log("val_auroc", self.val_auroc, prog_bar=True)
        self.log("val_loss", F.binary_cross_entropy_with_logits(logits, labels), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam([*self.bottom.parameters(), *self.top.parameters()], lr=self.hparams.dense_lr)

    def configure_sparse_optimizers(self):
        return ls.SparseRowWiseAdagrad([self.embeddings], lr=self.hparams.sparse_lr)


class EpochSummary(Callback):
    """One line per epoch on rank 0: validation AUROC and loss."""

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        print(f"\nepoch {trainer.current_epoch}: val_auroc {float(metrics['val_auroc']):.4f}, "
              f"val_loss {float(metrics['val_loss']):.4f}", flush=True)  # fmt: skip
