import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DGLBACKEND", "pytorch")

import pytest  # noqa: E402
import torch  # noqa: E402

from rank_pool import RankPool  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def rank_pools():
    """Pools of spawned gloo ranks, one per world size, started on first use and kept for the session."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size in pools and pools[world_size].broken:
            pools.pop(world_size).close()
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
