"""Two gloo ranks on CPU: one embedding table trained five ways, the same ids for each.

Each step, on each rank: look up a batch of Zipf-distributed ids (duplicates within and across
ranks) -> ``mean((rows @ proj - target)^2)`` -> backward -> an Adagrad step -> zero_grad.

Methods (each in 2 fresh processes, ``ranks.py``, so peak RSS, each rank's own ``VmHWM``, is per method; a smoke
run, ``run(shared_ranks=True)``, runs them one after the other in the same 2):

* ``ours``: ``lightning_sparse.SparseEmbedding(sharding="mod")`` + ``SparseAdagrad``, plain torch loop.
  ``ours_pipelined`` (not in ``METHODS``, so run by name: ``run([100_000], [4096], ["ours", "ours_pipelined"])``)
  is the same loop with each step's ids sent to their owners during the step before (``lightning_sparse.Pipeline``);
  ``ours_shared`` (also by name) the same loop with the table in shared memory (``shared_memory=True``).
* ``sparse_ddp``: the same table in a LightningModule, ``Trainer(strategy="sparse_ddp")``.
* ``dgl``: ``dgl.nn.NodeEmbedding`` + ``dgl.optim.SparseAdagrad`` (one table in shared memory).
* ``sparse_grad_ddp``: ``nn.Embedding(sparse=True)`` in DistributedDataParallel + ``torch.optim.Adagrad``
  (gloo all-gathers each sparse gradient).
* ``lightning_ddp``: ``nn.Embedding`` (dense gradient) in a LightningModule, ``Trainer(strategy="ddp")``
  + ``torch.optim.Adagrad``: the table a Lightning user has today, all-reduced in full every step.

Reported per method: median step time and spread (a step ends when the slower rank finishes
it), bytes each rank sends per step against the lower bound, peak RSS per rank. The lower bound
is what must cross between ranks however it is done: each distinct row a rank needs from the
other, sent once each way (the row to the requester, its gradient back), at 4 bytes per element.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
import uuid
from datetime import timedelta
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DGLBACKEND", "pytorch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dynamic import peak_rss_mib  # noqa: E402  (benchmarks/dynamic.py)
from ranks import start_ranks  # noqa: E402  (benchmarks/ranks.py)
from torch import nn  # noqa: E402

from lightning_sparse.faults import exits  # noqa: E402

METHODS = ("ours", "sparse_ddp", "dgl", "sparse_grad_ddp", "lightning_ddp")
LIGHTNING = ("sparse_ddp", "lightning_ddp")
WORLD = 2
FLOAT_BYTES, ID_BYTES = 4, 8


def make_batches(rank: int, cfg: dict, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids ``[steps, batch]`` from Zipf(s) over the rows (row ``k`` has weight ``(k+1)^-s``), targets, a projection."""
    gen = torch.Generator().manual_seed(1000 + rank)
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow_(-cfg["zipf"])
    ids = torch.multinomial(weights, cfg["steps"] * cfg["batch"], replacement=True, generator=gen)
    targets = torch.randn(cfg["steps"], cfg["batch"], generator=gen)
    proj = torch.randn(cfg["dim"], generator=torch.Generator().manual_seed(0))
    return ids.view(cfg["steps"], cfg["batch"]), targets, proj


