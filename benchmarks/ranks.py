"""Starting a benchmark's ranks: forked from one server process that imported torch and lightning_sparse once.

Each measured method still runs in fresh processes (its own peak RSS, nothing left over from the
method before), but a rank starts in a fraction of a second instead of importing torch and
Lightning again (seconds per rank on a small machine): ``multiprocessing``'s ``forkserver`` with
those modules preloaded. The server is a fresh, single-threaded process, so forking it is safe
where forking the benchmark's own process (which has run threaded kernels) is not.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "lightning_sparse"]


def start_ranks(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` on ``nprocs`` processes; returns when all exit, raises if one fails (as ``mp.start_processes``)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
