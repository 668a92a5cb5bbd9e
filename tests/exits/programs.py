"""Programs that train with lightning_sparse on 2 CPU ranks and exit: one per exit shape a user has.

Usage: ``python programs.py SHAPE``, run in a scratch directory (checkpoints land there). The
program exits 0 when it and every rank it launched exited 0. ``stress.py`` runs them many times.

Shapes (``SHAPES``):

- ``torch-spawn``, ``torch-spawn-destroy``: a plain torch loop (no Lightning: a SparseEmbedding
  with SparseAdagrad, a DDP-wrapped head, a loss all-reduced for logging) launched with
  ``torch.multiprocessing.spawn``; without and with ``destroy_process_group()``;
- ``torchrun``: the same loop launched by ``torchrun --standalone --nproc-per-node 2``;
- ``fit``, ``fit-destroy``: ``Trainer.fit`` with Lightning's own launcher (the script is run again
  for rank 1), checkpoints and ``log(sync_dist=True)``; without and with ``destroy_process_group()``;
- ``fit-spawn``: the same fit with ``SparseDDPStrategy(start_method="spawn")``;
- ``torchrun-fit``: the same fit launched by torchrun;
- ``eval``: ``validate``, ``test`` and ``predict`` in a row, then exit;
- ``exception``: ``fit`` raises in ``training_step`` on every rank; the program catches it and exits.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")

TIMEOUT = timedelta(seconds=60)
SHAPES = ["torch-spawn", "torch-spawn-destroy", "torchrun", "fit", "fit-destroy", "fit-spawn", "torchrun-fit", "eval",
          "exception"]  # fmt: skip


# ---------------------------------------------------------------------------------------- plain torch
def torch_loop(destroy: bool) -> None:
    """Every rank: 6 steps of a table and a DDP head, then (optionally) destroy the group."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lightning_sparse as ls

    torch.set_num_threads(1)
    rank = dist.get_rank()
    table = ls.SparseEmbedding(1000, 8, seed=0)
    head = DistributedDataParallel(torch.nn.Linear(8, 1))
    dense, sparse = torch.optim.SGD(head.parameters(), lr=0.1), ls.SparseAdagrad([table], lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(6):
        ids, target = torch.randint(0, 1000, (16,), generator=generator), torch.randn(16, generator=generator)
        loss = torch.nn.functional.mse_loss(head(table(ids)).squeeze(-1), target)
        loss.backward()
        dense.step(), sparse.step()
        dense.zero_grad(), sparse.zero_grad()
        dist.all_reduce(loss.detach())  # a tensor made for one collective, as in logging code
    if destroy:
        dist.destroy_process_group()
    print(f"rank {rank}: trained", flush=True)


def torch_spawn_rank(rank: int, port: int, destroy: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=TIMEOUT)
    torch_loop(destroy)


def torch_spawn(destroy: bool) -> int:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(torch_spawn_rank, args=(port, destroy), nprocs=2)  # raises if a rank exits abnormally
    return 0


def torchrun_rank() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=TIMEOUT)  # env:// from torchrun
    torch_loop(destroy=False)
    return 0


# ---------------------------------------------------------------------------------------- Lightning
def lightning(shape: str) -> int:
    import lightning.pytorch as pl
    import torch
    from exit_model import ExitModel, SaveTrainedTables
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_sparse as ls

    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randint(0, 1000, (128,), generator=generator), torch.randn(128, generator=generator)),
                        batch_size=16)  # fmt: skip
    strategy = ls.SparseDDPStrategy(timeout=TIMEOUT, start_method="spawn" if shape == "fit-spawn" else "popen")
    trained_path = os.path.join(os.getcwd(), "trained.pt")  # fit-spawn: the tables rank 0 held at the end of the fit
    callbacks = [ls.SparseStatsMonitor(), *([SaveTrainedTables(trained_path)] if shape == "fit-spawn" else [])]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=5, limit_val_batches=2,
                         default_root_dir=os.getcwd(), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    model = ExitModel(fail_at_batch=2 if shape == "exception" else None)
    if shape == "eval":
        trainer.validate(model, loader)
        trainer.test(model, loader)
        trainer.predict(model, loader)
    elif shape == "exception":
        try:
            trainer.fit(model, loader, loader)
        except ValueError as err:
            print(f"rank {trainer.global_rank}: caught {err}", flush=True)
    else:
        trainer.fit(model, loader, loader)
    if shape == "fit-spawn":  # this is the main process: rank 0 handed back exactly the full tables it trained
        trained = torch.load(trained_path, weights_only=True)
        assert not torch.equal(trained["users"], ExitModel().users.full_weight()), "the fit must train the table"
        handed = {"users": model.users.full_weight(), "item": model.features.tables["item"].full_weight()}
        for name, table in trained.items():
            assert torch.equal(handed[name], table), f"{name}: the table handed back is not the one rank 0 trained"
    if shape == "fit-destroy":
        torch.distributed.destroy_process_group()
    print(f"rank {trainer.global_rank}: done", flush=True)
    return _wait_for_launched_ranks(trainer)


def _wait_for_launched_ranks(trainer) -> int:
    """Rank 0 of Lightning's script launcher waits for the ranks it launched and reports their exits."""
    procs = getattr(trainer.strategy.launcher, "procs", [])  # the spawn launcher joins its processes itself
    codes = [proc.wait(timeout=120) for proc in procs if isinstance(proc, subprocess.Popen)]
    if any(codes):
        print(f"launched ranks exited with {codes}", flush=True)
        return 1
    return 0


def main(shape: str) -> int:
    if shape in ("torch-spawn", "torch-spawn-destroy"):
        return torch_spawn(destroy=shape.endswith("destroy"))
    if shape in ("torchrun", "torchrun-fit") and "TORCHELASTIC_RUN_ID" not in os.environ:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__, shape]
        return subprocess.run(command, check=False).returncode
    if shape == "torchrun":
        return torchrun_rank()
    if shape in SHAPES:
        return lightning(shape)
    raise SystemExit(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
