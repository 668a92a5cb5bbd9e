import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DGLBACKEND", "pytorch")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (tests/test_kernels.py): set before
# triton is imported. With a GPU they compile, and the CPU-tensor kernel tests are skipped.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile's on-disk caches of this run only (the ranks inherit it): a cache from an earlier checkout can hold
# graphs compiled against another fake kernel of lightning_sparse's custom ops.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="lightning-sparse-inductor-"))

from rank_pool import RankPool  # noqa: E402

# Start-up hooks for the child processes of some tests (the exit stress script, the hung-rank test), never for this one.
collect_ignore = ["exits/widen", "scripts/fast_observer"]

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def rank_pools():
    """Pools of spawned ranks, one per (world size, device), started on first use and kept for the session."""
    pools: dict[tuple[int, str], RankPool] = {}

    def get(world_size: int, device: str = "cpu") -> RankPool:
        key = (world_size, device)
        if key in pools and pools[key].broken:
            pools.pop(key).close()
        if key not in pools:
            pools[key] = RankPool(world_size, device)
        return pools[key]

    yield get
    for pool in pools.values():  # every pool's ranks exit at once
        pool.stop()
    errors = []
    for pool in pools.values():
        try:
            pool.close()  # checks that every rank exited with code 0
        except AssertionError as err:
            errors.append(str(err))
    assert not errors, "; ".join(errors)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that start interpreters of their own run first (a stable sort): with ``make test``'s two workers,
    each takes the next test as it finishes one, so these long ones overlap and the short ones fill in behind."""
    items.sort(key=lambda item: item.get_closest_marker("subprocesses") is None)


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that leaves a process group in this process fails here, not the next test of this worker that makes one."""
    before = torch.distributed.is_initialized()
    yield
    if not before and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        pytest.fail("the test left a process group initialized in the pytest process: destroy it (Lightning does not)")
