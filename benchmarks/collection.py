"""Many tables: one SparseEmbeddingCollection against separate tables (2 ranks) and FBGEMM's TBE (1 process).

The workload: 26 float32 tables of dim 64 with Criteo's cardinalities clamped to [100, 1M]
(5.6M rows in all), a batch of ``batch`` samples per rank; 23 features single-hot, 3 multi-hot
(bags of 1-5 ids); ids Zipf-like, ``(rows * rand() ** 4).long()``. Loss
``mean((sum of the 26 pooled vectors @ proj - target)^2)``, row-wise Adagrad.

* **2 ranks (gloo, 1 thread each)**: ``collection`` (one ``SparseEmbeddingCollection``: the
  single-hot features as plain ids, the multi-hot ones sum-pooled) against ``separate`` (26
  ``SparseEmbedding`` modules called one after the other, each multi-hot feature pooled by the
  user with ``index_add_``), both in the same processes, in
  interleaved rounds. Reported: median step time (forward + backward + step; a step ends when
  the slower rank ends it) and all-to-all calls per forward and per step, counted.
* **1 process (``threads``, 2 by default)**: the collection against FBGEMM's CPU TBE
  (``SplitTableBatchedEmbeddingBagsCodegen``, the same 26 tables and bags, sum pooling,
  ``EXACT_ROWWISE_ADAGRAD`` fused into backward), when fbgemm_gpu imports.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ranks import start_ranks  # noqa: E402  (benchmarks/ranks.py)

CRITEO = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10,
          5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)  # fmt: skip
MULTI_HOT = (2, 11, 23)  # C3, C12, C24: bags of 1-5 ids
DIM, LR = 64, 0.1


def cardinalities(max_rows: int) -> list[int]:
    return [max(100, min(c, max_rows)) for c in CRITEO]


def make_batches(rows: list[int], batch: int, count: int, seed: int) -> list[tuple[list, torch.Tensor]]:
    """``count`` batches: per table (ids, bag offsets [batch + 1]), and a target."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        features = []
        for t, n in enumerate(rows):
            lengths = torch.randint(1, 6, (batch,), generator=gen) if t in MULTI_HOT else torch.ones(batch, dtype=torch.int64)
            ids = (n * torch.rand(int(lengths.sum()), generator=gen) ** 4).long()
            features.append((ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])))
        out.append((features, torch.randn(batch, generator=gen)))
    return out


def loss_fn(total: torch.Tensor, target: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """``total``: the sum of the 26 pooled vectors, ``[batch, dim]``."""
    return ((total @ proj) - target).pow(2).mean()


def add_up(vectors) -> torch.Tensor:
    vectors = iter(vectors)
    total = next(vectors)
    for v in vectors:
        total = total + v
    return total


# ---------------------------------------------------------------------- the two ways to hold 26 tables
def build_collection(rows: list[int]):
    import lightning_sparse as ls

    tables = {f"t{i}": ls.SparseEmbedding(n, DIM, seed=i) for i, n in enumerate(rows)}
    # Single-hot features as plain ids (one row each), multi-hot ones as sum-pooled bags.
    collection = ls.SparseEmbeddingCollection(tables, pooling={f"t{i}": "sum" for i in MULTI_HOT})
    opt = ls.SparseRowWiseAdagrad([collection], lr=LR)

    def step(features, target, proj):
        out = collection({f"t{i}": ls.JaggedIds(ids, offsets=offsets) if i in MULTI_HOT else ids
                          for i, (ids, offsets) in enumerate(features)})  # fmt: skip
        loss_fn(add_up(out.values()), target, proj).backward()
        opt.step()
        opt.zero_grad()

    return step


def build_separate(rows: list[int]):
    import lightning_sparse as ls

    tables = [ls.SparseEmbedding(n, DIM, seed=i) for i, n in enumerate(rows)]
    opt = ls.SparseRowWiseAdagrad(tables, lr=LR)

    def step(features, target, proj):
        pooled = []
        for i, (table, (ids, offsets)) in enumerate(zip(tables, features)):
            rows_out = table(ids)
            if i not in MULTI_HOT:
                pooled.append(rows_out)
                continue
            bag = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets[1:] - offsets[:-1], output_size=len(ids))
            pooled.append(torch.zeros(len(offsets) - 1, DIM).index_add_(0, bag, rows_out))
        loss_fn(add_up(pooled), target, proj).backward()
        opt.step()
        opt.zero_grad()

    return step


def build_fbgemm(rows: list[int]):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(n, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in rows], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR, eps=1e-10, pooling_mode=PoolingMode.SUM, weights_precision=SparseType.FP32,
    )  # fmt: skip

    def step(features, target, proj):
        # TBE's input: all tables' ids in one tensor, offsets table-major over [T * batch + 1] bags.
        ids = torch.cat([f[0] for f in features])
        starts = [0]
        for f in features:
            starts.append(starts[-1] + len(f[0]))
        offsets = torch.cat([f[1][:-1] + s for f, s in zip(features, starts)] + [torch.tensor([starts[-1]])])
        out = tbe(ids, offsets).view(len(target), len(features), DIM)  # [batch, T * dim]
        loss_fn(out.sum(1), target, proj).backward()

    return step


