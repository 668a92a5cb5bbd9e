"""The two all-to-all primitives every stage is made of (split sizes, then values), who they talk to, and what they count.

Every stage takes its ranks as one value, :class:`Peers`: the process group, this rank, their
number, and the :class:`ExchangeStats` that count the traffic. With one rank (``peers.alone``)
nothing is exchanged: each stage keeps its data where it is, the one-rank case in one place.

Collectives: **every rank of the group must call each**, in the same order, also with nothing
to send.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse.faults.peers import collective

ProcessGroup = dist.ProcessGroup


@dataclass
class ExchangeStats:
    """Running totals of what the sparse path sent, received and spent; reset by the reader.

    Bytes count what crossed to or from other ranks (headers included), not a rank's split to
    itself; ``collectives`` counts the all-to-all calls. ``unique_ids`` may be a 0-d device
    tensor: a one-process GPU step counts its distinct ids in its update kernel (see :meth:`on_device`).
    ``rounds_ahead`` counts the lookup rounds whose ids went ahead of their lookup (a pipelined loop).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    exchange_seconds: float = 0.0
    update_seconds: float = 0.0
    ids_looked_up: int = 0
    unique_ids: int = 0
    collectives: int = 0
    rounds_ahead: int = 0

    def add(self, other: ExchangeStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def reset(self) -> None:
        for name, spec in self.__dataclass_fields__.items():
            setattr(self, name, spec.default)

    def on_device(self, name: str, device: torch.device) -> Tensor:
        """Counter ``name`` as a 0-d int64 tensor on ``device``, for a kernel to add to (no host read until it is logged)."""
        value = getattr(self, name)
        if not isinstance(value, Tensor) or value.device != device:
            value = torch.full((), value if not isinstance(value, Tensor) else int(value), dtype=torch.int64, device=device)
            setattr(self, name, value)
        return value


@dataclass(frozen=True)
class Peers:
    """The ranks a stage talks to: ``group`` (``None``: the default group), this ``rank``, ``world_size``, and
    ``stats``, where the stage counts what it sent (``None``: not counted), and ``fence``: where ranks of one
    host meet in shared memory (a table in shared memory's :class:`~lightning_sparse.wire.shared_memory.Fence`),
    through which :func:`exchange_counts` and :func:`exchange_values` go (counted in no stats: nothing crosses the network).

    A table makes one from its placement when it is needed (it keeps only weak references to its
    groups); a lookup unit or an optimizer counts its own traffic with :meth:`counting`.
    """

    group: ProcessGroup | None = None
    rank: int = 0
    world_size: int = 1
    stats: ExchangeStats | None = None
    fence: Any = None

    @property
    def alone(self) -> bool:
        """Whether this rank is the group's only one: then no stage talks to anyone."""
        return self.world_size == 1

    def counting(self, stats: ExchangeStats | None) -> Peers:
        """The same ranks, their traffic counted in ``stats``."""
        return replace(self, stats=stats)


def split_starts(splits: Sequence[int]) -> list[int]:
    """``[0, s0, s0 + s1, ...]``: where each split starts (and, last, the total)."""
    return [0, *accumulate(splits)]


# ---------------------------------------------------------------------------- primitives
def exchange_counts(send: Tensor, peers: Peers) -> Tensor:
    """Row ``j`` of ``send`` ([W, K] int64) goes to rank ``j``; row ``i`` of the result came from rank ``i``.

    Collective: every rank of the group must call it with the same ``K``.
    """
    if peers.alone:
        return send
    if peers.fence is not None and (recv := peers.fence.exchange(send)) is not None:
        return recv
    send = send.contiguous()
    recv = torch.empty_like(send)
    with collective("all-to-all of split sizes"):
        dist.all_to_all_single(recv, send, group=peers.group)
    if peers.stats is not None:  # what crossed to other ranks: all rows but our own
        row = send[0].numel() * send.element_size()
        peers.stats.bytes_sent += row * (peers.world_size - 1)
        peers.stats.bytes_received += row * (peers.world_size - 1)
        peers.stats.collectives += 1
    return recv


def exchange_values(values: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], peers: Peers) -> Tensor:
    """Uneven all-to-all along dim 0: ``send_splits[j]`` leading rows go to rank ``j``.

    Collective: every rank of the group must call it; ``recv_splits`` must be what the peers send.
    """
    if peers.alone:
        return values
    if (
        peers.fence is not None
        and (recv := peers.fence.exchange_values(values, list(send_splits), list(recv_splits))) is not None
    ):
        return recv
    recv = values.new_empty((sum(recv_splits), *values.shape[1:]))
    with collective("all-to-all of values"):
        dist.all_to_all_single(
            recv, values.contiguous(), output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits),
            group=peers.group,
        )  # fmt: skip
    if peers.stats is not None:  # what crossed to other ranks: our own split stays here
        row = values[0].numel() * values.element_size() if len(values) else 0
        peers.stats.bytes_sent += (sum(send_splits) - send_splits[peers.rank]) * row
        peers.stats.bytes_received += (sum(recv_splits) - recv_splits[peers.rank]) * row
        peers.stats.collectives += 1
    return recv
