"""A step on tables whose rows live on 2 MiB pages (the default) against the same step on 4 KiB pages, in one process.

``lightning_sparse`` asks Linux for transparent huge pages for a CPU shard, its per-row optimizer state and a dynamic
table's slot map (``tables/placement.py``: ``empty_rows``); ``LIGHTNING_SPARSE_HUGE_PAGES=0`` keeps the system's default
pages. Each workload builds both tables in this process (the switch set while the 4 KiB one makes its memory), then
runs them in turns: ``rounds`` rounds of ``steps`` steps each, one thread. A round gives each its median step; the
ratio is the median over rounds of the round's ratio (4 KiB time / 2 MiB time: above 1, huge pages are faster).

Workloads (``batch`` ids a step, ``mean((rows @ proj - target)^2)``, backward, step, zero_grad):

* ``adagrad`` and ``adam``: a ``SparseEmbedding`` of ``rows`` x 64 with ``SparseAdagrad`` / ``SparseAdam``, skewed ids
  (``rows * rand() ** 3``);
* ``dynamic``: a ``DynamicEmbedding`` with room for ``rows`` ids, ``pool`` of them in the table before the clock
  starts, 10% new ids a step (``dynamic.py``'s stream).

    python benchmarks/huge_pages.py [--rows 1000000] [--rounds 21] [--out benchmarks/results/huge_pages.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402  (benchmarks/report.py: the suite's ratio of interleaved rounds)
import torch  # noqa: E402
from dynamic import Stream  # noqa: E402  (benchmarks/dynamic.py)

import lightning_sparse as ls  # noqa: E402
from lightning_sparse.tables.placement import HUGE_PAGES_ENV  # noqa: E402
from lightning_sparse.wire.hashing import mix  # noqa: E402

DIM = 64
PAGES = ("4 KiB", "2 MiB")


def _build(workload: str, pages: str, rows: int, batch: int, pool: int):
    """A table, its optimizer and a step function; the table's memory made on ``pages``."""
    if pages == "4 KiB":
        os.environ[HUGE_PAGES_ENV] = "0"
    try:
        if workload == "dynamic":
            table = ls.DynamicEmbedding(rows, DIM, seed=0)
            optimizer = ls.SparseAdagrad([table], lr=0.1)
            for chunk in mix(torch.arange(pool) * 2 + 1).split(8192):  # the pool holds rows before the clock starts
                table(chunk).sum().backward()
            stream = Stream(0, 1, {"batch": batch, "pool": pool})
            next_ids = lambda: stream.next()[1]  # noqa: E731 (raw ids)
        else:
            table = ls.SparseEmbedding(rows, DIM, sharding="mod", seed=0)
            optimizer = (ls.SparseAdam if workload == "adam" else ls.SparseAdagrad)([table], lr=0.1)
            table(torch.arange(batch)).sum().backward()
            gen = torch.Generator().manual_seed(0)
            next_ids = lambda: (rows * torch.rand(batch, generator=gen) ** 3).long()  # noqa: E731
        optimizer.step()  # the optimizer's state is made here, on the same pages
        optimizer.zero_grad()
    finally:
        os.environ.pop(HUGE_PAGES_ENV, None)
    proj, target = torch.randn(DIM), torch.randn(batch)

    def step() -> float:
        ids = next_ids()
        start = time.perf_counter()
        ((table(ids) @ proj - target) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    return step


def run(rows: int = 1_000_000, batch: int = 4096, pool: int = 200_000, rounds: int = 21, steps: int = 20, warmup: int = 10,
        workloads: tuple[str, ...] = ("adagrad", "adam", "dynamic"), log=print) -> dict:  # fmt: skip
    torch.set_num_threads(1)
    results = []
    for workload in workloads:
        runs = {pages: _build(workload, pages, rows, batch, min(pool, rows // 2)) for pages in PAGES}
        for step in runs.values():
            for _ in range(warmup):
                step()
        per_round = {pages: [] for pages in PAGES}
        for _ in range(rounds):
            for pages, step in runs.items():
                per_round[pages].append(statistics.median(step() for _ in range(steps)))
        ratios = [small / huge for small, huge in zip(per_round["4 KiB"], per_round["2 MiB"])]  # for their range
        row = {"workload": workload, "ms": {pages: 1e3 * statistics.median(t) for pages, t in per_round.items()},
               "ratio_4k_over_2m": report.ratio({"round_ms": per_round["2 MiB"]}, {"round_ms": per_round["4 KiB"]}),
               "ratio_range": [min(ratios), max(ratios)],
               "rounds_ms": {pages: [round(1e3 * t, 3) for t in ts] for pages, ts in per_round.items()}}  # fmt: skip
        log(f"{workload:8s} 4 KiB pages {row['ms']['4 KiB']:.2f} ms, 2 MiB pages {row['ms']['2 MiB']:.2f} ms: "
            f"{row['ratio_4k_over_2m']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
        results.append(row)
        del runs
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return {"config": {"rows": rows, "dim": DIM, "batch": batch, "pool": pool, "rounds": rounds, "steps": steps},
            "transparent_hugepage": thp.read_text().strip() if thp.exists() else None, "results": results}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "huge_pages.json"))
    args = parser.parse_args()
    doc = run(rows=args.rows, batch=args.batch, rounds=args.rounds)
    doc["processor"] = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                             if line.startswith("model name")), None)  # fmt: skip
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
