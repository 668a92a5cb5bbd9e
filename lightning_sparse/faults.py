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
from datetime import timedelta
from typing import Any, Iterator

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
    """A peer rank died, hung, timed out or could not be reached (a collective of the sparse path, or the job's start)."""


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


def rendezvous_failure(err: BaseException, environment: Any, node_rank: int, timeout: timedelta | None) -> PeerFailure:
    """The error for a job whose ranks could not meet at the start (``init_process_group`` failed).

    ``err`` is torch's ``DistNetworkError`` (the address cannot be reached: a wrong MASTER_ADDR, no
    route, a closed port) or ``DistStoreError`` (the ranks did not all arrive within the timeout).
    Without this, the message names torch's store, not the settings a user has to fix.
    """
    address, port = environment.main_address, environment.main_port
    rank, world_size = environment.global_rank(), environment.world_size()
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return PeerFailure(
        f"Rank {rank} of {world_size} (node {node_rank}) could not start the job: the ranks did not all meet at "
        f"MASTER_ADDR={address}, MASTER_PORT={port} within the timeout ({timeout}): {type(err).__name__}: {first_line} "
        f"HINT: MASTER_ADDR must be the address of the host running NODE_RANK=0 as the other hosts see it, its port "
        f"must be open between the hosts, every host must start its share of the {world_size} ranks, and on hosts "
        f"with several network interfaces GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) must name the one that links them."
    )
