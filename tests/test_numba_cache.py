"""Processes of one host that reach a numba kernel together compile it once (``backend.compiled_call``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_sparse.kernels import backend

pytestmark = [pytest.mark.subprocesses, pytest.mark.skipif(not backend.numba_available(), reason="needs numba")]

# A kernel of its own (cached on disk), so that the callers import torch, numba and kernels/backend.py only (not the package
# and Lightning: seconds each).
KERNEL = textwrap.dedent(
    """
    import numba

    @numba.njit(cache=True)
    def runs(keys):
        count = 0
        for i in range(keys.shape[0]):
            count += i == 0 or keys[i] != keys[i - 1]
        return count
    """
)
# Both processes import numba, say they are ready, wait for the other, then call the kernel at the same moment: each would
# compile it before the other has written the cache.
CALLER = textwrap.dedent(
    """
    import importlib.util, json, os, sys, time
    import numpy as np

    spec = importlib.util.spec_from_file_location("backend", sys.argv[3])
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    import kernel

    me, other = sys.argv[1], sys.argv[2]
    open(me, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(other) and time.monotonic() < deadline:
        time.sleep(0.001)
    runs = backend.compiled_call(kernel.runs, np.array([1, 1, 2], dtype=np.int64))
    stats = kernel.runs.stats
    print(json.dumps({"runs": runs, "compiled": sum(stats.cache_misses.values()), "loaded": sum(stats.cache_hits.values())}))
    """
)


def test_processes_that_reach_a_kernel_together_compile_it_once(tmp_path):
    (tmp_path / "kernel.py").write_text(KERNEL)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path)}  # an empty cache
    ready = [str(tmp_path / name) for name in ("a", "b")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CALLER, mine, theirs, str(Path(backend.__file__))], env=env, stdout=subprocess.PIPE, text=True
        )  # fmt: skip
        for mine, theirs in (ready, ready[::-1])
    ]
    results = [json.loads(proc.communicate(timeout=120)[0].strip().splitlines()[-1]) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert [r["runs"] for r in results] == [2, 2]
    # One compiled and wrote the cache while the other waited for the lock, then loaded what it wrote.
    assert sorted((r["compiled"], r["loaded"]) for r in results) == [(0, 1), (1, 0)], results
