"""A recommender with a 1M-user x 100k-item embedding model, trained with strategy="sparse_ddp".

Synthetic implicit feedback: users and items are drawn from Zipf distributions (a few are very
popular, most are rare); every user and item has one of ``tastes`` hidden tastes. Each
interaction (label 1) goes to an item of the user's taste and is paired with an equally popular
item of another taste (label 0), so popularity tells nothing: the model must learn the tastes of
users and items from their ids alone, and validation AUROC rises from 0.5 as the embeddings learn. Run through LightningCLI::

    python examples/recommender.py fit --config examples/recommender.yaml
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from cli_main import run_cli
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAUROC
from typing_extensions import override

import lightning_sparse as ls  # registers strategy="sparse_ddp"


def zipf_ranks(num: int, count: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """``count`` popularity ranks in [0, num) drawn from a Zipf law (rank 0 is the most popular)."""
    cdf = torch.cumsum(torch.arange(1, num + 1, dtype=torch.float64).pow(-exponent), 0)
    ranks = torch.searchsorted(cdf, torch.rand(count, generator=generator, dtype=torch.float64) * cdf[-1])
    return ranks.clamp(max=num - 1)


class SyntheticInteractions(LightningDataModule):
    """Zipf-distributed (user, item, label) triples with hidden tastes; the same on every rank (seeded)."""

    def __init__(
        self,
        num_users: int = 1_000_000,
        num_items: int = 100_000,
        tastes: int = 8,
        train_interactions: int = 400_000,
        val_interactions: int = 40_000,
        exponent: float = 1.1,
        batch_size: int = 2048,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _make(self, count: int, generator: torch.Generator) -> TensorDataset:
        h = self.hparams
        # Popular ids are spread over the id space by fixed permutations (the same for train and val).
        users = self.user_order[zipf_ranks(h.num_users, count, h.exponent, generator)]
        taste = users % h.tastes
        other_taste = (taste + torch.randint(1, h.tastes, (count,), generator=generator)) % h.tastes
        positives = self._item_of_taste(taste, generator)
        negatives = self._item_of_taste(other_taste, generator)  # as popular as positives: only taste tells
        return TensorDataset(
            torch.cat([users, users]),
            torch.cat([positives, negatives]),
            torch.cat([torch.ones(count), torch.zeros(count)]),
        )

    def _item_of_taste(self, taste: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Zipf-popular items whose hidden taste is ``taste``: the ids i with i % tastes == taste."""
        h = self.hparams
        ranks = zipf_ranks(h.num_items // h.tastes, len(taste), h.exponent, generator)
        return self.item_order[ranks] * h.tastes + taste

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.hparams.seed)
        self.user_order = torch.randperm(self.hparams.num_users, generator=generator)
        self.item_order = torch.randperm(self.hparams.num_items // self.hparams.tastes, generator=generator)
        self.train_data = self._make(self.hparams.train_interactions, generator)
        self.val_data = self._make(self.hparams.val_interactions, generator)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_data, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_data, batch_size=4 * self.hparams.batch_size)


class Recommender(LightningModule):
    """User and item tables (SparseEmbedding) feeding a small dense MLP."""

    def __init__(
        self,
        num_users: int = 1_000_000,
        num_items: int = 100_000,
        embedding_dim: int = 32,
        hidden: int = 64,
        sparse_lr: float = 0.05,
        dense_lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.users = ls.SparseEmbedding(num_users, embedding_dim, seed=1)
        self.items = ls.SparseEmbedding(num_items, embedding_dim, seed=2)
        self.mlp = nn.Sequential(nn.Linear(3 * embedding_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.val_auroc = BinaryAUROC()

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        u, i = self.users(users), self.items(items)
        return self.mlp(torch.cat([u, i, u * i], dim=-1)).squeeze(-1)

    def training_step(self, batch, batch_idx):
        users, items, labels = batch
        loss = F.binary_cross_entropy_with_logits(self(users, items), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        users, items, labels = batch
        self.val_auroc(self(users, items), labels.long())
        self.log("val_auroc", self.val_auroc, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.mlp.parameters(), lr=self.hparams.dense_lr)

    def configure_sparse_optimizers(self):
        return ls.SparseRowWiseAdagrad([self.users, self.items], lr=self.hparams.sparse_lr)


class EpochSummary(Callback):
    """One line per epoch on rank 0: validation AUROC and what the sparse path moved."""

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        if trainer.is_global_zero:
            print(
                f"\nepoch {trainer.current_epoch}: val_auroc {float(metrics['val_auroc']):.3f}, "
                f"train_loss {float(metrics.get('train_loss', float('nan'))):.3f}",
                flush=True,
            )


def main() -> None:
    run_cli(Recommender, SyntheticInteractions, threads=1)


if __name__ == "__main__":
    main()
