"""The recommender of ``recommender.py``, trained by a loop written with Lightning Fabric.

The same model (a LightningModule works as a plain ``nn.Module`` in Fabric), the same data, the
same tables and optimizers; the loop is yours: gradient accumulation under
``fabric.no_backward_sync``, dense gradient clipping, a checkpoint per epoch that resumes
exactly (and that ``Trainer(strategy="sparse_ddp")`` can load too)::

    python examples/fabric_recommender.py --devices 2 --epochs 3 --checkpoint /tmp/rec.ckpt
    python examples/fabric_recommender.py --devices 3 --epochs 4 --checkpoint /tmp/rec.ckpt --resume

A resumed run on another number of processes reshards the tables and their optimizer state.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler
from torchmetrics.classification import BinaryAUROC

import lightning_sparse as ls  # registers Fabric(strategy="sparse_ddp")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recommender import Recommender, SyntheticInteractions  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true", help="32-true or bf16-mixed")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=2, help="batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--num-users", type=int, default=1_000_000)
    parser.add_argument("--num-items", type=int, default=100_000)
    parser.add_argument("--train-interactions", type=int, default=150_000)
    parser.add_argument("--sparse-lr", type=float, default=0.01)
    parser.add_argument("--dense-lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="max norm of the dense gradients")
    parser.add_argument("--checkpoint", type=Path, help="written after every epoch")
    parser.add_argument("--resume", action="store_true", help="start from --checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy="sparse_ddp", precision=args.precision)
    fabric.launch()
    fabric.seed_everything(args.seed)

    data = SyntheticInteractions(args.num_users, args.num_items, train_interactions=args.train_interactions,
                                 batch_size=args.batch_size, seed=args.seed)  # fmt: skip
    data.setup("fit")
    model = Recommender(args.num_users, args.num_items, sparse_lr=args.sparse_lr, dense_lr=args.dense_lr)
    dense = torch.optim.Adam(model.mlp.parameters(), lr=args.dense_lr)
    sparse = ls.SparseRowWiseAdagrad([model.users, model.items], lr=args.sparse_lr)
    model, dense, sparse = fabric.setup(model, dense, sparse)

    # The shuffled sampler the Trainer would use; its epoch is set here, so that a resumed run
    # sees the batches an uninterrupted one would.
    sampler = DistributedSampler(data.train_data, fabric.world_size, fabric.global_rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(data.train_data, batch_size=args.batch_size, sampler=sampler)
    val_loader = fabric.setup_dataloaders(data.val_dataloader())
    auroc = BinaryAUROC().to(fabric.device)

    state = {"model": model, "dense": dense, "sparse": sparse, "epoch": 0}
    if args.resume:
        fabric.load(args.checkpoint, state)
        fabric.print(f"resumed from {args.checkpoint} at epoch {state['epoch']} on {fabric.world_size} processes")
    for epoch in range(state["epoch"], args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for index, batch in enumerate(train_loader):
            users, items, labels = fabric.to_device(batch)
            stepping = (index + 1) % args.accumulate == 0 or index + 1 == len(train_loader)
            with fabric.no_backward_sync(model, enabled=not stepping):
                loss = F.binary_cross_entropy_with_logits(model(users, items).float(), labels)
                fabric.backward(loss / args.accumulate)
            if stepping:
                fabric.clip_gradients(model, dense, max_norm=args.clip)  # dense parameters only
                dense.step()
                sparse.step()
                dense.zero_grad()
                sparse.zero_grad()
        model.eval()
        with torch.no_grad():
            for users, items, labels in val_loader:  # the same number of batches on every rank (padded)
                auroc.update(model(users, items).float(), labels.long())
        fabric.print(f"epoch {epoch}: val_auroc {float(auroc.compute()):.3f}, last train loss {loss.item():.3f}")
        auroc.reset()
        state["epoch"] = epoch + 1
        if args.checkpoint is not None:
            fabric.save(args.checkpoint, state)


if __name__ == "__main__":
    main()
