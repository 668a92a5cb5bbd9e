"""The scale simulator: one rank's host work, bytes and memory as the world grows to thousands of ranks.

Each world size ``W`` runs in a fresh process as rank 1 of a ``W``-rank job whose peers mirror
it (:mod:`mirror`): the all-to-alls are copies, so what is timed is this rank's own work on the
host (sorting, packing, headers, the Python of the exchange, the update) at fixed per-rank work:
the per-rank batch and shard size stay the same while ``W`` grows, and the tables grow with
``W`` (``rows per rank x W`` rows each).

Ids are drawn as for an 8-rank job (``(rows * rand() ** 4).long()`` over ``rows per rank x 8``
rows) and moved to pseudo-random rows of the W-rank tables by a fixed injective map
(:func:`spread`): every W sees the same repeats, so the same number of distinct rows, and only
their spread over the owners changes.

Two workloads, both with row-wise Adagrad and dim 64:

* ``26 tables``: one ``SparseEmbeddingCollection`` over Criteo's 26 tables, rows per rank
  ``clamp(cardinality, 100, rows_cap)``, 23 single-hot features and 3 sum-pooled bags of 1-5
  ids (the workload of ``collection.py``);
* ``1 table``: one ``SparseEmbedding`` of ``rows_cap`` rows per rank, ``batch`` ids.

Per ``W``: the median step (lookup, backward, optimizer step) and its parts, the stage labels'
host time from ``torch.profiler`` (``lightning_sparse.ids_to_owners`` ...), what this rank would
send to its peers per step (bytes, messages: the all-to-all fan-out), collectives per step,
and the process's peak resident memory (``VmHWM``).

    python benchmarks/scale.py --worlds 8,1024,4096          # prints a table, --json to keep it
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
RANK = 1
BASE_WORLD = 8  # ids are drawn as for a job of this size, then spread over the W-rank tables
SPREAD = 1_000_003  # a prime: multiplying by it modulo the table size maps distinct ids to distinct ids
STAGES = ("ids_to_owners", "rows_to_requesters", "grads_to_owners", "grads_over_replicas")


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def spread(ids, rows: int):
    """``ids`` drawn from the first ``rows_per_rank * BASE_WORLD`` rows, moved to pseudo-random rows of the table.

    The map is injective, so the batch's repeats (how many distinct ids, how often each) are the
    same at every W, and hot ids land on every owner, as hashed ids do; only the spread over
    owners changes with W.
    """
    import math

    factor = SPREAD if math.gcd(SPREAD, rows) == 1 else 1
    return (ids * factor) % rows


def measure(world_size: int, workload: str, batch: int, rows_cap: int, steps: int, group_size: int | None = None) -> dict:
    """In this process: rank ``RANK`` of a mirrored ``world_size``-rank job, ``steps`` timed steps.

    ``group_size``: 2-D sharding, tables sharded over groups of that many ranks and replicated
    across the ``world_size / group_size`` groups (so a table has ``rows per rank x group_size`` rows).
    """
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(HERE))
    from collection import CRITEO, DIM, LR, MULTI_HOT
    from mirror import init_mirror, mirror_groups

    import lightning_sparse as ls

    torch.set_num_threads(1)
    group = init_mirror(RANK, world_size)
    groups, placement = [group], {}
    shard_ranks = world_size
    if group_size is not None and group_size < world_size:
        shard_group, replica_group = mirror_groups(RANK, world_size, group_size)
        groups += [shard_group, replica_group]
        placement = {"process_group": shard_group, "replica_group": replica_group}
        shard_ranks = group_size
    gen = torch.Generator().manual_seed(0)
    if workload == "26 tables":
        per_rank = [max(100, min(c, rows_cap)) for c in CRITEO]
        tables = {f"t{i}": ls.SparseEmbedding(n * shard_ranks, DIM, seed=i, **placement) for i, n in enumerate(per_rank)}
        module = ls.SparseEmbeddingCollection(tables, pooling={f"t{i}": "sum" for i in MULTI_HOT})

        def make_input() -> dict:
            features = {}
            for i, n in enumerate(per_rank):
                lengths = torch.randint(1, 6, (batch,), generator=gen) if i in MULTI_HOT else None
                count = int(lengths.sum()) if lengths is not None else batch
                ids = spread((n * BASE_WORLD * torch.rand(count, generator=gen) ** 4).long(), n * shard_ranks)
                features[f"t{i}"] = ls.JaggedIds(ids, lengths=lengths) if lengths is not None else ids
            return features

        def forward(features: dict) -> torch.Tensor:
            return sum(out.sum() for out in module(features).values())

    else:
        module = ls.SparseEmbedding(rows_cap * shard_ranks, DIM, **placement)

        def make_input() -> torch.Tensor:
            return spread((rows_cap * BASE_WORLD * torch.rand(batch, generator=gen) ** 4).long(), rows_cap * shard_ranks)

        def forward(ids: torch.Tensor) -> torch.Tensor:
            return module(ids).pow(2).sum()

    opt = ls.SparseRowWiseAdagrad([module], lr=LR)
    inputs = [make_input() for _ in range(steps + 2)]

    def step(features) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = forward(features)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    for features in inputs[:2]:  # warm-up: slots settle, state allocated
        step(features)
    for g in groups:
        g.counts.reset()
    timed = [step(features) for features in inputs[2:]]
    per_step = {"peer_bytes": sum(g.counts.peer_bytes for g in groups) / steps,
                "peer_messages": sum(g.counts.peer_messages for g in groups) / steps,
                "all_to_all_peers": (groups[1] if len(groups) > 1 else group).counts.peer_messages / steps,
                "collectives": sum(sum(g.counts.calls.values()) for g in groups) / steps}  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(inputs[-1])
    stage_ms = {s: 0.0 for s in STAGES}
    for event in prof.key_averages():
        name = event.key.removeprefix("lightning_sparse.")
        if name in stage_ms:
            stage_ms[name] += event.cpu_time_total / 1e3
    dist.destroy_process_group()
    med = lambda i: statistics.median(t[i] for t in timed) * 1e3  # noqa: E731
    return {
        "world_size": world_size, "group_size": group_size or world_size, "workload": workload, "batch_per_rank": batch, "rows_cap": rows_cap, "steps": steps,
        "step_ms": statistics.median(sum(t) for t in timed) * 1e3, "lookup_ms": med(0), "backward_ms": med(1),
        "optimizer_ms": med(2), "stage_ms": stage_ms, **per_step, "peak_rss_mib": _peak_rss_mib(),
    }  # fmt: skip


def parse_layouts(text: str) -> list[tuple[int, int | None]]:
    """``"8,1024,4096/512"`` -> ``[(8, None), (1024, None), (4096, 512)]``: ``W`` (1-D) or ``W/G`` (2-D, groups of G)."""
    layouts = []
    for item in text.split(","):
        world, _, group = item.partition("/")
        layouts.append((int(world), int(group) if group else None))
    return layouts


def run(worlds: list[tuple[int, int | None]], workloads: list[str], batch: int, rows_cap: int, steps: int,
        rounds: int = 1, in_process: bool = False, timeout: float = 900) -> dict:  # fmt: skip
    """Every (workload, W[/G]) in its own process (a fresh peak memory; ``in_process``: here, for a smoke run).

    ``rounds``: measure every layout that many times, the layouts interleaved (round 1 of each, then
    round 2 ...), and keep for each the round with the median step time (all rounds' step times in
    ``step_ms_rounds``): a slow moment of the machine then moves one round, not one layout's figure.
    """
    measured: dict[tuple[str, int, int | None], list[dict]] = {}
    for _ in range(rounds):
        for workload in workloads:
            for world_size, group_size in worlds:
                result = measure(world_size, workload, batch, rows_cap, steps, group_size) if in_process else \
                    _measure_in_worker(world_size, group_size, workload, batch, rows_cap, steps, timeout)  # fmt: skip
                measured.setdefault((workload, world_size, group_size), []).append(result)
    results = []
    for tries in measured.values():
        middle = sorted(tries, key=lambda r: r["step_ms"])[(len(tries) - 1) // 2]
        results.append({**middle, "step_ms_rounds": [r["step_ms"] for r in tries]})
    return {"rank": RANK, "batch_per_rank": batch, "rows_cap": rows_cap, "rounds": rounds, "results": results}


def _measure_in_worker(world_size: int, group_size: int | None, workload: str, batch: int, rows_cap: int, steps: int,
                        timeout: float) -> dict:  # fmt: skip
    """:func:`measure` in a fresh worker process (its own peak memory)."""
    cmd = [sys.executable, "-W", "ignore", str(Path(__file__).resolve()), "--worker", str(world_size),
           "--workload", workload, "--batch", str(batch), "--rows-cap", str(rows_cap), "--steps", str(steps),
           *(["--group-size", str(group_size)] if group_size else [])]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"scale worker W={world_size} ({workload}) failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  {workload:<10} W={world_size:<5} G={result['group_size']:<5} step {result['step_ms']:8.1f} ms  "
          f"sent {result['peer_bytes'] / 2**20:7.2f} MiB to {result['peer_messages']:6.0f} peers  "
          f"peak {result['peak_rss_mib']:6.0f} MiB", flush=True)  # fmt: skip
    return result


def table(section: dict) -> str:
    lines = ["| workload | W | G | step ms | lookup | backward | optimizer | ids_to_owners | rows_to_requesters | "
             "grads_to_owners | grads_over_replicas | bytes to peers / step | messages / step | all-to-all peers / step | "
             "peak RSS MiB | step ms, each round |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in section["results"]:
        stages = " | ".join(f"{r['stage_ms'].get(s, 0.0):.1f}" for s in STAGES)
        lines.append(f"| {r['workload']} | {r['world_size']} | {r.get('group_size', r['world_size'])} | {r['step_ms']:.1f} | "
                     f"{r['lookup_ms']:.1f} | {r['backward_ms']:.1f} | {r['optimizer_ms']:.1f} | {stages} | "
                     f"{r['peer_bytes'] / 2**20:.2f} MiB | {r['peer_messages']:.0f} | "
                     f"{r.get('all_to_all_peers', r['peer_messages']):.0f} | {r['peak_rss_mib']:.0f} | "
                     f"{', '.join(f'{t:.1f}' for t in r.get('step_ms_rounds', [r['step_ms']]))} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--worlds",
        default="8,64,512,1024,4096,1024/128,4096/512",
        help="world sizes W (1-D) or W/G (2-D sharding over groups of G ranks)",
    )
    parser.add_argument("--workloads", default="26 tables,1 table")
    parser.add_argument("--batch", type=int, default=4096, help="samples per rank per step")
    parser.add_argument("--rows-cap", type=int, default=20_000, help="most rows per table per rank")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="measure each layout this many times, interleaved; keep the median")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--group-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.workload, args.batch, args.rows_cap, args.steps, args.group_size)))
        return 0
    section = run(parse_layouts(args.worlds), args.workloads.split(","), args.batch, args.rows_cap, args.steps, args.rounds)
    print(table(section))
    if args.json:
        args.json.write_text(json.dumps(section, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
