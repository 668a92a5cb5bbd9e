"""Training-step benchmark: one embedding table, 2 gloo ranks on CPU, four ways to train it.

Each step, on each rank: look up a batch of Zipf-distributed ids (duplicates within and across
ranks) -> a small loss -> backward -> an Adagrad-family optimizer step -> zero_grad.

Methods (each run in its own 2 freshly spawned processes, so peak RSS is per method):

* ``dense_ddp``: ``nn.Embedding`` (dense gradient) in ``DistributedDataParallel`` +
  ``torch.optim.Adagrad``: every step all-reduces a gradient the size of the whole table.
* ``sparse_grad_ddp``: ``nn.Embedding(sparse=True)`` in DDP (gloo all-reduces the sparse
  gradient: an all-gather of its indices and values) + ``torch.optim.Adagrad``.
* ``dgl``: ``dgl.nn.NodeEmbedding`` + ``dgl.optim.SparseAdagrad``: one table in shared memory,
  lookups read it directly, gradient rows go to their owner (id % W) through shared memory.
* ``ours``: ``lightning_sparse.SparseEmbedding(sharding="mod")`` + ``lightning_sparse.SparseAdagrad``.

Writes raw results as JSON (``--out``); ``benchmarks/report.py`` turns them into
``docs/benchmarks.md`` and ``docs/benchmarks.png``. Run with ``make bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DGLBACKEND", "pytorch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

METHODS = ("ours", "dense_ddp", "sparse_grad_ddp", "dgl")
WORLD = 2
FLOAT_BYTES, ID_BYTES = 4, 8


# ---------------------------------------------------------------------- data
def make_batches(rank: int, cfg: dict, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids ``[steps, batch]`` drawn from Zipf(s) over the rows (row ``k`` has weight ``(k+1)^-s``, so hot
    ids are low ids), targets ``[steps, batch]`` and a fixed projection ``[dim]``. Same on every method."""
    steps = cfg["warmup"] + cfg["steps"]
    gen = torch.Generator().manual_seed(1000 + rank)
    weights = torch.arange(1, num_rows + 1, dtype=torch.float64).pow_(-cfg["zipf"])
    ids = torch.multinomial(weights, steps * cfg["batch"], replacement=True, generator=gen).view(steps, cfg["batch"])
    targets = torch.randn(steps, cfg["batch"], generator=gen)
    proj = torch.randn(cfg["dim"], generator=torch.Generator().manual_seed(0))
    return ids, targets, proj


