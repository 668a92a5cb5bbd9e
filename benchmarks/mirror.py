"""One rank of a W-rank job in one process: a process group whose peers mirror this rank.

:class:`MirrorGroup` answers every collective as if each of the other ``W - 1`` ranks sent this
rank exactly what this rank sends to it: an ``all_to_all_single`` copies the input to the output
(and insists that the receive splits equal the send splits), an ``all_reduce`` combines ``W``
equal values, ``broadcast`` and ``barrier`` do nothing, ``all_gather`` repeats the input. So
headers, ids, rows and gradients stay consistent and every code path of the sparse exchange runs
at any ``W``, with no peer processes and no network: what is left is this rank's host work,
which is what the scale benchmark (``scale.py``) measures.

The mirrored job is a real one. Rank ``k`` of it looks up rank ``r``'s ids with each owner ``j``
replaced by ``(r + k - j) mod W`` (same local row), so that rank ``k`` sends rank ``r`` what ``r``
sends ``k``; if every rank's shard starts equal to rank ``r``'s, rank ``r``'s results (rows,
gradients, updated shard) are those of that ``W``-rank job, up to the order of floating-point
sums. ``tests/test_scale.py`` checks exactly that against a plain-torch reference.

    >>> group = init_mirror(rank=3, world_size=1024)   # the default group from now on
    >>> ...                                            # build tables, look up, step
    >>> group.calls, group.peer_messages               # collectives called, messages to peers

For 2-D sharding, :func:`mirror_groups` gives the rank its sharding group and replica group,
both mirrored the same way (every replica sends what this rank sends).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

BACKEND = "mirror"


@dataclass
class MirrorCounts:
    """What this rank would have put on the wire: collectives, messages to peers, bytes to peers."""

    calls: dict[str, int] = field(default_factory=dict)
    peer_messages: int = 0
    peer_bytes: int = 0

    def count(self, name: str, peers: int, nbytes: int) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.peer_messages += peers
        self.peer_bytes += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.peer_messages = self.peer_bytes = 0


def _done(result: object) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)


class MirrorGroup(dist.ProcessGroup):
    """Rank ``rank`` of a ``world_size``-rank group whose peers send this rank what it sends them."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._rank, self._world_size = rank, world_size
        self.counts = MirrorCounts()

    def size(self) -> int:
        return self._world_size

    def getBackendName(self) -> str:  # noqa: N802 - the name torch calls
        return BACKEND

    def all_to_all_single(self, output: Tensor, input: Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: object = None) -> dist.Work:  # fmt: skip
        if list(output_split_sizes) != list(input_split_sizes) or output.numel() != input.numel():
            raise RuntimeError(
                f"MirrorGroup: rank {self._rank} would receive splits {list(output_split_sizes)[:8]}... but sends "
                f"{list(input_split_sizes)[:8]}...: a mirrored peer sends what it receives. HINT: the caller must derive "
                f"its receive splits from headers exchanged through this group."
            )
        output.copy_(input)
        row = input.element_size() * (input[0].numel() if input.dim() > 1 and len(input) else 1)
        if input_split_sizes:
            own = input_split_sizes[self._rank] * row
        else:  # equal splits
            own = input.numel() * input.element_size() // self._world_size
        if input_split_sizes:  # the ranks other than this one that get a non-empty split (counted in C, not a Python loop)
            splits = list(input_split_sizes)
            peers = len(splits) - splits.count(0) - (splits[self._rank] != 0)
        else:
            peers = self._world_size - 1
        self.counts.count("all_to_all_single", peers, input.numel() * input.element_size() - own)
        return _done(output)

    def allreduce(self, tensors: list[Tensor], opts: object = None) -> dist.Work:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        for tensor in tensors:
            if op == dist.ReduceOp.SUM:
                tensor.mul_(self._world_size)
            elif op == dist.ReduceOp.PRODUCT:
                tensor.pow_(self._world_size)
            # MIN, MAX, AVG, BAND, BOR of W equal values: the value itself
        self.counts.count("all_reduce", 2 * (self._world_size - 1), sum(2 * t.numel() * t.element_size() for t in tensors))
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[Tensor], opts: object = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[Tensor], opts: object = None) -> dist.Work:
        self.counts.count("broadcast", 1, 0)
        return _done(tensors)

    def barrier(self, opts: object = None) -> dist.Work:
        self.counts.count("barrier", self._world_size - 1, 0)
        return _done(None)

    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: object = None) -> dist.Work:
        for outputs, tensor in zip(output_lists, inputs):
            for out in outputs:
                out.copy_(tensor)
        self.counts.count("all_gather", self._world_size - 1, sum(t.numel() * t.element_size() for t in inputs))
        return _done(output_lists)

    def _allgather_base(self, output: Tensor, input: Tensor, opts: object = None) -> dist.Work:
        output.view(self._world_size, -1).copy_(input.reshape(1, -1))
        self.counts.count("all_gather", self._world_size - 1, input.numel() * input.element_size())
        return _done(output)

    def all_gather_single(self, output: Tensor, input: Tensor, opts: object = None) -> dist.Work:
        return self._allgather_base(output, input, opts)

    def __repr__(self) -> str:
        return f"MirrorGroup(rank={self._rank}, world_size={self._world_size})"


def _create(store: dist.Store, rank: int, world_size: int, timeout: object) -> MirrorGroup:
    return MirrorGroup(rank, world_size)


def mirror_groups(rank: int, world_size: int, group_size: int) -> tuple[MirrorGroup, MirrorGroup]:
    """This rank's (sharding group, replica group) of a mirrored 2-D job, after :func:`init_mirror`.

    Only this rank's two groups are made (no W / G + G groups as ``sharding_groups`` makes), and
    registered with c10d so that ``dist.get_rank(group)`` knows them.
    """
    from torch.distributed import distributed_c10d as c10d

    replicas = world_size // group_size
    if replicas * group_size != world_size:
        raise ValueError(f"group size {group_size} does not divide the world size {world_size}")
    index, position = divmod(rank, group_size)
    shard, replica = MirrorGroup(position, group_size), MirrorGroup(index, replicas)
    c10d._world.pg_group_ranks[shard] = {index * group_size + p: p for p in range(group_size)}
    c10d._world.pg_group_ranks[replica] = {q * group_size + position: q for q in range(replicas)}
    for group in (shard, replica):
        c10d._world.pg_map[group] = (BACKEND, dist.HashStore())
        c10d._world.pg_backend_config[group] = f"cpu:{BACKEND},cuda:{BACKEND}"
    return shard, replica


def init_mirror(rank: int, world_size: int) -> MirrorGroup:
    """Make a :class:`MirrorGroup` the default process group (destroy it with ``dist.destroy_process_group()``)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
    group = dist.group.WORLD
    if not isinstance(group, MirrorGroup):
        raise RuntimeError(f"init_mirror: the default group is {type(group).__name__}, not a MirrorGroup")
    return group
