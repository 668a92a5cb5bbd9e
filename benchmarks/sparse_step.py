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
    ids are low ids), targets ``[steps, batch]`` and a fixed projection ``[dim]``. Same for every method."""
    steps = cfg["warmup"] + cfg["max_extra_warmup"] + cfg["max_steps"]
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
            # What crosses to the other rank, computed independently from the ids; the table's and
            # optimizer's ExchangeStats (which count the same thing) are reported beside it.
            "bytes_sent_per_step": ours_bytes_to_peer(rank, ids, cfg["dim"], steps),
            "bytes_source": "computed from the ids: unique ids the peer owns (8 B out, 8 + 4*dim B of gradient), "
            "rows the peer asked this rank for (4*dim B), split-size headers; the ExchangeStats figures below "
            "count the same bytes",
            "stats_bytes_sent_per_step": (emb.stats.bytes_sent + opt.stats.bytes_sent) / steps,
            "stats_bytes_received_per_step": (emb.stats.bytes_received + opt.stats.bytes_received) / steps,
            "lookup_bytes_sent_per_step": emb.stats.bytes_sent / steps,
            "grad_bytes_sent_per_step": opt.stats.bytes_sent / steps,
            "lookup_exchange_ms_per_step": 1e3 * emb.stats.exchange_seconds / steps,
            "grad_exchange_ms_per_step": 1e3 * opt.stats.exchange_seconds / steps,
            "update_ms_per_step": 1e3 * opt.stats.update_seconds / steps,
            "unique_ids_per_step": emb.stats.unique_ids / steps,
        }

    return step, reset, stats


def ours_bytes_to_peer(rank: int, ids: torch.Tensor, dim: int, steps: int) -> float:
    """Bytes rank ``rank`` sends to the other rank per step under "mod" sharding (W = 2), from the ids:
    lookup ids it needs from the peer, rows the peer needs from it, gradients of the peer's rows, headers."""
    uniques = [torch.unique(row) for row in ids]
    from_peer = torch.tensor([float((u % WORLD != rank).sum()) for u in uniques])  # ids the peer owns
    gathered = [torch.zeros_like(from_peer) for _ in range(WORLD)]
    dist.all_gather(gathered, from_peer)
    asked_of_me = gathered[1 - rank]  # the peer's unique ids that this rank owns
    headers = (1 + 4) * ID_BYTES + 2 * ID_BYTES  # one row of each [W, 1 + 4] and [W, 2] split-size header
    per_step = headers + from_peer * ID_BYTES + asked_of_me * dim * FLOAT_BYTES + from_peer * (ID_BYTES + dim * FLOAT_BYTES)
    return float(per_step.sum()) / steps


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


