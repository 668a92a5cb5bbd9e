"""A small two-table recommender as a LightningModule, and its plain-torch single-process twin."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sparse as ls

USERS, ITEMS, DIM = 40, 25, 4


def dataset(size: int = 48, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    users = (torch.rand(size, generator=gen) ** 2 * USERS).long()  # skewed: duplicates
    items = (torch.rand(size, 2, generator=gen) * ITEMS).long()  # two items per sample
    target = torch.randn(size, generator=gen)
    return TensorDataset(users, items, target)


class TwoTower(pl.LightningModule):
    """users: looked up once per sample; items: looked up twice per forward (two calls)."""

    def __init__(
        self,
        sparse: str = "SparseAdagrad",
        sparse_kwargs: dict | None = None,
        dense_lr: float = 0.05,
        scheduler: bool = False,
        manual: bool = False,
        batch_size: int = 4,
        schemes: tuple[str, str] = ("mod", "range"),
        dense: str = "SGD",
    ) -> None:
        super().__init__()
        pl.seed_everything(123, verbose=False)  # same dense init on every rank and in the reference
        self.users = ls.SparseEmbedding(USERS, DIM, seed=1, sharding=schemes[0])
        self.items = ls.SparseEmbedding(ITEMS, DIM, seed=2, sharding=schemes[1])
        self.mlp = nn.Sequential(nn.Linear(3 * DIM, 8), nn.Tanh(), nn.Linear(8, 1))
        self.sparse, self.sparse_kwargs = sparse, sparse_kwargs or {"lr": 0.2}
        self.dense_lr, self.scheduler, self.batch_size, self.dense = dense_lr, scheduler, batch_size, dense
        self.automatic_optimization = not manual
        self.inject_inf_at: tuple[int, int] | None = None  # (rank, global step)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        u = self.users(users)
        # read global_step only when injecting: a compiled forward would be recompiled at every step (a guard on it)
        if self.inject_inf_at is not None and self.inject_inf_at == (self.global_rank, self.global_step) and u.requires_grad:
            u.register_hook(lambda g: g * float("inf"))  # an overflow in this rank's sparse gradient only
        first, second = self.items(items[:, 0]), self.items(items[:, 1])
        return self.mlp(torch.cat([u, first, second], dim=-1)).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        users, items, target = batch
        loss = nn.functional.mse_loss(self(users, items).float(), target)
        if self.automatic_optimization:
            self.log("train_loss", loss, batch_size=len(users), sync_dist=False)
            return loss
        dense, sparse = self.optimizers()
        self.manual_backward(loss)
        dense.step()
        sparse.step()
        dense.zero_grad()
        sparse.zero_grad()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        users, items, target = batch
        self.log("val_loss", nn.functional.mse_loss(self(users, items).float(), target), batch_size=len(users), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        users, items, index = batch
        return torch.stack([index.float(), self(users, items).float()], dim=1)

    def configure_optimizers(self):
        return getattr(torch.optim, self.dense)(self.mlp.parameters(), lr=self.dense_lr)

    def configure_sparse_optimizers(self):
        if self.sparse == "mixed":  # two optimizers: per-row Adam steps and row-wise Adagrad sums
            return [ls.SparseAdam([self.users], lr=0.05), ls.SparseRowWiseAdagrad([self.items], lr=0.2)]
        optimizer = getattr(ls, self.sparse)([self.users, self.items], **self.sparse_kwargs)
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(16, seed=1), batch_size=self.batch_size)


def lightning_env(rank: int, world_size: int, num_nodes: int = 1) -> None:
    """Tell Lightning the processes already exist (it then launches nothing and reuses the group).

    With ``num_nodes > 1`` the ranks pose as ``num_nodes`` machines of ``world_size // num_nodes`` devices.
    """
    per_node = world_size // num_nodes
    os.environ.update(
        {"LOCAL_RANK": str(rank % per_node), "NODE_RANK": str(rank // per_node), "WORLD_SIZE": str(world_size),
         "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599"}
    )  # fmt: skip


def trainer(world_size: int, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=world_size, strategy="sparse_ddp", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )  # fmt: skip
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


class FirstStep(pl.Callback):
    """The global step a fit starts from: 0, or the step of the checkpoint it resumed (a resume that restored nothing
    trains from scratch, and with the same seeds ends as the uninterrupted fit: its tables cannot tell the two apart)."""

    step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
        self.step = trainer.global_step


def state(module: TwoTower) -> dict[str, torch.Tensor]:
    """Everything trained, as full tensors (collective for the tables)."""
    out = {name: p.detach().clone() for name, p in module.mlp.named_parameters()}
    out["users"] = module.users.full_weight()
    out["items"] = module.items.full_weight()
    return out


# ---------------------------------------------------------------- the plain-torch reference
def global_batches(world_size: int, batch_size: int, epochs: int, seed: int = 123) -> list[list[torch.Tensor]]:
    """The global batches Lightning's shuffled DistributedSampler feeds to ``world_size`` ranks.

    Lightning seeds the sampler with PL_GLOBAL_SEED, which ``seed_everything(123)`` in the module sets.

    Step b of epoch e concatenates batch b of every rank, so that a mean loss over it equals the
    average over ranks of per-rank mean losses.
    """
    data = dataset()
    out = []
    for epoch in range(epochs):
        per_rank = []
        for rank in range(world_size):
            sampler = torch.utils.data.DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            per_rank.append(list(DataLoader(data, batch_size=batch_size, sampler=sampler)))
        for step in range(len(per_rank[0])):
            out.append([torch.cat([per_rank[r][step][k] for r in range(world_size)]) for k in range(3)])
    return out


def reference(
    batches: list[list[torch.Tensor]],
    sparse_cls: type[torch.optim.Optimizer],
    sparse_kwargs: dict,
    dense_lr: float = 0.05,
    accumulate: int = 1,
    clip_norm: float | None = None,
    scheduler: bool = False,
) -> dict[str, torch.Tensor]:
    """Single process: nn.Embedding(sparse=True) + torch optimizers, the same dense optimizer."""
    pl.seed_everything(123, verbose=False)
    twin = TwoTower()  # for the dense initialization only
    users, items = nn.Embedding(USERS, DIM, sparse=True), nn.Embedding(ITEMS, DIM, sparse=True)
    with torch.no_grad():
        users.weight.copy_(ls.init.normal()(torch.arange(USERS), DIM, 1))
        items.weight.copy_(ls.init.normal()(torch.arange(ITEMS), DIM, 2))
    mlp = twin.mlp
    dense = torch.optim.SGD(mlp.parameters(), lr=dense_lr)
    sparse = sparse_cls([users.weight, items.weight], **sparse_kwargs)
    sched = torch.optim.lr_scheduler.StepLR(sparse, step_size=2, gamma=0.5) if scheduler else None
    for index, (u, i, y) in enumerate(batches):
        pred = mlp(torch.cat([users(u), items(i[:, 0]), items(i[:, 1])], dim=-1)).squeeze(-1)
        (nn.functional.mse_loss(pred, y) / accumulate).backward()
        if (index + 1) % accumulate:
            continue
        if clip_norm is not None:
            nn.utils.clip_grad_norm_(mlp.parameters(), clip_norm)
        dense.step()
        sparse.step()
        dense.zero_grad()
        sparse.zero_grad()
        if sched is not None:
            sched.step()
    out = {name: p.detach().clone() for name, p in mlp.named_parameters()}
    out["users"], out["items"] = users.weight.detach().clone(), items.weight.detach().clone()
    return out


class CollectionTower(TwoTower):
    """TwoTower with its tables in one SparseEmbeddingCollection: three features, one round per forward."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        users, items = self._modules.pop("users"), self._modules.pop("items")
        self.embeddings = ls.SparseEmbeddingCollection(
            {"users": users, "items": items}, features={"user": "users", "first": "items", "second": "items"}
        )

    @property
    def users(self) -> ls.SparseEmbedding:
        return self.embeddings.tables["users"]

    @property
    def items(self) -> ls.SparseEmbedding:
        return self.embeddings.tables["items"]

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        out = self.embeddings({"user": users, "first": items[:, 0], "second": items[:, 1]})
        if self.inject_inf_at == (self.global_rank, self.global_step) and out["user"].requires_grad:
            out["user"].register_hook(lambda g: g * float("inf"))  # an overflow in this rank's sparse gradient only
        return self.mlp(torch.cat([out["user"], out["first"], out["second"]], dim=-1)).squeeze(-1)
