"""One process: every sparse optimizer against torch's and FBGEMM's, and against two memory floors.

The workload (the same ids for every method): a ``rows x dim`` float32 table, ``batch`` ids per
step drawn as ``(rows * rand() ** 4).long()`` (skewed: about three quarters distinct at 65,536
of 1M), a loss ``mean((out @ proj - target)^2)`` on the looked-up rows.

What is timed, per method, in interleaved rounds (each round runs every method a few steps;
the figure is the median over all steps of all rounds):

* ``step``: forward + backward + optimizer step (+ ``zero_grad``);
* ``update``: the optimizer step alone (after an untimed forward and backward);
* ``lookup``: forward + backward with no step.

Methods: lightning_sparse's ``SparseSGD``, ``SparseAdagrad``, ``SparseRowWiseAdagrad``,
``SparseAdam`` (row and global bias correction); torch's ``nn.Embedding(sparse=True)`` with
``SGD``, ``Adagrad`` and ``SparseAdam``; FBGEMM's CPU TBE (``SplitTableBatchedEmbeddingBagsCodegen``,
one id per bag, the optimizer fused into backward) with ``EXACT_SGD``, ``EXACT_ADAGRAD`` and
``EXACT_ROWWISE_ADAGRAD`` when ``fbgemm_gpu`` imports. Floors, per optimizer, on the same rows:

* ``copy``: a sequential copy of the bytes the update must move (the touched rows of the table
  and of its state, read and written once);
* ``gather_scatter``: ``index_select`` + ``index_copy_`` of the touched rows of the table and of each
  state tensor, written as the update writes them (``kernels.rows.copy_rows``): what the update does
  minus its arithmetic.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_sparse.kernels.rows import copy_rows

OURS = {
    "sgd": ("SparseSGD", dict(lr=0.1)),
    "adagrad": ("SparseAdagrad", dict(lr=0.1)),
    "rowwise_adagrad": ("SparseRowWiseAdagrad", dict(lr=0.1)),
    "adam_row": ("SparseAdam", dict(lr=1e-3)),
    "adam_global": ("SparseAdam", dict(lr=1e-3, bias_correction="global")),
}
TORCH = {
    "sgd": lambda w: torch.optim.SGD([w], lr=0.1),
    "adagrad": lambda w: torch.optim.Adagrad([w], lr=0.1),
    "adam_global": lambda w: torch.optim.SparseAdam([w], lr=1e-3),
}
FBGEMM = {"sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD"}
# Per-row state the update reads and writes, in bytes per row beside the row itself (float32).
STATE_BYTES = {"sgd": lambda d: 0, "adagrad": lambda d: 4 * d, "rowwise_adagrad": lambda d: 4,
               "adam_row": lambda d: 8 * d + 8, "adam_global": lambda d: 8 * d}  # fmt: skip


@dataclass
class Method:
    name: str  # e.g. "ours/adam_row", "torch/adagrad", "fbgemm/sgd", "floor/gather_scatter/adam_row"
    family: str  # optimizer family it compares in
    kind: str  # "step", "update" or "lookup"
    run: Callable[[int], float]  # run(batch index) -> seconds timed
    samples: list[float] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)  # each round's median step, to set against other methods' same round


def make_ids(rows: int, batch: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(rows * torch.rand(batch, generator=gen) ** 4).long().clamp_(max=rows - 1) for _ in range(count)]


def loss_fn(out: torch.Tensor, target: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    return ((out @ proj) - target).pow(2).mean()


def _no_sync() -> None:
    pass


_SYNC: Callable[[], None] = _no_sync  # torch.cuda.synchronize when timing on a GPU


def _timed(fn: Callable[[], object]) -> float:
    _SYNC()
    start = time.perf_counter()
    fn()
    _SYNC()
    return time.perf_counter() - start


def build_methods(rows: int, dim: int, batches: list[torch.Tensor], with_fbgemm: bool, device: str = "cpu") -> list[Method]:
    import lightning_sparse as ls

    gen = torch.Generator().manual_seed(1)
    proj = torch.randn(dim, generator=gen).to(device)
    targets = [torch.randn(len(b), generator=gen).to(device) for b in batches]
    methods: list[Method] = []

    for family, (cls, kwargs) in OURS.items():
        emb = ls.SparseEmbedding(rows, dim, seed=0, device=device)
        opt = getattr(ls, cls)([emb], **kwargs)

        def step(i, emb=emb, opt=opt):
            def go():
                loss_fn(emb(batches[i]), targets[i], proj).backward()
                opt.step()
                opt.zero_grad()

            return _timed(go)

        def update(i, emb=emb, opt=opt):
            loss_fn(emb(batches[i]), targets[i], proj).backward()
            seconds = _timed(opt.step)
            opt.zero_grad()
            return seconds

        methods += [Method(f"ours/{family}", family, "step", step), Method(f"ours/{family}", family, "update", update)]
        if family == "sgd":

            def lookup(i, emb=emb):
                seconds = _timed(lambda: loss_fn(emb(batches[i]), targets[i], proj).backward())
                emb.zero_grad()
                return seconds

            methods.append(Method("ours/lookup", "lookup", "lookup", lookup))

    for family, make in TORCH.items():
        emb = nn.Embedding(rows, dim, sparse=True, device=device)
        nn.init.normal_(emb.weight, std=dim**-0.5)
        opt = make(emb.weight)

        def step(i, emb=emb, opt=opt):
            def go():
                loss_fn(emb(batches[i]), targets[i], proj).backward()
                opt.step()
                opt.zero_grad()

            return _timed(go)

        def update(i, emb=emb, opt=opt):
            loss_fn(emb(batches[i]), targets[i], proj).backward()
            seconds = _timed(opt.step)
            opt.zero_grad()
            return seconds

        methods += [Method(f"torch/{family}", family, "step", step), Method(f"torch/{family}", family, "update", update)]
        if family == "sgd":

            def lookup(i, emb=emb):
                seconds = _timed(lambda: loss_fn(emb(batches[i]), targets[i], proj).backward())
                emb.weight.grad = None
                return seconds

            methods.append(Method("torch/lookup", "lookup", "lookup", lookup))

    if with_fbgemm:
        methods += _fbgemm_methods(rows, dim, batches, targets, proj)

    # Floors on the touched rows of each family's table and state.
    distinct = [torch.unique(b) for b in batches]
    table = torch.randn(rows, dim, device=device)
    for family, state_bytes in STATE_BYTES.items():
        extra = state_bytes(dim)
        state = [torch.zeros(rows, dim, device=device) for _ in range(extra // (4 * dim))]
        if extra % (4 * dim) == 4:
            state.append(torch.zeros(rows, device=device))
        elif extra % (4 * dim) == 8:
            state.append(torch.zeros(rows, dtype=torch.int64, device=device))
        tensors = [table, *state]

        def gather_scatter(i, tensors=tensors):
            u = distinct[i]
            return _timed(lambda: [copy_rows(t, u, t.index_select(0, u)) for t in tensors])

        row_bytes = 4 * dim + extra
        source = torch.empty(max(len(u) for u in distinct) * row_bytes // 4, device=device)
        target = torch.empty_like(source)

        def copy(i, row_bytes=row_bytes, source=source, target=target):
            n = len(distinct[i]) * row_bytes // 4
            return _timed(lambda: target[:n].copy_(source[:n]))

        methods += [Method(f"floor/gather_scatter/{family}", family, "floor_gather_scatter", gather_scatter),
                    Method(f"floor/copy/{family}", family, "floor_copy", copy)]  # fmt: skip
    return methods


def _fbgemm_methods(rows, dim, batches, targets, proj) -> list[Method]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    methods = []
    offsets = [torch.arange(len(b) + 1) for b in batches]
    for family, optimizer in FBGEMM.items():
        # One id per bag with sum pooling: the per-id lookup (PoolingMode.NONE is far slower on CPU).
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=getattr(EmbOptimType, optimizer),
            learning_rate=0.1, eps=1e-10, pooling_mode=PoolingMode.SUM, weights_precision=SparseType.FP32,
        )  # fmt: skip

        def step(i, tbe=tbe):
            return _timed(lambda: loss_fn(tbe(batches[i], offsets[i]), targets[i], proj).backward())

        methods.append(Method(f"fbgemm/{family}", family, "step", step))
    return methods


def run(rows: int, dim: int, batch: int, rounds: int, steps_per_round: int, threads: int, with_fbgemm: bool,
        device: str = "cpu") -> dict:  # fmt: skip
    global _SYNC
    torch.set_num_threads(threads)
    _SYNC = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    batches = [b.to(device) for b in make_ids(rows, batch, count=8)]
    methods = build_methods(rows, dim, batches, with_fbgemm and device == "cpu", device)
    for method in methods:  # warm up: first steps allocate state, fault in pages
        for i in range(2):
            method.run(i % len(batches))
    counter = 0
    for _ in range(rounds):
        for method in methods:
            times = []
            for _ in range(steps_per_round):
                times.append(method.run(counter % len(batches)))
                counter += 1
            method.samples += times
            method.round_ms.append(1e3 * statistics.median(times))
    distinct = statistics.mean(len(torch.unique(b)) for b in batches)
    import os

    kept = "MALLOC_TRIM_THRESHOLD_" in os.environ
    return {
        "allocator": "glibc, freed memory kept" if kept else "glibc defaults", "device": device, "rows": rows, "dim": dim, "batch": batch, "distinct_ids_mean": distinct, "threads": threads,
        "fbgemm": with_fbgemm and device == "cpu",
        "rounds": rounds, "steps_per_round": steps_per_round,
        "results": [
            {"name": m.name, "family": m.family, "kind": m.kind, "ms_median": 1e3 * statistics.median(m.samples),
             "ms_p25": 1e3 * _quantile(m.samples, 0.25), "ms_p75": 1e3 * _quantile(m.samples, 0.75), "samples": len(m.samples),
             "round_ms": m.round_ms}
            for m in methods
        ],
    }  # fmt: skip


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fbgemm_available() -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fbgemm_gpu  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - not installed, or built for another torch
        return False


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    out = run(args.rows, args.dim, args.batch, args.rounds, args.steps_per_round, args.threads, fbgemm_available())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    for r in out["results"]:
        print(f"{r['name']:36} {r['kind']:22} {r['ms_median']:8.2f} ms")
    print(json.dumps({k: v for k, v in out.items() if k != "results"}))
