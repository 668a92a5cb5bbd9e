"""One CPU process: the host time of a Trainer step under ``sparse_ddp`` against Lightning's ``ddp`` (issue 43, item 4).

With a tiny model a step's time is the host's: Lightning's loop, the strategy's hooks, the closure,
the optimizers' Python. Four fits of ``steps`` steps each, interleaved over ``rounds`` rounds:

* ``plain/ddp`` and ``plain/sparse_ddp``: the same plain model (a dense ``nn.Embedding`` and a linear
  layer, SGD) under each strategy: what the strategy itself costs per step, with no table;
* ``table/ddp``: ``nn.Embedding(sparse=True)`` with torch's SGD, under ``ddp``;
* ``table/sparse_ddp``: a ``SparseEmbedding`` with ``SparseSGD``, under ``sparse_ddp``: the lookup and
  the sparse step too.

Each fit's figure is its median step (from ``on_train_batch_start`` to ``on_train_batch_end``, after
``warmup`` steps); a ratio is the median over rounds of each round's ratio, and its spread (lowest,
highest) says how noisy the machine was. With ``--profile``, a cProfile of ``table/sparse_ddp``'s
steps prints the functions of lightning_sparse by their own time (to stderr).

Run: ``python benchmarks/trainer_host.py [--rounds 5] [--steps 200] [--profile]``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sparse  # noqa: F401 - registers strategy="sparse_ddp"

ROWS, DIM, BATCH = 1000, 8, 32
FITS = ("plain/ddp", "plain/sparse_ddp", "table/ddp", "table/sparse_ddp")


class Tiny(LightningModule):
    """An embedding (``"plain"``: dense; ``"torch"``: torch's sparse; ``"ours"``: a SparseEmbedding) and a linear layer."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import lightning_sparse as ls

        torch.manual_seed(0)
        self.kind = kind
        self.table = ls.SparseEmbedding(ROWS, DIM, seed=1) if kind == "ours" else nn.Embedding(ROWS, DIM, sparse=kind == "torch")
        self.head = nn.Linear(DIM, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, target = batch
        loss = (self.head(self.table(ids)).squeeze(-1) - target).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters() if self.kind == "ours" else self.parameters(), lr=0.1)

    def configure_sparse_optimizers(self):
        import lightning_sparse as ls

        return ls.SparseSGD([self.table], lr=0.1) if self.kind == "ours" else None


class StepTimes(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.begin = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self.begin)


def fit(name: str, steps: int, warmup: int, profile: cProfile.Profile | None = None) -> float:
    """The median step of one fit (ms)."""
    model, strategy = name.split("/")
    kind = {"plain": "plain", "table": "ours" if strategy == "sparse_ddp" else "torch"}[model]
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset((ROWS * torch.rand((steps + warmup) * BATCH, generator=gen) ** 2).long(),
                         torch.randn((steps + warmup) * BATCH, generator=gen))  # fmt: skip
    times = StepTimes()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[times], log_every_n_steps=50)  # fmt: skip
    if profile is not None:
        profile.enable()
    trainer.fit(Tiny(kind), DataLoader(data, batch_size=BATCH))
    if profile is not None:
        profile.disable()
    return 1e3 * statistics.median(times.times[warmup:])


def run(rounds: int = 5, steps: int = 200, warmup: int = 20) -> dict[str, Any]:
    per_round = [{name: fit(name, steps, warmup) for name in (FITS if r % 2 == 0 else FITS[::-1])} for r in range(rounds)]

    def ratio(a: str, b: str) -> dict[str, float]:
        values = sorted(r[a] / r[b] for r in per_round)
        return {"median": statistics.median(values), "lowest": values[0], "highest": values[-1]}

    return {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": rounds, "steps": steps,
        "step_ms": {name: statistics.median(r[name] for r in per_round) for name in FITS},
        "ratios": {"plain: sparse_ddp / ddp": ratio("plain/sparse_ddp", "plain/ddp"),
                   "table: sparse_ddp / ddp": ratio("table/sparse_ddp", "table/ddp")},
    }  # fmt: skip


def profiled(steps: int) -> str:
    """The functions of lightning_sparse by their own time over a ``table/sparse_ddp`` fit."""
    profile = cProfile.Profile()
    fit("table/sparse_ddp", steps, 0, profile)
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).sort_stats("tottime")
    stats.print_stats(os.sep + "lightning_sparse" + os.sep, 25)
    return out.getvalue()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_PORT", "29517")
    print(json.dumps(run(args.rounds, args.steps), indent=1))
    if args.profile:
        print(profiled(args.steps), file=sys.stderr)
