"""Clean exits: nothing of lightning_sparse holds the process group, and fit-gather-destroy-exit never aborts.

The abort ("terminate called without an active exception", SIGABRT, about 1 run in 12) came from
a process group that outlived ``destroy_process_group()`` because a table held it: gloo's worker
threads then released it during interpreter shutdown (torch issue #190489). Tables and optimizers
now look the group up when needed, or hold a user's group weakly.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_sparse as ls
from rank_pool import RankPool

SCRIPT = Path(__file__).parent / "scripts" / "fit_and_exit.py"
RUNS, AT_ONCE = 30, 3


def _holders_of_the_group() -> list[str]:
    """lightning_sparse objects that refer to the default group, after a lookup, a step and a checkpoint."""
    table = ls.SparseEmbedding(100, 4)
    optimizer = ls.SparseAdam([table])
    table(torch.arange(dist.get_rank(), 100, 3)).sum().backward()
    optimizer.step()
    module = torch.nn.Module()
    module.table = table
    table.full_weight()
    ours = (ls.SparseEmbedding, ls.SparseOptimizer)
    holders = []
    for referrer in gc.get_referrers(dist.group.WORLD):
        owners = [o for o in gc.get_referrers(referrer) if isinstance(o, ours) and getattr(o, "__dict__", None) is referrer]
        holders += [type(o).__name__ for o in owners] + ([type(referrer).__name__] if isinstance(referrer, ours) else [])
    return holders


def test_no_table_or_optimizer_holds_the_process_group(rank_pools):
    assert rank_pools(2).run(_holders_of_the_group) == [[], []]


def _use_after_destroy() -> str:
    table = ls.SparseEmbedding(10, 2)
    table(torch.tensor([1]))
    dist.destroy_process_group()
    try:
        table(torch.tensor([1]))
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_a_table_used_after_destroy_process_group_says_so():
    pool = RankPool(2)  # its group is destroyed: not a shared pool
    try:
        results = pool.run_raw(_use_after_destroy, timeout=60)
    finally:
        pool.close()
    for message in results:
        assert "has been destroyed" in message and "HINT" in message


@pytest.mark.timeout(900)
def test_fit_gather_destroy_exit_never_aborts(tmp_path):
    """30 runs of 2 spawned ranks that fit with sparse_ddp, gather a table, destroy the group and exit."""
    failures = []
    for start in range(0, RUNS, AT_ONCE):
        runs = [
            subprocess.Popen([sys.executable, str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
            for _ in range(min(AT_ONCE, RUNS - start))
        ]
        for run in runs:
            output, _ = run.communicate(timeout=300)
            if run.returncode != 0 or "terminate called" in output or output.count(" done") != 2:
                failures.append(f"exit code {run.returncode}:\n{output[-2000:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs did not exit cleanly:\n" + "\n".join(failures[:2])


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.timeout(180)
def test_a_hung_rank_does_not_outlive_the_fit(tmp_path):
    """Rank 1 hangs; rank 0 fails with PeerFailure after the 10 s timeout and kills the rank it launched."""
    import os
    import signal
    import time

    pid_file = tmp_path / "pid"
    start = time.monotonic()
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "scripts" / "hang_one_rank.py"), str(pid_file), "sleep"],
                         capture_output=True, text=True, timeout=150, cwd=tmp_path)  # fmt: skip
    seconds = time.monotonic() - start
    pid = int(pid_file.read_text())
    time.sleep(1)
    alive = _running(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert run.returncode != 0 and "PeerFailure" in run.stderr + run.stdout, run.stderr[-2000:]
    assert not alive, f"rank 1 (pid {pid}) was left running after the fit failed"
    assert seconds < 90
