"""Which implementation runs a kernel: Triton on a GPU, numba or plain torch on a CPU.

Every kernel in this folder has two implementations of one contract: a Triton kernel, for
CUDA tensors, and plain torch ops, for CPU tensors (fast there: ``index_select``,
``F.embedding_bag``) and for a GPU without Triton. :func:`uses_triton` picks one per call.
The optimizer's fused update has a third, for CPU tensors: a numba kernel
(:mod:`lightning_sparse.kernels.numba_runs`), which :func:`uses_numba` picks when numba imports.

``LIGHTNING_SPARSE_KERNELS`` overrides the choice, for tests and A/B benchmarks:

* ``torch``: plain torch everywhere, also on a GPU;
* ``triton``: Triton everywhere, also for CPU tensors, which Triton runs only in its
  interpreter (``TRITON_INTERPRET=1``, set before triton is imported): how the suite runs the
  GPU's code path on a CPU, where it counts the path's ops and host reads;
* ``numba``: numba for CPU tensors (an error if it does not import), plain torch for CUDA tensors without Triton.

numba is imported at its first use (:func:`numba_module`), never with the package. Its kernels are compiled at
their first call and kept in numba's disk cache; :func:`compiled_call` makes the ranks of one host that reach a kernel
together compile it once (a file lock), not once each. Its parallel kernels run
on :func:`numba_threads`: torch's thread count (``torch.get_num_threads()``), and numba's ``workqueue``
threading layer unless ``NUMBA_THREADING_LAYER`` names another. Why workqueue: it is numba's own thread pool,
loads no second OpenMP runtime beside torch's (numba's ``omp`` layer links the system's libgomp, torch
wheels bring their own; two runtimes each spin their threads on the same cores) and survives a ``fork``
(DataLoader workers), which GNU OpenMP does not promise; ``tbb`` is seldom installed. Its one limit: two
threads launching parallel kernels at once abort the process. :func:`numba_threads` holds a process-wide lock
around every launch of this package (and the kernels hold the GIL), so its own launches never overlap; numba
code of the user's own that runs parallel kernels from other threads should set ``NUMBA_THREADING_LAYER=tbb``.
A dynamic table's slot map runs its probes on CPU tensors in numba (:func:`uses_numba`,
:mod:`lightning_sparse.tables.slot_kernels`, one thread) when numba imports, else in plain torch: the same results.

:data:`launches` counts Triton kernel launches, for the tests that count a step's kernels, and makes
the launch's device current: Triton launches on the current CUDA device and its current stream, so
a table on ``cuda:1`` while ``cuda:0`` is current would run on the wrong device, out of order with
its own stream. Every launch in the package goes through :meth:`Launches.launch`
(``tests/test_gpu_risks.py`` holds the source to that).

The first use of the Triton kernels checks the versions (:func:`check_versions`): a Triton older
than :data:`MIN_TRITON` raises, and a GPU whose (torch, Triton) pair is not one the GPU path has run
on (:data:`RAN_ON_A_GPU`) gets one warning. Nothing is checked at import, nor on a CPU-only path.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import cache
from types import ModuleType

import torch
from torch import Tensor

ENV = "LIGHTNING_SPARSE_KERNELS"
CHOICES = ("auto", "torch", "triton", "numba")
NUMBA_LAYER = "workqueue"  # numba's threading layer unless NUMBA_THREADING_LAYER names one (see the module's docstring)
# The (torch, Triton) releases the GPU path has run on, on a GPU (README's status table; docs/guide/gpu.md, "Versions").
# The suite also compiles the kernels for sm_90 with Triton 3.6 and 3.9 and runs them in 3.9's interpreter.
RAN_ON_A_GPU = (("2.11", "3.6"),)
MIN_TRITON = (3, 6)  # the oldest Triton the kernels compile with (tl.div_rn, atomics' semantics, the interpreter's ops)


class Launches:
    """Triton launches so far, and whether one is under way (the tests count the torch ops of a step apart from them:
    Triton's interpreter runs torch ops of its own to move a kernel's arguments)."""

    def __init__(self) -> None:
        self.count = 0
        self.running = False

    @contextmanager
    def launch(self, device: torch.device) -> Iterator[None]:
        """Around one kernel launch on ``device`` (its tensors'), made the current device while it launches."""
        self.count += 1
        self.running = True
        try:
            with on_device(device):
                yield
        finally:
            self.running = False


def on_device(device: torch.device) -> AbstractContextManager:
    """``device`` made the current CUDA device (Triton's launches and CUDA events use the current one); elsewhere nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


launches = Launches()


def choice() -> str:
    """``LIGHTNING_SPARSE_KERNELS`` (default ``auto``: Triton for CUDA tensors when triton is installed, numba for CPU
    tensors when numba is)."""
    value = os.environ.get(ENV, "auto")
    if value not in CHOICES:
        raise ValueError(f"Invalid {ENV}={value!r}. HINT: use one of {CHOICES}.")
    return value


@cache
def triton_available() -> bool:
    """Whether triton imports (it ships with torch's CUDA wheels; for CPU tests, ``pip install triton``)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def uses_triton(tensor: Tensor) -> bool:
    """Whether the kernels for ``tensor`` (a table's shard) run in Triton."""
    wanted = choice()
    if wanted == "torch":
        return False
    if wanted == "triton":
        if not triton_available():
            raise RuntimeError(f"{ENV}=triton but triton does not import. HINT: pip install triton.")
        if not tensor.is_cuda and not interpreting():
            raise RuntimeError(f"{ENV}=triton on CPU tensors needs Triton's interpreter. HINT: set TRITON_INTERPRET=1.")
        _versions_checked(tensor.is_cuda)
        return True
    if tensor.is_cuda and triton_available():
        _versions_checked(True)
        return True
    return False


@cache
def numba_available() -> bool:
    """Whether numba imports (a dependency: the CPU's fused update and slot map; without it the CPU takes plain torch ops)."""
    try:
        numba_module()
    except ImportError:
        return False
    return True


def uses_numba(tensor: Tensor) -> bool:
    """Whether the CPU kernels for ``tensor`` (a table's shard) run in numba: CPU tensors, unless ``torch`` or ``triton``
    is chosen."""
    wanted = choice()
    if tensor.device.type != "cpu" or wanted in ("torch", "triton"):
        return False
    if wanted == "numba" and not numba_available():
        raise RuntimeError(f"{ENV}=numba but numba does not import. HINT: pip install numba, or set {ENV}=torch.")
    return numba_available()


@cache
def numba_module() -> ModuleType:
    """numba, imported now (the first use), its threading layer :data:`NUMBA_LAYER` unless ``NUMBA_THREADING_LAYER`` is set.

    The layer is the process's (numba reads ``NUMBA_THREADING_LAYER`` when it is imported, and child processes inherit
    it): where numba was imported before, it keeps the layer it was given.
    """
    if "numba" not in sys.modules:
        os.environ.setdefault("NUMBA_THREADING_LAYER", NUMBA_LAYER)
    import numba

    return numba


_numba_launch = threading.Lock()


@contextmanager
def numba_threads() -> Iterator[None]:
    """Around a launch of a parallel numba kernel: ``torch.get_num_threads()`` threads (at most numba's pool), one launch
    at a time in the process (the workqueue layer aborts on two at once; see the module's docstring).

    numba's thread count is the calling thread's own, so it is set at every launch.
    """
    numba = numba_module()
    with _numba_launch:
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
        yield


_compiled: set[tuple] = set()  # (kernel, argument types) this process has called: compiled or loaded from numba's cache


def compiled_call(kernel, *args):  # noqa: ANN001, ANN201 (a numba dispatcher and its arguments)
    """``kernel(*args)``; the first call for these argument types holds a file lock beside numba's cache of ``kernel``.

    Ranks of one host start together and reach a kernel together: each would compile it (seconds of CPU each) before
    any has written the cache. Under the lock one compiles and writes it, the others wait, then load what it wrote.
    A process that dies holding the lock releases it (``flock``); without ``fcntl`` or a writable cache, no lock.
    """
    types = tuple((arg.dtype, arg.ndim) if hasattr(arg, "ndim") else type(arg) for arg in args)
    if (kernel, types) in _compiled:
        return kernel(*args)
    try:
        import fcntl

        cells = tuple(cell.cell_contents for cell in kernel.py_func.__closure__ or ())  # a closure's constants
        digest = hashlib.sha256(repr((cells, types)).encode()).hexdigest()[:16]
        lock = open(os.path.join(kernel._cache.cache_path, f"{kernel.py_func.__qualname__}-{digest}.lock"), "a")  # noqa: SIM115
    except (ImportError, AttributeError, OSError):
        return kernel(*args)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = kernel(*args)
    _compiled.add((kernel, types))
    return result


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``2.11.0+cu128``."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def check_versions(torch_version: str, triton_version: str, compiled: bool) -> None:
    """Raise for a Triton older than :data:`MIN_TRITON`; with ``compiled`` (on a GPU), warn for a (torch, Triton) pair
    the GPU path has not run on."""
    if _release(triton_version) < MIN_TRITON:
        raise RuntimeError(
            f"lightning_sparse's GPU kernels need Triton {'.'.join(map(str, MIN_TRITON))} or later; this is triton "
            f"{triton_version}. HINT: pip install 'triton>={'.'.join(map(str, MIN_TRITON))}' (torch 2.11's CUDA wheels bring "
            f"3.6), or set {ENV}=torch for the plain torch path."
        )
    pair = tuple(".".join(map(str, _release(v))) for v in (torch_version, triton_version))
    if compiled and pair not in RAN_ON_A_GPU:
        ran = ", ".join(f"torch {a} with Triton {b}" for a, b in RAN_ON_A_GPU)
        warnings.warn(
            f"lightning_sparse's GPU path has run on {ran} only; this is torch {torch_version} with Triton "
            f"{triton_version}. HINT: benchmarks/gpu_checks.sh runs its checks on this machine; {ENV}=torch takes the "
            f"plain torch path.",
            stacklevel=3,
        )


@cache
def _versions_checked(compiled: bool) -> None:
    """:func:`check_versions` of the installed torch and Triton, once per process (and kind of run: GPU or interpreter)."""
    import triton

    check_versions(torch.__version__, triton.__version__, compiled)


def computes_in_triton(tensor: Tensor) -> bool:
    """Whether to compute on ``tensor`` (ids, not a table's shard) in Triton, where torch's ops give the same result.

    As :func:`uses_triton`, except that Triton forced on CPU tensors without the interpreter is no error:
    torch computes them (an init's reference rows on the host of a GPU run, say).
    """
    if choice() == "triton" and not tensor.is_cuda and not interpreting():
        return False
    return uses_triton(tensor)


def gpu_path(tensor: Tensor) -> bool:
    """Whether code for ``tensor`` takes the GPU's path: on a GPU, or Triton on CPU (the tests' stand-in for one).

    Where the two differ only in what reads the host (``nonzero`` against ``nonzero_static``), a
    CPU takes the faster of the two, a GPU the one without a host read.
    """
    return tensor.is_cuda or uses_triton(tensor)
