"""CallAgainGraphs: a TEST DOUBLE for lightning_sparse.lightning.capture.CudaGraphs, so that the Lightning side of a
captured step runs on a CPU. It makes no CUDA graph and measures nothing.

``capture(run)`` keeps ``run`` and runs nothing (as a CUDA capture runs no kernel); the graph's
``replay()`` calls ``run`` again, standing in for the device work a CUDA graph would replay (it
also runs the step's Python again, which a graph does not: the mechanism must not depend on
that). Warm-ups run on the current thread; the device is not checked; no sync debug mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CallAgain:
    """What ``CallAgainGraphs.capture`` returns: ``replay()`` calls the captured callable."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self.run = run
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.run()


class CallAgainGraphs:
    """The three methods of CudaGraphs, on any device: captures are kept (``captured``), not run."""

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self.captured: list[CallAgain] = []

    def check_device(self, device: torch.device, who: str) -> None:
        pass

    def side_stream(self, run: Callable[[], Any]) -> Any:
        return run()

    def capture(self, run: Callable[[], Any]) -> CallAgain:
        graph = CallAgain(run)
        self.captured.append(graph)
        return graph
