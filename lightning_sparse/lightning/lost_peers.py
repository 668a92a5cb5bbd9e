"""The strategy's lost-peer hooks: a rank that cannot reach the others says so, and nothing is left behind.

A mixin of :class:`~lightning_sparse.lightning.strategy.SparseDDPStrategy` (kept apart so that each class
has one job). The sparse path's own collectives report a lost peer as
:class:`~lightning_sparse.faults.peers.PeerFailure` (:func:`~lightning_sparse.faults.peers.collective`);
these hooks do the same for the rest of a step and for the job's start:

- ``setup_distributed``: ranks that cannot meet (a wrong MASTER_ADDR, a closed port, a machine
  that never starts) fail with a PeerFailure naming the address and what to check; under
  torchrun with restarts and its shared store, rank 0 warns (pytorch/pytorch#135712);
- ``backward`` (DDP's all-reduce of the dense gradients), ``barrier``, ``broadcast``, ``reduce``
  (``self.log(..., sync_dist=True)``): a lost peer becomes a PeerFailure, with the roll call;
- ``on_exception``: after a lost peer, the ranks this process launched are killed (and taken off
  Lightning's child-process observer first, which would otherwise kill this process before it reports).
"""

from __future__ import annotations

import logging
import signal
import subprocess
from typing import Any

import torch.distributed as dist
from typing_extensions import override

from lightning_sparse.faults.peers import (
    PeerFailure,
    collective,
    is_peer_failure,
    rendezvous_failure,
    restart_hazard,
    set_ranks_per_node,
)

log = logging.getLogger("lightning_sparse.lightning.strategy")


class LostPeerHooks:
    """Mixed into a DDPStrategy subclass, before it in the bases."""

    @override
    def setup_distributed(self) -> None:
        try:
            super().setup_distributed()
        except (dist.DistNetworkError, dist.DistStoreError) as err:  # the ranks never met: name the settings to fix
            raise rendezvous_failure(err, self.cluster_environment, self.node_rank, self._timeout) from err
        set_ranks_per_node(self.num_processes)
        hazard = restart_hazard()
        if hazard is not None and self.global_rank == 0:
            log.warning(hazard)

    @override
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        with collective("backward (with DDP's all-reduce of the dense gradients)", note_other_errors=False):
            return super().backward(*args, **kwargs)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with collective("barrier"):
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with collective("broadcast"):
            return super().broadcast(obj, src)

    @override
    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        with collective("reduce (self.log(..., sync_dist=True))"):
            return super().reduce(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # A lost peer ends the run: ranks this process launched must not be left behind (a hung
        # rank, stopped or deadlocked, would otherwise outlive the program). SIGKILL reaches a stopped one.
        procs = getattr(self.launcher, "procs", None)
        lost_peer = isinstance(exception, PeerFailure) or is_peer_failure(exception)
        if lost_peer and procs:
            log.debug("%s: %s; killing the %d ranks this process launched", type(self).__name__,
                      type(exception).__name__, len(procs))  # fmt: skip
            # Lightning's child-process observer polls this very list every 5 s and answers a child's
            # non-zero exit by SIGKILLing this process too, before the error is reported: take the
            # ranks off its list before they die.
            doomed = list(procs)
            procs.clear()
            for proc in doomed:
                proc.send_signal(signal.SIGKILL)
            for proc in doomed:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:  # stuck in the kernel: report the lost peer all the same
                    log.warning("rank process %d did not die within 30 s of SIGKILL", proc.pid)
