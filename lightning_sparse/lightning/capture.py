"""Replays: a training step captured in a CUDA graph once, then replayed on each batch copied into static buffers.

torch's CUDA-graph recipe (docs/guide/gpu.md), held once for the Trainer's captured step
(:mod:`~lightning_sparse.lightning.captured_strategy`) and Fabric's (``fabric.strategy.captured(step)``):

1. the first batch is cloned into a **static batch**, which the step reads instead of its batch;
2. ``warmup_steps`` **warm-up** steps run on a side stream (they train: each is its batch's step), the
   last one under the **checks** (:class:`UserHostReads`, and on a GPU torch's sync debug mode "error"):
   a host read, an op whose output size depends on values, or autocast with its weight cache in the
   user's code is refused by its file and line, before any capture;
3. the step is **captured** (not run), its tensor outputs copied into static outputs made from the last
   warm-up's;
4. each later batch of the same structure, shapes and dtypes is copied into the static batch and the
   graph **replayed**. A batch of another shape is refused in the middle of an epoch (dynamic shapes);
   the epoch's last one runs eagerly (``other_shapes="eager"``, after which the next batch warms up and
   captures again: an eager step may move what the graph reads) or is dropped (``"drop"``).

What makes the graphs is an object with the methods of :class:`CudaGraphs` (tests pass a stand-in).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.overrides import TorchFunctionMode

OTHER_SHAPES = ("eager", "drop")
READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "equal"}
SIZED_BY_VALUES = {"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select"}
FROM_HOST = {"tensor", "as_tensor"}
# Frames of code that is not the user's, whose steps are capture-safe by construction (on a GPU the sync debug
# mode watches them too), and frames passed over to find the user's line (torch, the standard library, packages).
OURS = tuple(os.path.dirname(sys.modules[name].__file__) + os.sep for name in ("lightning", __package__.split(".")[0]))
PASSED_OVER = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.__file__) + os.sep, "site-packages", "dist-packages")


class CaptureRefused(MisconfigurationException):
    """What cannot be captured, named before any capture (the message ends with a HINT)."""


class CudaGraphs:
    """How the graphs are made: torch.cuda's ``CUDAGraph``, warm-ups on a side stream, sync debug mode "error"."""

    def check_device(self, device: torch.device, who: str) -> None:
        """Refuse a step that is not on a CUDA device."""
        if not torch.cuda.is_available() or device.type != "cuda":
            where = "this machine has no CUDA device" if not torch.cuda.is_available() else f"this run's device is {device}"
            raise CaptureRefused(f"{who} captures the training step in a CUDA graph, and {where}. HINT: run on one GPU "
                                 f"(accelerator='gpu', devices=1), or leave capture off (the eager step is the same step).")  # fmt: skip

    def side_stream(self, run: Callable[[], Any]) -> Any:
        """``run()`` on a side stream, which the current stream then waits for (torch's warm-up)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            output = run()
        torch.cuda.current_stream().wait_stream(side)
        return output

    def capture(self, run: Callable[[], Any]) -> Any:
        """A graph of ``run()``, captured and not run; its ``replay()`` runs it. Other threads may use CUDA meanwhile
        (a loader's pin-memory thread): only this thread's calls that a capture forbids raise."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            run()
        return graph

    @contextmanager
    def watching(self) -> Iterator[None]:
        """torch's sync debug mode "error" while the checked warm-up runs: any op that makes the host wait raises."""
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


class UserHostReads(TorchFunctionMode):
    """Refuses, at the call, what a graph cannot replay in the user's code: host reads of ``device_type`` tensors
    (``item``, ``bool()``, ``.cpu()``, ...), ops sized by values (``nonzero``, boolean masks, ...), autocast with its cache.

    The user's code is the innermost caller outside torch, Lightning and lightning_sparse.
    """

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self._device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        problem = self._problem(getattr(func, "__name__", ""), args, kwargs)
        if problem is not None:
            where = user_frame(traceback.extract_stack()[:-1])
            if where is not None:
                raise CaptureRefused(f"The captured step {problem} at {where}: a CUDA graph replays device work only, so the "
                                     f"value would be the capture's forever. HINT: {FIXES[problem.split()[0]]}.")  # fmt: skip
        return func(*args, **kwargs)

    def _problem(self, name: str, args: tuple, kwargs: dict) -> str | None:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        if not any(t.device.type == self._device_type for t in tensors) and name not in FROM_HOST:
            return None
        if torch.is_autocast_enabled(self._device_type) and torch.is_autocast_cache_enabled():
            return f"runs {name} under torch.autocast with cache_enabled=True"
        if name in FROM_HOST and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == self._device_type:
            return f"copies host data to the device ({name})"
        if name in READS and isinstance(args[0], Tensor):
            return f"reads a tensor on the host ({name})"
        if name in SIZED_BY_VALUES or (name == "repeat_interleave" and kwargs.get("output_size") is None):
            return f"sizes an output by values ({name})"
        index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else None
        if any(isinstance(p, Tensor) and p.dtype == torch.bool for p in (index if isinstance(index, tuple) else (index,))):
            return f"sizes an output by values ({name} with a boolean mask)"
        return None


FIXES = {
    "runs": "torch.autocast(..., cache_enabled=False), or Trainer(precision='bf16-mixed'), whose autocast has no cache",
    "reads": "keep the value on the device (log the tensor itself; torch.where instead of if), or leave capture off",
    "sizes": "use fixed-size ops (torch.where, a mask multiplied in, padded ids), or leave capture off",
    "copies": "make the tensor once, outside the step (e.g. a buffer of the module), and read it in the step",
}


def user_frame(stack: traceback.StackSummary | list[traceback.FrameSummary]) -> str | None:
    """``file:line (code)`` of the innermost frame that is the user's: ``None`` if Lightning's or ours comes first."""
    for frame in reversed(stack):
        if frame.filename.startswith(OURS):
            return None
        if frame.filename.startswith(PASSED_OVER[:2]) or any(part in frame.filename for part in PASSED_OVER[2:]):
            continue
        return f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return None


# ---------------------------------------------------------------- the static batch
def leaves(obj: Any, path: str = "batch") -> Iterator[tuple[str, Any]]:
    """(path, leaf) of a batch's tensors and other values: mappings, lists, tuples and dataclasses are walked."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from leaves(value, f"{path}[{index}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from leaves(getattr(obj, field.name), f"{path}.{field.name}")
    else:
        yield path, obj


def signature(batch: Any) -> list[tuple[str, Any]]:
    """What a graph fixes of a batch: its structure, each tensor's shape, dtype and device, the other values."""
    return [(path, (tuple(v.shape), v.dtype, v.device) if isinstance(v, Tensor) else v) for path, v in leaves(batch)]


def difference(captured: list[tuple[str, Any]], other: list[tuple[str, Any]]) -> str:
    """The first leaf where ``other`` differs from ``captured`` (both :func:`signature`)."""
    for (path, was), (other_path, now) in zip(captured, other):
        if path != other_path:
            return f"the batch's structure changed ({path} became {other_path})"
        if was != now:
            show = lambda v: f"shape {list(v[0])} {v[1]}" if isinstance(v, tuple) and len(v) == 3 else repr(v)  # noqa: E731
            return f"{path} has {show(now)} where the captured step took {show(was)}"
    return f"the batch has {len(other)} leaves where the captured step took {len(captured)}"


def tensors_of(outputs: Any) -> list[Tensor]:
    return [t for _, t in leaves(outputs) if isinstance(t, Tensor)]


class Replays:
    """One step's warm-ups, capture and replays over batches of one signature (see the module)."""

    def __init__(self, graphs: Any, other_shapes: str, warmup_steps: int, device_type: str = "cuda") -> None:
        if other_shapes not in OTHER_SHAPES:
            raise ValueError(f"Invalid other_shapes: {other_shapes!r}. HINT: use one of {OTHER_SHAPES}.")
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"Invalid warmup_steps: {warmup_steps!r}. HINT: pass an int >= 1 (torch's recipe warms up first).")
        self.graphs, self.other_shapes, self.warmup_steps, self.device_type = graphs, other_shapes, warmup_steps, device_type
        self.counts = dict.fromkeys(("warm-up", "captured", "replayed", "eager", "dropped"), 0)  # what ran, since built
        self.invalidate()

    def invalidate(self) -> None:
        """Forget the graph and the static batch: the next batch warms up and captures again."""
        self._graph: Any = None
        self._signature: list[tuple[str, Any]] | None = None
        self._static: Any = None
        self._static_tensors: list[Tensor] = []
        self._outputs: Any = None
        self._warmed = 0

    @property
    def static_batch(self) -> Any:
        """The batch the step reads while it is warmed up, captured or replayed."""
        return self._static

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def step(self, batch: Any, run: Callable[[], Any], eager: Callable[[], Any], last: bool, what: str) -> tuple[str, Any]:
        """Run one step: ``("replayed" | "warm-up", static outputs)``, ``("eager", eager())`` or ``("dropped", None)``.

        ``run()`` is the step on :attr:`static_batch` (warmed up, then captured); ``eager()`` the step on
        ``batch`` itself; ``last``: whether it is the epoch's last batch; ``what``: the step, for messages.
        """
        now = signature(batch)
        if self._signature is not None and now != self._signature:
            if not last:
                raise CaptureRefused(f"{what}: {difference(self._signature, now)}, in the middle of an epoch; a captured step "
                                     f"replays one shape. HINT: give every batch one shape (pad ids or bags to a fixed "
                                     f"size; drop_last=True for the last), or leave capture off.")  # fmt: skip
            if self.other_shapes == "drop":
                self.counts["dropped"] += 1
                return "dropped", None
            self.invalidate()  # the eager step may reallocate buffers the graph reads
            self.counts["eager"] += 1
            return "eager", eager()
        if self._static is None:
            self._signature = now
            self._static = apply_to_collection(batch, Tensor, lambda t: t.detach().clone())
            self._static_tensors = tensors_of(self._static)
        else:
            for static, given in zip(self._static_tensors, tensors_of(batch)):
                static.copy_(given)
        if self._graph is not None:
            self._graph.replay()
            self.counts["replayed"] += 1
            return "replayed", self._outputs
        self._warmed += 1
        checked = self._warmed == self.warmup_steps
        outputs = self._checked(run, what) if checked else self.graphs.side_stream(run)
        self._outputs = apply_to_collection(outputs, Tensor, lambda t: t.detach().clone())
        self.counts["warm-up"] += 1
        if checked:
            statics = tensors_of(self._outputs)
            self._graph = self.graphs.capture(lambda: [s.copy_(t) for s, t in zip(statics, tensors_of(run()))])
            self.counts["captured"] += 1
        return "warm-up", self._outputs

    def _checked(self, run: Callable[[], Any], what: str) -> Any:
        """The last warm-up, under :class:`UserHostReads` and the graph maker's watch."""
        watch = getattr(self.graphs, "watching", None)
        with UserHostReads(self.device_type), watch() if watch is not None else nullcontext():
            try:
                return self.graphs.side_stream(run)
            except RuntimeError as err:
                if "synchroniz" not in str(err) or isinstance(err, CaptureRefused):
                    raise
                where = _innermost_outside_torch(err)
                raise CaptureRefused(f"{what} makes the host wait for the GPU at {where} ({str(err).strip()[:200]}): a CUDA "
                                     f"graph cannot capture that. HINT: keep values on the device in the step, or leave "
                                     f"capture off.") from err  # fmt: skip


def _innermost_outside_torch(err: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/torch/" not in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({(frames[-1].line or '').strip()})" if frames else "an op of torch"