class _Head(nn.Module):
    """The projection of the loss as a trainable dense parameter (Lightning needs one for DDP)."""

    def __init__(self, proj: torch.Tensor) -> None:
        super().__init__()
        self.proj = nn.Parameter(proj.clone())

    def forward(self, rows: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(rows, target, self.proj)


def build_ours_dense_head(cfg: dict, num_rows: int, proj: torch.Tensor):
    """Plain-torch twin of ``ours_lightning``: the same table plus a dim-sized dense parameter in DDP."""
    import lightning_sparse as ls
    from torch.nn.parallel import DistributedDataParallel

    emb = ls.SparseEmbedding(num_rows, cfg["dim"], sharding="mod", seed=0)
    emb.materialize()
    head = DistributedDataParallel(_Head(proj))
    sparse_opt = ls.SparseAdagrad([emb], lr=0.1)
    dense_opt = torch.optim.Adagrad(head.parameters(), lr=0.1)

    def step(ids, target):
        head(emb(ids), target).backward()
        dense_opt.step()
        sparse_opt.step()
        dense_opt.zero_grad()
        sparse_opt.zero_grad()

    def reset():
        emb.stats.reset()
        sparse_opt.stats.reset()

    def stats(rank, ids, steps):
        return {"bytes_sent_per_step": (emb.stats.bytes_sent + sparse_opt.stats.bytes_sent) / steps,
                "bytes_source": "measured: ExchangeStats (the dense parameter's DDP all-reduce not counted)"}  # fmt: skip

    return step, reset, stats


def run_ours_lightning(rank: int, cfg: dict, num_rows: int, result: dict) -> None:
    """The same model as ``ours_dense_head`` trained by ``Trainer(strategy="sparse_ddp")`` on the ranks
    this script spawned; a step is the time between consecutive ``on_train_batch_start`` calls."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["BENCH_PORT"], WORLD_SIZE=str(WORLD),
                      NODE_RANK="0", LOCAL_RANK=str(rank), RANK=str(rank))  # fmt: skip
    import lightning.pytorch as pl

    import lightning_sparse as ls

    warmup, steps = cfg["lightning_warmup"], cfg["lightning_steps"]
    ids, targets, proj = make_batches(rank, {**cfg, "max_steps": warmup + steps + 1 - cfg["warmup"]}, num_rows)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = ls.SparseEmbedding(num_rows, cfg["dim"], sharding="mod", seed=0)
            self.head = _Head(proj)

        def training_step(self, batch, batch_idx):
            batch_ids, target = batch
            return self.head(self.emb(batch_ids), target)

        def configure_optimizers(self):
            return torch.optim.Adagrad(self.head.parameters(), lr=0.1)

        def configure_sparse_optimizers(self):
            return ls.SparseAdagrad([self.emb], lr=0.1)

    starts: list[float] = []

    class Clock(pl.Callback):
        stats: float | None = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            starts.append(time.perf_counter())
            if batch_idx == warmup:
                module.emb.stats.reset()
                trainer.strategy.sparse_optimizers[0].stats.reset()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == warmup + steps - 1:
                self.stats = (module.emb.stats.bytes_sent + trainer.strategy.sparse_optimizers[0].stats.bytes_sent) / steps

    batches = list(zip(ids[: warmup + steps + 1], targets[: warmup + steps + 1]))
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    clock = Clock()
    start = time.perf_counter()
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy="sparse_ddp", max_steps=warmup + steps + 1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[clock],
    )  # fmt: skip
    module = Module()
    trainer.fit(module, train_dataloaders=loader)
    result["setup_s"] = time.perf_counter() - start  # the whole fit: setup plus all steps
    result["warmup_steps"] = warmup
    result["step_s"] = [b - a for a, b in zip(starts[warmup:], starts[warmup + 1 :])][:steps]
    result["bytes_sent_per_step"] = clock.stats
    result["bytes_source"] = "measured: ExchangeStats (the dense parameter's DDP all-reduce not counted)"


BUILDERS = {
    "ours": build_ours,
    "dense_ddp": build_dense_ddp,
    "sparse_grad_ddp": build_sparse_grad_ddp,
    "dgl": build_dgl,
    "ours_dense_head": build_ours_dense_head,
}
LIGHTNING_PAIR = ("ours_dense_head", "ours_lightning")


# ---------------------------------------------------------------------- one run: 2 ranks
def rank_main(rank: int, cfg: dict, method: str, num_rows: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    result: dict = {"rank": rank, "rss_start_mib": peak_rss_mib()}
    os.environ["BENCH_PORT"] = str(port)
    try:
        if method == "ours_lightning":
            run_ours_lightning(rank, cfg, num_rows, result)
        else:
            run_loop(rank, cfg, method, num_rows, result)
    except Exception as exc:  # recorded in the JSON; the other rank fails the same way
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    result["peak_rss_mib"] = peak_rss_mib()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_loop(rank: int, cfg: dict, method: str, num_rows: int, result: dict) -> None:
    """Build ``method``, warm up, agree on a step count, time the steps; results into ``result``."""
    ids, targets, proj = make_batches(rank, cfg, num_rows)
    start = time.perf_counter()
    step, reset, stats = BUILDERS[method](cfg, num_rows, proj)
    dist.barrier()
    result["setup_s"] = time.perf_counter() - start
    for i in range(cfg["warmup"]):
        t0 = time.perf_counter()
        step(ids[i], targets[i])
    # Every rank must run the same number of steps: agree on the slowest rank's warm step time.
    warm = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    warm_s = float(warm)
    extra = min(cfg["max_extra_warmup"], int(cfg["extra_warmup_s"] / warm_s))
    steps = max(cfg["min_steps"], min(cfg["max_steps"], int(cfg["budget_s"] / warm_s)))
    first = cfg["warmup"] + extra
    for i in range(cfg["warmup"], first):
        step(ids[i], targets[i])
    reset()
    dist.barrier()
    times = []
    for i in range(first, first + steps):
        t0 = time.perf_counter()
        step(ids[i], targets[i])
        times.append(time.perf_counter() - t0)
    result["warmup_steps"] = first
    result["step_s"] = times
    result.update(stats(rank, ids[first : first + steps], steps))
    dist.barrier()


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds all processes of the machine spent busy, CPU seconds of this process and its ended children)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
    except (OSError, ValueError):
        busy = float("nan")
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(cfg: dict, method: str, num_rows: int) -> dict:
    """Spawn 2 ranks for one (method, rows) and summarize them."""
    wall = time.perf_counter()
    cpu_before = cpu_seconds()
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(
                rank_main, args=(cfg, method, num_rows, free_port(), out_dir), nprocs=WORLD, start_method="spawn"
            )
        except Exception as exc:  # a rank died (e.g. killed for memory)
            return {"method": method, "rows": num_rows, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]}
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD)]
    busy, ours = (after - before for after, before in zip(cpu_seconds(), cpu_before))
    row: dict = {"method": method, "rows": num_rows, "run_wall_s": time.perf_counter() - wall}
    # CPU time that processes other than this benchmark used meanwhile: other work on the machine skews timings.
    row["other_cpu_s"] = round(max(0.0, busy - ours), 2)
    row["peak_rss_mib"] = [r["peak_rss_mib"] for r in ranks]
    row["rss_start_mib"] = [r["rss_start_mib"] for r in ranks]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        row["error"] = errors[0]
        return row
    # A step ends when the slowest rank finishes it: per step, the max over ranks.
    per_step = [max(ts) for ts in zip(*(r["step_s"] for r in ranks))]
    row["step_ms_median"] = 1e3 * statistics.median(per_step)
    quartiles = statistics.quantiles(per_step, n=4) if len(per_step) > 1 else per_step * 3
    row["step_ms_p25"], row["step_ms_p75"] = 1e3 * quartiles[0], 1e3 * quartiles[2]
    row["step_ms_min"] = 1e3 * min(per_step)
    row["step_ms_max"] = 1e3 * max(per_step)
    row["step_ms_all"] = [round(1e3 * t, 3) for t in per_step]
    row["setup_s"] = max(r["setup_s"] for r in ranks)
    row["warmup_steps"] = ranks[0]["warmup_steps"]
    row["measured_steps"] = len(per_step)
    for key in ranks[0]:
        if key.endswith("_per_step"):
            values = [r[key] for r in ranks]
            row[key] = statistics.mean(values) if None not in values else None  # mean over ranks
        elif key == "bytes_source":
            row[key] = ranks[0][key]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000, 4_000_000])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096, help="lookups per rank per step")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the id distribution")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps before the step time is estimated")
    parser.add_argument("--extra-warmup-s", type=float, default=0.5, help="then more warm-up steps, about this long")
    parser.add_argument("--max-extra-warmup", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=4.0, help="measured steps: about this long per method and size")
    parser.add_argument("--min-steps", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--lightning-rows", type=int, default=100_000,
                        help="table rows of the Lightning-overhead comparison (0: skip it)")
    parser.add_argument("--lightning-warmup", type=int, default=10)
    parser.add_argument("--lightning-steps", type=int, default=100)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sparse_step.json"))
    args = parser.parse_args()

    base = {"dim": args.dim, "batch": args.batch, "zipf": args.zipf, "warmup": args.warmup,
            "extra_warmup_s": args.extra_warmup_s, "max_extra_warmup": args.max_extra_warmup,
            "budget_s": args.budget_s, "min_steps": args.min_steps, "max_steps": args.max_steps}  # fmt: skip
    start = time.perf_counter()
    code_before = _code_state()
    runs = []
    plan = [(rows, method, base) for rows in args.rows for method in args.methods]
    if args.lightning_rows:
        # Fixed step counts, the same for both: Trainer's loop is not adaptive.
        fixed = {**base, "warmup": 2, "max_extra_warmup": args.lightning_warmup - 2, "extra_warmup_s": 1e9,
                 "min_steps": args.lightning_steps, "max_steps": args.lightning_steps,
                 "lightning_warmup": args.lightning_warmup, "lightning_steps": args.lightning_steps}  # fmt: skip
        plan += [(args.lightning_rows, method, fixed) for method in LIGHTNING_PAIR]
    for rows, method, cfg in plan:
        row = run_one(cfg, method, rows)
        runs.append(row)
        if "error" in row:
            print(f"{rows:>9} rows  {method:<16} ERROR {row['error']}", flush=True)
            continue
        sent = row.get("bytes_sent_per_step")
        print(
            f"{rows:>9} rows  {method:<16} {row['step_ms_median']:9.2f} ms/step  "
            f"{(sent or 0) / 2**20:9.3f} MiB sent/rank/step  peak RSS {max(row['peak_rss_mib']):7.0f} MiB  "
            f"({row['run_wall_s']:.1f} s, other processes {row['other_cpu_s']:.1f} CPU-s)",
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
        "code": {"before": code_before, "after": _code_state()},
        "total_wall_s": total,
        "other_cpu_s": round(sum(r.get("other_cpu_s", 0.0) for r in runs), 1),
        "runs": runs,
        "lightning_pair": list(LIGHTNING_PAIR) if args.lightning_rows else [],
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} ({total:.0f} s)")


def _code_state() -> dict:
    """The commit measured, and whether lightning_sparse/ had uncommitted changes."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "lightning_sparse_uncommitted": git("status", "--porcelain", "--", "lightning_sparse").splitlines()}  # fmt: skip


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
