"""Small tensors of host values on the device, without a wait, and never read from the host by a captured CUDA graph.

A copy from pinned host memory captured in a CUDA graph copies from that host address again at
every replay, and torch's caching host allocator may hand that memory to the next pinned
allocation (a ``DataLoader(pin_memory=True)``, gloo's staging) once the tensor is freed. So
:func:`to_device` refuses to copy while the device's stream is capturing, and what a kernel reads
at every step (a collection's table of features, a ``TableSet``'s tables: addresses and sizes) is
a :class:`KeptValues`: made on the device once, outside a capture, and kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_sparse.kernels.backend import on_device


def host_tensor(values: Sequence[int | float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small tensor of Python values on ``device``; to a GPU through pinned memory, without blocking.

    (The pinned buffer comes from torch's caching host allocator: it is reused, not allocated anew, once
    its copy is done.)
    """
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(values: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory, without blocking (a pageable copy would sync).

    Never while ``device``'s stream captures a CUDA graph (see the module): that raises a ``RuntimeError``.
    """
    if device.type == "cpu":
        return values
    if capturing(device):
        raise RuntimeError(
            f"lightning_sparse would copy host values to {device} inside a CUDA graph being captured: every replay would "
            f"read pinned host memory that is freed and reused in between. HINT: run the step once before capturing it "
            f"(the warm-up of docs/guide/gpu.md), with the same input tensors and capturable=True optimizers."
        )
    return values.pin_memory().to(device, non_blocking=True)


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (never on a CPU)."""
    if device.type != "cuda":
        return False
    with on_device(device):
        return torch.cuda.is_current_stream_capturing()


class KeptValues:
    """An int64 tensor of host values (addresses, sizes) on a device, made once and kept while the values stay the same.

    Outside a capture a change of values makes a new tensor (:func:`host_tensor`: one copy from pinned
    memory, no wait); the warm-up before a capture makes the one the capture reads. A change during a
    capture (an input of the step that is a new tensor each call, e.g. offsets from lengths) makes the new
    tensor on the device: a copy of the last one, each changed value written by a fill (a kernel argument),
    so the graph holds no host address. A tensor that a capture read is kept as long as this object.
    """

    def __init__(self) -> None:
        self._values: tuple[int, ...] = ()
        self._tensor: Tensor | None = None
        self._held: list[Tensor] = []  # read by captured graphs: never freed while this object lives

    def get(self, values: Sequence[int], device: torch.device) -> Tensor:
        """``values`` as an int64 tensor on ``device``: the kept one if they are the same as last time."""
        values, in_capture = tuple(values), capturing(device)
        if self._tensor is None or self._tensor.device != device or self._values != values:
            self._tensor = self._filled(values, device) if in_capture else host_tensor(values, torch.int64, device)
            self._values = values
        if in_capture:
            self._hold(self._tensor)
        return self._tensor

    def _hold(self, tensor: Tensor) -> None:
        if not any(t is tensor for t in self._held):
            self._held.append(tensor)

    def _filled(self, values: tuple[int, ...], device: torch.device) -> Tensor:
        """``values`` on ``device`` by device ops only: the last tensor (zeros if none of that length) with the changes filled."""
        last = self._tensor
        if last is not None and last.device == device and len(self._values) == len(values):
            self._hold(last)  # the graph copies it at every replay
            tensor, before = last.clone(), self._values
        else:
            tensor, before = torch.zeros(len(values), dtype=torch.int64, device=device), (0,) * len(values)
        for index, (old, new) in enumerate(zip(before, values)):
            if old != new:
                tensor[index : index + 1].fill_(new)
        return tensor


class LateRead:
    """A device value copied to the host without a wait, and read once the copy is done (never waiting for it).

    :meth:`start` copies the value to pinned host memory and records an event; :meth:`read`
    returns the copy once the event has completed, else ``None`` (on a CPU the copy is done at
    once). A caller that needs a bound, not the exact value, keeps the last one read: e.g. a
    dynamic table's free slots, which tell it whether a batch may have to evict.
    """

    def __init__(self) -> None:
        self._host: Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._unread = False

    def start(self, value: Tensor) -> bool:
        """Copy ``value`` (a 0-d tensor) to the host, without waiting; ``False``: a copy still under way was left to finish."""
        if self._unread and self._event is not None and not self._event.query():
            return False
        if self._host is None:
            cuda = value.device.type == "cuda"
            self._host = torch.zeros((), dtype=value.dtype, pin_memory=cuda)
            self._event = torch.cuda.Event() if cuda else None
        with on_device(value.device):  # the event is recorded on the current device's stream: the copy's
            self._host.copy_(value, non_blocking=True)
            if self._event is not None:
                self._event.record()
        self._unread = True
        return True

    def read(self) -> int | None:
        """The value copied by the last :meth:`start`, once (``None`` if none is done and unread)."""
        if not self._unread or (self._event is not None and not self._event.query()):
            return None
        self._unread = False
        return int(self._host)
