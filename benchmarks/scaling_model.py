"""A scaling model: bytes, messages, memory and predicted step time per rank for a DLRM-sized job, 1-D and 2-D.

The model is Criteo's 26 tables (the cardinalities of ``collection.py``) at dim 128, float32,
row-wise Adagrad (4 bytes of state per row), one id per feature per sample, 65,536 samples per
rank per step, ids drawn as in the benchmarks (``rows * rand() ** 4``: a few hot rows, a long
tail). For W ranks and sharding group size G (``G = W``: 1-D), per rank and step:

* distinct ids ``U`` of a rank's batch, and ``U_G`` of a group's G batches (expected values,
  computed exactly from the id distribution: ``sum_k 1 - (1 - p_k) ** m``);
* sent bytes: ids to owners, rows back, gradients to owners (``U (G - 1) / G`` rows of each, ids
  8 bytes, rows ``4 d``) and, for 2-D, the replica round: each rank's merged rows (``U_G / G`` of
  them, an 8-byte id and ``4 d`` bytes each) to the ``W / G - 1`` other replicas;
* messages: ``3 (G - 1)`` all-to-all peers, plus ``2 (W / G - 1)`` all-gather peers for 2-D;
* memory: the shard and its state (``rows / G``), and the replica round's receive buffer
  (``W / G`` times the merged rows);
* predicted step time: the simulator's host time for the 26-table workload at that (W, G)
  (``bench.json``, 4,096 samples per rank at dim 64, scaled by 16 for 65,536; "n/a" where the
  simulator did not run that layout), plus the time on the wire:
  off-host bytes at 50 GB/s (one 400 Gb/s NDR InfiniBand port per GPU) and on-host bytes at
  450 GB/s (NVLink 4, 900 GB/s bidirectional per H100), both from NVIDIA's DGX H100 datasheet
  (8 GPUs per host), plus ``ALPHA_S`` per peer message (an assumption: NCCL's per-peer cost over
  InfiniBand is a few microseconds; the datasheet gives none). Links are assumed uncontended.

TorchRec's 2-D parallel (``DMPCollection``) keeps replicas in step differently: ``sync()``
all-reduces (averages) the shards' weights and optimizer state over the replica group, every
step by default, whatever rows were touched. Its cost, ``2 (R - 1) / R`` times the shard and its
state for a ring all-reduce, is in the table for comparison.

    python benchmarks/scaling_model.py                 # markdown table (reads benchmarks/results/bench.json)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from collection import CRITEO  # noqa: E402

DIM, SAMPLES, GPUS_PER_HOST = 128, 65_536, 8
ROW_BYTES, STATE_BYTES, ID_BYTES = 4 * DIM, 4, 8
NVLINK_BPS, IB_BPS = 450e9, 50e9  # per GPU and direction, DGX H100 datasheet
ALPHA_S = 5e-6  # per peer message (assumed)
SIMULATED_SAMPLES = 4096  # per rank, in the simulator's 26-table workload


@functools.cache
def expected_distinct(rows: int, draws: int) -> float:
    """Expected distinct values among ``draws`` ids drawn as ``floor(rows * U ** 4)``."""
    edges = (torch.arange(rows + 1, dtype=torch.float64) / rows) ** 0.25
    p = edges[1:] - edges[:-1]  # P(id = k)
    return float((-torch.expm1(draws * torch.log1p(-p))).sum())


def per_rank(world: int, group: int, host_ms: float | None) -> dict:
    replicas = world // group
    rank_distinct = sum(expected_distinct(n, SAMPLES) for n in CRITEO)
    group_distinct = sum(expected_distinct(n, SAMPLES * group) for n in CRITEO)
    merged = group_distinct / group  # rows a rank owns that its group touched
    moved = rank_distinct * (group - 1) / group  # each of ids, rows, grads
    exchange = moved * (ID_BYTES + 2 * ROW_BYTES)
    replica = merged * (ID_BYTES + ROW_BYTES) * (replicas - 1)
    on_host_share = min(group, GPUS_PER_HOST) / group  # a group's peers on this rank's host (groups are host-aligned)
    seconds = (exchange * (1 - on_host_share) / IB_BPS + exchange * on_host_share / NVLINK_BPS
               + replica / (IB_BPS if group >= GPUS_PER_HOST else NVLINK_BPS)
               + ALPHA_S * (3 * (group - 1) + 2 * (replicas - 1)))  # fmt: skip
    shard = sum(CRITEO) / group * (ROW_BYTES + STATE_BYTES)
    torchrec_sync = 2 * (replicas - 1) / replicas * shard if replicas > 1 else 0.0
    return {
        "world_size": world, "group_size": group, "distinct_per_rank": rank_distinct, "merged_rows": merged,
        "sent_mib": (exchange + replica) / 2**20, "replica_mib": replica / 2**20,
        "messages": 3 * (group - 1) + 2 * (replicas - 1), "shard_gib": shard / 2**30,
        "replica_buffer_mib": replicas * merged * (ID_BYTES + ROW_BYTES) / 2**20 if replicas > 1 else 0.0,
        "wire_ms": seconds * 1e3, "host_ms": host_ms,
        "step_ms": seconds * 1e3 + host_ms if host_ms is not None else None,
        "torchrec_sync_mib": torchrec_sync / 2**20,
    }  # fmt: skip


def host_times(doc: dict) -> dict[tuple[int, int], float]:
    """Simulated host ms per step of the 26-table workload by (W, G) in a ``bench.json`` document, scaled to the model's samples per rank."""
    scale = SAMPLES / doc.get("scale", {}).get("batch_per_rank", SIMULATED_SAMPLES)
    return {(r["world_size"], r.get("group_size", r["world_size"])): r["step_ms"] * scale
            for r in doc.get("scale", {}).get("results", []) if r["workload"] == "26 tables"}  # fmt: skip


def model(worlds: list[int], hosts: dict[tuple[int, int], float]) -> list[dict]:
    """Per (W, G): G = W (1-D), G = 8 (one host) and G = W / 8 (8 replicas), at least 8."""
    rows = []
    for world in worlds:
        for group in sorted({world, min(world, GPUS_PER_HOST), max(GPUS_PER_HOST, world // 8)}, reverse=True):
            rows.append(per_rank(world, group, hosts.get((world, group))))
    return rows


def table(rows: list[dict]) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    header = (
        "| W | G | shard + state / rank | sent / rank / step | of which replica round | messages / step | "
        "replica buffer | wire ms | host ms | predicted step ms | TorchRec 2-D sync / step |"
    )
    lines = [header, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['world_size']} | {r['group_size']} | {r['shard_gib']:.2f} GiB | {r['sent_mib']:.0f} MiB | "
                     f"{r['replica_mib']:.0f} MiB | {r['messages']} | {r['replica_buffer_mib']:.0f} MiB | "
                     f"{r['wire_ms']:.1f} | {fmt(r['host_ms'], '.0f')} | {fmt(r['step_ms'], '.0f')} | "
                     f"{r['torchrec_sync_mib']:.0f} MiB |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="8,64,512,1024,4096")
    parser.add_argument("--bench", type=Path, default=HERE / "results" / "bench.json")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    doc = json.loads(args.bench.read_text()) if args.bench.exists() else {}
    rows = model([int(w) for w in args.worlds.split(",")], host_times(doc))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
