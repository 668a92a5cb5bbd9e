"""Half-precision tables against float32: the step time of one table, in one process.

Each method is a ``SparseEmbedding(rows, dim)`` trained with ``SparseAdagrad``: ``float32``,
``bfloat16`` with stochastic rounding (the default for half tables), ``bfloat16`` rounded to
nearest, and ``float16`` with stochastic rounding. A step is a lookup of ``batch`` skewed ids
(``rows * rand() ** 4``), ``mean((rows @ proj - target)^2)`` in float32, backward, the optimizer
step and ``zero_grad``. The methods take turns in ``rounds`` rounds of ``steps`` steps; each
figure is the median over the rounds of the round's median step, and each ratio the median over
the rounds of the round's ratio to float32.

    python benchmarks/half.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import lightning_sparse as ls

METHODS = {  # name: (dtype, stochastic_rounding)
    "float32": (torch.float32, None),
    "bfloat16": (torch.bfloat16, None),
    "bfloat16, nearest": (torch.bfloat16, False),
    "float16": (torch.float16, None),
}


def run(rows: int = 1_000_000, dim: int = 64, batch: int = 65_536, steps: int = 4, rounds: int = 5, threads: int = 2,
        log=print) -> dict:  # fmt: skip
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    batches = [(rows * torch.rand(batch, generator=gen) ** 4).long() for _ in range(8)]
    proj, target = torch.randn(dim, generator=gen), torch.randn(batch, generator=gen)
    tables, optimizers = {}, {}
    for name, (dtype, rounding) in METHODS.items():
        options = {} if rounding is None else {"stochastic_rounding": rounding}
        tables[name] = ls.SparseEmbedding(rows, dim, dtype=dtype, output_dtype=torch.float32, seed=0, **options)
        optimizers[name] = ls.SparseAdagrad([tables[name]], lr=0.01)
    counter = 0

    def step(name: str) -> float:
        nonlocal counter
        ids = batches[counter % len(batches)]
        counter += 1
        start = time.perf_counter()
        ((tables[name](ids) @ proj - target) ** 2).mean().backward()
        optimizers[name].step()
        optimizers[name].zero_grad()
        return time.perf_counter() - start

    for name in METHODS:  # warm up: state, pages
        for _ in range(2):
            step(name)
    times = {name: [] for name in METHODS}
    for _ in range(rounds):
        for name in METHODS:
            times[name].append(statistics.median(step(name) for _ in range(steps)))
    results = []
    for name in METHODS:
        ratio = statistics.median(t / f for t, f in zip(times[name], times["float32"]))
        table_bytes = tables[name].shard.numel() * tables[name].shard.element_size()
        state_bytes = sum(v.numel() * v.element_size() for v in optimizers[name].state[tables[name].shard].values() if v.dim())
        results.append({"method": name, "ms": statistics.median(times[name]) * 1e3, "ratio_to_float32": ratio,
                        "table_bytes": table_bytes, "state_bytes": state_bytes})  # fmt: skip
        log(f"  {name:<18} {results[-1]['ms']:.2f} ms ({ratio:.2f}x float32), table {table_bytes / 2**20:.0f} MiB, "
            f"optimizer state {state_bytes / 2**20:.0f} MiB")  # fmt: skip
    return {"config": dict(rows=rows, dim=dim, batch=batch, steps=steps, rounds=rounds, threads=threads,
                           optimizer="SparseAdagrad(lr=0.01)"), "results": results}  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    doc = run(**(dict(rows=20_000, batch=1024, steps=2, rounds=2) if args.quick else {}))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    sys.exit(0)
