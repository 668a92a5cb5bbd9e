"""Small tensors of host values on the device, without a wait."""

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
    """A host tensor on ``device``; to a GPU through pinned memory, without blocking (a pageable copy would sync)."""
    if device.type == "cpu":
        return values
    return values.pin_memory().to(device, non_blocking=True)


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
