"""Fit ``CollectionTower`` (tests/lightning_models.py) in whatever job launched this process; rank 0 saves the result.

    python fit_collection.py OUT.pt --num-nodes 2 --devices 1 --timeout 20 [--checkpoints DIR [--resume]]
                             [--pause RANK STEP DIR] [--die RANK STEP FILE] [--epochs 2] [--times FILE]

``--times``: rank 0 writes every training step's wall time (s) there as JSON (benchmarks/network.py).

Launched by torchrun (TorchElasticEnvironment) or with MASTER_ADDR / NODE_RANK set by hand
(LightningEnvironment). Two epochs of 6 steps (batches of 4 per rank on 2 ranks), Adagrad(lr=0.2)
on the tables: ``lightning_models.reference`` replays the same global batches in plain torch.

``--checkpoints``: a checkpoint at every epoch's end and ``last.ckpt``; ``--resume`` starts from
``last`` (from scratch when there is none yet). ``--pause``: rank RANK writes DIR/paused when
global step STEP begins, then waits for DIR/go (the test cuts a link or kills a host meanwhile). ``--die``: rank
RANK SIGKILLs itself at step STEP, once per job: it writes FILE first, and never dies where FILE exists
(torchrun's TORCHELASTIC_RESTART_COUNT would not do: a machine whose workers torchrun restarts
because another machine failed starts them with the count unchanged, and ranks may move between machines).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lightning_models as lm  # noqa: E402

import lightning_sparse as ls  # noqa: E402


class AtStep(pl.Callback):
    def __init__(self, rank: int, step: int, action) -> None:
        self.rank, self.step, self.action = rank, step, action

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            self.action()


class StepTimes(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path, self.times, self.start = path, [], 0.0

    def on_train_batch_start(self, *args: object) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args: object) -> None:
        self.times.append(time.perf_counter() - self.start)

    def on_train_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps(self.times))


def pause(directory: Path, most_s: float = 300) -> None:
    (directory / "paused").touch()
    deadline = time.monotonic() + most_s
    while not (directory / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def die(marker: Path) -> None:
    marker.touch()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks, for whoever debugs a test
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=20)
    parser.add_argument("--checkpoints")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--pause", nargs=3)
    parser.add_argument("--die", nargs=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--times")
    args = parser.parse_args()

    callbacks: list[pl.Callback] = []
    if args.checkpoints:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoints, save_top_k=-1, save_last=True))
    if args.pause:
        callbacks.append(AtStep(int(args.pause[0]), int(args.pause[1]), lambda: pause(Path(args.pause[2]))))
    if args.die and not Path(args.die[2]).exists():
        callbacks.append(AtStep(int(args.die[0]), int(args.die[1]), lambda: die(Path(args.die[2]))))
    if args.times:
        callbacks.append(StepTimes(args.times))
    module = lm.CollectionTower()
    trainer = lm.trainer(args.devices, num_nodes=args.num_nodes, max_epochs=args.epochs, callbacks=callbacks,
                         enable_checkpointing=bool(args.checkpoints),
                         strategy=ls.SparseDDPStrategy(timeout=timedelta(seconds=args.timeout)))  # fmt: skip
    # When this rank began to join the job and when it learned of a loss: on the clock every process of the machine shares.
    print(f"fit started at monotonic {time.monotonic():.3f}", flush=True)
    try:
        trainer.fit(module, ckpt_path="last" if args.resume else None)
    except ls.PeerFailure:
        print(f"PeerFailure raised at monotonic {time.monotonic():.3f}", flush=True)
        raise
    state = lm.state(module)  # collective: every rank takes part
    if trainer.global_rank == 0:
        torch.save({"state": state, "world_size": trainer.world_size, "num_nodes": trainer.num_nodes}, args.out)


if __name__ == "__main__":
    main()
