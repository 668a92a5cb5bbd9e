"""Lost peers under the Trainer: a rank that cannot reach the others says so, and nothing is left behind.

The sparse path's own collectives report a lost peer as :class:`~lightning_sparse.faults.peers.PeerFailure`
(:func:`~lightning_sparse.faults.peers.collective`); :class:`~lightning_sparse.lightning.strategy.SparseDDPStrategy`
does the same for the rest of a step and for the job's start, with these:

- its ``setup_distributed``: ranks that cannot meet (a wrong MASTER_ADDR, a closed port, a machine
  that never starts) fail with a PeerFailure naming the address and what to check
  (:func:`~lightning_sparse.faults.peers.rendezvous_failure`); once they met, :func:`after_meeting`;
- its ``backward`` (DDP's all-reduce of the dense gradients), ``barrier``, ``broadcast``, ``reduce``
  (``self.log(..., sync_dist=True)``) run in :func:`~lightning_sparse.faults.peers.collective`: a lost
  peer becomes a PeerFailure, with the roll call;
- its ``on_exception``: :func:`kill_launched`.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from typing import Any

from lightning_sparse.faults.peers import PeerFailure, is_peer_failure, restart_hazard, set_ranks_per_node
from lightning_sparse.lightning import compat

log = logging.getLogger("lightning_sparse.lightning.strategy")


def after_meeting(ranks_per_node: int, global_rank: int) -> None:
    """Once the ranks met: roll calls name machines too; under torchrun with restarts and its shared store,
    rank 0 warns (pytorch/pytorch#135712)."""
    set_ranks_per_node(ranks_per_node)
    hazard = restart_hazard()
    if hazard is not None and global_rank == 0:
        log.warning(hazard)


def kill_launched(launcher: Any, exception: BaseException) -> None:
    """After a lost peer, kill the ranks this process launched (``launcher.procs``, if any).

    A lost peer ends the run: ranks this process launched must not be left behind (a hung rank,
    stopped or deadlocked, would otherwise outlive the program). SIGKILL reaches a stopped one.
    """
    if not (isinstance(exception, PeerFailure) or is_peer_failure(exception)):
        return
    doomed = compat.take_launched_processes(launcher)  # off the list Lightning's observer polls, before they die
    if doomed:
        log.debug("SparseDDPStrategy: %s; killing the %d ranks this process launched", type(exception).__name__, len(doomed))
    for proc in doomed:
        proc.send_signal(signal.SIGKILL)
    for proc in doomed:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # stuck in the kernel: report the lost peer all the same
            log.warning("rank process %d did not die within 30 s of SIGKILL", proc.pid)
