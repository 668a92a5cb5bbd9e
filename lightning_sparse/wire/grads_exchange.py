"""Stage 3, grads to owners: at an optimizer step, the row gradients of all its tables go to their owners.

The gradients of a table's last lookup go back along that lookup's :class:`~lightning_sparse.wire.exchange.Route`
(the *routed* round: no ids, no split sizes); those of other lookups (accumulation, a table
looked up twice) take the *general* round: a header, then ids and values. All tables of one
optimizer share each round. Collective: **every rank of the group must call it**.

Host reads: where every table's last lookup was every rank's sole lookup of it since the last step
(:attr:`LookupHeader.sole`, read with that lookup's split sizes), the step knows without a word that
only routed rows exist, and on a GPU's path it reads the host not at all: the step's one read was
the lookup's. Otherwise each round reads its control codes or its header once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.profiler import record_function

from lightning_sparse.faults.peers import collective
from lightning_sparse.kernels import gpu_path
from lightning_sparse.kernels.host import host_tensor, to_device
from lightning_sparse.wire.alltoall import Peers, exchange_counts, exchange_values
from lightning_sparse.wire.exchange import Route
from lightning_sparse.wire.packing import common_word, pack, read_as, unpack


# ---------------------------------------------------------------------------- stage 3: grads to owners
@dataclass(frozen=True)
class RowsByOwner:
    """Gradient rows that go by the general round: distinct rows grouped by owner (with one rank: any rows, as they came)."""

    local_ids: Tensor  # each row's index on its owner
    values: Tensor  # [rows, width]
    counts: Tensor | None  # [W] on the rows' device: rows for each owner (with one rank: None, all are its own)
    distinct: bool = True  # no row repeats (with several ranks: always)
    per_id: bool = False  # some came from lookups that did not count their distinct ids (a gather's: one per id)


@dataclass(frozen=True)
class OutgoingGrads:
    """One table's row gradients on the requester, ready for :func:`grads_to_owners`.

    ``route`` is the table's last lookup (``None`` if no lookup since the last step recorded
    gradients) and ``routed`` this rank's gradient rows for it, in the route's order (``None``
    if this rank has none). ``others`` holds any other gradient rows; ``None`` if there are none.
    """

    route: Route | None
    routed: Tensor | None
    width: int
    others: RowsByOwner | None = None
    nonfinite: Tensor | None = None  # a 0-d device flag: 1 if a value above is inf or NaN (when checked)
    looked_up: bool = False  # this rank recorded a lookup of the table since the last step


@dataclass
class IncomingGrads:
    """One table's gradient rows as received by the owner: pieces of (local rows, values).

    Each piece from the routed round (or kept locally) holds distinct rows; a row may appear in
    several pieces, and repeat within the piece of the general round (``merged``).
    """

    rows: list[Tensor]
    values: list[Tensor]
    touched: bool = False  # whether any rank looked the table up since the last step, or had a gradient for it
    merged: bool = False  # a piece holds rows from several ranks, or rows that repeat
    nonfinite_ranks: list[int] = field(default_factory=list)  # ranks whose gradient held inf or NaN (when checked)
    # With rows kept on the device only: 1.0 for each row of a rank that had a gradient, 0.0 for a placeholder
    # (a rank that looked the table up, but whose backward never reached the lookup). ``None``: no placeholders.
    present: Tensor | None = None
    per_id: bool = False  # see RowsByOwner

    @property
    def distinct(self) -> bool:
        """Whether the rows are distinct as they are (one piece, from one source)."""
        return len(self.rows) == 1 and not self.merged

    def add(self, rows: Tensor, values: Tensor, merged: bool, present: Tensor | None = None) -> None:
        """One more piece: ``merged`` if its rows may repeat (several sources), ``present`` to mark its placeholders."""
        self.rows.append(rows)
        self.values.append(values)
        self.merged = self.merged or merged
        self.present = present


# Control code per table that rides with the routed rows to every destination.
_HAS_ROUTED, _HAS_OTHERS, _NONFINITE, _LOOKED_UP = 1, 2, 4, 8


def only_routed(routes: Sequence[Route | None], peers: Peers, checks: bool, replicas: int = 1) -> bool:
    """Whether a step of tables whose last lookups took ``routes`` knows, with no word, that only routed rows exist.

    So when every table has a route whose round was every rank's sole lookup of it (``LookupHeader.sole``):
    every rank then has the same answer. Not when gradients are checked (``checks``: the flags ride in
    the control codes) or replicated (2-D sharding sums the rows over replicas: ``replicas > 1``), and not
    with one rank, which has nobody to ask (and whose lone tables' gathers leave no route).
    """
    if peers.alone or checks or replicas > 1:
        return False
    return all(route is not None and route.headers.sole for route in routes)


def grads_to_owners(
    outgoing: Sequence[OutgoingGrads], peers: Peers, wire_dtype: torch.dtype, device: torch.device, sole: bool = False
) -> list[IncomingGrads]:
    """Stage 3: send every table's row gradients to the rows' owners.

    The routed round runs if some table has a route (every rank knows the same routes): its sizes
    follow from the routes. To each destination it carries each table's routed rows, then one
    control code per table (whether this rank had routed rows, whether it has others, whether it
    looked the table up). Every rank thereby learns what every rank has; if any rank has other
    rows, the general round follows (a header of counts, then ids and values). Where no table has
    a route (tables in shared memory, whose lookups make no round), the general round's header
    carries the codes and there is no routed round. One host read per round: the control codes,
    the header.

    ``sole`` (:func:`only_routed`, the same on every rank): no rank has other rows, so there is no
    general round, every table counts as touched, and on a GPU's path the codes stay on the device:
    a placeholder row (of a rank whose backward never reached the lookup) is marked in
    ``IncomingGrads.present`` or by its zero count (``duplicate_grads="mean"``), and the update skips
    it. No host read.

    A table's ``nonfinite`` flag rides in its control code too, so every rank learns which
    ranks' gradients held an inf or NaN (``IncomingGrads.nonfinite_ranks``).

    Collective: every rank of the group must call it with the same tables in the same order.
    """
    if peers.alone:
        return [_keep_local(t) for t in outgoing]
    start = time.perf_counter()
    with record_function("lightning_sparse.grads_to_owners"):
        if any(t.route is not None for t in outgoing):
            incoming, codes = _routed_round(outgoing, peers, wire_dtype, device, sole)
            others = codes is not None and bool((codes & _HAS_OTHERS).any())
            general = _general_round(outgoing, peers, wire_dtype, device)[1] if others else []
        else:  # no routed round: the general round's header carries the codes
            codes, general = _general_round(outgoing, peers, wire_dtype, device, with_codes=True)
            incoming = _incoming(codes)
        for table, (rows, values) in zip(incoming, general):
            if len(rows):
                table.add(rows, values, merged=True)
    if peers.stats is not None:
        peers.stats.exchange_seconds += time.perf_counter() - start
    return incoming


def _keep_local(grads: OutgoingGrads) -> IncomingGrads:
    bad = [0] if grads.nonfinite is not None and bool(grads.nonfinite) else []  # a host read, only when checking
    others = grads.others
    incoming = IncomingGrads([], [], touched=grads.routed is not None or others is not None or grads.looked_up,
                             nonfinite_ranks=bad, per_id=others is not None and others.per_id)  # fmt: skip
    if grads.routed is not None:
        incoming.add(grads.route.received, grads.routed, merged=False)
    if others is not None:
        incoming.add(others.local_ids, others.values, merged=not others.distinct)
    return incoming


def _routed_round(outgoing, peers, wire_dtype, device, sole) -> tuple[list[IncomingGrads], Tensor | None]:
    """Every table's routed rows and the control codes, one message per destination (:func:`pack`).

    Returns the tables' rows and every rank's codes on the host (``[W, T]``), or ``None`` for the codes
    where ``sole`` keeps them on the device.
    """
    code_values = _codes(outgoing, wire_dtype, device)
    routed = [t for t in outgoing if t.route is not None]
    word = common_word([t.width for t in routed])
    code_width = -(-len(outgoing) // word) * word  # the codes ride as one row per destination
    code_row = torch.zeros(code_width, dtype=wire_dtype, device=device)
    code_row[: len(outgoing)] = code_values
    rows = [t.routed.to(wire_dtype) if t.routed is not None  # else placeholders, marked unused by the code
            else torch.zeros(sum(t.route.send_splits), t.width, dtype=wire_dtype, device=device) for t in routed]  # fmt: skip
    rows.append(code_row.expand(peers.world_size, code_width))
    one_each = torch.ones(peers.world_size, dtype=torch.int64)
    send_counts = torch.stack([t.route.send_counts for t in routed] + [one_each])  # [tables + 1, W]
    recv_counts = torch.stack([t.route.recv_counts for t in routed] + [one_each])
    widths = [t.width for t in routed] + [code_width]
    flat, send_sizes = pack(rows, send_counts, to_device(send_counts, device), word)
    recv_sizes = (recv_counts * torch.tensor(widths).unsqueeze(1)).sum(0).tolist()
    recv = exchange_values(flat, send_sizes, recv_sizes, peers)
    *pieces, sources_codes = unpack(recv, recv_counts, to_device(recv_counts, device), widths, word)
    if sole and gpu_path(recv):
        return _marked_pieces(outgoing, pieces, sources_codes, recv_counts[:-1], device), None
    with collective("all-to-all of gradients"):
        all_codes = sources_codes[:, : len(outgoing)].to(torch.int64).cpu()  # [W, T], the round's one host read
    incoming = _incoming(all_codes)
    # Sources that sent this rank rows of each routed table, and those that marked them as placeholders.
    with_rows = recv_counts[:-1] > 0  # [routed, W]
    routed_index = torch.tensor([i for i, t in enumerate(outgoing) if t.route is not None])
    sent = ((all_codes.index_select(1, routed_index) & _HAS_ROUTED) != 0).t() & with_rows
    senders, complete = sent.sum(1).tolist(), (sent == with_rows).all(1).tolist()
    for k, (index, values) in enumerate(zip(routed_index.tolist(), pieces)):
        if not senders[k]:
            continue
        received = outgoing[index].route.received
        if not complete[k]:  # drop the placeholders of sources without a gradient (a host-side index)
            keep = to_device(torch.repeat_interleave(sent[k], recv_counts[k]).nonzero().view(-1), device)
            received, values = received.index_select(0, keep), values.index_select(0, keep)
        incoming[index].add(received, values, merged=senders[k] > 1)  # rows of several sources: a row may repeat
    return incoming, all_codes


def _codes(outgoing: Sequence[OutgoingGrads], dtype: torch.dtype, device: torch.device) -> Tensor:
    """This rank's control code for each table (see :func:`grads_to_owners`), in ``dtype`` on ``device``."""
    codes = [_HAS_ROUTED * (t.routed is not None) + _HAS_OTHERS * (t.others is not None) + _LOOKED_UP * t.looked_up
             for t in outgoing]  # fmt: skip
    code_values = host_tensor(codes, dtype, device)
    for index, grads in enumerate(outgoing):
        if grads.nonfinite is not None:  # device flag: no host read here
            code_values[index] += _NONFINITE * grads.nonfinite.to(dtype)
    return code_values


def _incoming(all_codes: Tensor) -> list[IncomingGrads]:
    """Each table's incoming gradients, empty, marked as every rank's codes (``[W, T]`` on the host) say."""
    touched = ((all_codes & (_HAS_ROUTED | _HAS_OTHERS | _LOOKED_UP)) != 0).any(0).tolist()
    nonfinite = (all_codes & _NONFINITE) != 0
    any_nonfinite = nonfinite.any(0).tolist()
    return [IncomingGrads([], [], touched=touched[i],
                          nonfinite_ranks=nonfinite[:, i].nonzero().view(-1).tolist() if any_nonfinite[i] else [])
            for i in range(all_codes.shape[1])]  # fmt: skip


def _marked_pieces(outgoing, pieces, sources_codes, recv_counts, device) -> list[IncomingGrads]:
    """The routed rows as they came, placeholders marked on the device (see ``IncomingGrads.present``). No host read.

    Every table counts as touched: each rank that recorded its last round read it (``LookupHeader.sole``).
    """
    incoming = [IncomingGrads([], [], touched=True) for _ in outgoing]
    routed = [i for i, t in enumerate(outgoing) if t.route is not None]
    for index, values, counts in zip(routed, pieces, recv_counts):
        if not len(values):
            continue
        had_grad = (sources_codes[:, index].to(torch.int64) & _HAS_ROUTED) != 0  # [W] on the device
        present = torch.repeat_interleave(had_grad.to(values.dtype), to_device(counts, device), output_size=len(values))
        several = int((counts > 0).sum()) > 1  # rows of several sources: a row may repeat
        incoming[index].add(outgoing[index].route.received, values, merged=several, present=present)
    return incoming


def _general_round(
    outgoing, peers, wire_dtype, device, with_codes: bool = False
) -> tuple[Tensor | None, list[tuple[Tensor, Tensor]]]:
    """A header of counts per (owner, table), then rows of (local id, values) of every table in one buffer.

    ``with_codes``: the header carries this rank's control codes too, and every rank's (``[W, T]`` on the host)
    are returned; if they say that no rank has rows, no values cross.
    """
    codes = _codes(outgoing, torch.int64, device).unsqueeze(1).expand(len(outgoing), peers.world_size) if with_codes else None
    empty_counts = torch.zeros(peers.world_size, dtype=torch.int64, device=device)
    counts = torch.stack([t.others.counts if t.others is not None else empty_counts for t in outgoing])  # [T, W]
    sent = counts if codes is None else torch.cat([counts, codes])
    received = exchange_counts(sent.t().contiguous(), peers).t()  # [T or 2T, W]: from each source
    with collective("all-to-all of gradient counts"):
        host = torch.stack([sent, received]).cpu()  # the round's one host read
    tables = len(outgoing)
    all_codes = host[1, tables:].t() if with_codes else None  # [W, T]
    if all_codes is not None and not bool((all_codes & _HAS_OTHERS).any()):
        return all_codes, []
    return all_codes, _values_round(outgoing, peers, wire_dtype, device, counts, received[:tables], host[:, :tables])


def _values_round(outgoing, peers, wire_dtype, device, counts, recv_counts, host) -> list[tuple[Tensor, Tensor]]:
    """The general round's rows after its header: ``counts`` sent and ``recv_counts`` received (``[T, W]``; ``host``: both)."""
    id_width = 8 // torch.empty(0, dtype=wire_dtype).element_size()
    widths = [id_width + t.width for t in outgoing]
    wire = []
    for t, width in zip(outgoing, widths):
        if t.others is None:
            wire.append(torch.empty(0, width, dtype=wire_dtype, device=device))
            continue
        ids, values = t.others.local_ids, t.others.values
        # Each row: its local id's 8 bytes reinterpreted in the wire dtype (exact), then its values.
        wire.append(torch.cat([ids.contiguous().view(wire_dtype).view(-1, id_width), values.to(wire_dtype)], dim=1))
    word = common_word(widths)
    flat, send_sizes = pack(wire, host[0], counts, word)
    recv_sizes = (host[1] * torch.tensor(widths).unsqueeze(1)).sum(0).tolist()
    recv = exchange_values(flat, send_sizes, recv_sizes, peers)
    return [(read_as(rows[:, :id_width], torch.int64).view(-1), rows[:, id_width:])
            for rows in unpack(recv, host[1], recv_counts, widths, word)]  # fmt: skip
