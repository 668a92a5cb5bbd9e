"""The id-range check of a table's one-process lookups on a GPU: kept on the device, read by the host without waiting.

On a CPU a lookup checks its ids on the host before reading a row (it costs nothing there). On a
GPU a training step must not wait for the device, so the Triton gather
(:func:`lightning_sparse.kernels.rows.gather`) checks the ids as it reads the rows, clamping
bad ones, and widens :attr:`RangeCheck.verdict` on the device. Then:

* the optimizer's fused update reads the verdict on the device and updates **no row** of the
  table while it shows an id out of range: nothing is corrupted;
* each lookup starts an asynchronous copy of the verdict to pinned host memory and records an
  event; the host reads the copy only once the event has completed (``event.query()``, which
  never waits), at the table's next optimizer step and at its next lookup, and raises the
  usual ``IndexError`` there (the one a CPU lookup raises), then clears the verdict.

So the error is raised by the optimizer step that would have used the rows (in the host-bound
regime of one GPU, the copy is done long before), or, if the GPU runs far behind the host, by
the first later step or lookup of that table that finds the copy done: until then the table's
rows stay as they were. A lookup without grad mode has no step to wait for: it waits for its
own verdict (one host read) and raises before returning.

While a CUDA graph is being captured the host side stands aside (no copy, no event, no read:
none of them may run in a capture): a replayed step keeps the verdict on the device, where the
update kernels read it and update no row of the table, and the next eager lookup or step of
the table reports it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.kernels.backend import on_device


class RangeCheck:
    """A lookup unit's verdict on the ids of its GPU lookups.

    A table's: ``[lowest id < 0, highest id >= rows]`` (0 where none). A collection's
    (:mod:`lightning_sparse.kernels.bags`): ``[-1 if any input was bad, 0]``, then per feature
    its error code and id range; its first two read like a table's of one row.
    """

    def __init__(self) -> None:
        self._verdict: Tensor | None = None
        self._host: Tensor | None = None  # pinned: the copy never blocks
        self._event: torch.cuda.Event | None = None
        self._unread = False  # a copy was started and has not been read
        self.dtype_code: int | dict[int, int] = -1  # the dtype of the ids last looked up (a collection's: per feature)

    def verdict(self, device: torch.device, size: int = 2) -> Tensor:
        """The device verdict (made on first use; the gather and the update kernels read and widen it)."""
        if self._verdict is None or self._verdict.device != device or len(self._verdict) != size:
            self._verdict = torch.zeros(size, dtype=torch.int64, device=device)
            self._host = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
            self._event = torch.cuda.Event() if device.type == "cuda" else None
        return self._verdict

    @property
    def device_verdict(self) -> Tensor | None:
        """The device verdict, if a GPU lookup has made one (the update kernel skips its rows while it shows a bad id)."""
        return self._verdict

    def sent(self, dtype_code: int | dict[int, int] = -1) -> None:
        """After a lookup's gather: start copying the verdict to the host, without waiting (on the verdict's device).

        ``dtype_code``: the dtype of the ids looked up (a collection's: per feature), for the message of a bad id.
        """
        self.dtype_code = dtype_code
        with on_device(self._verdict.device):  # the event is recorded on the current device's stream: the copy's
            if self._capturing():
                return
            self._host.copy_(self._verdict, non_blocking=True)
            if self._event is not None:
                self._event.record()
        self._unread = True

    def failed(self, num_rows: int, wait: bool = False) -> list[int] | None:
        """The verdict's values if the copy shows bad input (``[lowest, highest, ...]``); ``None`` if not, or not done yet.

        ``wait``: wait for the copy (a host read; for a lookup without a step to protect). A
        failure read here clears the verdict: it is reported once.
        """
        if not self._unread or self._capturing():
            return None
        if self._event is not None and not self._event.query():
            if not wait:
                return None
            self._event.synchronize()
        self._unread = False
        values = self._host.tolist()  # pinned host memory, copied before the event: no device read
        if values[0] >= 0 and values[1] < num_rows:
            return None
        self._verdict.zero_()
        return values

    def _capturing(self) -> bool:
        """Whether the verdict's device's current stream is capturing a graph (see the module)."""
        if self._verdict is None or not self._verdict.is_cuda:
            return False
        with on_device(self._verdict.device):
            return torch.cuda.is_current_stream_capturing()
