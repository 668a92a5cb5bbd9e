"""One host's shared memory: a table whose ranks all run on one machine keeps its rows where every rank can read them.

``SparseEmbedding(shared_memory=True)``: the whole table lives in one segment that every rank of its
group maps, in owner-major key order (``RowSharding.key``), so rank ``r``'s shard is its own block of
the segment. Rows stay owned as before: only the owner updates a row, and its optimizer state stays
private. But a lookup reads any owner's rows in place
(:class:`~lightning_sparse.lookup.outputs.SharedReads`): no ids to owners, no rows back. Per step
what crosses between ranks is the gradients to owners (the step's general round) and one
:class:`Fence` after the owners' update, so that no rank reads a row while its owner writes it.
DGL's ``NodeEmbedding`` keeps its table in shared memory too.

The fence after the update is a gloo barrier's round trip per step unless the ranks can meet in
the shared memory itself (:class:`Fence`): on x86-64, whose stores reach other cores in program
order, each rank writes its arrival into its own slot and waits for the others' (microseconds
where a barrier through the network stack takes a fraction of a millisecond, more on small VMs).
Its slots carry small messages too (:meth:`Fence.exchange`: the split sizes of the step's gradients), and
each rank has a mailbox beside them for the gradient rows themselves (:meth:`Fence.exchange_values`): on
such a host the step's exchange crosses no network stack at all.

The segment is a file in ``/dev/shm`` that rank 0 of the group creates, reserving its pages first
(a full ``/dev/shm`` raises here with a HINT, on every rank, instead of a SIGBUS in a later step), and
unlinks once every rank has mapped it: the memory lives while some rank maps it, and a job that dies
leaves nothing behind in ``/dev/shm``.
"""

from __future__ import annotations

import math
import os
import platform
import time
import uuid
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse.faults.peers import collective
from lightning_sparse.wire.alltoall import split_starts

SHM_DIR = "/dev/shm"


def map_segment(shape: tuple[int, int], dtype: torch.dtype, group: dist.ProcessGroup, what: str) -> Tensor:
    """A zero-filled ``shape`` tensor that every rank of ``group`` maps from one shared-memory file.

    Raises on every rank if rank 0 cannot make the file (``/dev/shm`` too small) or a rank cannot
    map it (it runs on another host). ``what`` names the table in errors.
    Collective: every rank of ``group`` must call it.
    """
    rank = dist.get_rank(group)
    nbytes = shape[0] * shape[1] * dtype.itemsize
    offer: list[dict | None] = [_create(nbytes, what) if rank == 0 else None]
    with collective(f"shared-memory set-up of {what}"):
        dist.broadcast_object_list(offer, src=dist.get_global_rank(group, 0), group=group)
    made = offer[0]
    path = made.get("path")
    try:
        if "error" in made:
            raise RuntimeError(made["error"])
        segment, problem = _attach(made, shape, dtype, rank, what)
        problems: list[str | None] = [None] * dist.get_world_size(group)
        with collective(f"shared-memory set-up of {what}"):
            dist.all_gather_object(problems, problem, group=group)  # every rank has mapped it, or said why not
    finally:
        if rank == 0 and path is not None:
            os.unlink(path)
    for problem in problems:
        if problem is not None:
            raise RuntimeError(problem)
    return segment


# Where a store reaches other cores in program order (total store order), a slot written after the rows tells a
# reader that read it first that the rows are there; elsewhere the fence is the group's barrier.
STORES_IN_ORDER = platform.machine().lower() in ("x86_64", "amd64")
SPIN_S = 2e-4  # a fence checks the slots this long before it sleeps between checks
CHECK_PEERS_S = 1.0  # how often a waiting fence checks that the ranks it waits for are alive
FENCE_TIMEOUT_S = 1800.0  # torch's default collective timeout: a fence's where its group does not say its own
MESSAGE_WORDS = 1024  # int64 words each rank may post in one :meth:`Fence.exchange`
MAILBOX_STEP = 1 << 20  # a mailbox grows in whole MiB, at least twice what it was