def loss_fn(rows: torch.Tensor, target: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    return ((rows @ proj) - target).pow(2).mean()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ---------------------------------------------------------------------- methods
# Each builds its model and returns (step(ids, target), stats_fn); stats_fn(rank, ids_of_measured_steps)
# returns the communication figures for the measured steps.


def build_ours(cfg: dict, num_rows: int, proj: torch.Tensor):
    import lightning_sparse as ls

    emb = ls.SparseEmbedding(num_rows, cfg["dim"], sharding="mod", seed=0)
    emb.materialize()
    opt = ls.SparseAdagrad([emb], lr=0.1)

    def step(ids, target):
        loss_fn(emb(ids), target, proj).backward()
        opt.step()
        opt.zero_grad()

    def reset():
        emb.stats.reset()
        opt.stats.reset()

    def stats(rank, ids, steps):
        return {
            "bytes_sent_per_step": (emb.stats.bytes_sent + opt.stats.bytes_sent) / steps,
            "bytes_received_per_step": (emb.stats.bytes_received + opt.stats.bytes_received) / steps,
            "bytes_source": "measured: SparseEmbedding.stats + SparseAdagrad.stats (ExchangeStats)",
            "lookup_bytes_sent_per_step": emb.stats.bytes_sent / steps,
            "grad_bytes_sent_per_step": opt.stats.bytes_sent / steps,
            "lookup_exchange_ms_per_step": 1e3 * emb.stats.exchange_seconds / steps,
            "grad_exchange_ms_per_step": 1e3 * opt.stats.exchange_seconds / steps,
            "update_ms_per_step": 1e3 * opt.stats.update_seconds / steps,
            "unique_ids_per_step": emb.stats.unique_ids / steps,
        }

    return step, reset, stats


def _ddp_step(model, opt, proj):
    def step(ids, target):
        loss_fn(model(ids), target, proj).backward()
        opt.step()
        opt.zero_grad()

    return step


def build_dense_ddp(cfg: dict, num_rows: int, proj: torch.Tensor):
    from torch.nn.parallel import DistributedDataParallel

    emb = nn.Embedding(num_rows, cfg["dim"])
    nn.init.normal_(emb.weight, std=cfg["dim"] ** -0.5)
    model = DistributedDataParallel(emb)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    table_bytes = num_rows * cfg["dim"] * FLOAT_BYTES

    def stats(rank, ids, steps):
        # A ring all-reduce of S bytes sends 2 (W-1)/W * S per rank: S for W = 2.
        return {
            "bytes_sent_per_step": 2 * (WORLD - 1) / WORLD * table_bytes,
            "bytes_source": "computed: the dense gradient (whole table, float32) is all-reduced every step",
        }

    return _ddp_step(model, opt, proj), lambda: None, stats


def build_sparse_grad_ddp(cfg: dict, num_rows: int, proj: torch.Tensor):
    from torch.nn.parallel import DistributedDataParallel

    emb = nn.Embedding(num_rows, cfg["dim"], sparse=True)
    nn.init.normal_(emb.weight, std=cfg["dim"] ** -0.5)
    model = DistributedDataParallel(emb)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)

    def stats(rank, ids, steps):
        # gloo's sparse all-reduce coalesces, then all-gathers indices and values padded to the
        # largest nnz of any rank: each rank sends max_nnz * (8 + 4 * dim) bytes to each peer.
        unique = torch.tensor([float(len(torch.unique(row))) for row in ids])
        gathered = [torch.zeros_like(unique) for _ in range(WORLD)]
        dist.all_gather(gathered, unique)
        max_nnz = torch.stack(gathered).max(dim=0).values
        per_step = float(max_nnz.mean()) * (ID_BYTES + cfg["dim"] * FLOAT_BYTES) * (WORLD - 1)
        return {
            "bytes_sent_per_step": per_step,
            "bytes_source": "estimated: max unique ids over ranks x (8 + 4*dim) per peer (gloo sparse all-reduce = all-gather)",
            "unique_ids_per_step": float(unique.mean()),
        }

    return _ddp_step(model, opt, proj), lambda: None, stats


def _use_private_dgl_store() -> None:
    """DGL's NodeEmbedding opens a TCPStore on the fixed port 12346 (module global ``_STORE``);
    give it one on a free port instead (as tests/test_dgl_parity.py does)."""
    from dgl.nn.pytorch import sparse_emb

    if sparse_emb._STORE is not None:
        return
    timeout = timedelta(seconds=120)
    if dist.get_rank() == 0:
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
        dist.broadcast_object_list([store.port], src=0)
    else:
        port = [None]
        dist.broadcast_object_list(port, src=0)
        store = dist.TCPStore("127.0.0.1", port[0], None, False, timeout)
    sparse_emb._STORE = store


def build_dgl(cfg: dict, num_rows: int, proj: torch.Tensor):
    import dgl

    _use_private_dgl_store()
    name = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    std = cfg["dim"] ** -0.5

    def init(table):
        return nn.init.normal_(table, std=std)

    emb = dgl.nn.NodeEmbedding(num_rows, cfg["dim"], f"lsbench_{name[0]}", init_func=init)
    opt = dgl.optim.SparseAdagrad([emb], lr=0.1)

    def step(ids, target):
        loss_fn(emb(ids), target, proj).backward()
        opt.zero_grad()  # DGL: marks the trace to be cleared by step() after it has read it
        opt.step()

    def stats(rank, ids, steps):
        # Gradient rows (all occurrences, not deduplicated) of ids owned by the other rank
        # (id % W) are copied into shared-memory buffers; lookups read the shared table directly.
        foreign = float((ids % WORLD != rank).sum()) / steps
        return {
            "bytes_sent_per_step": foreign * (ID_BYTES + cfg["dim"] * FLOAT_BYTES),
            "bytes_source": "computed: gradient rows (with duplicates) for ids the peer owns, written to shared memory; "
            "lookups read the shared table (no copy)",
        }

    return step, lambda: None, stats


BUILDERS = {
    "ours": build_ours,
    "dense_ddp": build_dense_ddp,
    "sparse_grad_ddp": build_sparse_grad_ddp,
    "dgl": build_dgl,
}


