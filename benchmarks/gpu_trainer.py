"""One GPU: ``Trainer.fit`` throughput, a captured step against the eager step and Lightning's ``ddp`` with torch's tables.

Two workloads (issue 43), each fit three ways in one run, on the same batches:

* ``dlrm``: 26 tables of 200k x 64 (one id per table and sample, skewed ids), batch 16,384, with
  examples/dlrm's MLPs (bottom 13 -> 64 -> 32 -> 64, pairwise dots, top -> 128 -> 64 -> 1) and its
  dense Adam; ours in one ``SparseEmbeddingCollection``;
* ``one_table``: a one-table recommender: users and items in one table of 1.1M x 32 (items after the
  1M users), looked up as ``[batch, 2]`` ids, with examples/recommender.py's MLP on ``[u, i, u * i]``,
  batch 16,384. (The run of 2026-11-27, ``recommender`` in benchmarks/results/gpu_trainer.json, was
  examples/recommender.py's two-table model instead: two tables stepping one after the other.)

and the ways:

* ``ours captured``: ``strategy="sparse_ddp_captured"``, ``SparseAdagrad(capturable=True)``,
  ``Adam(capturable=True)``;
* ``ours eager``: ``strategy="sparse_ddp"``, ``SparseAdagrad``, ``Adam``;
* ``torch ddp``: Lightning's ``strategy="ddp"``, ``nn.Embedding(sparse=True)`` tables with
  ``torch.optim.Adagrad`` and the MLP's ``Adam`` (manual optimization: two optimizers); if that fit
  fails, ``torch single-device`` (``strategy="auto"``) is run and taken as the baseline, and the error kept.

Each fit runs ``warmup`` steps, then ``steps`` steps timed from the first's start to the last's end
(the GPU synchronized at both): samples per second. The ratios are over the baseline's, and
captured over eager. Batches are made on the device beforehand (8, cycled): the loader moves nothing.

Run on a GPU: ``python benchmarks/gpu_trainer.py [--out trainer.json] [--steps 40]``; prints the JSON.
``run(..., device="cpu", graphs=...)`` runs it at tiny sizes on a CPU (tests/test_benchmarks.py), with
a test double of the graph maker and SGD for the dense part: there the numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning
import torch
import torch.nn.functional as F
from gpu import _release
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "dlrm"))
from model import mlp  # noqa: E402 - examples/dlrm's MLPs

WORKLOADS = {
    "dlrm": dict(tables=26, rows=200_000, dim=64, batch=16_384),
    "one_table": dict(users=1_000_000, items=100_000, dim=32, batch=16_384),
}
WAYS = ("ours captured", "ours eager", "torch ddp")
DENSE = 13  # examples/dlrm's dense features
SPARSE_LR, DENSE_LR = 0.01, 1e-3


class Bench(LightningModule):
    """The workload's model with our tables (``kind="ours"``) or torch's sparse ``nn.Embedding``s (``"torch"``)."""

    def __init__(self, workload: str, kind: str, capturable: bool, sizes: dict[str, int]) -> None:
        super().__init__()
        self.workload, self.kind, self.capturable = workload, kind, capturable
        dim = sizes["dim"]
        if workload == "dlrm":
            rows = {f"C{i + 1}": sizes["rows"] for i in range(sizes["tables"])}
        else:  # one table: users, then items
            rows = {"pair": sizes["users"] + sizes["items"]}
        if kind == "ours":
            import lightning_sparse as ls

            made = {name: ls.SparseEmbedding(n, dim, seed=i) for i, (name, n) in enumerate(rows.items())}
            self.tables = ls.SparseEmbeddingCollection(made) if workload == "dlrm" else made["pair"]
        else:
            made = {name: nn.Embedding(n, dim, sparse=True) for name, n in rows.items()}
            self.tables = nn.ModuleDict(made) if workload == "dlrm" else made["pair"]
            self.automatic_optimization = False  # two optimizers: the tables' Adagrad and the MLP's Adam
        if workload == "dlrm":
            self.bottom, vectors = mlp([DENSE, 64, 32, dim]), len(rows) + 1
            self.top = mlp([dim + vectors * (vectors - 1) // 2, 128, 64, 1], last_activation=False)
            pair_rows, pair_cols = torch.triu_indices(vectors, vectors, offset=1)
            self.register_buffer("pairs", pair_rows * vectors + pair_cols, persistent=False)
        else:  # examples/recommender.py's MLP (hidden 64)
            self.top = nn.Sequential(nn.Linear(3 * dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def dense_parameters(self) -> list[nn.Parameter]:
        return [*getattr(self, "bottom", nn.Identity()).parameters(), *self.top.parameters()]

    def forward(self, dense: torch.Tensor, ids: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.workload == "one_table":  # ids [batch, 2]: (user, item) rows of the one table
            u, i = self.tables(ids["pair"]).unbind(1)
            return self.top(torch.cat([u, i, u * i], dim=-1)).squeeze(-1)
        if self.kind == "ours":
            embedded = self.tables(ids)
        else:
            embedded = {name: self.tables[name](value) for name, value in ids.items()}
        x = self.bottom(dense)
        vectors = torch.stack([x, *embedded.values()], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1).index_select(1, self.pairs)
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        dense, ids, labels = batch
        loss = F.binary_cross_entropy_with_logits(self(dense, ids), labels)
        self.log("train_loss", loss, prog_bar=True)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def configure_optimizers(self):
        if self.device.type == "cuda":
            dense = torch.optim.Adam(self.dense_parameters(), lr=DENSE_LR, capturable=self.capturable)
        else:  # torch's capturable Adam takes GPU tensors only: SGD (capturable without the flag) for the CPU's smoke run
            dense = torch.optim.SGD(self.dense_parameters(), lr=DENSE_LR)
        if self.kind == "ours":
            return dense
        return [dense, torch.optim.Adagrad(self.tables.parameters(), lr=SPARSE_LR)]

    def configure_sparse_optimizers(self):
        import lightning_sparse as ls

        return ls.SparseAdagrad([self.tables], lr=SPARSE_LR, capturable=self.capturable) if self.kind == "ours" else None


class FixedBatches(Dataset):
    """``length`` batches cycling over ``distinct`` ones made once on ``device`` (skewed ids, random labels)."""

    def __init__(self, workload: str, sizes: dict[str, int], length: int, device: torch.device, distinct: int = 8) -> None:
        gen = torch.Generator().manual_seed(0)
        batch = sizes["batch"]
        skewed = lambda rows: (rows * torch.rand(batch, generator=gen) ** 4).long()  # noqa: E731

        def ids() -> dict[str, torch.Tensor]:
            if workload == "one_table":  # (user, item) rows: items after the users
                return {"pair": torch.stack([skewed(sizes["users"]), sizes["users"] + skewed(sizes["items"])], dim=1)}
            return {f"C{i + 1}": skewed(sizes["rows"]) for i in range(sizes["tables"])}

        self.batches = [(torch.randn(batch, DENSE, generator=gen).to(device), {n: i.to(device) for n, i in ids().items()},
                         torch.randint(0, 2, (batch,), generator=gen).float().to(device)) for _ in range(distinct)]  # fmt: skip
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.batches[index % len(self.batches)]


class Throughput(Callback):
    """Samples per second over the steps after ``warmup`` (the device synchronized at both ends)."""

    def __init__(self, warmup: int, batch: int) -> None:
        self.warmup, self.batch, self.start, self.end, self.steps = warmup, batch, 0.0, 0.0, 0

    def _sync(self, module: LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup:
            self._sync(pl_module)
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            self._sync(pl_module)
            self.end, self.steps = time.perf_counter(), batch_idx + 1 - self.warmup

    @property
    def samples_per_s(self) -> float:
        return self.steps * self.batch / (self.end - self.start)


def fit(workload: str, way: str, sizes: dict[str, int], steps: int, warmup: int, device: torch.device,
        graphs: Any = None) -> dict[str, Any]:  # fmt: skip
    """One ``Trainer.fit`` of ``warmup + steps`` steps: its samples per second (and how a captured fit ran)."""
    import lightning_sparse as ls

    torch.manual_seed(0)
    kind = "ours" if way.startswith("ours") else "torch"
    module = Bench(workload, kind, way == "ours captured", sizes)
    strategy: Any = {"ours eager": "sparse_ddp", "torch ddp": "ddp", "torch single-device": "auto"}.get(way)
    if way == "ours captured":
        strategy = ls.CapturedSparseDDPStrategy(graphs=graphs) if graphs is not None else "sparse_ddp_captured"
    meter = Throughput(warmup, sizes["batch"])
    trainer = Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, strategy=strategy, max_epochs=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0, callbacks=[meter])  # fmt: skip
    try:
        trainer.fit(module, DataLoader(FixedBatches(workload, sizes, warmup + steps, device), batch_size=None))
    finally:  # Lightning leaves its process group behind; the next fit (or the caller) starts without one
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    result: dict[str, Any] = {"samples_per_s": meter.samples_per_s, "step_ms": 1e3 * sizes["batch"] / meter.samples_per_s}
    if way == "ours captured":
        result["captures"] = dict(trainer.strategy.captures)
    del trainer, module
    _release(device)
    return result


def run(workloads: dict[str, dict[str, int]] = WORKLOADS, steps: int = 40, warmup: int = 8, device: str = "cuda",
        graphs: Any = None, out: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Every workload fit every way; ``out``: written after each fit too (a run stopped by its time limit keeps those)."""
    device = torch.device(device)
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
                           "lightning": lightning.__version__, "steps": steps, "warmup": warmup, "workloads": {}}  # fmt: skip
    for workload, sizes in workloads.items():
        found: dict[str, Any] = {"sizes": sizes, "fits": {}, "errors": {}}
        for way in WAYS:
            try:
                found["fits"][way] = fit(workload, way, sizes, steps, warmup, device, graphs)
            except Exception as err:  # noqa: BLE001 - a fit that fails is reported, and the others still run
                found["errors"][way] = f"{type(err).__name__}: {str(err)[:400]}"
                _release(device)
                if way == "torch ddp":
                    found["fits"]["torch single-device"] = fit(workload, "torch single-device", sizes, steps, warmup, device)
            doc["workloads"][workload] = found
            if out is not None:
                out.write_text(json.dumps(doc, indent=1))
        rate = {way: fit_["samples_per_s"] for way, fit_ in found["fits"].items()}
        baseline = "torch ddp" if "torch ddp" in rate else "torch single-device"
        found["baseline"] = baseline
        found["ratios"] = {
            f"{way} / {baseline}": rate[way] / rate[baseline] for way in ("ours captured", "ours eager") if way in rate
        }
        if "ours captured" in rate and "ours eager" in rate:
            found["ratios"]["ours captured / ours eager"] = rate["ours captured"] / rate["ours eager"]
        doc["workloads"][workload] = found
    if out is not None:
        out.write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: list[str] | None = None) -> int:
    """Run, print (and write) the results; 1 if a fit of ours failed (the baseline's fall-back is no failure)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results JSON here too")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--only", choices=list(WORKLOADS), help="one workload")
    args = parser.parse_args(argv)
    workloads = {args.only: WORKLOADS[args.only]} if args.only else WORKLOADS
    doc = run(workloads, args.steps, args.warmup, out=Path(args.out) if args.out else None)
    print(json.dumps(doc, indent=1))
    failed = [f"{name}: {way}" for name, found in doc["workloads"].items() for way in found["errors"] if way != "torch ddp"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
