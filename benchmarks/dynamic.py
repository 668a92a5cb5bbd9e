"""DynamicEmbedding against SparseEmbedding: step time with new ids every step, and memory under an endless stream.

Two measurements, on CPU with one thread per process:

* ``step``: one process, and 2 gloo ranks. Each step, each rank looks up ``batch`` ids: 90% drawn
  (skewed, ``rand() ** 3``) from ``pool`` ids that already hold rows, 10% never seen before,
  which the dynamic table admits. The SparseEmbedding (``rows`` rows, ``sharding="mod"``) gets
  the same batch as row numbers. ``mean((rows @ proj - target)^2)`` -> backward ->
  ``SparseAdagrad`` step -> ``zero_grad``. Two dynamic tables: ``room`` (capacity for every id
  of the run: admissions only) and ``full`` (capacity ``pool``: every new id evicts the least
  recently used one). The methods take turns in ``rounds`` rounds of ``steps`` steps (a step
  ends when the slower rank is done). Each round gives each method its median step; the figure
  is the median over rounds, and the ratio the median over rounds of the round's ratio to the
  SparseEmbedding (the rounds pair the methods in time, which the machine's drift does not).
* ``stream``: 2 ranks push ``distinct`` distinct ids (every id new, ``batch`` per rank and step)
  through a table of ``capacity`` ids with ``SparseAdagrad``. Reported per rank: peak resident
  memory (``VmHWM``) after a tenth of the stream and at the end, occupancy, admissions and
  evictions; the run fails if occupancy ever exceeds the capacity.

    python benchmarks/dynamic.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ranks import start_ranks  # noqa: E402  (benchmarks/ranks.py)

import lightning_sparse as ls  # noqa: E402
from lightning_sparse.faults import exits  # noqa: E402
from lightning_sparse.wire.hashing import mix  # noqa: E402

NEW_FRACTION = 0.1


def peak_rss_mib(field: str = "VmHWM") -> float:
    """This process's peak resident memory (``VmHWM``), or its current one (``field="VmRSS"``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------------------- step time
class Stream:
    """Per rank: batches of ``batch`` ids, 90% from the pool (skewed), 10% new, as row numbers and as raw ids."""

    def __init__(self, rank: int, world: int, cfg: dict) -> None:
        self.gen = torch.Generator().manual_seed(rank)
        self.rank, self.world, self.cfg = rank, world, cfg
        self.fresh = int(cfg["batch"] * NEW_FRACTION)
        self.count = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        old = (cfg["pool"] * torch.rand(cfg["batch"] - self.fresh, generator=self.gen) ** 3).long()
        new = cfg["pool"] + (self.count * self.world + self.rank) * self.fresh + torch.arange(self.fresh)
        self.count += 1
        rows = torch.cat([old, new])
        return rows, mix(rows * 2 + 1)  # the raw ids: any distinct 64-bit values


def _build(kind: str, cfg: dict, world: int):
    total_rows = cfg["pool"] + (cfg["warmup_steps"] + cfg["rounds"] * cfg["steps"] + 1) * world * cfg["batch"]
    device = cfg.get("device", "cpu")
    if kind == "sparse":
        return ls.SparseEmbedding(total_rows, cfg["dim"], sharding="mod", seed=0, device=device)
    capacity = total_rows if kind == "dynamic_room" else cfg["pool"]
    return ls.DynamicEmbedding(capacity, cfg["dim"], seed=0, device=device)