# ---------------------------------------------------------------------- 2 ranks
def _counting_all_to_all(counter: list[int]):
    original = dist.all_to_all_single

    def counted(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)

    return counted


def rank_main(rank: int, cfg: dict, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))  # fmt: skip
    rows = cardinalities(cfg["max_rows"])
    batches = make_batches(rows, cfg["batch"], 4, seed=rank)
    proj = torch.randn(DIM, generator=torch.Generator().manual_seed(0))
    methods = {"collection": build_collection(rows), "separate": build_separate(rows)}
    calls = [0]
    dist.all_to_all_single = _counting_all_to_all(calls)
    result: dict = {name: {"step_s": []} for name in methods}
    for name, step in methods.items():  # warm up; count collectives on a warm step
        for i in range(2):
            step(*batches[i], proj)
        before = calls[0]
        step(*batches[2], proj)
        result[name]["all_to_all_per_step"] = calls[0] - before
    for round_ in range(cfg["rounds"]):
        for name, step in methods.items():
            for i in range(cfg["steps_per_round"]):
                dist.barrier()
                start = time.perf_counter()
                step(*batches[(round_ + i) % len(batches)], proj)
                result[name]["step_s"].append(time.perf_counter() - start)
    dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(max_rows: int, batch: int, rounds: int, steps_per_round: int) -> dict:
    cfg = {"max_rows": max_rows, "batch": batch, "rounds": rounds, "steps_per_round": steps_per_round}
    with tempfile.TemporaryDirectory() as out_dir:
        start_ranks(rank_main, (cfg, _free_port(), out_dir), 2)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)]
    methods = {}
    for name in ranks[0]:
        per_step = [max(ts) for ts in zip(*(r[name]["step_s"] for r in ranks))]
        methods[name] = {"step_ms_median": 1e3 * statistics.median(per_step), "steps": len(per_step),
                         "round_ms": _round_medians(per_step, steps_per_round),
                         "all_to_all_per_step": ranks[0][name]["all_to_all_per_step"]}  # fmt: skip
    return {"world_size": 2, "threads_per_rank": 1, "tables": len(CRITEO), "dim": DIM, "rows": sum(cardinalities(max_rows)),
            "batch_per_rank": batch, "methods": methods}  # fmt: skip


def _round_medians(step_s: list[float], steps_per_round: int) -> list[float]:
    """Each round's median step in ms (the methods take turns round by round: a ratio per round cancels the machine's drift)."""
    return [1e3 * statistics.median(step_s[i : i + steps_per_round]) for i in range(0, len(step_s), steps_per_round)]


# ---------------------------------------------------------------------- 1 process
def run_single(max_rows: int, batch: int, rounds: int, steps_per_round: int, threads: int = 2) -> dict:
    torch.set_num_threads(threads)
    rows = cardinalities(max_rows)
    batches = make_batches(rows, batch, 4, seed=0)
    proj = torch.randn(DIM, generator=torch.Generator().manual_seed(0))
    methods = {"collection": build_collection(rows)}
    try:
        methods["fbgemm"] = build_fbgemm(rows)
    except Exception as exc:  # noqa: BLE001 - fbgemm_gpu missing or built for another torch
        skipped = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    else:
        skipped = None
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for step in methods.values():
        for i in range(2):
            step(*batches[i], proj)
    for round_ in range(rounds):
        for name, step in methods.items():
            for i in range(steps_per_round):
                start = time.perf_counter()
                step(*batches[(round_ + i) % len(batches)], proj)
                samples[name].append(time.perf_counter() - start)
    out = {"threads": threads, "tables": len(CRITEO), "dim": DIM, "rows": sum(rows), "batch": batch,
           "methods": {name: {"step_ms_median": 1e3 * statistics.median(s), "steps": len(s),
                              "round_ms": _round_medians(s, steps_per_round)} for name, s in samples.items()}}  # fmt: skip
    if skipped:
        out["fbgemm_skipped"] = skipped
    return out


def run(max_rows: int = 1_000_000, batch: int = 2048, rounds: int = 5, steps_per_round: int = 3, threads: int = 2,
        log=print) -> dict:  # fmt: skip
    """``threads``: the one-process comparison's (each rank has one)."""
    log("  26 tables, 2 ranks: collection vs separate tables...")
    distributed = run_distributed(max_rows, batch, rounds, steps_per_round)
    for name, m in distributed["methods"].items():
        log(f"    {name:<12} {m['step_ms_median']:8.2f} ms/step  {m['all_to_all_per_step']} all-to-alls/step")
    log("  26 tables, 1 process: collection vs FBGEMM TBE...")
    single = run_single(max_rows, batch, rounds, steps_per_round, threads)
    for name, m in single["methods"].items():
        log(f"    {name:<12} {m['step_ms_median']:8.2f} ms/step")
    return {"distributed": distributed, "single_process": single}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(run(args.max_rows, args.batch, args.rounds), indent=1))
