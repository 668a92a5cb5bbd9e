"""One sort that deduplicates ids and groups them by owner: what every stage of the sparse path builds on.

Sorting owner-major keys (:meth:`lightning_sparse.wire.sharding.RowSharding.key`, or a
:class:`~lightning_sparse.wire.sharding.JointSharding` key for many tables) gives a lookup its
distinct rows grouped by owner, the counts per owner by binary search, the inverse to expand
rows back, and the runs that a segment sum adds up in backward; the optimizer coalesces
gradients and checkpoints group rows by owner with the same class.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.kernels import Runs, gpu_path, segment_sum, sort_runs, uses_triton


class SortedKeys:
    """One stable sort of keys, and the runs of equal keys it forms.

    Sorting owner-major keys gives everything the sparse path needs from a batch: the distinct
    keys in ascending order (so grouped by owner), how many go to each owner
    (:meth:`counts_below`), where each input landed (:meth:`inverse`), and the runs a segment
    sum adds up (:meth:`segment_sum`, :func:`lightning_sparse.kernels.segment_sum`). Only
    :meth:`finish` may read the host (the number of distinct keys), and not when the caller
    already knows it. The sort is all the constructor does: the rest is computed when asked.

    >>> runs = SortedKeys(torch.tensor([7, 3, 7, 9])).finish()
    >>> runs.unique.tolist(), runs.inverse().tolist(), runs.counts().tolist()
    ([3, 7, 9], [1, 0, 1, 2], [1, 2, 1])
    >>> runs.segment_sum(torch.tensor([[1.0], [2.0], [3.0], [4.0]])).view(-1).tolist()
    [2.0, 4.0, 4.0]
    """

    def __init__(self, keys: Tensor, bound: int | None = None) -> None:
        """``bound``: all keys are below it. Below 2**31 the sort runs on int32 keys, a third faster."""
        self.runs: Runs = sort_runs(keys, bound)
        self.sorted, self.perm = self.runs.keys, self.runs.perm
        self._first: Tensor | None = None
        self._run: Tensor | None = None
        self.unique = self.offsets = keys.new_empty(0, dtype=torch.int64)

    @property
    def is_first(self) -> Tensor:
        """Where each run (distinct key) starts in sorted order."""
        if self._first is None:
            first = torch.ones_like(self.sorted, dtype=torch.bool)
            if len(self.sorted) > 1:
                torch.ne(self.sorted[1:], self.sorted[:-1], out=first[1:])
            self._first = first
        return self._first

    def run_number(self) -> Tensor:
        """For each sorted position, 1 + the index of its key among the distinct keys (non-decreasing: runs of their own)."""
        if self._run is None:
            self._run = torch.cumsum(self.is_first, 0)
        return self._run

    def run_index(self) -> Tensor:
        """For each sorted position, the index of its key among the distinct keys."""
        return self.run_number() - 1

    def counts_below(self, boundaries: Tensor) -> Tensor:
        """How many distinct keys are smaller than each boundary (no host read)."""
        positions = torch.searchsorted(self.sorted, boundaries.to(self.sorted.dtype))
        run = self.run_number()
        return torch.cat([run.new_zeros(1), run]).index_select(0, positions)

    def counts_in_blocks(self, blocks: Tensor, num_blocks: int) -> Tensor:
        """How many distinct keys fall in each of ``num_blocks`` blocks, given each sorted key's block (no host read).

        One pass over the keys: with about as many blocks as keys (ranks x tables at thousands of
        ranks), this beats :meth:`counts_below`'s binary search per boundary. Keys whose block is
        outside ``0 .. num_blocks - 1`` are not counted.

        >>> runs = SortedKeys(torch.tensor([7, 3, 7, 9]))
        >>> runs.counts_in_blocks(runs.sorted // 4, 3).tolist()   # blocks [0, 4), [4, 8), [8, 12)
        [1, 1, 1]
        """
        counted = self.is_first & (blocks >= 0) & (blocks < num_blocks)
        counts = torch.zeros(num_blocks + 1, dtype=torch.int64, device=blocks.device)  # + 1: a bin for the uncounted
        return counts.index_add_(0, torch.where(counted, blocks, num_blocks), counted.to(torch.int64))[:-1]

    def finish(self, num_unique: int | None = None) -> SortedKeys:
        """Materialize ``unique`` and ``offsets`` (where each run starts in sorted order)."""
        if num_unique is not None and gpu_path(self.is_first):  # no host read for the output size (slower on a CPU)
            self.offsets = torch.nonzero_static(self.is_first, size=num_unique).view(-1)
        else:
            self.offsets = torch.nonzero(self.is_first).view(-1)
        self.unique = self.sorted.index_select(0, self.offsets).to(torch.int64)
        return self

    def finish_padded(self) -> Tensor:
        """:meth:`finish` at the batch's size, with no host read; returns which entries of ``unique`` are real.

        ``unique`` and ``offsets`` get one entry per key: the distinct keys, then the last one
        again as padding (``counts`` does not hold then). For a batch that has no bound on its
        distinct keys but its size (one rank's on a GPU).
        """
        n = len(self.sorted)
        self.offsets = torch.nonzero_static(self.is_first, size=n, fill_value=max(n - 1, 0)).view(-1)
        self.unique = self.sorted.index_select(0, self.offsets).to(torch.int64)
        return torch.arange(n, device=self.sorted.device) < self.run_number()[-1:]

    def inverse(self) -> Tensor:
        """For each input position, the index of its key in ``unique``."""
        return torch.empty_like(self.perm).index_copy_(0, self.perm, self.run_index())

    def counts(self) -> Tensor:
        """Occurrences of each distinct key."""
        ends = torch.cat([self.offsets[1:], self.offsets.new_full((1,), len(self.sorted))])
        return ends - self.offsets

    def segment_sum(self, values: Tensor, weights: Tensor | None = None) -> Tensor:
        """Add up the rows of ``values`` (one per input key) that share a key: ``[len(unique), width]``.

        ``weights``: one per sorted position, for a weighted sum. After :meth:`finish`.
        """
        # Triton finds the runs from their numbers (run k + 1 sums into row k); plain torch takes the offsets.
        by_run = Runs(self.run_number() if uses_triton(values) else self.sorted, self.perm)
        return segment_sum(by_run, values, len(self.unique), shift=-1, weights=weights, offsets=self.offsets)


def coalesce(keys: Tensor, values: Tensor, bound: int | None = None) -> tuple[Tensor, Tensor]:
    """Sum the rows of ``values`` that share a key; returns (ascending distinct keys, their sums)."""
    runs = SortedKeys(keys, bound).finish()
    return runs.unique, runs.segment_sum(values)


def transpose_blocks(counts: Tensor, total: int) -> Tensor:
    """The gather that turns a layout of ``[A, B]`` blocks from ``a``-major into ``b``-major order.

    Block ``(a, b)`` holds ``counts[a, b]`` consecutive items; in the input the blocks go
    ``(0, 0), (0, 1), ..., (1, 0), ...``, in the output ``(0, 0), (1, 0), ..., (0, 1), ...``.
    Returns ``index`` (``[total]``, ``total = counts.sum()``) with ``output = input[index]``:
    one ``index_select`` instead of ``A * B`` slices. The exchange uses it to turn items grouped
    by (rank, table) into items grouped by (table, rank) and back.

    >>> transpose_blocks(torch.tensor([[1, 2], [0, 3]]), 6).tolist()   # a0: x | y y, a1: - | z z z
    [0, 1, 2, 3, 4, 5]
    >>> transpose_blocks(torch.tensor([[2, 1], [1, 0]]), 4).tolist()   # x x | y, z | -  ->  x x z | y
    [0, 1, 3, 2]
    """
    by_b = counts.t().reshape(-1)
    out_starts = _starts(by_b)  # listed b-major, as the output goes
    in_starts = _starts(counts.reshape(-1)).view(counts.shape).t().reshape(-1)
    return _shifted(out_starts, in_starts - out_starts, total)


def transposed_places(counts: Tensor, total: int, within_b: bool = False) -> Tensor:
    """The scatter for the same turn: where each item of the ``a``-major layout lands in the ``b``-major one.

    ``output[places] = input``; the inverse of :func:`transpose_blocks`, for a producer that
    writes its items straight into the output (one copy instead of a concatenation and a gather).
    ``within_b``: places counted from the start of the item's ``b`` (its index among the items of
    its ``b``), e.g. an item's index among its table's items when ``b`` is the table.

    >>> transposed_places(torch.tensor([[2, 1], [1, 0]]), 4).tolist()
    [0, 1, 3, 2]
    >>> transposed_places(torch.tensor([[2, 1], [1, 0]]), 4, within_b=True).tolist()
    [0, 1, 0, 2]
    """
    in_starts = _starts(counts.reshape(-1))  # listed a-major, as the input goes
    out_starts = _starts(counts.t().reshape(-1)).view(counts.shape[1], counts.shape[0])
    if within_b:  # block (0, b) starts b's items in the output
        out_starts = out_starts - out_starts[:, :1]
    return _shifted(in_starts, out_starts.t().reshape(-1) - in_starts, total)


def _starts(sizes: Tensor) -> Tensor:
    """Where each of consecutive blocks of ``sizes`` starts: the exclusive cumulative sum (one pass)."""
    starts = torch.zeros_like(sizes)
    if len(sizes) > 1:
        torch.cumsum(sizes[:-1], 0, out=starts[1:])
    return starts


def _shifted(starts: Tensor, shift: Tensor, total: int) -> Tensor:
    """``arange(total)`` plus, for each item, the shift of its block (consecutive blocks starting at ``starts``).

    Each block adds the change of shift from the block before it at its first item, and a
    cumulative sum spreads it over the block: empty blocks' changes telescope into the next
    block's, so the work is one pass over the blocks and one over the items (with many blocks,
    most of them empty, this beats expanding a block index with ``repeat_interleave``).
    """
    change = shift.clone()
    change[1:] -= shift[:-1]
    delta = torch.zeros(total + 1, dtype=shift.dtype, device=shift.device)  # + 1: where trailing empty blocks start
    delta.index_add_(0, starts, change)
    return torch.arange(total, device=starts.device) + torch.cumsum(delta[:total], 0)


def gather_segments(flat: Tensor, starts: Tensor, lengths: Tensor) -> Tensor:
    """``flat[starts[0] : starts[0] + lengths[0]]``, then the next segment, ... as one tensor (one gather).

    ``starts`` and ``lengths`` are host int64 tensors (one per rank: no Python loop over ranks).
    """
    total = int(lengths.sum())
    offsets = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths, output_size=total)
    index = torch.arange(total) + offsets
    return flat.index_select(0, index.to(flat.device, non_blocking=True))