def loss_fn(rows: torch.Tensor, target: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    return ((rows @ proj) - target).pow(2).mean()


def lower_bound_bytes(rank: int, ids: torch.Tensor, dim: int) -> float:
    """Per step: distinct rows this rank needs from the peer plus those the peer needs from it, one row each ("mod")."""
    mine = torch.tensor([float((torch.unique(row) % WORLD != rank).sum()) for row in ids])
    both = [torch.zeros_like(mine) for _ in range(WORLD)]
    dist.all_gather(both, mine)
    return float((both[rank] + both[1 - rank]).mean()) * dim * FLOAT_BYTES


# ---------------------------------------------------------------------- plain loops
def build_ours(cfg: dict, rows: int, proj: torch.Tensor, pipelined: bool = False, shared_memory: bool = False):
    import lightning_sparse as ls

    emb = ls.SparseEmbedding(rows, cfg["dim"], sharding="mod", seed=0, shared_memory=shared_memory)
    opt = ls.SparseAdagrad([emb], lr=0.1)
    # Pipelined: the steps take the batches in order, so step i looks up these objects (the values run_loop passes)
    # and sends step i + 1's ahead first.
    batches = list(make_batches(dist.get_rank(), cfg, rows)[0].unbind(0)) if pipelined else []
    pipeline, taken = ls.Pipeline(lambda ids: {emb: ids}), [0]

    def step(ids, target):
        if pipelined:
            i, ids = taken[0], batches[taken[0]]
            if i == 0:
                pipeline.send_ahead(ids)
            if i + 1 < len(batches):
                pipeline.send_ahead(batches[i + 1])
            taken[0] += 1
        loss_fn(emb(ids), target, proj).backward()
        opt.step()
        opt.zero_grad()

    def reset():
        emb.stats.reset()
        opt.stats.reset()

    def stats(steps):
        return {"bytes_sent_per_step": (emb.stats.bytes_sent + opt.stats.bytes_sent) / steps,
                "bytes_source": "measured (ExchangeStats: every byte of the all-to-alls that leaves the rank)",
                "collectives_per_step": (emb.stats.collectives + opt.stats.collectives) / steps,
                "unique_ids_per_step": emb.stats.unique_ids / steps, "rounds_ahead_per_step": emb.stats.rounds_ahead / steps}  # fmt: skip

    return step, reset, stats


def build_sparse_grad_ddp(cfg: dict, rows: int, proj: torch.Tensor):
    from torch.nn.parallel import DistributedDataParallel

    emb = nn.Embedding(rows, cfg["dim"], sparse=True)
    nn.init.normal_(emb.weight, std=cfg["dim"] ** -0.5)
    model = DistributedDataParallel(emb)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    counted: list[float] = []

    def step(ids, target):
        counted.append(float(len(torch.unique(ids))))
        loss_fn(model(ids), target, proj).backward()
        opt.step()
        opt.zero_grad()

    def stats(steps):
        # gloo's sparse all-reduce all-gathers the coalesced indices and values, padded to the largest
        # nnz of any rank: each rank sends max_nnz * (8 + 4 * dim) bytes to each peer.
        mine = torch.tensor(counted[-steps:])
        both = [torch.zeros_like(mine) for _ in range(WORLD)]
        dist.all_gather(both, mine)
        max_nnz = float(torch.stack(both).max(dim=0).values.mean())
        return {"bytes_sent_per_step": max_nnz * (ID_BYTES + cfg["dim"] * FLOAT_BYTES) * (WORLD - 1),
                "bytes_source": "computed: the larger rank's distinct ids x (8 + 4*dim) bytes (gloo's sparse all-reduce is an all-gather)"}  # fmt: skip

    return step, counted.clear, stats


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


def build_dgl(cfg: dict, rows: int, proj: torch.Tensor):
    import dgl

    _use_private_dgl_store()
    name = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    std = cfg["dim"] ** -0.5
    emb = dgl.nn.NodeEmbedding(rows, cfg["dim"], f"lsbench_{name[0]}", init_func=lambda t: nn.init.normal_(t, std=std))
    opt = dgl.optim.SparseAdagrad([emb], lr=0.1)
    foreign: list[float] = []

    def step(ids, target):
        foreign.append(float((ids % WORLD != dist.get_rank()).sum()))
        loss_fn(emb(ids), target, proj).backward()
        opt.zero_grad()  # DGL: marks the trace to be cleared by step() after it has read it
        opt.step()

    def stats(steps):
        return {"bytes_sent_per_step": statistics.mean(foreign[-steps:]) * (ID_BYTES + cfg["dim"] * FLOAT_BYTES),
                "bytes_source": "computed: gradient rows (with duplicates) of ids the peer owns, written to shared "
                "memory; lookups read the shared table"}  # fmt: skip

    return step, foreign.clear, stats


BUILDERS = {"ours": build_ours, "ours_pipelined": partial(build_ours, pipelined=True),
            "ours_shared": partial(build_ours, shared_memory=True), "sparse_grad_ddp": build_sparse_grad_ddp, "dgl": build_dgl}  # fmt: skip


def run_loop(rank: int, cfg: dict, method: str, rows: int, result: dict) -> None:
    """Build ``method``, warm up, agree on a step count, time the steps."""
    ids, targets, proj = make_batches(rank, cfg, rows)
    start = time.perf_counter()
    step, reset, stats = BUILDERS[method](cfg, rows, proj)
    dist.barrier()
    result["setup_s"] = time.perf_counter() - start
    for i in range(cfg["warmup"]):
        t0 = time.perf_counter()
        step(ids[i], targets[i])
    # Every rank must run the same number of steps: agree on the slowest rank's warm step time.
    warm = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    steps = max(cfg["min_steps"], min(cfg["steps"] - cfg["warmup"], int(cfg["budget_s"] / float(warm))))
    reset()
    dist.barrier()
    times = []
    for i in range(cfg["warmup"], cfg["warmup"] + steps):
        t0 = time.perf_counter()
        step(ids[i], targets[i])
        times.append(time.perf_counter() - t0)
    result["step_s"] = times
    result.update(stats(steps))
    result["lower_bound_bytes_per_step"] = lower_bound_bytes(rank, ids[cfg["warmup"] : cfg["warmup"] + steps], cfg["dim"])


# ---------------------------------------------------------------------- Lightning
def run_lightning(rank: int, cfg: dict, method: str, rows: int, result: dict) -> None:
    """A LightningModule with the table and the loss's projection as a dense parameter; a step is the
    time between consecutive ``on_train_batch_start`` calls (the Trainer's whole loop)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["BENCH_PORT"], WORLD_SIZE=str(WORLD),
                      NODE_RANK="0", LOCAL_RANK=str(rank), RANK=str(rank))  # fmt: skip
    import lightning.pytorch as pl

    import lightning_sparse as ls

    ids, targets, proj = make_batches(rank, cfg, rows)
    sparse = method == "sparse_ddp"

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if sparse:
                self.emb = ls.SparseEmbedding(rows, cfg["dim"], sharding="mod", seed=0)
            else:
                self.emb = nn.Embedding(rows, cfg["dim"])
                nn.init.normal_(self.emb.weight, std=cfg["dim"] ** -0.5)
            self.proj = nn.Parameter(proj.clone())

        def training_step(self, batch, batch_idx):
            batch_ids, target = batch
            return loss_fn(self.emb(batch_ids), target, self.proj)

        def configure_optimizers(self):
            params = [self.proj] if sparse else self.parameters()
            return torch.optim.Adagrad(params, lr=0.1)

        def configure_sparse_optimizers(self):
            return ls.SparseAdagrad([self.emb], lr=0.1)

    starts: list[float] = []
    warmup = cfg["warmup"]

    class Clock(pl.Callback):
        """Times steps; after the warm-up, every rank agrees on how many more steps fit the budget."""

        last = cfg["steps"] - 1

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            starts.append(time.perf_counter())
            if sparse and batch_idx == warmup:
                module.emb.stats.reset()
                trainer.strategy.sparse_optimizers[0].stats.reset()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == warmup - 1:
                warm = torch.tensor([time.perf_counter() - starts[-1]])
                dist.all_reduce(warm, op=dist.ReduceOp.MAX)  # the same answer on every rank
                more = max(cfg["min_steps"], min(cfg["steps"] - warmup - 1, int(cfg["budget_s"] / float(warm))))
                Clock.last = warmup + more  # one step past the measured ones: it ends the last measured step
            if batch_idx >= Clock.last:
                trainer.should_stop = True

    count = cfg["steps"]
    loader = torch.utils.data.DataLoader(list(zip(ids[:count], targets[:count])), batch_size=None, shuffle=False)
    start = time.perf_counter()
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=method.replace("lightning_", ""), max_steps=count, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False, callbacks=[Clock()],
    )  # fmt: skip
    module = Module()
    trainer.fit(module, train_dataloaders=loader)
    result["setup_s"] = time.perf_counter() - start
    steps = [b - a for a, b in zip(starts[warmup:], starts[warmup + 1 :])]
    result["step_s"] = steps
    measured = ids[warmup : warmup + len(steps)]
    if sparse:
        stats = module.emb.stats.bytes_sent + trainer.strategy.sparse_optimizers[0].stats.bytes_sent
        result["bytes_sent_per_step"] = stats / max(1, len(steps))
        result["bytes_source"] = "measured (ExchangeStats); the projection's DDP all-reduce not counted"
    else:
        result["bytes_sent_per_step"] = 2 * (WORLD - 1) / WORLD * rows * cfg["dim"] * FLOAT_BYTES
        result["bytes_source"] = "computed: DDP all-reduces the dense gradient of the whole table (ring: 2(W-1)/W x table)"
    result["lower_bound_bytes_per_step"] = lower_bound_bytes(rank, measured, cfg["dim"])


# ---------------------------------------------------------------------- one run: 2 ranks
def rank_main(rank: int, cfg: dict, methods: list[str], rows: int, port: int, out_dir: str) -> None:
    """``methods`` one after the other in one process group (:func:`run` puts the Lightning ones last: a Trainer sets up
    and tears down a process's distributed state its own way, the plain loops run before it)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))  # fmt: skip
    os.environ["BENCH_PORT"] = str(_free_port() if rank == 0 else 0)
    port_list = [os.environ["BENCH_PORT"]]
    dist.broadcast_object_list(port_list, src=0)
    os.environ["BENCH_PORT"] = port_list[0]
    for method in methods:
        result: dict = {"rank": rank}
        try:
            (run_lightning if method in LIGHTNING else run_loop)(rank, cfg, method, rows, result)
        except Exception as exc:  # recorded in the JSON; the other rank fails the same way
            result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        # This rank's own peak (VmHWM), not ru_maxrss: a spawned rank's ru_maxrss starts at the peak of
        # the process it was forked from, so every method showed the parent's 7 GiB.
        result["peak_rss_mib"] = peak_rss_mib()
        Path(out_dir, f"{method}.rank{rank}.json").write_text(json.dumps(result))
        if "error" in result:  # the ranks may be out of step: the methods after it are not run
            break
    # Lightning's objects hold the process group in reference cycles: free them and the group now,
    # not at interpreter shutdown (see docs/benchmarks.md, caveats, and lightning_sparse.faults.exits).
    exits.release_process_groups()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(cfg: dict, method: str, rows: int) -> dict:
    """Spawn 2 ranks for one (method, rows, batch) and summarize them."""
    return run_in_ranks(cfg, [method], rows)[0]


def run_in_ranks(cfg: dict, methods: list[str], rows: int) -> list[dict]:
    """Spawn 2 ranks that run ``methods`` (rows, batch) one after the other and summarize each method.

    A method's ``run_wall_s`` is its ranks' whole run, from their start to their exit.
    """
    wall = time.perf_counter()
    exit_error = None
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            start_ranks(rank_main, (cfg, methods, rows, _free_port(), out_dir), WORLD)
        except Exception as exc:  # a rank died (killed for memory), or aborted at exit after writing its results
            exit_error = exc
        ranks = {}
        for method in methods:
            files = [Path(out_dir, f"{method}.rank{r}.json") for r in range(WORLD)]
            if all(f.exists() for f in files):
                ranks[method] = [json.loads(f.read_text()) for f in files]
    wall = time.perf_counter() - wall
    return [_summarize(cfg, method, rows, ranks.get(method), exit_error, wall, methods) for method in methods]


def _summarize(cfg: dict, method: str, rows: int, ranks: list[dict] | None, exit_error: Exception | None, wall: float,
               methods: list[str]) -> dict:  # fmt: skip
    row: dict = {"method": method, "rows": rows, "batch": cfg["batch"]}
    if exit_error is not None:
        if ranks is None:
            return {**row, "error": f"{type(exit_error).__name__}: {exit_error}".splitlines()[0][:300]}
        row["exit"] = f"{type(exit_error).__name__} after the results were written: {exit_error}".splitlines()[0][:200]
    if ranks is None:  # a method before it in the same ranks failed
        return {**row, "error": f"not run: {' / '.join(methods)} in the same ranks, one failed before it"}
    row["run_wall_s"] = wall
    if len(methods) > 1:
        row["ranks_shared_with"] = [m for m in methods if m != method]
    row["peak_rss_mib"] = [r["peak_rss_mib"] for r in ranks]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {**row, "error": errors[0]}
    per_step = [max(ts) for ts in zip(*(r["step_s"] for r in ranks))]  # the slower rank ends the step
    quartiles = statistics.quantiles(per_step, n=4) if len(per_step) > 1 else per_step * 3
    row.update(step_ms_median=1e3 * statistics.median(per_step), step_ms_p25=1e3 * quartiles[0],
               step_ms_p75=1e3 * quartiles[2], measured_steps=len(per_step), setup_s=max(r["setup_s"] for r in ranks))  # fmt: skip
    for key in ("bytes_sent_per_step", "lower_bound_bytes_per_step", "collectives_per_step", "unique_ids_per_step",
                "rounds_ahead_per_step"):  # fmt: skip
        if key in ranks[0]:
            row[key] = statistics.mean(r[key] for r in ranks)
    row["bytes_source"] = ranks[0].get("bytes_source")
    return row


def run(rows_list: list[int], batches: list[int], methods: list[str], dim: int = 64, zipf: float = 1.1,
        budget_s: float = 3.0, min_steps: int = 5, max_steps: int = 120, warmup: int = 5, shared_ranks: bool = False,
        log=print) -> dict:  # fmt: skip
    """``shared_ranks``: a (rows, batch)'s methods one after the other in the same 2 ranks, the Lightning ones last (a
    smoke run: one start of the ranks instead of one per method; a method's peak RSS then includes the ones before it)."""
    runs = []
    for batch in batches:
        for rows in rows_list:
            cfg = {"dim": dim, "batch": batch, "zipf": zipf, "budget_s": budget_s, "min_steps": min_steps,
                   "warmup": warmup, "steps": warmup + max_steps + 1}  # fmt: skip
            if shared_ranks:  # the Lightning methods last (see rank_main)
                measured = run_in_ranks(cfg, sorted(methods, key=lambda m: m in LIGHTNING), rows)
            else:  # each in 2 ranks of its own; a generator: each method is logged as soon as it ends
                measured = (run_one(cfg, m, rows) for m in methods)
            for row in measured:
                method = row["method"]
                runs.append(row)
                if "error" in row:
                    log(f"  2 ranks  {rows:>9} rows  batch {batch:>6}  {method:<16} ERROR {row['error']}")
                else:
                    log(f"  2 ranks  {rows:>9} rows  batch {batch:>6}  {method:<16} {row['step_ms_median']:9.2f} ms/step")
    return {"world_size": WORLD, "backend": "gloo", "threads_per_rank": 1, "dim": dim, "zipf": zipf,
            "optimizer": "Adagrad(lr=0.1)", "runs": runs}  # fmt: skip
