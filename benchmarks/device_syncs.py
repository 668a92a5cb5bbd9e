"""DeviceSyncs: the host syncs a block of code makes on a GPU, counted by torch's sync debug mode, each by where.

    with DeviceSyncs() as syncs:
        step()
    syncs.calls    # ["exchange.py:153"]: the Python line of each sync
    syncs.stacks   # ["exchange.py:153 < engine.py:102 < ..."]: its innermost Python lines, caller last

Used by benchmarks/gpu.py, gpu_ranks.py and the tests (tests/host_reads.py, the GPU's count beside the CPU harness).
The mode is turned on before the count begins: on an H200 the switch itself was reported once, as a sync. Ranks
sharing a GPU over gloo also wait for it inside each collective: gloo stages CUDA tensors through host memory and
waits for those copies on its worker thread. That wait is gloo's, not the calling code's, and its warnings, raised
off Python's thread, are not counted here.
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import torch


class DeviceSyncs:
    """The host syncs of the block, on the caller's thread (see the module)."""

    def __init__(self, depth: int = 5) -> None:
        self.depth = depth
        self.calls: list[str] = []
        self.stacks: list[str] = []

    def _note(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        stack = [f for f in traceback.extract_stack()[:-1] if Path(f.filename).name != "warnings.py"]
        frames = [f"{Path(f.filename).name}:{f.lineno}" for f in stack][-self.depth :]
        self.calls.append(f"{Path(filename).name}:{lineno}")
        self.stacks.append(" < ".join(reversed(frames)))

    def __enter__(self) -> DeviceSyncs:
        torch.cuda.set_sync_debug_mode("warn")  # before the count (see the module)
        self._catching = warnings.catch_warnings()
        self._catching.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._note  # restored by catch_warnings
        return self

    def __exit__(self, *exc) -> None:
        self._catching.__exit__(*exc)
        torch.cuda.set_sync_debug_mode("default")
