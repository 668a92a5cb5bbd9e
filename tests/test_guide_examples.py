"""The README's examples run."""

from __future__ import annotations

import re
from pathlib import Path

import lightning_models as lm
import torch
from torch.utils.data import DataLoader, TensorDataset

README = Path(__file__).resolve().parents[1] / "README.md"


def _lightning_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "configure_sparse_optimizers" in b]
    return block


def _run_readme_module() -> tuple[float, int]:
    lm.lightning_env(torch.distributed.get_rank(), 2)
    namespace: dict = {}
    exec(
        _lightning_example().replace(
            "devices=2, max_epochs=1,",
            "devices=2, max_epochs=3, logger=False, enable_progress_bar=False, enable_checkpointing=False,",
        ),
        namespace,
    )
    gen = torch.Generator().manual_seed(0)
    users, items = torch.randint(0, 1000, (256,), generator=gen), torch.randint(0, 500, (256,), generator=gen)
    clicked = ((users + items) % 2).float()
    model, trainer = namespace["Recommender"](), namespace["trainer"]
    initial = namespace["ls"].SparseEmbedding(1000, 16).full_weight()  # the same seed: the same table
    trainer.fit(model, DataLoader(TensorDataset(users, items, clicked), batch_size=32))
    moved = (model.users.full_weight() != initial).any(dim=1)
    return float(trainer.callback_metrics["train_loss"]), int(moved.sum()), int(torch.unique(users).numel())


def test_readme_lightning_example_trains(rank_pools):
    import math

    for loss, moved_rows, looked_up_rows in rank_pools(2).run(_run_readme_module):
        assert math.isfinite(loss)
        assert moved_rows == looked_up_rows  # exactly the rows the data touched were trained


def _collection_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "SparseEmbeddingCollection(" in b]
    return block


def _run_collection_example() -> dict:
    namespace: dict = {}
    exec(_collection_example(), namespace)
    out = namespace["out"]
    sum(v.sum() for v in out.values()).backward()
    namespace["optimizer"].step()
    return {k: tuple(v.shape) for k, v in out.items()}


def test_readme_collection_example_runs_on_every_rank(rank_pools):
    for shapes in rank_pools(2).run(_run_collection_example):
        assert shapes == {"user": (2, 16), "candidate": (2, 2, 16), "history": (2, 16)}
