"""The DGL examples (GraphSAGE on learnable rows, DeepWalk) train on 2 processes; skipped without dgl."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("dgl")

EXAMPLE = Path(__file__).parent.parent / "examples" / "dgl"
sys.path.insert(0, str(EXAMPLE))
import graphs  # noqa: E402
from example_runs import run_script  # noqa: E402


def test_planted_communities_are_reproducible_and_planted():
    a = graphs.planted_communities(1000, 10, degree_in=5, degree_out=5, labeled=0.2, seed=3)
    b = graphs.planted_communities(1000, 10, degree_in=5, degree_out=5, labeled=0.2, seed=3)
    assert torch.equal(torch.stack(a.graph.edges()), torch.stack(b.graph.edges())) and torch.equal(a.labels, b.labels)
    assert torch.bincount(a.labels).tolist() == [100] * 10
    src, dst = a.graph.edges()
    assert a.graph.has_edges_between(dst, src).all() and not (src == dst).any()  # undirected, no self loops
    inside = (a.labels[src] == a.labels[dst]).double().mean()
    assert 0.45 < inside < 0.7  # 5 of 10 draws inside, 1 in 10 of the others: about 55%
    splits = torch.cat([a.train, a.val, a.test])
    assert len(a.train) == 200 and torch.equal(splits.sort().values, torch.arange(1000))
    with pytest.raises(ValueError, match="HINT"):
        graphs.planted_communities(1001, 10, 5, 5)


def _fit(rank_pools, script: str, args: list[str]) -> float:
    """The example's CLI with its YAML on the 2-rank pool (tests/example_runs.py); the test accuracy it prints."""
    config = script.replace(".py", ".yaml")
    printed = rank_pools(2).run(run_script, EXAMPLE / script, ["fit", "--config", config, "--trainer.logger", "false", *args])
    found = re.findall(r"test_acc\s+([0-9.]+)", printed[0])
    assert found, printed[0][-3000:]
    return float(found[-1])


def test_graphsage_recovers_communities_on_two_processes(rank_pools):
    accuracy = _fit(rank_pools, "sage.py", ["--data.num_nodes", "2000", "--data.batch_size", "32", "--trainer.max_epochs", "3"])
    assert accuracy > 0.8  # chance: 0.1; 0.970 after these 3 epochs (and after 5)


def test_deepwalk_recovers_communities_on_two_processes(rank_pools):
    accuracy = _fit(rank_pools, "deepwalk.py", ["--data.num_nodes", "2000", "--trainer.max_epochs", "3"])
    assert accuracy > 0.8  # chance: 0.1; 0.887 after these 3 epochs
