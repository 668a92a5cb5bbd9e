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

Which peer: a failed collective does not say which rank was missing (a cut link shows only as a
timeout). So before raising, a rank takes a *roll call* on the job's store (the TCPStore at
MASTER_ADDR that every rank joined at the start): it writes its own key and waits a few seconds
(:data:`ROLL_CALL_S`) for the others'. The message names the ranks that did not answer (dead,
or cut off from the store's host), or says that this rank cannot reach the store itself (this
host is the one cut off), or that everybody answered (a link too slow for the timeout).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from itertools import count
from typing import Any

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


# What NCCL raises when two ranks of a communicator hold the same GPU (ncclInvalidUsage).
_SHARED_GPU_ON_NCCL = "Duplicate GPU detected"

ROLL_CALL_S = 2.0  # how long a rank that lost a peer waits for the others to answer the roll call
_roll_calls = count()  # keys of a later roll call in the same job do not see an earlier one's answers
_ranks_per_node: int | None = None


def set_ranks_per_node(ranks: int | None) -> None:
    """Ranks per machine (the strategy's devices), so that roll calls name nodes too."""
    global _ranks_per_node
    _ranks_per_node = ranks


class PeerFailure(RuntimeError):
    """A peer rank died, hung, timed out or could not be reached (a collective of the sparse path, or the job's start)."""


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is torch's report of a lost peer (as opposed to a bug or bad input)."""
    lost = tuple(
        getattr(dist, name) for name in ("DistBackendError", "DistNetworkError", "DistStoreError") if hasattr(dist, name)
    )
    if isinstance(err, lost):
        return True
    return type(err) is RuntimeError and any(message in str(err) for message in _LOST_PEER_MESSAGES)


def caused_by_lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a lost peer, or (for DCP's ``CheckpointException``) a rank failed inside it for one.

    DCP holds each rank's failure as ``(exception, traceback summary)``: the exception is the cause.
    """
    failures = err.failures.values() if type(err).__name__ == "CheckpointException" else ()
    causes = [err, *(exception for exception, _ in failures)]
    return any(isinstance(c, PeerFailure) or is_peer_failure(c) for c in causes)


@contextmanager
def collective(what: str, note_other_errors: bool = True) -> Iterator[None]:
    """Run a collective (or a host read waiting for one); a lost peer becomes :class:`PeerFailure`.

    ``note_other_errors``: add a note to any other error saying where it came from (off where
    the block runs user code too, e.g. a backward pass).
    """
    try:
        yield
    except PeerFailure:
        raise
    except Exception as err:
        if is_peer_failure(err):
            raise PeerFailure(
                f"The {what} failed: another rank probably died, or did not reach it within the process group's "
                f"timeout ({type(err).__name__}: {_first_line(err)}).{roll_call()} HINT: restart all ranks and resume "
                f"from the last checkpoint, e.g. trainer.fit(model, ckpt_path='last'), or let torchrun --max-restarts "
                f"do it (docs/guide/launching.md)."
            ) from err
        if note_other_errors:
            err.add_note(f"(raised in lightning_sparse's {what}; not a lost peer)")
        if _SHARED_GPU_ON_NCCL in str(err):
            err.add_note(
                "HINT: two ranks of an NCCL group use one GPU: call torch.cuda.set_device(local_rank) before "
                "init_process_group (Lightning's strategies do), or share one GPU between ranks over gloo "
                '(init_process_group("gloo"); docs/guide/launching.md, "Several ranks on one GPU").'
            )
        raise


def roll_call(wait_s: float = ROLL_CALL_S) -> str:
    """Ask every rank to answer on the job's store within ``wait_s``; a sentence for the error message ("" if no store)."""
    if not dist.is_initialized():
        return ""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return ""
    address = _tcp_address(store)
    if address is not None and not _reachable(address, wait_s):
        # The store's client would block for good on a link that is gone (its timeouts do not cover
        # every call), so its host is probed first with a connection of our own.
        return (f" This rank cannot reach the job's store at {address[0]}:{address[1]} either: this host is probably "
                f"the one cut off from the others.")  # fmt: skip
    rank, world_size = dist.get_rank(), dist.get_world_size()
    key = f"lightning_sparse/roll_call/{next(_roll_calls)}/"
    missing = [r for r in range(world_size) if r != rank]
    old_timeout = store.timeout
    try:
        store.set_timeout(timedelta(seconds=wait_s))
        store.set(key + str(rank), "here")
        deadline = time.monotonic() + wait_s
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([key + str(r)])]
            if missing:
                time.sleep(0.1)
    except Exception as err:  # noqa: BLE001 - whatever the store raises, the roll call cannot tell who is gone
        return f" A roll call on the job's store could not be taken ({type(err).__name__}: {_first_line(err)})."
    finally:
        store.set_timeout(old_timeout)  # local to the client: no network call, cannot block
    if not missing:
        return (
            " Every rank answered a roll call on the job's store afterwards: none is dead or cut off; the collective "
            "timed out (a link too slow for the timeout, or ranks in different collectives)."
        )
    names = ", ".join(f"rank {r}" + (f" (node {r // _ranks_per_node})" if _ranks_per_node else "") for r in missing)
    return f" Did not answer a roll call on the job's store within {wait_s:g} s (dead, hung, or cut off from it): {names}."


def restart_hazard() -> str | None:
    """A warning for torchrun restarts that can fail to reconnect (pytorch/pytorch#135712), or None.

    With restarts and the store shared between torchrun's agents and the workers (its default),
    a machine whose workers torchrun restarts because another machine failed keeps its old
    restart count; its new workers then read the previous attempt's addresses from the shared
    store and cannot connect. A store of the workers' own per attempt avoids it.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (f"torchrun --max-restarts {restarts} with the store it shares with the workers: a restart after one "
                f"machine fails can leave the others unable to reconnect (pytorch/pytorch#135712). HINT: launch torchrun "
                f"with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment.")  # fmt: skip
    return None


def _tcp_address(store: Any) -> tuple[str, int] | None:
    """Host and port of the TCPStore under ``store`` (through PrefixStores), or None for another kind."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, dist.TCPStore) else None


def _reachable(address: tuple[str, int], wait_s: float) -> bool:
    try:
        socket.create_connection(address, timeout=wait_s).close()
        return True
    except OSError:
        return False


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def rendezvous_failure(err: BaseException, environment: Any, node_rank: int, timeout: timedelta | None) -> PeerFailure:
    """The error for a job whose ranks could not meet at the start (``init_process_group`` failed).

    ``err`` is torch's ``DistNetworkError`` (the address cannot be reached: a wrong MASTER_ADDR, no
    route, a closed port) or ``DistStoreError`` (the ranks did not all arrive within the timeout).
    Without this, the message names torch's store, not the settings a user has to fix.
    """
    address, port = environment.main_address, environment.main_port
    rank, world_size = environment.global_rank(), environment.world_size()
    return PeerFailure(
        f"Rank {rank} of {world_size} (node {node_rank}) could not start the job: the ranks did not all meet at "
        f"MASTER_ADDR={address}, MASTER_PORT={port} within the timeout ({timeout}): {type(err).__name__}: {_first_line(err)} "
        f"HINT: MASTER_ADDR must be the address of the host running NODE_RANK=0 as the other hosts see it, its port "
        f"must be open between the hosts, every host must start its share of the {world_size} ranks, and on hosts "
        f"with several network interfaces GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) must name the one that links them."
    )
