"""Processes of one host that reach a numba kernel together compile it once (``backend.compiled_call``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from lightning_sparse.kernels import backend

pytestmark = pytest.mark.skipif(not backend.numba_available(), reason="needs numba")

# Both processes import numba, say they are ready, wait for the other, then call the kernel at the same moment: each would
# compile it (about a second) before the other has written the cache.
CALLER = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    from lightning_sparse.kernels import backend, numba_runs

    me, other = sys.argv[1], sys.argv[2]
    open(me, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(other) and time.monotonic() < deadline:
        time.sleep(0.001)
    keys = np.array([1, 1, 2], dtype=np.int64)
    runs = backend.compiled_call(numba_runs.run_starts, keys, np.empty(4, dtype=np.int64))
    stats = numba_runs.run_starts.stats
    print(json.dumps({"runs": runs, "compiled": sum(stats.cache_misses.values()), "loaded": sum(stats.cache_hits.values())}))
    """
)


def test_processes_that_reach_a_kernel_together_compile_it_once(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}  # empty: neither finds the kernel compiled
    ready = [str(tmp_path / name) for name in ("a", "b")]
    procs = [
        subprocess.Popen([sys.executable, "-c", CALLER, mine, theirs], env=env, stdout=subprocess.PIPE, text=True)
        for mine, theirs in (ready, ready[::-1])
    ]
    results = [json.loads(proc.communicate(timeout=120)[0].strip().splitlines()[-1]) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert [r["runs"] for r in results] == [2, 2]
    # One compiled and wrote the cache while the other waited for the lock, then loaded what it wrote.
    assert sorted((r["compiled"], r["loaded"]) for r in results) == [(0, 1), (1, 0)], results
