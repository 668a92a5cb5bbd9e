"""Before/after: the same workloads on two revisions of lightning_sparse, in interleaved rounds of one run.

    python benchmarks/compare_revisions.py --before 1f688e3            # before = that commit, after = this tree
    python benchmarks/compare_revisions.py --before HEAD~3 --rounds 7

For a change that must not slow the lookup path (a refactor), this measures both sides on the
same machine in the same minutes: each round runs every workload once on each side (the order
alternates), each side in fresh processes that import its own ``lightning_sparse``; the verdict
per workload is the median over rounds of that round's after/before ratio, with the range of
the ratios as the noise. The workloads (public API only, so any revision runs them):

* ``one table, 1 process``: 1M x 64 float32 rows, 65,536 ids per step (Zipf-like), Adagrad;
* ``one table, 2 ranks``: the same table on 2 gloo ranks (1 thread each), 4,096 and 65,536 ids
  per rank;
* ``collection, 2 ranks`` and ``26 separate tables, 2 ranks``: the 26-table workload of
  ``collection.py`` (batch 2,048 per rank), row-wise Adagrad; ``collection, 1 process``: the
  same collection in one process (2 threads).

A step is forward + backward + optimizer step; on 2 ranks it ends when the slower rank ends it.
Measure on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ROWS, DIM, LR = 1_000_000, 64, 0.1


def _ids(batch: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [(ROWS * torch.rand(batch, generator=gen) ** 4).long() for _ in range(4)]


def _one_table_steps(batch: int, steps: int, seed: int) -> list[float]:
    """Step times of one table (any placement the caller set up)."""
    import torch

    import lightning_sparse as ls

    table = ls.SparseEmbedding(ROWS, DIM, seed=0)
    opt = ls.SparseAdagrad([table], lr=LR)
    batches = _ids(batch, seed)
    times = []
    for i in range(steps + 2):  # 2 warm-up steps
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        start = time.perf_counter()
        table(batches[i % len(batches)]).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times[2:]


def _collection_steps(steps: int, seed: int, separate: bool = True) -> dict[str, list[float]]:
    """Step times of the 26-table collection (and of 26 separate tables) on this process's ranks."""
    import collection as workload  # benchmarks/collection.py: the 26-table workload
    import torch

    rows = workload.cardinalities(ROWS)
    batches = workload.make_batches(rows, 2048, 4, seed=seed)
    proj = torch.randn(workload.DIM, generator=torch.Generator().manual_seed(0))
    where = "2 ranks" if torch.distributed.is_initialized() else "1 process"
    builds = [("collection", workload.build_collection)] + [("26 separate tables", workload.build_separate)] * separate
    out = {}
    for name, build in builds:
        step, times = build(rows), []
        for i in range(steps + 2):
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            start = time.perf_counter()
            step(*batches[i % len(batches)], proj)
            times.append(time.perf_counter() - start)
        out[f"{name}, {where}"] = times[2:]
    return out


def _rank(rank: int, port: int, steps: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))  # fmt: skip
    try:
        result = {f"one table, 2 ranks, {b} ids": _one_table_steps(b, steps, seed=rank) for b in (4096, 65536)}
        result.update(_collection_steps(steps, seed=rank))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def worker(steps: int) -> dict[str, float]:
    """All workloads on the ``lightning_sparse`` that this process imports: median step ms per workload."""
    import socket

    import torch
    import torch.multiprocessing as mp

    torch.set_num_threads(2)
    medians = {"one table, 1 process, 65536 ids": 1e3 * statistics.median(_one_table_steps(65536, steps, seed=0))}
    for name, times in _collection_steps(steps, seed=0, separate=False).items():  # one process: the same round, no exchange
        medians[name] = 1e3 * statistics.median(times)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(port, steps, out_dir), nprocs=2, start_method="spawn")
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)]
    for name in ranks[0]:
        medians[name] = 1e3 * statistics.median(max(ts) for ts in zip(ranks[0][name], ranks[1][name]))
    return medians


def _run_side(tree: Path, steps: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-W", "ignore", __file__, "--worker", "--steps", str(steps)], env=env,
                          check=True, capture_output=True, text=True, cwd=tree)  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    package = Path(result.pop("package"))
    if package != tree / "lightning_sparse":
        raise RuntimeError(f"The side at {tree} imported lightning_sparse from {package}. HINT: run from a plain checkout.")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="git revision of the 'before' side (the 'after' side is this working tree)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per workload per round")
    parser.add_argument("--out", default=str(HERE / "results" / "compare_revisions.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        import lightning_sparse

        print(json.dumps({"package": str(Path(lightning_sparse.__file__).parent), **worker(args.steps)}))
        return 0
    if not args.before:
        parser.error("--before REV is required")
    with tempfile.TemporaryDirectory() as scratch:
        before = Path(scratch)
        archive = subprocess.run(["git", "archive", args.before, "lightning_sparse"], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        sides = {"before": before, "after": ROOT}
        rounds: list[dict[str, dict[str, float]]] = []
        for r in range(args.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            rounds.append({side: _run_side(sides[side], args.steps) for side in order})
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    report = {}
    for name in rounds[0]["before"]:
        ratios = sorted(rd["after"][name] / rd["before"][name] for rd in rounds)
        report[name] = {
            "before_ms": statistics.median(rd["before"][name] for rd in rounds),
            "after_ms": statistics.median(rd["after"][name] for rd in rounds),
            "ratio_median": statistics.median(ratios),
            "ratio_range": [ratios[0], ratios[-1]],
        }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"before": args.before, "after": f"working tree at {commit}", "rounds": args.rounds, "steps": args.steps,
              "workloads": report}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"| workload | before (ms) | after (ms) | after/before, median of {args.rounds} rounds | range |")
    print("|---|---:|---:|---:|---|")
    for name, r in report.items():
        low, high = r["ratio_range"]
        print(f"| {name} | {r['before_ms']:.1f} | {r['after_ms']:.1f} | {r['ratio_median']:.3f} | {low:.3f}-{high:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
