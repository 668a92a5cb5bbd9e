"""The LightningModule of the Lightning exit shapes (programs.py), and a callback of theirs: a module of its own, so
that ``start_method="spawn"`` can pickle them."""

import lightning.pytorch as pl
import torch

import lightning_sparse as ls


class ExitModel(pl.LightningModule):
    """A table, a one-table collection and a dense head; logs with ``sync_dist``; may raise at one step."""

    def __init__(self, fail_at_batch: int | None = None) -> None:
        super().__init__()
        self.fail_at_batch = fail_at_batch
        self.users = ls.SparseEmbedding(1000, 8, seed=0)
        self.features = ls.SparseEmbeddingCollection({"item": ls.SparseEmbedding(500, 8, seed=1)})
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids):
        rows = self.users(ids) + self.features({"item": ids % 500})["item"]
        return self.head(rows).squeeze(-1)

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at_batch:
            raise ValueError("planted failure")
        loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.1)

    def configure_sparse_optimizers(self):
        return ls.SparseAdagrad([self.users, self.features], lr=0.1)


class SaveTrainedTables(pl.Callback):
    """At the end of the fit, rank 0 saves the full trained tables to ``path``: what the spawn launcher must hand back."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer: pl.Trainer, pl_module: ExitModel) -> None:
        tables = {"users": pl_module.users.full_weight(), "item": pl_module.features.tables["item"].full_weight()}  # collective
        if trainer.global_rank == 0:
            torch.save(tables, self.path)
