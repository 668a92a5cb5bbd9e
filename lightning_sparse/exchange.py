"""The all-to-all stages of the sparse path, named by the direction data moves.

A lookup and an optimizer step move data in three stages:

1. ``ids_to_owners``: each rank sends the unique ids it looks up to the ranks that own them;
2. ``rows_to_requesters``: owners gather those rows and send them back;
3. ``grads_to_owners``: at the optimizer step, row gradients go to the owners (all tables of one
   optimizer share one round).

Every stage is a collective: **every rank of the group must call it, in the same order**, even a
rank with nothing to send (it sends empty tensors). Each uses two ``all_to_all_single`` calls:
split sizes first (a tiny int64 exchange), then values with uneven splits. With one rank there is
nothing to exchange and the stages return their input. Each stage runs under a
``torch.profiler.record_function`` label ``lightning_sparse.<stage>`` so profiles read as the data path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

ProcessGroup = dist.ProcessGroup


@dataclass
class ExchangeStats:
    """Running totals of what the sparse path sent, received and spent; reset by the reader.

    Bytes count what crossed to or from other ranks (headers included), not a rank's split to itself.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    exchange_seconds: float = 0.0
    update_seconds: float = 0.0
    ids_looked_up: int = 0
    unique_ids: int = 0

    def add(self, other: "ExchangeStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, type(getattr(self, name))())


class PeerFailure(RuntimeError):
    """A collective of the sparse path failed: a peer rank died, hung or timed out."""


def _collective(name: str, call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except RuntimeError as err:  # DistBackendError and gloo/NCCL errors
        raise PeerFailure(
            f"The sparse all-to-all ({name}) failed: another rank probably died, or did not reach it within the "
            f"process group's timeout ({type(err).__name__}: {err}). HINT: restart all ranks and resume from the "
            f"last checkpoint, e.g. trainer.fit(model, ckpt_path='last')."
        ) from err


def exchange_counts(
    send: Tensor, group: ProcessGroup | None, world_size: int, stats: ExchangeStats | None = None
) -> Tensor:
    """Row ``j`` of ``send`` ([W, K] int64) goes to rank ``j``; row ``i`` of the result came from rank ``i``.

    Collective: every rank of ``group`` must call it with the same ``K``.
    """
    if world_size == 1:
        return send
    recv = torch.empty_like(send)
    _collective("split sizes", dist.all_to_all_single, recv, send.contiguous(), group=group)
    if stats is not None:  # what crossed to other ranks: all rows but our own
        row = send[0].numel() * send.element_size()
        stats.bytes_sent += row * (world_size - 1)
        stats.bytes_received += row * (world_size - 1)
    return recv


def exchange_values(
    values: Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: ProcessGroup | None,
    world_size: int,
    stats: ExchangeStats | None = None,
) -> Tensor:
    """Uneven all-to-all along dim 0: ``send_splits[j]`` leading rows go to rank ``j``.

    Collective: every rank of ``group`` must call it; ``recv_splits`` must be what the peers send.
    """
    if world_size == 1:
        return values
    recv = values.new_empty((sum(recv_splits), *values.shape[1:]))
    _collective(
        "values", dist.all_to_all_single, recv, values.contiguous(),
        output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits), group=group,
    )  # fmt: skip
    if stats is not None:  # what crossed to other ranks: our own split stays here
        rank = dist.get_rank(group)
        row = values[0].numel() * values.element_size() if len(values) else 0
        stats.bytes_sent += (sum(send_splits) - send_splits[rank]) * row
        stats.bytes_received += (sum(recv_splits) - recv_splits[rank]) * row
    return recv


@dataclass
class IdRoute:
    """How one lookup's unique ids travelled to their owners, kept to send the rows back."""

    order: Tensor  # permutation that sorts the requester's unique ids by owner rank
    send_splits: list[int]  # ids sent to each owner
    recv_splits: list[int]  # ids received from each requester
    received_ids: Tensor  # ids this rank owns, grouped by requesting rank
    peer_flags: list[list[int]]  # [W][F] the ``flags`` each rank sent along (read to the host once)


def ids_to_owners(
    ids: Tensor,
    owners: Tensor,
    flags: Tensor,
    group: ProcessGroup | None,
    world_size: int,
    stats: ExchangeStats | None = None,
) -> IdRoute:
    """Stage 1: send ``ids`` (unique global ids) to their ``owners``.

    ``flags`` (a small int64 vector) travels to every rank beside the split sizes at no extra
    cost. ``flags[0]`` is an error code: if any rank sends a nonzero one, no ids are exchanged,
    so that all ranks can fail together instead of leaving the healthy ones blocked in the next
    collective. The other entries are the caller's (see ``SparseEmbedding``).

    Collective: every rank of ``group`` must call it.
    """
    start = time.perf_counter()
    with record_function("lightning_sparse.ids_to_owners"):
        order = torch.argsort(owners, stable=True)
        send_counts = torch.bincount(owners, minlength=world_size)
        header = torch.cat([send_counts.view(-1, 1), flags.view(1, -1).expand(world_size, -1)], dim=1)
        peers = exchange_counts(header, group, world_size, stats)
        send_splits, peer_rows = send_counts.tolist(), peers.tolist()  # the stage's only host syncs
        recv_splits = [row[0] for row in peer_rows]
        route = IdRoute(order, send_splits, recv_splits, received_ids=ids, peer_flags=[row[1:] for row in peer_rows])
        if not any(flags[0] for flags in route.peer_flags):
            route.received_ids = exchange_values(ids[order], send_splits, recv_splits, group, world_size, stats)
    if stats is not None and world_size > 1:
        stats.exchange_seconds += time.perf_counter() - start
    return route


def rows_to_requesters(
    rows: Tensor, route: IdRoute, group: ProcessGroup | None, world_size: int, stats: ExchangeStats | None = None
) -> Tensor:
    """Stage 2: send the rows for ``route.received_ids`` back; returns rows in the requester's id order.

    Collective: every rank of ``group`` must call it.
    """
    if world_size == 1:
        return rows
    start = time.perf_counter()
    with record_function("lightning_sparse.rows_to_requesters"):
        received = exchange_values(rows, route.recv_splits, route.send_splits, group, world_size, stats)
        out = torch.empty_like(received)
        out[route.order] = received
    if stats is not None:
        stats.exchange_seconds += time.perf_counter() - start
    return out


@dataclass
class GradBatch:
    """Row gradients of one table: ``values[i]`` belongs to global row ``ids[i]``."""

    ids: Tensor
    values: Tensor
    owners: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    touched: bool = True  # in a result: whether any rank had a gradient for this table


def grads_to_owners(
    batches: Sequence[GradBatch],
    group: ProcessGroup | None,
    world_size: int,
    stats: ExchangeStats | None = None,
) -> list[GradBatch]:
    """Stage 3: send each table's row gradients to the rows' owners, all tables in one round.

    Two collectives for any number of tables: the header (rows per owner and table, plus whether
    this rank had a gradient for each table), then one flat buffer in the tables' promoted dtype
    in which each row carries its id (the id's 8 bytes reinterpreted in that dtype, so nothing is
    rounded) followed by its gradient. Returns, per table, the ids and values this rank received
    (grouped by source rank, so one id may appear once per source; the caller coalesces them)
    and whether any rank had a gradient for the table (``touched``).

    Collective: every rank of ``group`` must call it with the same number of tables.
    """
    if world_size == 1:
        return [GradBatch(b.ids, b.values, touched=b.touched) for b in batches]
    start = time.perf_counter()
    with record_function("lightning_sparse.grads_to_owners"):
        wire_dtype = batches[0].values.dtype
        for b in batches[1:]:
            wire_dtype = torch.promote_types(wire_dtype, b.values.dtype)
        id_width = torch.empty(0, dtype=torch.int64).element_size() // torch.empty(0, dtype=wire_dtype).element_size()
        widths = [id_width + b.values.shape[1] for b in batches]  # per row: id, then gradient
        chunks, send_counts = [], []
        for b in batches:
            order = torch.argsort(b.owners, stable=True)
            ids_as_wire = b.ids[order].contiguous().view(wire_dtype).view(-1, id_width)
            rows = torch.cat([ids_as_wire, b.values[order].to(wire_dtype)], dim=1)
            counts = torch.bincount(b.owners, minlength=world_size)
            chunks.append(rows.reshape(-1).split([c * rows.shape[1] for c in counts.tolist()]))
            send_counts.append(counts)
        send = torch.stack(send_counts, dim=1)  # [W, T]
        touched = torch.tensor([b.touched for b in batches], dtype=torch.int64, device=send.device)
        header = torch.cat([send, touched.view(1, -1).expand(world_size, -1)], dim=1)  # [W, 2T]
        recv_header = exchange_counts(header, group, world_size, stats)
        recv, touched_anywhere = recv_header[:, : len(batches)], recv_header[:, len(batches) :].any(dim=0).tolist()
        send_l, recv_l = send.tolist(), recv.tolist()

        tables = range(len(batches))
        values_out = torch.cat([chunks[t][d] for d in range(world_size) for t in tables])
        values_in = exchange_values(
            values_out,
            [sum(c * w for c, w in zip(r, widths)) for r in send_l],
            [sum(c * w for c, w in zip(r, widths)) for r in recv_l],
            group,
            world_size,
            stats,
        )
        # Regroup what arrived (source-major, table-minor) by table, and split ids from gradients.
        parts = values_in.split([c * w for r in recv_l for c, w in zip(r, widths)])
        out = []
        for t in tables:
            picks = range(t, world_size * len(batches), len(batches))
            rows = torch.cat([parts[i] for i in picks]).view(-1, widths[t])
            ids_t = rows[:, :id_width].flatten().view(torch.int64)
            values_t = rows[:, id_width:].to(batches[t].values.dtype)
            out.append(GradBatch(ids_t, values_t, touched=touched_anywhere[t]))
    if stats is not None:
        stats.exchange_seconds += time.perf_counter() - start
    return out
