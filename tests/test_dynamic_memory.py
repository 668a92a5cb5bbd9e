"""A long stream through a DynamicEmbedding leaves nothing behind in the heap (lightning_sparse.faults.flight_recorder).

The resident memory of a 10-million-id stream on 2 ranks (``benchmarks/dynamic.py``) grew by
43-54 MiB after its first tenth because small records of every collective (torch's flight
recorder) stayed alive among the step's freed temporaries. In a few seconds of a test, resident
memory moves by whole MiB either way as the heap settles; the bytes the heap holds in use
(glibc's ``mallinfo2``) do not: with the records they grew by about 5 KiB a step on each rank,
without them they stay flat after the first steps.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import sys

import pytest
import torch

import lightning_sparse as ls

STEPS, WARM_UP = 40, 10  # steps measured, after the warm-up's steps
# Heap bytes in use may grow this much over the measured steps (a run without the records: 3-14 KiB;
# with them: about 200 KiB).
HEAP_GROWTH_LIMIT = 64 * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _heap_in_use() -> int:
    """Bytes of the process's heap that are allocated (glibc's ``mallinfo2().uordblks``)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().uordblks


def _recorded_collectives() -> int:
    """How many collectives torch's flight recorder holds in this process."""
    from torch._C._distributed_c10d import _dump_fr_trace

    return len(pickle.loads(_dump_fr_trace()).get("entries", []))


def _stream(batch: int, dim: int, capacity: int) -> tuple[int, int]:
    """Every id new (the table full and evicting after a few steps): growth of the heap in use after warm-up, and records."""
    from lightning_sparse.wire.hashing import mix

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    table = ls.DynamicEmbedding(capacity, dim, seed=0)
    optimizer = ls.SparseAdagrad([table], lr=0.1)
    start = None
    for step in range(WARM_UP + STEPS):
        first = (step * world + rank) * batch
        table(mix(torch.arange(first, first + batch))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == WARM_UP - 1:
            start = _heap_in_use()
    return _heap_in_use() - start, _recorded_collectives()


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc's heap")
def test_a_stream_leaves_nothing_behind_in_the_heap(rank_pools):
    for rank, (growth, records) in enumerate(rank_pools(2).run(_stream, 256, 16, 5000)):
        assert records == 0, f"rank {rank}: torch's flight recorder holds {records} collectives"
        assert growth < HEAP_GROWTH_LIMIT, f"rank {rank}: the heap in use grew by {growth} bytes over {STEPS} steps"
