"""A pool of spawned ranks that run the same function on request, for multi-process tests.

Spawning W processes costs seconds; a test that checks dozens of hypothesis examples instead
sends each example to a pool that stays up for the whole session. Every rank of the pool runs
the function (so it may call collectives) and sends back its result or its error.

CPU pools use gloo. CUDA pools give rank ``r`` GPU ``r % device_count`` and use NCCL when
every rank has a GPU of its own, else gloo (which moves CUDA tensors through the host).
"""

from __future__ import annotations

import gc
import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from run_queue import RunQueueWaits

from lightning_sparse.faults.peers import caused_by_lost_peer

# Tests that can run on a GPU are parametrized with these: CPU (gloo) always, CUDA when present.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]

# Collectives give up after this long, so a test never hangs on a lost peer.
COLLECTIVE_TIMEOUT_S = 30

# (world size, sharding group size): 1-D over every rank, or 2-D (sharded over G, replicated W / G times).
LAYOUTS = [pytest.param(w, None, id=f"W{w}") for w in (1, 2, 3, 4)] + [pytest.param(4, 2, id="W4-G2")]


@contextmanager
def table_groups(group_size: int | None):
    """``dict(process_group=..., replica_group=...)`` for a table: 2-D groups (destroyed after), or the default group."""
    import lightning_sparse as ls

    if group_size is None:
        yield {}
        return
    shard_group, replica_group = ls.sharding_groups(group_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        yield {"process_group": shard_group, "replica_group": replica_group}
    finally:
        for group in (shard_group, replica_group):
            if group is not None:
                dist.destroy_process_group(group)


def assert_replicas_identical(results: list[tuple[torch.Tensor, ...]], group_size: int | None) -> None:
    """Under 2-D sharding the ranks at one position of each sharding group hold bit-identical tables.

    ``results[rank]``: tensors that rank computed (e.g. full tables, gathered inside its sharding group).
    """
    if group_size is not None:
        for rank, tensors in enumerate(results):
            for mine, first in zip(tensors, results[rank % group_size], strict=True):
                assert torch.equal(mine, first), f"rank {rank} differs from its replica {rank % group_size}"


# Ranks are forked from one server process that imported these once (multiprocessing's
# forkserver): a rank starts in a fraction of a second instead of importing torch again, and the
# server, a fresh single-threaded process, is safe to fork. Each rank is still its own process.
# lightning_sparse (and with it Lightning, dynamo and triton) and tests/lightning_models.py, which
# nearly every job imports: 1.3 s of CPU once per server instead of once per rank (about 40 ranks a run).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torchmetrics", "lightning_sparse", "lightning_models",
           "rank_pool"]  # fmt: skip

# A job that has not answered in this long, plus the time its ranks waited for a CPU (tests/run_queue.py), means the
# pool is broken: a hung rank fails at this limit on any machine, a job slowed by a loaded one does not.
JOB_TIMEOUT_S = 120


@dataclass
class RankError:
    """What a rank raised: exception type name, message and formatted traceback."""

    type: str
    message: str
    traceback: str
    peer_failure: bool = False  # a lost or failed peer (lightning_sparse.faults.peers.caused_by_lost_peer), not its own error


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def backend_for(device: str, world_size: int) -> str:
    if device == "cuda" and world_size <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def _worker(rank: int, world_size: int, port: int, device: str, inbox: mp.Queue, outbox: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend_for(device, world_size),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    # The modules every job imports (PRELOAD) live as long as the rank: frozen, the interpreter's
    # finalization skips its garbage-collection passes over them (seconds per rank at exit, all
    # ranks at once). triton is among them (lightning_sparse imports it through Lightning and
    # dynamo): nanobind would report its frozen objects as leaks at a finalization, but a rank of
    # the forkserver ends with os._exit (no finalization) and the server itself freezes nothing.
    gc.freeze()
    try:
        while (job := inbox.get()) is not None:
            fn, args = _loads(job)
            try:
                outbox.put((rank, _dumps(("ok", fn(*args)))))
            except BaseException as err:  # noqa: BLE001 - every error goes back to the test
                error = RankError(type(err).__name__, str(err), traceback.format_exc(), caused_by_lost_peer(err))
                outbox.put((rank, _dumps(("err", error))))
    finally:
        if dist.is_initialized():  # a job may have destroyed it
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankPool:
    """``world_size`` spawned ranks in one group; ``run(fn, *args)`` runs ``fn`` on every rank."""

    def __init__(self, world_size: int, device: str = "cpu") -> None:
        self.world_size, self.device = world_size, device
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, on the first pool
        port = free_port()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(rank, world_size, port, device, self._inboxes[rank], self._outbox), daemon=True)
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False
        self._stopped = False

    def run_raw(self, fn: Callable[..., Any], *args: Any, timeout: float = JOB_TIMEOUT_S) -> list[Any]:
        """Per-rank results, with a :class:`RankError` in place of a rank that raised or died."""
        job = _dumps((fn, args))
        for inbox in self._inboxes:
            inbox.put(job)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        waits = RunQueueWaits([p.pid for p in self._procs])
        while len(results) < self.world_size:
            try:
                rank, data = self._outbox.get(timeout=1)
                results[rank] = _loads(data)[1]
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
            if dead and all(r in results or r in dead for r in range(self.world_size)):
                self.broken = True
                for r in dead:
                    code = self._procs[r].exitcode
                    results[r] = RankError("ProcessDied", f"rank {r} exited with code {code}", "")
                continue
            waits.sample()
            if time.monotonic() > deadline + waits.most():
                self.broken = True
                raise TimeoutError(
                    f"{fn.__name__} did not finish on all {self.world_size} ranks within {timeout}s "
                    f"(plus the {waits.most():.0f} s they waited for a CPU)"
                )
        return [results[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = JOB_TIMEOUT_S) -> list[Any]:
        """Per-rank results; raises if any rank raised, with every rank's traceback: first those of the ranks that raised
        an error of their own, then those of the ranks that only saw a peer fail ("Connection closed by peer")."""
        results = self.run_raw(fn, *args, timeout=timeout)
        failed = sorted((res.peer_failure, r) for r, res in enumerate(results) if isinstance(res, RankError))
        if failed:
            raise AssertionError("\n".join(
                f"rank {r}{' (a peer failed)' if peer else ''}:\n{results[r].traceback}" for peer, r in failed
            ))  # fmt: skip
        return results

    def stop(self) -> None:
        """Tell the ranks to leave (they destroy their group and exit); :meth:`close` waits for them."""
        if not self._stopped:
            for inbox in self._inboxes:
                inbox.put(None)
            self._stopped = True

    def close(self) -> None:
        """Stop the ranks and wait; raises unless each exited with code 0 (an abort at exit is -6)."""
        self.stop()
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        codes = [p.exitcode for p in self._procs]
        if not self.broken and codes != [0] * self.world_size:
            raise AssertionError(f"the ranks of a {self.world_size}-rank pool exited with codes {codes}")
