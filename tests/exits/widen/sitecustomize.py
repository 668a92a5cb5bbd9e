"""Widen the exit race: imported at start-up when this folder is on PYTHONPATH and LS_EXIT_WIDEN=1 (../stress.py).

Two knobs make the abort at exit (a gloo worker thread asking for the GIL during interpreter
finalization) likely instead of rare:

- each process runs on one CPU, so the main thread, woken by a finished collective, usually
  preempts the worker thread before it has released that collective's work and tensors;
- a switch interval of one second: a worker waiting for the GIL gets it only when the main thread
  blocks, not after the usual 5 ms, so a release that misses the last blocking call before exit
  happens during finalization.
"""

import os
import sys

if os.environ.get("LS_EXIT_WIDEN") == "1":
    sys.setswitchinterval(float(os.environ.get("LS_EXIT_SWITCH_INTERVAL", "1.0")))
    os.sched_setaffinity(0, {os.getpid() % os.cpu_count()})
