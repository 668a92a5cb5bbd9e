"""Clean exits: no collective's worker thread may ask for the GIL once the interpreter finalizes.

The abort this module prevents ("terminate called without an active exception", SIGABRT, after
the program's last line) is a chain of four facts, each seen in a core dump of the abort:

1. gloo runs every collective on a worker thread of its process group. The worker marks the work
   finished (the caller's ``wait()`` returns) and only then drops its reference to the work, and
   with it the work's tensors.
2. Dropping a C++ reference to a tensor that has a Python object takes the GIL (torch 2.13 keeps
   the Python object alive from C++ while C++ holds the tensor, and releases it with
   ``TensorImpl::decref_pyobject``), whether or not Python still refers to the tensor. Keeping
   the tensors referenced from Python therefore does not help.
3. A thread that asks for the GIL after ``Py_FinalizeEx`` has begun is ended with
   ``pthread_exit`` (CPython 3.11 and 3.12), which unwinds through the ``noexcept`` destructor of
   the work: ``std::terminate``.
4. A worker falls into that window when its group is still alive at finalization (destroyed
   there, when the module globals go) and the worker has not yet released the last work it ran:
   it was descheduled, or waited for the GIL while the main thread went on to exit.

``destroy_process_group()`` alone does not close the window: gloo's ``shutdown()`` leaves the
worker threads running, and they are joined only when the last reference to the group goes,
which a live object may delay until finalization. With torch 2.13 that is the common case, not
the exception: a group used by DistributedDataParallel, or created before
``torch.distributed.checkpoint`` was imported, stays referenced from C++ after the wrapper is
freed and the group destroyed (no Python object refers to it), so step 4 is what protects them.

At exit (an ``atexit`` handler, registered on ``import lightning_sparse``, so plain PyTorch
programs get it too) :func:`release_process_groups` therefore

1. collects garbage, so works, DDP wrappers and groups held only by reference cycles go now;
2. destroys every process group still registered with ``torch.distributed``;
3. so frees every group that nothing else holds: its destructor joins its worker threads with
   the GIL released, so every pending release happens now;
4. waits, with the GIL released, until no other thread of the process is runnable (at most
   ``DRAIN_TIMEOUT_S``): a group that a live object still holds keeps its workers, and a worker
   with a work left to release gets the GIL now instead of during finalization.

pytorch/pytorch#179291 proposed steps 1-2 for torch itself and was abandoned; the stress script
``tests/exits/stress.py`` runs every exit shape with the race widened and counts aborts.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
import time

import torch.distributed as dist

log = logging.getLogger(__name__)

# The longest the exit handler waits for other threads to go idle; a worker needs microseconds.
DRAIN_TIMEOUT_S = 2.0
# The drain sleeps this long between looks at the threads (each sleep releases the GIL).
_DRAIN_POLL_S = 0.002

_installed = False


def install() -> None:
    """Register :func:`release_process_groups` to run at exit (once; ``import lightning_sparse`` does it).

    ``atexit`` runs handlers in reverse order of registration, so handlers registered after
    this one (a logger that finishes a run, a program's own cleanup) run first and may still use
    the groups.
    """
    global _installed
    if not _installed:
        _installed = True
        atexit.register(release_process_groups)


def release_process_groups() -> None:
    """Destroy the process groups and let their worker threads finish, while the interpreter is alive.

    Safe to call more than once and without ``torch.distributed``; after it, the groups are gone.
    Called by the exit handler; a program may also call it itself before it ends.
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 - exiting anyway; the drain below still runs
            log.debug("destroying the process groups at exit failed: %s", err)
    _drain_other_threads()


def _drain_other_threads(timeout: float = DRAIN_TIMEOUT_S) -> bool:
    """Sleep (releasing the GIL) until no other thread is runnable twice in a row; True if that happened.

    A worker that waits for the GIL to release a finished work is woken by the first sleep, does
    so and goes back to waiting for work: sleeping. Where ``/proc`` is missing (not Linux) the
    wait is two poll intervals.
    """
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        time.sleep(_DRAIN_POLL_S)
        runnable = _runnable_threads()
        quiet = quiet + 1 if runnable == 0 else 0
        if quiet >= 2:
            return True
    log.debug("other threads still runnable after %.1f s at exit", timeout)
    return False


def _runnable_threads() -> int:
    """How many threads of this process other than the calling one are running or runnable (Linux)."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    runnable = 0
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]  # the field after "(comm)"
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        runnable += state == "R"
    return runnable
