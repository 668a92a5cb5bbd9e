"""Widen the exit race: imported at start-up when this folder is on PYTHONPATH and LS_EXIT_WIDEN=1 (../stress.py).

Two knobs make the abort at exit (a gloo worker thread asking for the GIL during interpreter
finalization) likely instead of rare, and one check makes its precondition certain to be seen:

- each process runs on one CPU, so the main thread, woken by a finished collective, usually
  preempts the worker thread before it has released that collective's work and tensors;
- a switch interval of one second: a worker waiting for the GIL gets it only when the main thread
  blocks, not after the usual 5 ms, so a release that misses the last blocking call before exit
  happens during finalization;
- at exit, after every other handler (lightning_sparse's among them: this one is registered first, and
  ``atexit`` runs handlers last-registered first), the default process group must be gone. A group
  still alive here is destroyed during finalization, the window where the abort happens: this
  prints ``GROUP_ALIVE_MARK``, which fails the run whether or not the race is lost this time.
"""

import atexit
import os
import sys

GROUP_ALIVE_MARK = "exit check: a process group is still alive as the interpreter finalizes"


def _check_no_group_is_alive() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        print(f"{GROUP_ALIVE_MARK} (pid {os.getpid()})", file=sys.stderr, flush=True)


if os.environ.get("LS_EXIT_WIDEN") == "1":
    atexit.register(_check_no_group_is_alive)
    sys.setswitchinterval(float(os.environ.get("LS_EXIT_SWITCH_INTERVAL", "1.0")))
    os.sched_setaffinity(0, {os.getpid() % os.cpu_count()})