def _time_steps(rank: int, world: int, cfg: dict) -> dict:
    kinds = ["sparse", "dynamic_room", "dynamic_full"]
    tables = {kind: _build(kind, cfg, world) for kind in kinds}
    optimizers = {kind: ls.SparseAdagrad([table], lr=0.1) for kind, table in tables.items()}
    streams = {kind: Stream(rank, world, cfg) for kind in kinds}
    device = torch.device(cfg.get("device", "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    proj = torch.randn(cfg["dim"], generator=torch.Generator().manual_seed(0)).to(device)
    target = torch.randn(cfg["batch"], generator=torch.Generator().manual_seed(1)).to(device)
    pool = mix(torch.arange(cfg["pool"]) * 2 + 1).to(device)
    chunks = -(-cfg["pool"] // (world * 8192))  # the same number of lookups on every rank (they are collectives)
    for kind in kinds[1:]:  # the pool's ids hold rows before the clock starts (the full table: all its room)
        for chunk in pool.tensor_split(world)[rank].tensor_split(chunks):
            tables[kind](chunk).sum().backward()
        optimizers[kind].step()
        optimizers[kind].zero_grad()

    def step(kind: str) -> float:
        rows, raw = streams[kind].next()
        ids = (rows if kind == "sparse" else raw).to(device)
        sync()
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        loss = ((tables[kind](ids) @ proj - target) ** 2).mean()
        loss.backward()
        optimizers[kind].step()
        optimizers[kind].zero_grad()
        sync()
        seconds = torch.tensor([time.perf_counter() - start])
        if world > 1:
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slower rank ends the step
        return float(seconds)

    for kind in kinds:
        for _ in range(cfg["warmup_steps"]):
            step(kind)
    times = {kind: [] for kind in kinds}  # per round: the median step
    for _ in range(cfg["rounds"]):
        for kind in kinds:
            times[kind].append(statistics.median(step(kind) for _ in range(cfg["steps"])))
    full = tables["dynamic_full"].slot_stats
    # Rounds pair the methods in time: the ratio is the median over rounds of each round's ratio.
    ratios = {kind: statistics.median(t / s for t, s in zip(times[kind], times["sparse"])) for kind in kinds[1:]}
    return {"ms": {kind: statistics.median(t) * 1e3 for kind, t in times.items()}, "round_ratios": ratios,
            "rounds_ms": {kind: [round(t * 1e3, 3) for t in ts] for kind, ts in times.items()},
            "full_evictions": full.evictions, "full_occupancy": full.occupancy}  # fmt: skip


# ---------------------------------------------------------------------------- stream
def _stream(rank: int, world: int, cfg: dict) -> dict:
    table = ls.DynamicEmbedding(cfg["capacity"], cfg["dim"], seed=0)
    optimizer = ls.SparseAdagrad([table], lr=0.1)
    steps = -(-cfg["distinct"] // (world * cfg["batch"]))
    early, start, most, marks, current, jumps, peak = None, time.perf_counter(), 0, {}, {}, [], peak_rss_mib()
    for step in range(steps):
        first = (step * world + rank) * cfg["batch"]
        ids = mix(torch.arange(min(first, cfg["distinct"]), min(first + cfg["batch"], cfg["distinct"])))
        table(ids).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        most = max(most, table.slots.occupancy)
        if peak_rss_mib() > peak + 1 and len(jumps) < 30:  # where the peak rises
            jumps.append({"step": step, "peak_mib": peak_rss_mib()})
        peak = peak_rss_mib()
        if step == steps // 10:
            early = peak_rss_mib()
            current["10%"] = peak_rss_mib("VmRSS")
        if step + 1 in {steps * k // 4 for k in (1, 2, 3)}:
            marks[f"{100 * (step + 1) // steps}%"] = peak_rss_mib()
            current[f"{100 * (step + 1) // steps}%"] = peak_rss_mib("VmRSS")
    stats = table.slot_stats
    return {"steps": steps, "seconds": time.perf_counter() - start, "peak_rss_mib_at_10pct": early,
            "peak_rss_mib_at_end": peak_rss_mib(), "peak_rss_mib_by_progress": marks,
            "rss_mib_by_progress": {**current, "100%": peak_rss_mib("VmRSS")}, "peak_jumps": jumps, "occupancy": stats.occupancy, "most_occupancy": most,
            "rank_capacity": table.slots.capacity, "admissions": stats.admissions, "evictions": stats.evictions,
            "rejections": stats.rejections}  # fmt: skip


# ---------------------------------------------------------------------------- processes
def _rank_main(rank: int, world: int, port: int, job: str, cfg: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=5))  # fmt: skip
    try:
        result = {"step": _time_steps, "stream": _stream}[job](rank, world, cfg)
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        exits.release_process_groups()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _on_ranks(job: str, cfg: dict, world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        start_ranks(_rank_main, (world, _free_port(), job, cfg, out), world)
        return [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(world)]


def run(batch: int = 4096, dim: int = 64, pool: int = 200_000, steps: int = 10, rounds: int = 3, warmup_steps: int = 3,
        distinct: int = 10_000_000, capacity: int = 100_000, stream_batch: int = 8192, two_ranks: bool = True,
        device: str = "cpu", log=print) -> dict:  # fmt: skip
    """``two_ranks=False`` measures the step in one process only; ``distinct=0`` skips the stream.

    ``device="cuda"`` measures the one-process step on the GPU (the 2-rank step and the stream stay on CPU).
    """
    cfg = dict(batch=batch, dim=dim, pool=pool, steps=steps, rounds=rounds, warmup_steps=warmup_steps, device=device)
    torch.set_num_threads(1)
    step = {"one process": _time_steps(0, 1, cfg)}
    if two_ranks:
        step["2 ranks"] = _on_ranks("step", {**cfg, "device": "cpu"}, 2)[0]
    for where, result in step.items():
        ms = result["ms"]
        result["ratio_room"], result["ratio_full"] = (
            result["round_ratios"]["dynamic_room"],
            result["round_ratios"]["dynamic_full"],
        )
        log(f"  {where:<12} batch {batch}: SparseEmbedding {ms['sparse']:.2f} ms, dynamic {ms['dynamic_room']:.2f} ms "
            f"({result['ratio_room']:.2f}x), full and evicting {ms['dynamic_full']:.2f} ms ({result['ratio_full']:.2f}x)")  # fmt: skip
    out = {"config": {**cfg, "new_fraction": NEW_FRACTION, "optimizer": "SparseAdagrad(lr=0.1)"}, "step": step}
    if not distinct:
        return out
    stream_cfg = dict(distinct=distinct, capacity=capacity, batch=stream_batch, dim=dim)
    stream = _on_ranks("stream", stream_cfg, 2)
    for rank, result in enumerate(stream):
        log(f"  stream rank {rank}: {distinct:,} ids through capacity {capacity:,}: peak RSS "
            f"{result['peak_rss_mib_at_10pct']:.0f} MiB at 10%, {result['peak_rss_mib_at_end']:.0f} MiB at the end; "
            f"occupancy {result['occupancy']:,}/{result['rank_capacity']:,}, {result['evictions']:,} evictions")  # fmt: skip
        if result["most_occupancy"] > result["rank_capacity"]:
            raise AssertionError(f"rank {rank} held {result['most_occupancy']} ids, more than its {result['rank_capacity']}")
    out["stream"] = {"config": stream_cfg, "ranks": stream}
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--device", default="cpu", help="cuda: the one-process step on the GPU, and nothing else")
    args = parser.parse_args()
    quick = dict(batch=1024, pool=20_000, steps=3, rounds=2, warmup_steps=1, distinct=200_000, capacity=10_000)
    gpu_only = dict(two_ranks=False, distinct=0, device="cuda") if args.device == "cuda" else {}
    doc = run(**(quick if args.quick else {}), **gpu_only)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    sys.exit(0)
