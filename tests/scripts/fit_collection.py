"""Fit ``CollectionTower`` (tests/lightning_models.py) in whatever job launched this process; rank 0 saves the result.

    python fit_collection.py OUT.pt NUM_NODES DEVICES_PER_NODE TIMEOUT_S

Launched by torchrun (TorchElasticEnvironment) or with MASTER_ADDR / NODE_RANK set by hand
(LightningEnvironment). Two epochs of batches of 4 per rank, Adagrad(lr=0.2) on the tables:
``lightning_models.reference`` replays the same global batches in plain torch.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lightning_models as lm  # noqa: E402
import lightning_sparse as ls  # noqa: E402


def main() -> None:
    out, num_nodes, devices, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    module = lm.CollectionTower()
    trainer = lm.trainer(devices, num_nodes=num_nodes, max_epochs=2,
                         strategy=ls.SparseDDPStrategy(timeout=timedelta(seconds=timeout)))  # fmt: skip
    trainer.fit(module)
    state = lm.state(module)  # collective: every rank takes part
    if trainer.global_rank == 0:
        torch.save({"state": state, "world_size": trainer.world_size, "num_nodes": trainer.num_nodes}, out)


if __name__ == "__main__":
    main()
