"""Peer failures: what a collective raises when another rank died, hung or timed out, and nothing else.

Every collective of the sparse path, of the strategy and of checkpoints, and every host read
that waits for one, runs inside :func:`collective`. It turns the errors torch raises for a lost
peer into :class:`PeerFailure` (with a HINT) and lets every other error through unchanged, with
a note saying which collective it came from: a shape or dtype bug must not be reported as a
dead rank.

What counts as a lost peer: ``torch.distributed``'s ``DistBackendError``, ``DistNetworkError``
and ``DistStoreError``, and the ``RuntimeError`` that gloo raises (in torch 2.13) when a peer's
connection closes or a collective times out. On NCCL, collectives only queue work; a lost peer
shows at the next host read that waits for it (a ``DistBackendError`` under
``TORCH_NCCL_BLOCKING_WAIT``), or the process group's watchdog takes the process down after the
group's ``timeout`` (torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``), printing its own report.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist

# Messages of the RuntimeErrors that gloo (and NCCL's error paths) raise for a lost peer.
_LOST_PEER_MESSAGES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "Application timeout caused pair closure",
    "timed out",
    "Timeout",
    "NCCL communicator was aborted",
    "remote process exited",
)


class PeerFailure(RuntimeError):
    """A collective of the sparse path failed: a peer rank died, hung or timed out."""


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is torch's report of a lost peer (as opposed to a bug or bad input)."""
    lost = tuple(getattr(dist, name) for name in ("DistBackendError", "DistNetworkError", "DistStoreError") if hasattr(dist, name))
    if isinstance(err, lost):
        return True
    return type(err) is RuntimeError and any(message in str(err) for message in _LOST_PEER_MESSAGES)


@contextmanager
def collective(what: str) -> Iterator[None]:
    """Run a collective (or a host read waiting for one); a lost peer becomes :class:`PeerFailure`."""
    try:
        yield
    except PeerFailure:
        raise
    except Exception as err:
        if is_peer_failure(err):
            raise PeerFailure(
                f"The sparse path's {what} failed: another rank probably died, or did not reach it within the "
                f"process group's timeout ({type(err).__name__}: {err}). HINT: restart all ranks and resume from the "
                f"last checkpoint, e.g. trainer.fit(model, ckpt_path='last')."
            ) from err
        err.add_note(f"(raised in lightning_sparse's {what}; not a lost peer)")
        raise
