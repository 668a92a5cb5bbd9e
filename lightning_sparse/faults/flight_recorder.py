"""torch's flight recorder off by default: the records it keeps of every collective fragment a long run's heap.

torch 2.13 records each collective of a process group (gloo too) in a ring of
``TORCH_FR_BUFFER_SIZE`` entries, 2000 by default, each with a captured Python traceback and the
tensors' sizes: small allocations that live for the next 2000 collectives. A training step makes
3 or more collectives and frees temporaries of a few MiB between them (rows, gradients,
optimizer state of the batch), whose sizes change with the batch. glibc keeps such temporaries
in its heap (it raises its mmap threshold to the largest block freed so far), and the records,
carved out of the holes the temporaries leave, pin them: the heap cannot reuse the holes for the
next, slightly larger temporaries and grows, until the ring is full (about 670 steps of 3
collectives). A stream of 10 million ids through a dynamic table on 2 gloo ranks grew each rank's
resident memory by 43 and 54 MiB after its first tenth; without the records, by 2 to 8 MiB.

:func:`install` (``import lightning_sparse`` calls it) sets ``TORCH_FR_BUFFER_SIZE=0`` unless the
program set it or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` itself: a program that wants torch's records
(an NCCL job that dumps them on a timeout) sets either variable, and this module leaves both
alone. torch reads the variable once, when the process creates its first process group of a
backend: groups created before ``import lightning_sparse`` keep their recorder.
"""

from __future__ import annotations

import os

# The variables torch reads for the size of the ring (the first one set wins), and the size we set.
BUFFER_SIZE_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
BUFFER_SIZE = "0"


def install() -> None:
    """Turn torch's flight recorder off for process groups created from now on, unless the program sized it (see the module)."""
    if not any(name in os.environ for name in BUFFER_SIZE_VARIABLES):
        os.environ[BUFFER_SIZE_VARIABLES[0]] = BUFFER_SIZE
