"""The DLRM example: Criteo TSV reading, and CI-sized runs of its LightningCLI on 2 processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).parent.parent / "examples" / "dlrm"
sys.path.insert(0, str(EXAMPLE))

import data as dlrm_data  # noqa: E402
from processes import assert_clean_exit


def write_tsv(path: Path, lines: int, seed: int = 0) -> None:
    """A tiny file in Criteo's layout: label, 13 integer counts, 26 hex ids; some fields empty."""
    gen = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(lines):
            label = int(torch.randint(0, 2, (1,), generator=gen))
            dense = ["" if torch.rand(1, generator=gen) < 0.1 else str(int(torch.randint(0, 50, (1,), generator=gen)))
                     for _ in range(13)]  # fmt: skip
            cats = ["" if torch.rand(1, generator=gen) < 0.1 else f"{int(torch.randint(0, 2**31, (1,), generator=gen)):08x}"
                    for _ in range(26)]  # fmt: skip
            f.write("\t".join([str(label), *dense, *cats]) + "\n")


def test_read_tsv(tmp_path):
    path = tmp_path / "day_0"
    write_tsv(path, 40)
    data = dlrm_data.read_tsv(path, max_rows=1000)
    assert len(data) == 40 and data.dense.shape == (40, 13)
    first = path.read_text().splitlines()[0].split("\t")
    rows = dlrm_data.cardinalities(1000)
    expected = int(first[14], 16) % rows[0] if first[14] else 0
    assert int(data.single["C1"][0]) == expected
    for name, ids in data.single.items():
        assert 0 <= int(ids.min()) and int(ids.max()) < rows[dlrm_data.SPARSE.index(name)]
    dense, features, labels = data.collate([3, 1])
    assert dense.shape == (2, 13) and labels.shape == (2,)
    assert features["C3"].num_bags == 2 and len(features["C3"].values) == 2  # Criteo is single-hot: bags of one


def test_read_tsv_names_a_malformed_line(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match=r"bad.tsv:1: 3 fields, expected 40 .*HINT"):
        dlrm_data.read_tsv(path, max_rows=100)


def test_synthetic_bags_collate_into_jagged_ids():
    data = dlrm_data.synthetic(64, max_rows=500, seed=0, split_seed=1)
    dense, features, labels = data.collate(list(range(10, 20)))
    assert set(features) == set(dlrm_data.SPARSE)
    bags = features["C3"]
    values, offsets, _ = data.bags["C3"]
    assert bags.values.tolist() == values[offsets[10] : offsets[20]].tolist()
    assert features["C24"].weights is not None and len(features["C24"].weights) == len(features["C24"].values)


def _fit(args: list[str], timeout: int = 240) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "main.py", "fit", "--config", "config.yaml", "--trainer.logger", "false", *args],
        cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert_clean_exit(result)
    return result.stdout


@pytest.mark.timeout(300)
def test_dlrm_trains_on_two_processes_and_auroc_rises():
    out = _fit(["--data.max_rows", "3000", "--data.train_samples", "60000", "--data.val_samples", "8000",
                "--data.batch_size", "1024", "--model.sparse_lr", "0.05", "--trainer.max_epochs", "2"])  # fmt: skip
    aurocs = [float(v) for v in re.findall(r"val_auroc ([0-9.]+)", out)]
    assert len(aurocs) == 2, out
    assert aurocs[0] > 0.6 and aurocs[1] > aurocs[0], out


@pytest.mark.timeout(300)
def test_dlrm_reads_criteo_tsv_with_one_flag(tmp_path):
    write_tsv(tmp_path / "train.tsv", 600)
    # One process: the flag is about reading the file (test_dlrm_trains_on_two_processes... covers 2 processes).
    out = _fit(["--data.tsv", str(tmp_path / "train.tsv"), "--data.val_samples", "100", "--data.max_rows", "500",
                "--data.batch_size", "64", "--trainer.max_epochs", "1", "--trainer.devices", "1"])  # fmt: skip
    assert "epoch 0: val_auroc" in out, out