# ---------------------------------------------------------------------- one run: 2 ranks
def rank_main(rank: int, cfg: dict, method: str, num_rows: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    result: dict = {"rank": rank, "rss_start_mib": peak_rss_mib()}
    try:
        ids, targets, proj = make_batches(rank, cfg, num_rows)
        start = time.perf_counter()
        step, reset, stats = BUILDERS[method](cfg, num_rows, proj)
        dist.barrier()
        result["setup_s"] = time.perf_counter() - start
        for i in range(cfg["warmup"]):
            step(ids[i], targets[i])
        reset()
        dist.barrier()
        times = []
        for i in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
            t0 = time.perf_counter()
            step(ids[i], targets[i])
            times.append(time.perf_counter() - t0)
        result["step_s"] = times
        result.update(stats(rank, ids[cfg["warmup"] :], cfg["steps"]))
        dist.barrier()
    except Exception as exc:  # recorded in the JSON; the other rank fails the same way
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    result["peak_rss_mib"] = peak_rss_mib()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(cfg: dict, method: str, num_rows: int) -> dict:
    """Spawn 2 ranks for one (method, rows) and summarize them."""
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(
                rank_main, args=(cfg, method, num_rows, free_port(), out_dir), nprocs=WORLD, start_method="spawn"
            )
        except Exception as exc:  # a rank died (e.g. killed for memory)
            return {"method": method, "rows": num_rows, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]}
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD)]
    row: dict = {"method": method, "rows": num_rows, "run_wall_s": time.perf_counter() - wall}
    row["peak_rss_mib"] = [r["peak_rss_mib"] for r in ranks]
    row["rss_start_mib"] = [r["rss_start_mib"] for r in ranks]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        row["error"] = errors[0]
        return row
    # A step ends when the slowest rank finishes it: per step, the max over ranks.
    per_step = [max(ts) for ts in zip(*(r["step_s"] for r in ranks))]
    row["step_ms_median"] = 1e3 * statistics.median(per_step)
    row["step_ms_min"] = 1e3 * min(per_step)
    row["step_ms_max"] = 1e3 * max(per_step)
    row["step_ms_all"] = [round(1e3 * t, 3) for t in per_step]
    row["setup_s"] = max(r["setup_s"] for r in ranks)
    for key in ranks[0]:
        if key.endswith("_per_step"):
            row[key] = statistics.mean(r[key] for r in ranks)  # mean over ranks
        elif key == "bytes_source":
            row[key] = ranks[0][key]
    return row


def steps_for(rows: int, cfg: dict) -> int:
    return cfg["steps_large"] if rows >= cfg["large_from"] else cfg["steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000, 4_000_000])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096, help="lookups per rank per step")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the id distribution")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--steps-large", type=int, default=10, help="measured steps for tables of --large-from rows or more")
    parser.add_argument("--large-from", type=int, default=2_000_000)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sparse_step.json"))
    args = parser.parse_args()

    base = {"dim": args.dim, "batch": args.batch, "zipf": args.zipf, "warmup": args.warmup,
            "steps": args.steps, "steps_large": args.steps_large, "large_from": args.large_from}  # fmt: skip
    start = time.perf_counter()
    runs = []
    for rows in args.rows:
        for method in args.methods:
            cfg = {**base, "steps": steps_for(rows, base)}
            row = run_one(cfg, method, rows)
            row["measured_steps"] = cfg["steps"]
            runs.append(row)
            if "error" in row:
                print(f"{rows:>9} rows  {method:<16} ERROR {row['error']}", flush=True)
            else:
                sent = row.get("bytes_sent_per_step")
                print(
                    f"{rows:>9} rows  {method:<16} {row['step_ms_median']:9.2f} ms/step  "
                    f"{(sent or 0) / 2**20:9.3f} MiB sent/rank/step  peak RSS {max(row['peak_rss_mib']):7.0f} MiB  "
                    f"({row['run_wall_s']:.1f} s)",
                    flush=True,
                )
    total = time.perf_counter() - start
    import dgl

    doc = {
        "benchmark": "sparse_step",
        "config": {**base, "world_size": WORLD, "backend": "gloo", "device": "cpu", "threads_per_rank": 1,
                   "optimizer": "Adagrad(lr=0.1)", "loss": "mean((rows @ proj - target)^2)", "sharding": "mod"},
        "machine": {
            "cpu_count": os.cpu_count(),
            "processor": _cpu_model(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "dgl": dgl.__version__,
        },
        "total_wall_s": total,
        "runs": runs,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} ({total:.0f} s)")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
