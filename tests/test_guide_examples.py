"""The examples of the README and the guide run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning_models as lm
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_sparse as ls

ROOT = Path(__file__).resolve().parents[1]
README, GUIDE = ROOT / "README.md", ROOT / "docs" / "guide"


def _block(page: Path, marker: str) -> str:
    """The one Python block of ``page`` that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def _lightning_example() -> str:
    return _block(GUIDE / "lightning.md", "configure_sparse_optimizers")


def _run_readme_module() -> tuple[float, int]:
    lm.lightning_env(torch.distributed.get_rank(), 2)
    namespace: dict = {}
    exec(
        _lightning_example().replace(
            "devices=2, max_epochs=1,",
            "devices=2, max_epochs=3, logger=False, enable_progress_bar=False, enable_checkpointing=False,",
        ),
        namespace,
    )
    gen = torch.Generator().manual_seed(0)
    users, items = torch.randint(0, 1000, (256,), generator=gen), torch.randint(0, 500, (256,), generator=gen)
    clicked = ((users + items) % 2).float()
    model, trainer = namespace["Recommender"](), namespace["trainer"]
    initial = namespace["ls"].SparseEmbedding(1000, 16).full_weight()  # the same seed: the same table
    trainer.fit(model, DataLoader(TensorDataset(users, items, clicked), batch_size=32))
    moved = (model.users.full_weight() != initial).any(dim=1)
    return float(trainer.callback_metrics["train_loss"]), int(moved.sum()), int(torch.unique(users).numel())


def test_the_lightning_guide_example_trains(rank_pools):
    import math

    for loss, moved_rows, looked_up_rows in rank_pools(2).run(_run_readme_module):
        assert math.isfinite(loss)
        assert moved_rows == looked_up_rows  # exactly the rows the data touched were trained


def _collection_example() -> str:
    return _block(GUIDE / "collections.md", "SparseEmbeddingCollection(")


def _run_example(code: str, output: str) -> dict:
    """Run a guide example as written, then a backward and a step through its outputs; each output's shape."""
    namespace: dict = {}
    exec(code, namespace)
    out = namespace[output]
    sum(v.sum() for v in out.values()).backward()
    namespace["optimizer"].step()
    return {k: tuple(v.shape) for k, v in out.items()}


def test_the_collection_guide_example_runs_on_every_rank(rank_pools):
    for shapes in rank_pools(2).run(_run_example, _collection_example(), "out"):
        assert shapes == {"user": (2, 16), "candidate": (2, 2, 16), "history": (2, 16)}


@pytest.mark.subprocesses
@pytest.mark.timeout(600)
def test_the_readme_quickstart_trains_as_written(tmp_path):
    """Saved as quickstart.py and run: 2 CPU processes, the loss of each epoch printed, and falling.

    Its time limit only catches a hang (no speed claim): it took 110 s at a load of 20 on 2 cores."""
    (tmp_path / "quickstart.py").write_text(_block(README, "configure_sparse_optimizers"))
    run = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, capture_output=True, text=True, timeout=540,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 5 and losses[-1] < 0.5 * losses[0], run.stdout


def test_the_torchrec_guide_example_runs_on_every_rank(rank_pools):
    for shapes in rank_pools(2).run(_run_example, _block(GUIDE / "torchrec.md", "SparseEmbeddingCollection("), "pooled"):
        assert shapes == {"user": (2, 64), "clicked": (2, 64)}


def test_the_plain_pytorch_checkpoint_example_saves_and_loads(tmp_path, monkeypatch):
    """The guide's plain-PyTorch recipe, as written, around a model and optimizer of its own: the rows come back."""
    monkeypatch.chdir(tmp_path)

    def build(seed: int) -> tuple[torch.nn.Module, ls.SparseAdagrad]:
        model = torch.nn.Module()
        model.users = ls.SparseEmbedding(50, 4, seed=seed)
        return model, ls.SparseAdagrad([model.users], lr=0.5)

    model, sparse = build(0)
    model.users(torch.tensor([1, 2, 3])).sum().backward()
    sparse.step()
    saved, saved_sum = model.users.full_weight().clone(), sparse.state[model.users.shard]["sum"].clone()
    save, load = _block(GUIDE / "checkpoints.md", "checkpoint.save(").split("# ... later")
    namespace = {"model": model, "sparse": sparse}
    exec(save, namespace)
    namespace["model"], namespace["sparse"] = build(9)
    exec(load.split("\n", 1)[1], namespace)
    assert torch.equal(namespace["model"].users.full_weight(), saved)
    assert torch.equal(namespace["sparse"].state[namespace["model"].users.shard]["sum"], saved_sum)
