"""Fit with sparse_ddp on 2 spawned CPU ranks, gather a table, destroy the group, exit; rank 1 a little later.

The shape of program that aborted at exit ("terminate called without an active exception",
SIGABRT) about once in a dozen runs when something still held the process group after
destroy_process_group(). Run by tests/test_exits.py many times; exits 0 when both ranks exited
cleanly, and prints each rank's line. With ``--no-destroy`` the program forgets
destroy_process_group() (torch issue #190489): sparse_ddp's exit handler destroys the group.
"""

import multiprocessing as mp
import os
import socket
import sys
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")


def fit(rank: int):
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_sparse as ls

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

    data = TensorDataset(torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(rank)), torch.randn(64))
    model = Model()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="sparse_ddp", max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=8))
    return model.users.full_weight()


def rank_main(rank: int, port: int, destroy: bool) -> None:
    import torch  # only the ranks import torch: the parent starts and waits for them
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    table = fit(rank)  # the trainer and the model are garbage once fit returns
    if destroy:
        dist.destroy_process_group()
    if rank == 1:
        time.sleep(0.3)  # the other rank exits first
    print(f"rank {rank}: {tuple(table.shape)} done", flush=True)


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")  # each rank exits through a full interpreter shutdown
    ranks = [context.Process(target=rank_main, args=(rank, port, "--no-destroy" not in sys.argv)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=240)
    codes = [process.exitcode for process in ranks]
    if codes != [0, 0]:
        print(f"a rank did not exit cleanly: exit codes {codes}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
