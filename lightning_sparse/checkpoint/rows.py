"""Per-row tensors to and from storage, in bands of rows, so that a save or load never holds more than a few.

A checkpoint stores each table and each per-row optimizer state as the logical ``[N, ...]``
tensor in global row order, cut into ``parts`` bands of ``part_rows`` rows. Each band is its own
small DCP checkpoint, written by the ranks in ``torch.chunk`` blocks (``Shard(0)``).

On a rank, the rows of one band are a contiguous slice of its shard under either sharding
scheme (``"range"``: a slice of the block; ``"mod"``: local rows ``l`` with ``l * W + rank`` in the
band). Saving a band moves that slice's rows to their block owner (one all-to-all) and writes
the block; loading reads the block and moves its rows back into the shard, in place. So the
scratch of a save or load is one band's block plus, on load, what DCP's reader holds while it
copies (one stored chunk): a fraction of a shard, whatever the number of state tensors, the
world sizes or the schemes. ``parts`` follows from the logical shape, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from lightning_sparse.faults.peers import collective
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.wire.alltoall import exchange_counts, exchange_values
from lightning_sparse.wire.grouping import SortedKeys
from lightning_sparse.wire.sharding import RowSharding

# A band is about this many bytes per rank (the scratch of a save or load), and a tensor has at
# most MAX_PARTS bands (each band is a DCP write: a few collectives and files).
PART_BYTES = 4 * 2**20
MAX_PARTS = 16


def layout(num_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, world_size: int) -> tuple[int, int]:
    """``(parts, part_rows)`` of a per-row tensor: about ``PART_BYTES`` per rank per band, at most ``MAX_PARTS`` bands."""
    row_bytes = torch.Size(row_shape).numel() * torch.empty(0, dtype=dtype).element_size()
    per_rank = -(-num_rows // world_size) * row_bytes
    parts = min(MAX_PARTS, max(1, -(-per_rank // PART_BYTES)))
    part_rows = -(-num_rows // parts)
    return -(-num_rows // part_rows), part_rows


def band(table: SparseEmbedding, start: int, stop: int, device: torch.device) -> tuple[slice, Tensor]:
    """The slice of this rank's shard holding the global rows in ``[start, stop)``, and those rows' global ids."""
    rank, world = table.rank, table.world_size
    local_rows = table.sharding.num_local_rows(rank)
    if table.sharding_scheme == "mod":  # local l is global l * W + rank
        lo, hi = -(-(start - rank) // world), -(-(stop - rank) // world)
    else:
        first = rank * table.sharding.block_size
        lo, hi = start - first, stop - first
    lo, hi = max(0, min(lo, local_rows)), max(0, min(hi, local_rows))
    local = torch.arange(lo, hi, device=device)
    return slice(lo, hi), (local * world + rank if table.sharding_scheme == "mod" else local + rank * table.sharding.block_size)


def move_rows(
    values: Tensor, global_ids: Tensor, target: RowSharding, table: SparseEmbedding, out: Tensor, offset: int = 0
) -> Tensor:
    """Send each row of ``values`` (global row ``global_ids[i]``) to its owner under ``target``; write what arrives into ``out``.

    ``target`` places the ids minus ``offset``; each received row goes to ``out[target.to_local(id - offset)]``.
    Collective over the table's group: every rank calls it once.
    """
    ids = global_ids - offset
    if table.world_size == 1:
        return out.index_copy_(0, target.to_local(ids), values)
    peers = table.peers.counting(None)
    keys = target.key(ids)
    runs = SortedKeys(keys)
    if not torch.equal(runs.sorted, keys):  # else already grouped by owner
        ids, values = ids.index_select(0, runs.perm), values.index_select(0, runs.perm)
    below = runs.counts_below(target.key_boundaries(ids.device))
    send = (below[1:] - below[:-1]).view(-1, 1)
    recv = exchange_counts(send, peers).view(-1)
    with collective("row move of a checkpoint"):
        send_splits, recv_splits = send.view(-1).tolist(), recv.tolist()
    received_ids = exchange_values(ids, send_splits, recv_splits, peers)
    rows = exchange_values(values, send_splits, recv_splits, peers)
    return out.index_copy_(0, target.to_local(received_ids), rows)


class RowStore:
    """Writes and reads the per-row tensors of one checkpoint, band by band (one ``DeviceMesh`` per group, not kept)."""

    def __init__(self, directory: Path, distributed: bool) -> None:
        self.directory, self.distributed = directory, distributed
        self._meshes: dict[int, Any] = {}

    def part_directory(self, key: str, part: int) -> Path:
        return self.directory / key / f"part-{part}"

    def save(self, key: str, table: SparseEmbedding, local: Tensor) -> dict[str, Any]:
        """Write this rank's rows ``local`` (in the table's sharding) of the per-row tensor ``key``. Collective."""
        parts, part_rows = layout(table.num_embeddings, tuple(local.shape[1:]), local.dtype, table.world_size)
        for part in range(parts):
            start, stop = part * part_rows, min(table.num_embeddings, (part + 1) * part_rows)
            rows, global_ids = band(table, start, stop, local.device)
            blocks = RowSharding(stop - start, table.world_size, "range")
            block = local.new_empty(blocks.num_local_rows(table.rank), *local.shape[1:])
            move_rows(local[rows], global_ids, blocks, table, block, start)
            dcp.save({key: self._stored(table, block, stop - start)}, checkpoint_id=self.part_directory(key, part),
                     no_dist=not self.distributed)  # fmt: skip
            del block
        return {"table": table.name, "shape": [table.num_embeddings, *local.shape[1:]], "dtype": str(local.dtype).removeprefix("torch."),
                "parts": parts, "part_rows": part_rows, "ranks": table.world_size}  # fmt: skip

    def load(self, key: str, table: SparseEmbedding, out: Tensor, stored: dict[str, Any], load: Any) -> None:
        """Fill ``out`` (this rank's rows in the table's sharding) from the stored tensor ``key``, band by band. Collective.

        ``load(state, directory)`` runs ``dcp.load`` with the caller's error handling.
        """
        for saved_rows, block in self.blocks(key, table, stored, load, out):
            with torch.no_grad():
                move_rows(block, saved_rows, table.sharding, table, out)
            del block

    def blocks(
        self, key: str, table: SparseEmbedding, stored: dict[str, Any], load: Any, like: Tensor
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """This rank's contiguous block of each band of the stored tensor ``key``: (the rows' saved ids, their values).

        ``like``: a tensor with the rows' trailing shape, dtype and device. Collective: every
        rank of the table's group reads each band.
        """
        for part in range(stored["parts"]):
            start = part * stored["part_rows"]
            stop = min(stored["shape"][0], start + stored["part_rows"])
            blocks = RowSharding(stop - start, table.world_size, "range")
            block = like.new_empty(blocks.num_local_rows(table.rank), *like.shape[1:])
            load({key: self._stored(table, block, stop - start)}, self.part_directory(key, part))
            yield blocks.global_ids(table.rank, device=block.device) + start, block

    def _stored(self, table: SparseEmbedding, block: Tensor, rows: int) -> Any:
        """``block`` as the chunk of a logical ``[rows, ...]`` band (a DTensor, or itself with one rank)."""
        if table.world_size == 1 or not self.distributed:
            return block
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        group = table.process_group
        mesh = self._meshes.get(id(group))
        if mesh is None:
            mesh = self._meshes[id(group)] = DeviceMesh.from_group(group, block.device.type)
        shape = torch.Size([rows, *block.shape[1:]])
        stride = torch.empty(0).new_empty(shape, device="meta").stride()
        return DTensor.from_local(block.contiguous(), mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def export_rows(directory: Path, key: str, stored: dict[str, Any], target: Tensor, load: Any) -> None:
    """Read every band of ``key`` into ``target`` (the full tensor, one process)."""
    for part in range(stored["parts"]):
        start = part * stored["part_rows"]
        stop = min(target.shape[0], start + stored["part_rows"])
        load({key: target[start:stop]}, directory / key / f"part-{part}")
