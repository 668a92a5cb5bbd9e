"""Two gloo ranks at small batches: ours, ours pipelined, ours in shared memory and DGL, in interleaved rounds (issue 46).

The workload is ``distributed.py``'s (one table, Zipf ids, ``mean((rows @ proj - target)^2)``, Adagrad,
one thread per rank), at ``batch`` ids per rank and each of ``rows_list`` table sizes. A round runs
every method once (each in 2 fresh ranks, ``distributed.run_one``), in an order that turns from round
to round; each method's figure in a round is its median step (a step ends when the slower rank
ends it). Reported per table size: each method's median over rounds, and each ratio ``dgl / ours``,
``dgl / ours_pipelined`` and ``dgl / ours_shared`` as the median of the rounds' ratios, with their lowest and highest (the
machine's noise).

    python benchmarks/small_batches.py [--rounds 5] [--rows 100000,1000000,4000000] [--batch 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import distributed  # noqa: E402

METHODS = ("ours", "ours_pipelined", "ours_shared", "dgl")
BASELINE = "dgl"


def run(rows_list: list[int], batch: int = 4096, rounds: int = 5, methods: tuple[str, ...] = METHODS, budget_s: float = 2.0,
        warmup: int = 5, max_steps: int = 120, log=print) -> dict:  # fmt: skip
    results = []
    for rows in rows_list:
        cfg = {"dim": 64, "batch": batch, "zipf": 1.1, "budget_s": budget_s, "min_steps": 5, "warmup": warmup,
               "steps": warmup + max_steps + 1}  # fmt: skip
        per_round: list[dict[str, float]] = []
        for r in range(rounds):
            order = methods[r % len(methods) :] + methods[: r % len(methods)]
            medians = {}
            for method in order:
                row = distributed.run_one(cfg, method, rows)
                if "error" in row:
                    raise RuntimeError(f"{method} at {rows} rows: {row['error']}")
                medians[method] = row["step_ms_median"]
            per_round.append(medians)
            log(f"  {rows:>9} rows  round {r + 1}: " + "  ".join(f"{m} {medians[m]:.2f} ms" for m in methods))
        entry = {"rows": rows, "batch": batch, "rounds": rounds,
                 "step_ms": {m: statistics.median(p[m] for p in per_round) for m in methods}, "speedup_vs_dgl": {}}  # fmt: skip
        for m in methods:
            if m == BASELINE:
                continue
            ratios = [p[BASELINE] / p[m] for p in per_round]
            entry["speedup_vs_dgl"][m] = {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}
        results.append(entry)
    return {"world_size": distributed.WORLD, "backend": "gloo", "threads_per_rank": 1, "optimizer": "Adagrad(lr=0.1)",
            "results": results}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="100000,1000000,4000000")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--out", default=None, help="write the JSON here (else print it)")
    args = parser.parse_args(argv)
    doc = run([int(r) for r in args.rows.split(",")], args.batch, args.rounds)
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for entry in doc["results"]:
        ratios = ", ".join(f"{m} {v['median']:.2f}x ({v['low']:.2f}-{v['high']:.2f})" for m, v in entry["speedup_vs_dgl"].items())
        print(f"{entry['rows']:>9} rows, {entry['batch']} ids/rank: DGL's step / ours: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
