"""Ranks sharing one GPU over gloo: a 2-rank step against a one-rank step, and the host syncs a step makes.

NCCL refuses two ranks on one device; gloo moves CUDA tensors through pinned host memory. So two
ranks on one GPU run the several-rank GPU path (docs/guide/launching.md, "Several ranks on one
GPU"): correct, but not fast, since every all-to-all goes through the host. This script measures,
for one SparseEmbedding with SparseAdagrad (each rank with its own batch of ``batch`` ids):

* ``step_ms``: the median step (forward, backward, step, zero_grad) of 1 rank and of 2 ranks
  sharing the device (a step ends when the slower rank ends it), and their ratio;
* ``host_syncs``: per step, what ``torch.cuda.set_sync_debug_mode("warn")`` reports on rank 0 (each
  warning is a host read that waits for the GPU), and the Python line of each (``host_syncs_at``). The
  one read the design allows is the lookup's split sizes (docs/design.md, "Host reads on several
  ranks"). Gloo's own waits for its staging copies, on its worker thread, raise no Python warning.

Run on a GPU: ``python benchmarks/gpu_ranks.py [rows dim batch]``; prints one JSON object. On a
CPU (``device="cpu"``) it runs the same steps with plain torch kernels and counts no syncs: how the
test suite checks that the script works.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from device_syncs import DeviceSyncs
from ranks import start_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_fn(rows: int, dim: int, batch: int, rank: int, device: torch.device):
    import lightning_sparse as ls

    emb = ls.SparseEmbedding(rows, dim, device=device)
    opt = ls.SparseAdagrad([emb], lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    batches = [(rows * torch.rand(batch, generator=gen) ** 3).long().to(device) for _ in range(4)]
    targets = [torch.randn(batch, dim, generator=gen).to(device) for _ in range(4)]

    def step(i: int) -> None:
        (emb(batches[i % 4]) - targets[i % 4]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _rank_main(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    torch.set_num_threads(1)
    device = torch.device(cfg["device"], 0) if cfg["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=2))  # fmt: skip
    try:
        step = _step_fn(cfg["rows"], cfg["dim"], cfg["batch"], rank, device)
        for i in range(cfg["warmup"]):
            step(i)
        _sync(device)
        dist.barrier()
        times = []
        for i in range(cfg["steps"]):
            begin = time.perf_counter()
            step(i)
            _sync(device)
            end = torch.tensor([time.perf_counter() - begin])
            dist.all_reduce(end, op=dist.ReduceOp.MAX)  # the slower rank's step
            times.append(1e3 * float(end))
        stacks: list[str] = []
        if device.type == "cuda":
            with DeviceSyncs() as device_syncs:
                for i in range(cfg["sync_steps"]):
                    step(i)
            stacks = device_syncs.stacks
        at = dict(Counter(stacks))  # each sync's innermost Python lines: how often
        syncs = sum(at.values()) / cfg["sync_steps"]
        Path(out, f"{rank}.json").write_text(json.dumps({"step_ms": statistics.median(times), "host_syncs": syncs, "at": at}))
    finally:
        dist.destroy_process_group()


def _on_ranks(world: int, cfg: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        start_ranks(_rank_main, (world, _free_port(), cfg, out), world)
        return [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(world)]


def run(rows: int = 1_000_000, dim: int = 64, batch: int = 65_536, steps: int = 20, warmup: int = 5, sync_steps: int = 3,
        device: str = "cuda") -> dict:  # fmt: skip
    cfg = dict(rows=rows, dim=dim, batch=batch, steps=steps, warmup=warmup, sync_steps=sync_steps, device=device)
    one, two = _on_ranks(1, cfg)[0], _on_ranks(2, cfg)
    return {
        **cfg,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "step_ms": {"1 rank": one["step_ms"], "2 ranks sharing the device": two[0]["step_ms"]},
        "ratio_2_ranks_to_1": two[0]["step_ms"] / one["step_ms"],
        "host_syncs_per_step": {"1 rank": one["host_syncs"], "2 ranks, rank 0": two[0]["host_syncs"]},
        "host_syncs_at": {"1 rank": one["at"], "2 ranks, rank 0": two[0]["at"]},  # the Python line of each, over sync_steps
    }


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = [int(a) for a in sys.argv[1:4]] if len(sys.argv) > 3 else []
    print(json.dumps(run(*sizes, device="cuda" if torch.cuda.is_available() else "cpu"), indent=1))
