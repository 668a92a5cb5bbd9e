"""Fit with sparse_ddp on 2 CPU ranks launched by Lightning; rank 1 hangs at step 3.

Usage: hang_one_rank.py PID_FILE stop|sleep [TIMEOUT_S]. Rank 1 writes its pid to PID_FILE, then
stops itself (SIGSTOP) or sleeps for ``HANG_S``. Rank 0 fails after the group's timeout (TIMEOUT_S,
default 10 s) and the strategy kills the rank it launched. Run by tests/test_exits.py, which checks that the hung rank
does not outlive the program.
"""

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_sparse as ls  # noqa: E402

HANG_S = 600  # how long the hung rank sleeps: far longer than the test waits


class StopAt(pl.Callback):
    def __init__(self, pid_file: str) -> None:
        self.pid_file = pid_file

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 3:
            with open(self.pid_file, "w") as f:
                f.write(str(os.getpid()))
            if sys.argv[2] == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(HANG_S)


class JoinOnceAllAreUp(ls.SparseDDPStrategy):
    """Joins the rendezvous once every rank has started: on a busy machine rank 1's imports alone can outlast the
    10 s timeout meant for the hung collective (files in the working directory, which both ranks share)."""

    def setup_distributed(self) -> None:
        environment = self.cluster_environment
        Path(f"up-{environment.global_rank()}").touch()
        deadline = time.monotonic() + HANG_S
        while not all(Path(f"up-{rank}").exists() for rank in range(environment.world_size())):
            if time.monotonic() > deadline:
                raise TimeoutError("the other rank never started")
            time.sleep(0.05)
        super().setup_distributed()


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.users = ls.SparseEmbedding(1000, 8, seed=0)
        self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        ids, target = batch
        return torch.nn.functional.mse_loss(self.head(self.users(ids)).squeeze(-1), target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.1)

    def configure_sparse_optimizers(self):
        return ls.SparseAdagrad([self.users], lr=0.1)


def main() -> int:
    torch.set_num_threads(1)
    timeout_s = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
    data = TensorDataset(torch.randint(0, 1000, (256,)), torch.randn(256))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=JoinOnceAllAreUp(timeout=timedelta(seconds=timeout_s)),
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[StopAt(sys.argv[1])])  # fmt: skip
    trainer.fit(Model(), DataLoader(data, batch_size=8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