class Fence:
    """Every rank of a group on one host waits here until all have arrived; writes before it are seen by reads after it.

    On x86-64 the ranks meet in shared memory: each rank's arrival count in its own slot (a cache line),
    its pid beside it; a rank waits until every slot holds its count, and raises if a rank it waits for
    has died (checked every :data:`CHECK_PEERS_S`) or after the group's timeout. Elsewhere it is the
    group's barrier, and :meth:`exchange` and :meth:`exchange_values` decline. Made collectively
    (:func:`map_segment`); calling it is collective: every rank of the group must call it, the same number of times.
    """

    def __init__(self, group: dist.ProcessGroup, what: str) -> None:
        self._group = weakref.ref(group)  # as a table holds its groups: destroy_process_group() releases them
        self.what, self.rank = what, dist.get_rank(group)
        self.arrivals = 0
        self.timeout_s = _timeout_s(group)
        self.slots = None
        self.mailboxes: Tensor | None = None  # [W, bytes]: each rank's outgoing buffer, made at the first exchange_values
        if STORES_IN_ORDER:
            slots = map_segment((dist.get_world_size(group), 8 + MESSAGE_WORDS), torch.int64, group, f"{what}'s fence")
            self.slots = slots.numpy()  # read and written without torch's dispatch: a check costs a microsecond
            self.slots[self.rank, 1] = os.getpid()
            self.barrier()  # every pid is written

    def __call__(self) -> None:
        if self.slots is None:
            self.barrier()
            return
        self.arrivals += 1
        self.slots[self.rank, 0] = self.arrivals
        start = last_check = time.perf_counter()
        while self.slots[:, 0].min() < self.arrivals:
            now = time.perf_counter()
            if now - last_check > CHECK_PEERS_S:
                self._raise_if_lost(now - start)
                last_check = now
            if now - start > SPIN_S:
                time.sleep(SPIN_S / 4)

    def exchange(self, send: Tensor) -> Tensor | None:
        """Row ``j`` of ``send`` (``[W, K]`` int64, on the CPU) goes to rank ``j``; row ``i`` of the result came from rank ``i``.

        Through the slots, between two fences (no rank posts again before every rank has read); ``None``
        where the ranks cannot meet in shared memory or the message is over :data:`MESSAGE_WORDS`: the
        caller sends it over the group. Collective: every rank of the group must call it with the same ``K``.
        """
        if self.slots is None or send.numel() > MESSAGE_WORDS or send.device.type != "cpu":
            return None
        world, width = send.shape
        self.slots[self.rank, 8 : 8 + send.numel()] = send.reshape(-1).numpy()
        self()
        received = torch.from_numpy(self.slots[:, 8 : 8 + send.numel()].reshape(world, world, width)[:, self.rank].copy())
        self()
        return received

    def exchange_values(self, values: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor | None:
        """:func:`~lightning_sparse.wire.alltoall.exchange_values` through the ranks' mailboxes: each rank posts its buffer
        (``send_splits[j]`` leading rows for rank ``j``) in its own, then copies its piece of every rank's.

        Its offsets and sizes go first by :meth:`exchange` (a mailbox too small grows on every rank), then two fences:
        the buffers posted, all read.
        ``None`` where the ranks cannot meet in shared memory: the caller sends it over the group.
        Collective: every rank of the group must call it.
        """
        if self.slots is None or values.device.type != "cpu":
            return None
        flat = values.contiguous().view(-1).view(torch.uint8)
        row_bytes = math.prod(values.shape[1:]) * values.element_size()  # (from the shape: this rank may send no rows)
        # To each rank: where its rows start in this rank's buffer, and the buffer's size (every rank learns the largest).
        starts = torch.tensor(split_starts(send_splits)[:-1], dtype=torch.int64) * row_bytes
        posted = self.exchange(torch.stack([starts, torch.full_like(starts, flat.numel())], dim=1))
        if posted is None:  # (declined alike on every rank: more ranks than the slots hold messages for)
            return None
        needed = int(posted[:, 1].max())
        if self.mailboxes is None or needed > self.mailboxes.shape[1]:
            size = max(needed, 2 * (self.mailboxes.shape[1] if self.mailboxes is not None else 0), 1)
            self.mailboxes = map_segment((len(send_splits), -(-size // MAILBOX_STEP) * MAILBOX_STEP), torch.uint8, self.group,
                                         f"{self.what}'s mailboxes")  # fmt: skip
        self.mailboxes[self.rank, : flat.numel()].copy_(flat)
        self()
        pieces = [self.mailboxes[source, start : start + n * row_bytes]
                  for source, (start, n) in enumerate(zip(posted[:, 0].tolist(), recv_splits))]  # fmt: skip
        received = torch.cat(pieces).view(values.dtype).view(-1, *values.shape[1:])
        self()
        return received

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError(f"The process group of {self.what}'s shared memory has been destroyed. HINT: use the table "
                               f"before destroy_process_group().")  # fmt: skip
        return group

    def barrier(self) -> None:
        with collective(f"shared-memory fence of {self.what}"):
            dist.barrier(group=self.group)

    def _raise_if_lost(self, waited: float) -> None:
        late = [r for r in range(len(self.slots)) if self.slots[r, 0] < self.arrivals]
        dead = [r for r in late if not _alive(int(self.slots[r, 1]))]
        if dead or waited > self.timeout_s:
            what = f"rank(s) {dead} of its group died" if dead else f"rank(s) {late} did not arrive within {waited:.0f} s"
            raise RuntimeError(f"The shared-memory fence of {self.what} failed: {what}. HINT: restart all ranks and resume from "
                               f"the last checkpoint (docs/guide/launching.md).")  # fmt: skip


def _create(nbytes: int, what: str) -> dict:
    """Rank 0: a new file of ``nbytes`` reserved bytes in ``/dev/shm``, and what tells another rank it sees the same one."""
    path = os.path.join(SHM_DIR, f"lightning_sparse_{os.getpid()}_{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        return {"error": f"{what}: cannot create its shared-memory file in {SHM_DIR} ({err}). HINT: shared_memory=True "
                         f"needs a writable {SHM_DIR} (tmpfs); leave it off otherwise."}  # fmt: skip
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))  # the pages now: tmpfs would SIGBUS at the first write past its size
    except OSError as err:
        os.close(fd)
        os.unlink(path)
        free = os.statvfs(SHM_DIR)
        return {"error": f"{what}: {SHM_DIR} has no room for its {nbytes / 2**20:.1f} MiB ({err}; "
                         f"{free.f_bavail * free.f_frsize / 2**20:.1f} MiB free). HINT: give the host's {SHM_DIR} more room "
                         f"(docker run --shm-size), or leave shared_memory off."}  # fmt: skip
    stat = os.fstat(fd)
    os.close(fd)
    return {"path": path, "boot_id": _boot_id(), "inode": (stat.st_dev, stat.st_ino)}


def _attach(made: dict, shape: tuple[int, int], dtype: torch.dtype, rank: int, what: str) -> tuple[Tensor | None, str | None]:
    """Map rank 0's file here; or say why this rank cannot (another host, another container's /dev/shm)."""
    hint = (f"HINT: shared_memory=True needs every rank of the table's group on one host, with one {SHM_DIR}; "
            f"leave it off for groups across hosts.")  # fmt: skip
    try:
        stat = os.stat(made["path"])
    except OSError:
        return None, f"{what}: rank {rank} cannot see the shared-memory file rank 0 made ({made['path']}). {hint}"
    if _boot_id() != made["boot_id"] or (stat.st_dev, stat.st_ino) != tuple(made["inode"]):
        return None, f"{what}: rank {rank} sees another file at {made['path']} than rank 0 made. {hint}"
    try:
        return torch.from_file(made["path"], shared=True, size=shape[0] * shape[1], dtype=dtype).view(shape), None
    except RuntimeError as err:  # said on every rank, not raised on this one while the others wait
        return None, f"{what}: rank {rank} cannot map the shared-memory file rank 0 made ({err}). {hint}"


def _boot_id() -> str:
    """This host's boot id (two hosts never share one); empty where Linux does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _timeout_s(group: dist.ProcessGroup) -> float:
    """The group's collective timeout, in seconds (torch keeps it in its backend's options), or torch's default."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return FENCE_TIMEOUT_S


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
