"""HostReads: counts, on a CPU, the calls that would make a GPU wait (a host sync), as the GPU would see them.

On the CPU every tensor is on the host, so the mode tells the two kinds apart as a GPU would:
tensors copied out with ``.cpu()`` or created without a ``device`` are host tensors, and so is
every result of an operation on host tensors only; reading those costs no sync. A host tensor
that an in-place operation writes device values into becomes a device tensor, except the
destination of an asynchronous copy from the device (``copy_(device_values, non_blocking=True)``),
which is pinned host memory: code that makes one reads it after its CUDA event, without waiting
(lightning_sparse/lookup/range_check.py). On a GPU's machine every pinned tensor is a host tensor too,
also one copied into before the mode began.

It counts (``calls`` names them) what syncs on a GPU:

* reading a device tensor's values: ``tolist``, ``item``, ``bool()``, ``int()``, ``.cpu()``, ...;
* ops whose output size depends on the values: ``nonzero``, ``unique``, ``masked_select``,
  ``repeat_interleave`` without ``output_size``, and indexing with a boolean mask (``x[mask]``,
  ``x[mask] = v``);
* blocking host-to-device copies: ``torch.tensor(data, device=...)`` and ``.to(device)`` or
  ``copy_`` of a host tensor without ``non_blocking=True``; also ``x[i] = number`` at an int index,
  which torch runs as a copy from a host scalar on CUDA (and a CUDA graph's capture refuses).
  Write ``x[i : i + 1].fill_(number)`` instead (a fill kernel, as ``x[i : j] = number`` is).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from lightning_sparse.kernels.backend import launches

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from device_syncs import DeviceSyncs  # noqa: E402  (the GPU's own count, beside this harness; re-exported)

__all__ = ["DeviceSyncs", "HostReads"]

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "equal", "cpu"}
SIZED_BY_VALUES = {"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select"}
CREATIONS = {"tensor", "zeros", "ones", "empty", "full", "arange"}
FROM_DATA = {"tensor", "as_tensor"}


class HostReads(TorchFunctionMode):
    """Counts the calls that would sync a GPU (see the module); ``ignore``: tensors known to live on the host."""

    def __init__(self, ignore: list[torch.Tensor] = (), follows: HostReads | None = None) -> None:
        """``follows``: the mode of an earlier phase, whose host tensors (e.g. a route's splits) stay host tensors."""
        super().__init__()
        self.calls: list[str] = []
        self._ignore = {id(t) for t in ignore}
        self._host: dict[int, torch.Tensor] = dict(follows._host) if follows else {}  # id -> tensor, kept alive

    def _is_host(self, t: torch.Tensor) -> bool:
        # Pinned memory (on a GPU's machine) is the host's: e.g. the range check's copy of its verdict, made
        # by an earlier step and read once its event has completed, which this mode did not see copied.
        return id(t) in self._host or id(t) in self._ignore or (t.device.type == "cpu" and t.is_pinned())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if launches.running:  # Triton's interpreter moving a kernel's arguments: not the code path's
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        on_host = bool(tensors) and all(self._is_host(t) for t in tensors)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        non_blocking = kwargs.get("non_blocking", False) or (name == "copy_" and len(args) > 2 and bool(args[2]))
        if not on_host:
            self._count(name, args, kwargs, first)
        elif name in FROM_DATA and kwargs.get("device") is not None:
            self.calls.append(f"{name}(device=...)")  # data from the host, copied while the host waits
        elif name in ("to", "cuda") and _to_device(args, kwargs):
            on_host = False  # a host tensor copied to the device
            if not non_blocking:
                self.calls.append("blocking to(device)")
        out = func(*args, **kwargs)
        if name == "copy_" and non_blocking and not self._is_host(args[1]):
            self._host[id(first)] = first  # an asynchronous copy's destination: pinned host memory, read after its event
            return out
        if name == "copy_" and first is not None and self._is_host(first) != self._is_host(args[1]):
            if self._is_host(first):  # device -> host: host values once copied
                if not non_blocking:  # (an asynchronous copy is read after its event, without waiting)
                    self.calls.append("blocking copy_ to the host")
                return out
            if not non_blocking:
                self.calls.append("blocking copy_ from the host")
        if not on_host and first is not None and (name == "__setitem__" or name.endswith("_")):
            self._host.pop(id(first), None)  # device values written into it: reading it now syncs
        if name == "cpu" or on_host or (name in CREATIONS and not tensors and kwargs.get("device") is None):
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor):
                    self._host[id(t)] = t
        return out

    def _count(self, name: str, args: tuple, kwargs: dict, first: torch.Tensor | None) -> None:
        if name in READS and not (first is not None and id(first) in self._ignore):
            self.calls.append(name)
        elif name in SIZED_BY_VALUES:
            self.calls.append(name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.calls.append(name)
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _has_mask(args[1]):
            self.calls.append(f"{name} with a boolean mask")
        elif name == "__setitem__" and len(args) > 2 and _is_number(args[2]) and _selects_one(args[1]):
            self.calls.append("__setitem__ of a number at an int index (a copy from the host)")


def _to_device(args: tuple, kwargs: dict) -> bool:
    """Whether a ``.to(...)`` call names a device (not just a dtype)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args[1:])


def _is_number(value) -> bool:
    return isinstance(value, (bool, int, float, complex))


def _selects_one(index) -> bool:
    """Whether ``x[index]`` selects along every indexed dimension by an int (a view without that dimension)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(p, int) and not isinstance(p, bool) for p in parts)


def _has_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class CopyInFlight:
    """Stands in for the CUDA event of a copy to the host that the GPU has not finished yet, until ``done``: a GPU far
    behind its host, on a CPU (set it as the ``_event`` of a ``LateRead`` or of a range check)."""

    def __init__(self) -> None:
        self.done = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True
